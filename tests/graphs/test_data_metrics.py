"""``NeatLoader.data_metrics()`` through the prebuilt graphs: the wait is the graph's (not the
consumer's), fill and estimate error match the loader's stats, a mixture's per-source tokens
add up to the window's real tokens, and each call starts a new window."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.mixtures.mixture import Mixture, MixtureSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import tiny_model

GRAPH_S = 0.3  # a slow step in the graph, per batch
CONSUMER_S = 0.05  # the trainer's step, per batch
BASE = ("wait_s", "wait_fraction", "batches", "fill", "estimate_error_p50", "estimate_error_p99")
# a packed graph's step cost, once a step was handed out
KEYS = (*BASE, "step_imbalance/attention", "step_imbalance/vision", "step_imbalance/step")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("metrics")
    data = {n: write_corpus(root / n, num_samples=k, seed=s)
            for n, k, s in (("caption", 10, 1), ("ocr", 6, 2))}  # fmt: skip
    return {"root": root, "data": data, "processor": load_tiny_processor()}


def slow_step(batch: dict[str, Any]) -> dict[str, Any]:
    time.sleep(GRAPH_S)  # module level: picklable into worker processes
    return batch


@pytest.mark.parametrize("workers", [0, 2])
def test_wait_is_the_time_next_blocks_on_the_graph_not_the_consumers_step(
    world: dict[str, Any], workers: int
) -> None:
    cfg = NeatVLMConfig(pack_size=1024, num_workers=workers, cache_dir=str(world["root"] / "c"),
                        media_root=str(world["root"] / "caption" / "media"))  # fmt: skip
    loader = neat_vlm_graph(world["data"]["caption"], world["processor"], config=cfg,
                            batch_transform=slow_step)  # fmt: skip
    begin = time.perf_counter()
    n = 0
    for _ in loader:
        n += 1
        time.sleep(CONSUMER_S)
    wall = time.perf_counter() - begin
    got = loader.data_metrics()
    assert set(KEYS) <= {k.removeprefix("data/") for k in got}
    assert all(type(v) is float for v in got.values())
    assert n >= 4
    assert got["data/batches"] == n == loader.stats.batches
    # The consumer's sleeps lie outside every next(): a figure that counted the time between
    # calls would reach the whole wall time.
    assert got["data/wait_s"] + n * CONSUMER_S <= wall
    # The graph builds at most `workers` batches at once, each >= GRAPH_S: the trainer, faster
    # than that, waited at least the difference (halved for slack).
    floor = n * (GRAPH_S / max(workers, 1) - CONSUMER_S)
    assert got["data/wait_s"] >= 0.5 * floor > 0
    assert 0.0 < got["data/wait_fraction"] <= 1.0
    # One window of the whole epoch: the same packs as the loader's running stats.
    assert got["data/fill"] == loader.stats.utilization()
    errors = loader.stats.estimate_error()
    assert got["data/estimate_error_p50"] == errors["p50"]
    assert got["data/estimate_error_p99"] == errors["p99"]
    again = loader.data_metrics()  # nothing since the last call
    assert (again["data/batches"], again["data/wait_s"], again["data/fill"]) == (0.0, 0.0, 0.0)


def _doc_tokens_by_source(batch: dict[str, Any], names: list[str]) -> dict[str, int]:
    """Real tokens per source read off the batch tensors: document d (1-based) of a row is
    ``doc_ids == d``; its source is ``doc_sources[row, d - 1]``."""
    out = dict.fromkeys(names, 0)
    for row in range(batch["doc_ids"].shape[0]):
        ids, counts = torch.unique(batch["doc_ids"][row], return_counts=True)
        for doc, count in zip(ids.tolist(), counts.tolist(), strict=True):
            if doc > 0:
                out[names[int(batch["doc_sources"][row, doc - 1])]] += count
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_mixture_tokens_per_source_add_up_to_each_windows_real_tokens(
    world: dict[str, Any], workers: int
) -> None:
    mix = Mixture(sources=[
        MixtureSource(name=n, data=world["data"][n], weight=0.5,
                      media_root=str(world["root"] / n / "media"))
        for n in ("caption", "ocr")
    ])  # fmt: skip
    # estimate_mode="estimate": the plan's lengths are off, so each window has its own errors
    cfg = NeatVLMConfig(pack_size=1024, batch_size=2, num_workers=workers,
                        cache_dir=str(world["root"] / "c"), estimate_mode="estimate")  # fmt: skip
    loader = neat_vlm_graph(mix, world["processor"], config=cfg)
    windows: list[tuple[dict[str, float], dict[str, int], int, list[float]]] = []
    expected, real, errors = {"caption": 0, "ocr": 0}, 0, []
    for i, batch in enumerate(loader):
        for name, tokens in _doc_tokens_by_source(batch, batch["source_names"]).items():
            expected[name] += tokens
        real += sum(int(m["real_tokens"]) for m in batch["packs"])
        errors += [abs(m["real_tokens"] / m["estimated_tokens"] - 1) for m in batch["packs"]]
        if i % 2 == 1:  # a logging step every 2 batches
            windows.append((loader.data_metrics(), expected, real, errors))
            expected, real, errors = {"caption": 0, "ocr": 0}, 0, []
    assert len(windows) >= 2
    for got, want, real_tokens, window_errors in windows:
        tokens = {k.removeprefix("data/tokens/"): v for k, v in got.items() if "/tokens/" in k}
        assert tokens == {k: float(v) for k, v in want.items()}
        assert sum(tokens.values()) == real_tokens > 0
        assert got["data/fill"] == real_tokens / (got["data/batches"] * 2 * 1024)
        assert got["data/estimate_error_p50"] == pytest.approx(np.percentile(window_errors, 50))
        assert got["data/estimate_error_p99"] == pytest.approx(np.percentile(window_errors, 99))
    assert len({w[0]["data/estimate_error_p50"] for w in windows}) > 1  # per window, not run
    for name in ("caption", "ocr"):  # both sources were served
        assert sum(w[0][f"data/tokens/{name}"] for w in windows) > 0


def test_no_iteration_yet_gives_an_empty_window(world: dict[str, Any]) -> None:
    cfg = NeatVLMConfig(pack_size=1024, cache_dir=str(world["root"] / "c"),
                        media_root=str(world["root"] / "caption" / "media"))  # fmt: skip
    loader = neat_vlm_graph(world["data"]["caption"], world["processor"], config=cfg)
    got = loader.data_metrics()
    assert got == {f"data/{k}": 0.0 for k in BASE}


class Logged(TrainerCallback):
    """What the Trainer hands its reporters (TensorBoard, W&B... are ``on_log`` callbacks)."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.logs.append(dict(kw["logs"]))


