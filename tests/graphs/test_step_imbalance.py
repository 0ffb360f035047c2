"""``data/step_imbalance/*``: every rank reports the same per-step cost of the whole step, read
from the plan, and it is the cost of the packs the ranks' own loaders really delivered; and
``neatpack plan``'s per-step rows are those same steps, each rank's packs summed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neatpack.graphs.command.cli import main
from neatpack.graphs.command.report import imbalance, step_rows
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


@pytest.mark.parametrize("balance", ["tokens", "cost"])
def test_plan_report_rows_are_the_steps_the_loaders_serve(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], balance: str
) -> None:
    """``neatpack plan --batch-size 2``: step ``k`` of the report is what the ranks' loaders
    (``batch_size=2``) hand over at step ``k``, each rank's two packs summed (rank ``r``: slots
    ``k*W*2 + r`` and ``k*W*2 + W + r``), for the plan the graph trains on; its rows are the
    ratios of the batches' own loads, and the loaders' ``step_imbalance`` agrees."""
    batch, cache = 2, tmp_path / "cache"
    cfg = NeatVLMConfig(pack_size=1024, batch_size=batch, seed=5, tail="drop",
                        balance=balance,  # type: ignore[arg-type]
                        media_root=str(corpus.parent / "media"), cache_dir=str(cache))  # fmt: skip
    processor = load_tiny_processor()
    loaders = [neat_vlm_graph(str(corpus), processor, config=cfg, rank=r, world_size=WORLD)
               for r in range(WORLD)]  # fmt: skip
    plan = loaders[0].source.plan_for(WORLD)
    attention, tokens, packs = [], [], []
    for batches in zip(*loaders, strict=True):  # one step
        lens = [[int(n) for m in b["packs"] for n in m["seq_lens"]] for b in batches]
        attention.append([sum(float(n) ** 2 for n in ls) for ls in lens])
        tokens.append([sum(ls) for ls in lens])
        packs.append([sorted(int(m["pack_index"]) for m in b["packs"]) for b in batches])
    rows = step_rows(plan, WORLD, batch_size=batch)  # [steps, packs per rank, ranks]
    assert [[sorted(step[:, r].tolist()) for r in range(WORLD)] for step in rows] == packs
    att, tok = np.asarray(attention), np.asarray(tokens, np.float64)
    assert att.shape[0] >= 3
    argv = ["plan", str(corpus), "--processor", "qwen2_vl", "--pack-size", "1024",
            "--media-root", str(corpus.parent / "media"), "--cache-dir", str(cache),
            "--world-size", str(WORLD), "--batch-size", str(batch), "--seed", "5",
            "--balance", balance, "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fingerprint"] == plan.fingerprint  # the plan the loaders serve
    assert (report["steps"], report["batch_size"]) == (att.shape[0], batch)
    assert report["tail_packs"] == len(plan) - att.shape[0] * WORLD * batch
    assert report["per_step_cost"]["attention"] == pytest.approx(imbalance(att).tolist(), abs=1e-4)
    assert report["imbalance"]["total"]["max"] == pytest.approx(imbalance(tok).max(), abs=1e-4)
    assert report["imbalance"]["total"]["mean"] == pytest.approx(imbalance(tok).mean(), abs=1e-4)
    for loader in loaders:
        figures = loader.data_metrics()
        want = att.max(axis=1).sum() / att.mean(axis=1).sum()
        assert figures["data/step_imbalance/attention"] == pytest.approx(want)
