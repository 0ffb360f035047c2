"""``data/step_imbalance/*``: every rank reports the same per-step cost of the whole step, read
from the plan, and it is the cost of the packs the ranks' own loaders really delivered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

WORLD = 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("steps"), num_samples=40, seed=3)


def _loaders(corpus: Path, batch_size: int) -> list[Any]:
    cfg = NeatVLMConfig(pack_size=1024, batch_size=batch_size, seed=5,
                        media_root=str(corpus.parent / "media"),
                        cache_dir=str(corpus.parent / "cache"))  # fmt: skip
    processor = load_tiny_processor()
    return [
        neat_vlm_graph(str(corpus), processor, config=cfg, rank=r, world_size=WORLD)
        for r in range(WORLD)
    ]


@pytest.mark.parametrize("batch_size", [1, 2])
def test_each_rank_reports_the_attention_cost_of_what_the_ranks_really_got(
    corpus: Path, batch_size: int
) -> None:
    loaders = _loaders(corpus, batch_size)
    peak = mean = 0.0
    steps = 0
    for batches in zip(*loaders, strict=True):  # one step: every rank's batch
        # the documents each rank trained on, from its own batches (exact index: the real
        # tokens after the shift)
        loads = [sum(float(n) ** 2 for m in b["packs"] for n in m["seq_lens"]) for b in batches]
        peak, mean, steps = peak + max(loads), mean + float(np.mean(loads)), steps + 1
    assert steps >= 3
    for loader in loaders:
        assert loader.stats.step_peak["attention"] == pytest.approx(peak)
        assert loader.stats.step_mean["attention"] == pytest.approx(mean)
        figures = loader.data_metrics()
        assert figures["data/step_imbalance/attention"] == pytest.approx(peak / mean)
        assert figures["data/step_imbalance/step"] >= 1.0
        assert loader.data_metrics()["data/step_imbalance/attention"] == 1.0  # a new window