def test_neat_trainer_logs_the_data_figures_each_logging_step(
    world: dict[str, Any], tmp_path: Path
) -> None:
    pytest.importorskip("accelerate")
    from neatpack.graphs.hf_trainer import NeatTrainer

    cfg = NeatVLMConfig(pack_size=1024, cache_dir=str(world["root"] / "c"),
                        media_root=str(world["root"] / "caption" / "media"))  # fmt: skip
    loader = neat_vlm_graph(world["data"]["caption"], world["processor"], config=cfg)
    model = tiny_model("qwen2_vl", processor=world["processor"])
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=1, report_to=[], use_cpu=True,
        max_steps=4, logging_steps=2, save_strategy="no",
    )  # fmt: skip
    reporter = Logged()
    trainer = NeatTrainer(model=model, args=args, train_loader=loader, callbacks=[reporter])
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in history] == [2, 4]
    sent = [log for log in reporter.logs if "loss" in log]
    assert len(sent) == 2
    for logged, seen in zip(history, sent, strict=True):
        figures = {k: v for k, v in logged.items() if k.startswith("data/")}
        assert set(figures) == {f"data/{k}" for k in KEYS}
        assert figures == {k: v for k, v in seen.items() if k.startswith("data/")}
        assert figures["data/batches"] == 2.0  # the 2 steps since the last log
        assert figures["data/fill"] > 0
    # The windows split the run: 4 batches of one pack each, 2 per window.
    assert loader.stats.batches == 4
    mean_fill = sum(h["data/fill"] for h in history) / 2
    assert mean_fill == pytest.approx(loader.stats.utilization(), rel=1e-12)
    assert not any(k.startswith("data/") for h in trainer.state.log_history if "loss" not in h
                   for k in h)  # fmt: skip
