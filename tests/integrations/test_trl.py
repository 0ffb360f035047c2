"""TRL's ``SFTTrainer`` on neatpack's packed VLM batches (``graphs/integrations/trl.py``), through
``NeatSFTTrainer.train`` on the tiny real Qwen2-VL model and processor: TRL's own loss is
next-token cross-entropy of the batch (neatpack's labels are already shifted, TRL must not shift
them again), its ``num_tokens`` counts real tokens, and a run SIGKILLed mid-epoch resumes through
``train(resume_from_checkpoint=True)`` in a fresh process with the uninterrupted run's batches.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.train import model_inputs
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import tiny_model

trl = pytest.importorskip("trl")
from neatpack.graphs.integrations.trl import NeatSFTTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "support" / "trainer_run.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_corpus(tmp_path_factory.mktemp("corpus"), num_samples=8, seed=3))


@pytest.fixture(scope="module")
def proc() -> Any:
    return load_tiny_processor("qwen2_vl")


def loader(corpus: Path, proc: Any, fmt: str = "sdpa") -> Any:
    cfg = NeatVLMConfig(pack_size=1024, media_root=str(corpus.parent / "media"), prefetch=0,
                        attn_implementation=fmt)  # fmt: skip
    return neat_vlm_graph(corpus, proc, config=cfg)


def sft_args(out: Path, **kw: Any) -> Any:
    return trl.SFTConfig(output_dir=str(out), use_cpu=True, bf16=False, report_to=[],
                         gradient_checkpointing=False, per_device_train_batch_size=1,
                         logging_steps=1, save_strategy="no", **kw)  # fmt: skip


class Reported(TrainerCallback):
    """Collects each training log as the trainer's reporters receive it (``on_log``)."""

    def __init__(self, into: list[dict[str, float]]) -> None:
        self.into = into

    def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if "loss" in kw["logs"]:
            self.into.append(dict(kw["logs"]))


@torch.no_grad()
def next_token_ce_sum(model: Any, batch: dict[str, Any]) -> tuple[float, int]:
    """Summed cross-entropy of the model's logits at ``t`` against ``input_ids[t + 1]`` of the
    same document, over the batch's label positions; and how many there are."""
    logits = model(**model_inputs(batch, keep_labels=False)).logits.float()
    labels, ids, docs = batch["labels"], batch["input_ids"], batch["doc_ids"]
    trained = labels[:, :-1].ne(-100)
    # what "already shifted" means: each label is the next token of its own document
    assert torch.equal(labels[:, :-1][trained], ids[:, 1:][trained])
    assert torch.equal(docs[:, :-1][trained], docs[:, 1:][trained])
    assert labels[:, -1].eq(-100).all()
    target = torch.where(trained, ids[:, 1:], -100)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), target.flatten(), reduction="sum")
    return float(ce), int(trained.sum())


def test_sft_loss_is_next_token_ce_over_the_step(corpus: Path, proc: Any, tmp_path: Path) -> None:
    """One optimizer step of two accumulated packed batches: the loss TRL logs is the summed
    next-token cross-entropy of both over their label tokens (``num_items_in_batch``), and
    ``num_tokens`` is their real tokens (TRL alone summed the 4D mask's attended pairs)."""
    model = tiny_model("qwen2_vl", processor=proc, seed=0)
    batches = list(loader(corpus, proc))[:2]
    assert sum(len(row) for b in batches for row in b["sample_ids"]) > 2  # really packed
    sums = [next_token_ce_sum(model, b) for b in batches]
    want = sum(s for s, _ in sums) / sum(n for _, n in sums)
    trainer = NeatSFTTrainer(
        model=model, args=sft_args(tmp_path, max_steps=1, gradient_accumulation_steps=2),
        train_loader=loader(corpus, proc), processing_class=proc,
    )  # fmt: skip
    reported: list[dict[str, float]] = []  # what report_to's TensorBoard / W&B callbacks get
    trainer.add_callback(Reported(reported))
    trainer.train()
    logged = trainer.state.log_history[0]
    assert abs(logged["loss"] - want) <= 1e-4 * want, (logged["loss"], want)
    shifted_twice = sum(  # what a second shift would score: each position against t + 2
        float(F.cross_entropy(
            model(**model_inputs(b, keep_labels=False)).logits[:, :-1].flatten(0, 1).float(),
            b["labels"][:, 1:].flatten(), reduction="sum"))
        for b in batches
    ) / sum(int(b["labels"][:, 1:].ne(-100).sum()) for b in batches)  # fmt: skip
    assert abs(shifted_twice - want) > 1e-2
    real = sum(int(b["doc_ids"].gt(0).sum()) for b in batches)
    assert logged["num_tokens"] == real
    # the loader's data figures of the step, in the same log as TRL's own metrics
    assert reported[0] == {k: v for k, v in logged.items() if k != "step"}
    assert logged["data/batches"] == 2  # the step's two accumulated batches
    assert logged["data/fill"] == pytest.approx(real / (2 * 1024))
    assert logged["data/wait_s"] > 0
    assert 0 < logged["data/wait_fraction"] <= 1
    assert {"entropy", "mean_token_accuracy", "data/estimate_error_p99"} <= logged.keys()


