"""PyTorch Lightning on a neatpack loader (``graphs/integrations/lightning.py``), through
Lightning's own entry points: ``Trainer.fit`` on a ``NeatDataModule``, its ``ModelCheckpoint``
and ``fit(ckpt_path="last")`` in a fresh process after a SIGKILL (the runs are
``tests/support/lightning_run.py``), a tiny real Qwen2-VL model and the real tiny processor.
"""

from __future__ import annotations

import copy
import csv
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.testing.resume import assert_exactly_once
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import tiny_model

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from neatpack.graphs.integrations.lightning import (  # noqa: E402
    NeatDataMetrics,
    NeatDataModule,
    loss_scale,
)

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "support" / "lightning_run.py"
NUM_SAMPLES = 12  # 6 packs of 1024 tokens: 6 steps an epoch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_corpus(tmp_path_factory.mktemp("corpus"), num_samples=NUM_SAMPLES, seed=3))


def graph(corpus: Path, proc: Any, rank: int = 0, world_size: int = 1) -> Any:
    cfg = NeatVLMConfig(pack_size=1024, media_root=str(corpus.parent / "media"), prefetch=0)
    return neat_vlm_graph(corpus, proc, config=cfg, rank=rank, world_size=world_size)


def loader_epochs(corpus: Path, rank: int = 0, world_size: int = 1) -> list[list[Any]]:
    """The loader's own two epochs on ``rank``: (input ids, sample ids) per batch."""
    loader = graph(corpus, load_tiny_processor("qwen2_vl"), rank, world_size)
    return [[(b["input_ids"].flatten().tolist(), b["sample_ids"]) for b in loader] for _ in "ab"]


def epoch_samples(kept: list[list[int]], epochs: list[list[Any]]) -> list[int]:
    """The sample ids of the batches ``kept`` (input ids), found in the loader's epochs."""
    samples = {json.dumps(ids): sids for epoch in epochs for ids, sids in epoch}
    return [i for ids in kept for row in samples[json.dumps(ids)] for i in row]


