"""One ``NeatTrainer`` (or, with ``"trainer": "trl"``, ``NeatSFTTrainer``) run in a process of
its own, for the resume tests that kill it (``tests/graphs/test_hf_trainer.py``,
``tests/integrations/test_trl.py``)::

    python tests/support/trainer_run.py '{"family": "qwen2_vl", "corpus": "...", "out": "...",
        "dumps": "...", "args": {"max_steps": 4, "save_steps": 2}, "kill_in_save": 4}'

A tiny real model (``family``, seeded with ``seed``) trains on a tiny real graph: the synthetic
corpus through ``neat_vlm_graph``, or pre-tokenized text through ``neat_llm_graph`` for
``qwen2``. What the parent checks is written under ``dumps``: ``batches.jsonl`` (the input ids
of every forward, in order), ``saved-<step>.pt`` (the model's weights at each checkpoint) and
``begin.pt`` (its weights when training begins, after any resume). Faults, as a kill would
leave them: ``kill_in_save: N`` SIGKILLs the process while checkpoint N is being written (the
weights are on disk, the optimizer and ``trainer_state.json`` are not); ``kill_after_save: N``
right after checkpoint N is complete. The last stdout line is ``{"global_step", "epoch"}``.
Under ``torchrun`` rank R > 0 writes under ``dumps/rankR``; ``loader_first`` builds the graph
before the training arguments (which start the process group), the order a guard refuses.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.hf_trainer import NeatTrainer
from neatpack.graphs.neat_llm import NeatLLMConfig, neat_llm_graph
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import tiny_model


def text_records() -> list[dict[str, Any]]:
    """Pre-tokenized samples of distinct lengths; a third of each is an untrained prompt."""
    g = torch.Generator().manual_seed(5)
    out = []
    for n in (9, 23, 14, 31, 6, 18, 27, 11):
        ids = torch.randint(10, 4000, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def build(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The model and the loader of ``spec``."""
    family, seed = spec["family"], int(spec.get("seed", 0))
    if family == "qwen2":
        cfg = NeatLLMConfig(pack_size=48, batch_size=1, prefetch=0)
        return tiny_model("qwen2", seed=seed), neat_llm_graph(text_records(), config=cfg)
    proc = load_tiny_processor(family)  # Qwen3-VL's patch is 16 pixels, not 14
    corpus = Path(spec["corpus"])
    vcfg = NeatVLMConfig(pack_size=1024, media_root=str(corpus.parent / "media"), prefetch=0)
    return tiny_model(family, processor=proc, seed=seed), neat_vlm_graph(corpus, proc, config=vcfg)


class Probe(TrainerCallback):
    """Dumps the weights at train begin and at each checkpoint; the kill after a save."""

    def __init__(self, dumps: Path, kill_after_save: int | None) -> None:
        self.dumps, self.kill_after_save = dumps, kill_after_save

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        torch.save(kw["model"].state_dict(), self.dumps / "begin.pt")

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        torch.save(kw["model"].state_dict(), self.dumps / f"saved-{state.global_step}.pt")
        if state.global_step == self.kill_after_save:
            os.kill(os.getpid(), signal.SIGKILL)


def training_args(spec: dict[str, Any]) -> Any:
    """``TrainingArguments``, or ``SFTConfig`` for ``"trainer": "trl"``; creating either starts
    the process group under ``torchrun``."""
    common = {"output_dir": spec["out"], "per_device_train_batch_size": 1, "report_to": [],
              "use_cpu": True, "learning_rate": 1e-2, "logging_steps": 1,
              "save_only_model": False, **spec["args"]}  # fmt: skip
    if spec.get("trainer") != "trl":
        return TrainingArguments(**common)
    from trl import SFTConfig

    # SFTConfig's defaults: bf16 and gradient checkpointing on, both off on a CPU test
    return SFTConfig(bf16=False, gradient_checkpointing=False, **common)


def main(spec: dict[str, Any]) -> None:
    dumps = Path(spec["dumps"])
    dumps.mkdir(parents=True, exist_ok=True)
    if spec.get("loader_first"):  # the order that misleads a graph under torchrun
        model, loader = build(spec)
        args = training_args(spec)
    else:
        args = training_args(spec)
        model, loader = build(spec)
    trainer: Any
    if spec.get("trainer") == "trl":
        from neatpack.graphs.integrations.trl import NeatSFTTrainer

        proc = load_tiny_processor(spec["family"])
        trainer = NeatSFTTrainer(model=model, args=args, train_loader=loader, processing_class=proc)
    else:
        trainer = NeatTrainer(model=model, args=args, train_loader=loader)
    rank = int(os.environ.get("RANK", "0"))
    if rank:  # torchrun: rank 0 writes the usual files, the others their batches only
        dumps = dumps / f"rank{rank}"
        dumps.mkdir(exist_ok=True)
    forward = model.forward  # after the trainer: TRL replaces it with its fused LM head
    log = (dumps / "batches.jsonl").open("a")

    def spy(*args: Any, **kwargs: Any) -> Any:
        log.write(json.dumps(kwargs["input_ids"].flatten().tolist()) + "\n")
        log.flush()
        return forward(*args, **kwargs)

    model.forward = spy
    trainer.add_callback(Probe(dumps, spec.get("kill_after_save")))
    kill_in_save = spec.get("kill_in_save")
    save_optimizer = trainer._save_optimizer_and_scheduler

    def torn(output_dir: str) -> None:  # the weights are written, the rest is not
        if trainer.state.global_step == kill_in_save:
            os.kill(os.getpid(), signal.SIGKILL)
        save_optimizer(output_dir)

    trainer._save_optimizer_and_scheduler = torn
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    print(json.dumps({"global_step": trainer.state.global_step, "epoch": trainer.state.epoch}))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    for phase in spec if isinstance(spec, list) else [spec]:  # a list: runs one after another
        main(phase)