def test_sft_trains_batches_without_attention_mask(corpus: Path, proc: Any, tmp_path: Path) -> None:
    """The ``position_ids`` format (``attention_mask=None``, as for flash attention): TRL's token
    count called ``None.sum()``; the step trains and counts the batch's real tokens."""
    model = tiny_model("qwen2_vl", processor=proc, seed=0)
    batch = next(iter(loader(corpus, proc, "position_ids")))
    assert batch["attention_mask"] is None
    total, n = next_token_ce_sum(model, batch)
    trainer = NeatSFTTrainer(model=model, args=sft_args(tmp_path, max_steps=1),
                             train_loader=loader(corpus, proc, "position_ids"),
                             processing_class=proc)  # fmt: skip
    trainer.train()
    logged = trainer.state.log_history[0]
    assert abs(logged["loss"] - total / n) <= 1e-4 * total / n
    assert logged["num_tokens"] == int(batch["doc_ids"].gt(0).sum())


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"packing": True}, "packing=True: neatpack's loader has already packed"),
     ({"padding_free": True}, "padding_free=True"),
     ({"label_smoothing_factor": 0.1}, "shifts the labels once more")],
)  # fmt: skip
def test_sft_refuses_what_would_pack_or_shift_again(
    kw: dict[str, Any], match: str, corpus: Path, proc: Any, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=match):
        NeatSFTTrainer(model=tiny_model("qwen2_vl", processor=proc), args=sft_args(tmp_path, **kw),
                       train_loader=loader(corpus, proc), processing_class=proc)  # fmt: skip


def run(phases: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUN), json.dumps(phases)], capture_output=True, text=True,
        timeout=300, cwd=ROOT,
    )  # fmt: skip


def forwards(dumps: Path) -> list[list[int]]:
    return [json.loads(line) for line in (dumps / "batches.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_sft_killed_mid_epoch_resumes_exactly(corpus: Path, proc: Any, tmp_path: Path) -> None:
    """An uninterrupted epoch, then a run SIGKILLed right after its step-2 checkpoint; a fresh
    process resumes with ``train(resume_from_checkpoint=True)``: it starts from the saved
    weights and trains the uninterrupted run's remaining batches, every sample once in the
    epoch (killed run's batches + resumed run's)."""
    epoch = list(loader(corpus, proc))
    ids = sorted(i for b in epoch for row in b["sample_ids"] for i in row)
    assert ids == list(range(8))  # the loader's epoch: every sample exactly once
    assert len(epoch) >= 4
    base = {"trainer": "trl", "family": "qwen2_vl", "corpus": str(corpus),
            "args": {"num_train_epochs": 1, "save_steps": 2}}  # fmt: skip
    whole = {**base, "out": str(tmp_path / "whole"), "dumps": str(tmp_path / "w")}
    cut = {**base, "out": str(tmp_path / "out"), "dumps": str(tmp_path / "a"),
           "kill_after_save": 2}  # fmt: skip
    killed = run([whole, cut])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoint-2" / "neatpack_loader_rank0.pt").exists()
    # seed 1: the fresh model differs from the saved one until the resume loads it
    resumed = run([{**cut, "dumps": str(tmp_path / "b"), "kill_after_save": None,
                    "resume": True, "seed": 1}])  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.splitlines()[-1])["global_step"] == len(epoch)

    want = [b["input_ids"].flatten().tolist() for b in epoch]
    assert forwards(tmp_path / "w") == want
    assert forwards(tmp_path / "a") == want[:2]
    assert forwards(tmp_path / "b") == want[2:]
    begin = torch.load(tmp_path / "b" / "begin.pt")
    saved = torch.load(tmp_path / "a" / "saved-2.pt")
    assert begin.keys() == saved.keys()
    assert [k for k in saved if not torch.equal(begin[k], saved[k])] == []


@pytest.mark.slow  # two torchrun launches of 2 processes: ~45 s
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_sft_on_two_ranks_trains_each_rank_its_share(corpus: Path, tmp_path: Path) -> None:
    """``torchrun`` with 2 CPU processes (gloo): a graph built before ``SFTConfig`` (which starts
    the process group) read world size 1, and both ranks trained every batch; it is refused,
    naming the fix. Built after, the two ranks train disjoint batches, together the epoch."""
    spec = {"trainer": "trl", "family": "qwen2_vl", "corpus": str(corpus),
            "args": {"max_steps": 2, "save_strategy": "no"}}  # fmt: skip
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(RUN)]
    bad = {**spec, "out": str(tmp_path / "bad"), "dumps": str(tmp_path / "x"), "loader_first": True}
    good = {**spec, "out": str(tmp_path / "out"), "dumps": str(tmp_path / "d")}
    done = subprocess.run([*launch, json.dumps([bad])], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode != 0
    assert "the loader was built for world_size=1 (rank 0) but the trainer runs 2" in done.stderr
    done = subprocess.run([*launch, json.dumps([good])], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = NeatVLMConfig(pack_size=1024, media_root=str(corpus.parent / "media"), prefetch=0)
    proc = load_tiny_processor("qwen2_vl")
    for r, dumps in enumerate([tmp_path / "d", tmp_path / "d" / "rank1"]):
        share = neat_vlm_graph(corpus, proc, config=cfg, rank=r, world_size=2)
        want = [b["input_ids"].flatten().tolist() for b in share][:2]
        assert forwards(dumps) == want
    assert forwards(tmp_path / "d") != forwards(tmp_path / "d" / "rank1")