class Recorder(pl.LightningModule):  # type: ignore[misc]
    """The model's own loss on each batch, and next-token cross-entropy from the same logits:
    the target at position t is ``input_ids[t + 1]`` wherever the batch trains position t."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.seen: list[tuple[float, float, float]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        out = self.model(**batch)
        ids, labels = batch["input_ids"], batch["labels"]
        logits = out.logits.detach().float()
        trained = labels[:, :-1] != -100
        assert bool((labels[:, -1] == -100).all())
        assert torch.equal(labels[:, :-1][trained], ids[:, 1:][trained])  # shifted once
        ref = F.cross_entropy(logits[:, :-1][trained], ids[:, 1:][trained])
        with torch.no_grad():  # labels alone: transformers shifts them a second time
            twice = self.model(**{**batch, "shift_labels": None}).loss
        self.seen.append((float(out.loss), float(ref), float(twice)))
        self.log("loss", out.loss)
        return out.loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_fit_loss_is_next_token_ce_and_data_metrics_reach_the_logger(
    corpus: Path, tmp_path: Path
) -> None:
    """Four optimizer steps of ``Trainer.fit``: the loss Lightning backpropagates is the model's
    next-token cross-entropy over the packed batch, not the doubly shifted one; and with
    ``NeatDataMetrics`` and ``log_every_n_steps=2`` the trainer's logger (CSV) gets the data
    figures in the rows of Lightning's own logs, each window the 2 batches since the last."""
    proc = load_tiny_processor("qwen2_vl")
    module = Recorder(tiny_model("qwen2_vl", processor=proc, attn_implementation="eager"))
    data = NeatDataModule(lambda: graph(corpus, proc))
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, log_every_n_steps=2, enable_checkpointing=False,
        logger=CSVLogger(tmp_path, name="logs", version=0), callbacks=[NeatDataMetrics()],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert len(module.seen) == 4
    for loss, ref, twice in module.seen:
        assert abs(loss - ref) <= 1e-5 * max(1.0, ref), (loss, ref)
        assert abs(twice - ref) > 1e-3

    with (tmp_path / "logs" / "version_0" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    figures = [r for r in rows if r.get("data/batches")]
    assert [r["step"] for r in figures] == [r["step"] for r in rows if r.get("loss")] == ["1", "3"]
    assert [float(r["data/batches"]) for r in figures] == [2.0, 2.0]
    for r in figures:
        assert float(r["data/wait_s"]) >= 0.0
        assert 0.0 <= float(r["data/wait_fraction"]) <= 1.0
        assert float(r["data/estimate_error_p99"]) >= float(r["data/estimate_error_p50"]) >= 0.0
    # equal windows of 1024-token packs: their mean fill is the run's real / pack tokens
    mean_fill = sum(float(r["data/fill"]) for r in figures) / 2
    assert abs(mean_fill - data.loader.stats.utilization()) < 1e-6


class GradientRecorder(pl.LightningModule):  # type: ignore[misc]
    """The documented ``training_step`` (the model's loss times ``loss_scale``); keeps each
    micro-batch and the gradient Lightning hands the optimizer at its first step."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.batches: list[dict[str, Any]] = []
        self.grads: dict[str, torch.Tensor] = {}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        self.batches.append(batch)
        return self.model(**batch).loss * loss_scale(self.trainer)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not self.grads:
            self.grads = {k: p.grad.clone() for k, p in self.model.named_parameters()}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def test_accumulated_gradient_is_the_step_token_mean(corpus: Path) -> None:
    """``accumulate_grad_batches=2``: the gradient of the first optimizer step is that of
    next-token cross-entropy over every label token of its 2 micro-batches (computed from the
    initial model's logits on the same batches), not the mean of the 2 micro-batch means."""
    proc = load_tiny_processor("qwen2_vl")
    model = tiny_model("qwen2_vl", processor=proc, attn_implementation="eager")
    initial = copy.deepcopy(model)
    module = GradientRecorder(model)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=NeatDataModule(lambda: graph(corpus, proc)))
    assert len(module.batches) == 2

    total, counts = torch.zeros(()), []
    for batch in module.batches:
        ids, labels = batch["input_ids"], batch["labels"]
        inputs = {k: v for k, v in batch.items() if "labels" not in k and k != "num_items_in_batch"}
        logits = initial(**inputs).logits.float()
        trained = labels[:, :-1] != -100
        assert torch.equal(labels[:, :-1][trained], ids[:, 1:][trained])
        counts.append(int(trained.sum()))
        total = total + F.cross_entropy(
            logits[:, :-1][trained], ids[:, 1:][trained], reduction="sum"
        )
    assert counts[0] != counts[1]  # unequal micro-batches: a mean of means would differ
    (total / sum(counts)).backward()
    for name, p in initial.named_parameters():
        want, got = p.grad, module.grads[name]
        tol = 1e-4 * float(want.abs().max()) + 1e-9
        assert float((got - want).abs().max()) <= tol, (name, float((got - want).abs().max()), tol)


def test_resume_inside_an_accumulation_window_trains_the_rest_of_it(
    corpus: Path, tmp_path: Path
) -> None:
    """``accumulate_grad_batches=2``, a checkpoint every step: resumed after step 1, Lightning
    saves again at the first micro-batch of step 2 (``ModelCheckpoint`` does not restore the
    step it last saved), inside the window. A fit from that checkpoint trains the window's
    second micro-batch with the whole window's label tokens, then the next window: the
    uninterrupted run's batches and normalizers."""
    proc = load_tiny_processor("qwen2_vl")

    def fit(steps: int, out: Path, resume: str | None = None) -> list[dict[str, Any]]:
        module = GradientRecorder(tiny_model("qwen2_vl", processor=proc))
        save = ModelCheckpoint(out, every_n_train_steps=1, save_top_k=-1, save_last=True)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=steps, accumulate_grad_batches=2, logger=False,
            callbacks=[save], enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        data = NeatDataModule(lambda: graph(corpus, proc))
        trainer.fit(module, datamodule=data, ckpt_path=resume)
        return module.batches

    want = fit(3, tmp_path / "full")
    fit(1, tmp_path / "out")
    fit(2, tmp_path / "out", resume="last")
    inside = [  # Lightning's own count: an odd number of micro-batches trained
        p for p in sorted((tmp_path / "out").glob("*.ckpt"))
        if torch.load(p, weights_only=False)["loops"]["fit_loop"][
            "epoch_loop.batch_progress"]["total"]["ready"] % 2
    ]  # fmt: skip
    assert len(inside) == 1, sorted(p.name for p in (tmp_path / "out").glob("*.ckpt"))
    got = fit(3, tmp_path / "out", resume=str(inside[0]))
    assert len(want) == 6
    assert len(got) == 3  # the window's second micro-batch, then step 3's two
    for a, b in zip(got, want[3:], strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert int(a["num_items_in_batch"]) == int(b["num_items_in_batch"])


def run(spec: dict[str, Any] | list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUN), json.dumps(spec)], capture_output=True, text=True,
        timeout=400, cwd=ROOT,
    )  # fmt: skip


def steps(dumps: Path, rank: int = 0) -> list[dict[str, Any]]:
    rows = (dumps / f"steps-rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in rows]


@pytest.mark.timeout(900)
def test_killed_runs_resume_exactly_through_fit_ckpt_path(corpus: Path, tmp_path: Path) -> None:
    """Two epochs of 6 steps, ``ModelCheckpoint(every_n_train_steps=2, save_last=True)``. Killed
    at step 3 (checkpoint 2 is mid-epoch), resumed by ``fit(ckpt_path="last")`` and killed again
    at step 7 (checkpoint 6 closes epoch 0), resumed again to the end: every step after a resume
    trains the uninterrupted run's batch with its loss (weights, optimizer and loader all
    restored), and each epoch trains every sample exactly once."""
    spec = {"corpus": str(corpus), "out": str(tmp_path / "out"), "max_epochs": 2, "every": 2}
    full = {**spec, "out": str(tmp_path / "full"), "dumps": str(tmp_path / "full")}
    first = run([full, {**spec, "dumps": str(tmp_path / "a"), "kill_at": 3}])
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    second = run({**spec, "dumps": str(tmp_path / "b"), "kill_at": 7, "resume": "last"})
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    third = run({**spec, "dumps": str(tmp_path / "c"), "resume": "last"})
    assert third.returncode == 0, third.stderr[-3000:]
    assert json.loads(third.stdout.splitlines()[-1]) == {"global_step": 12, "epoch": 2}

    want = steps(tmp_path / "full")
    assert [s["step"] for s in want] == list(range(12))
    epochs = loader_epochs(corpus)  # the loader's own two epochs: the uninterrupted run's
    assert [s["ids"] for s in want] == [ids for epoch in epochs for ids, _ in epoch]

    a, b, c = (steps(tmp_path / x) for x in "abc")
    assert [s["step"] for s in a] == [0, 1, 2]  # step 2 trained, then lost to the kill
    assert [s["step"] for s in b] == [2, 3, 4, 5, 6]
    assert [s["step"] for s in c] == list(range(6, 12))
    for got in (a, b, c):
        for s in got:
            assert s["ids"] == want[s["step"]]["ids"], f"step {s['step']}: another batch"
            assert abs(s["loss"] - want[s["step"]]["loss"]) <= 1e-4, (s, want[s["step"]]["loss"])
    kept = [s["ids"] for s in [*a[:2], *b[:4], *c]]  # what the checkpoints kept
    assert_exactly_once(epoch_samples(kept[:6], epochs), range(NUM_SAMPLES))
    assert_exactly_once(epoch_samples(kept[6:], epochs), range(NUM_SAMPLES))


@pytest.mark.slow  # 6 runs, 4 of them on 2 processes: ~2 min of wall time on 2 cores
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_ddp_two_processes_resume_each_rank_exactly(corpus: Path, tmp_path: Path) -> None:
    """``strategy="ddp"`` on 2 CPU processes (gloo), 3 steps an epoch per rank: killed at step 3
    (checkpoint 2, mid-epoch), ``fit(ckpt_path="last")`` resumes each rank from its own loader
    state (rank 0 wrote the checkpoint for both): each rank trains its uninterrupted batches and
    losses, and the two ranks together train each sample once an epoch. A resume on another
    number of processes is refused, naming both counts."""
    spec = {"corpus": str(corpus), "out": str(tmp_path / "out"), "max_epochs": 2, "every": 2,
            "devices": 2}  # fmt: skip
    full = run({**spec, "out": str(tmp_path / "full"), "dumps": str(tmp_path / "full")})
    assert full.returncode == 0, full.stderr[-3000:]
    killed = run({**spec, "dumps": str(tmp_path / "a"), "kill_at": 3})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run({**spec, "dumps": str(tmp_path / "b"), "resume": "last"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    kept: list[list[int]] = [[], []]  # sample ids per epoch, both ranks
    for rank in range(2):
        want, a, b = (steps(tmp_path / x, rank) for x in ("full", "a", "b"))
        epochs = loader_epochs(corpus, rank, 2)
        assert [s["ids"] for s in want] == [ids for epoch in epochs for ids, _ in epoch]
        assert [s["step"] for s in b] == [2, 3, 4, 5]
        for s in [*a, *b]:
            assert s["ids"] == want[s["step"]]["ids"], f"rank {rank} step {s['step']}"
            assert abs(s["loss"] - want[s["step"]]["loss"]) <= 1e-4, (rank, s["step"])
        trained = [s["ids"] for s in [*a[:2], *b]]
        kept[0] += epoch_samples(trained[:3], epochs)
        kept[1] += epoch_samples(trained[3:], epochs)
    for samples in kept:
        assert_exactly_once(samples, range(NUM_SAMPLES))
    # another number of processes is refused, naming both counts: 2 -> 1, and 1 -> 2, where
    # Lightning would take 1 more step of epoch 0 on each rank and the loader has 2 each
    mid_epoch = str(tmp_path / "out" / "epoch=0-step=2.ckpt")
    one = run({**spec, "devices": 1, "dumps": str(tmp_path / "one"), "resume": mid_epoch})
    single = {**spec, "devices": 1, "out": str(tmp_path / "single")}
    killed = run({**single, "dumps": str(tmp_path / "s"), "kill_at": 3})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    two = run({**single, "devices": 2, "dumps": str(tmp_path / "two"), "resume": "last"})
    for refused, saved, now in ((one, 2, 1), (two, 1, 2)):
        assert refused.returncode != 0
        assert f"saved by {saved} process(es); this run has {now}" in refused.stderr
    assert not (tmp_path / "one" / "steps-rank0.jsonl").exists()
    assert not (tmp_path / "two" / "steps-rank0.jsonl").exists()
