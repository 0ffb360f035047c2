"""One ``accelerate`` training run on a neatpack loader, for
``tests/integrations/test_accelerate.py``, started by Accelerate's own launcher on 2 CPU
processes (gloo)::

    python -m accelerate.commands.launch --multi_gpu --num_processes 2 \\
        tests/support/accelerate_run.py '{"corpus": "...", "out": "...", "dumps": "...",
                                          "steps": 5, "save_every": 2, "kill_at": 3}'

The loop is the one ``neatpack.graphs.integrations.accelerate`` documents: a tiny real
Qwen2-VL prepared by ``accelerator.prepare``, the loader through ``prepare_loader``, the loss
through ``model_inputs`` and ``loss_scale``, ``save_state(accelerator, out/step-N)`` every
``save_every`` steps, ``accelerator.load_state(resume)`` when ``resume`` names a checkpoint
(``"last"``: ``last_complete_state(out)``).
Each rank writes ``dumps/rank<R>.jsonl``, one line per step: ``step``, ``epoch``, the batch's
``packs`` (sample ids, padded), ``loss`` (the model's), ``reference`` (next-token
cross-entropy from the logits and the input ids, not from neatpack's labels) and
``grad_error`` (the relative max difference between the LM head's gradient after
``accelerator.backward`` and the gradient of the reference summed over the ranks). Every step,
``log_data_metrics`` logs the data figures through ``accelerator.log`` into a tracker of the
main process that writes ``dumps/log.jsonl``.
``kill_at: N``: rank 0 SIGKILLs itself when step N's batch arrives (mid-epoch).
``kill_in_save: N``: rank 0 SIGKILLs itself inside step N's ``save_state``, after the weights,
optimizer, random states and the loader's state are written (a :class:`Tripwire` registered
after the loader: its ``state_dict`` is called last).
Rank 0 writes the model's weights to ``dumps/saved-N.pt`` after each save and to
``dumps/begin.pt`` after ``load_state``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.integrations.accelerate import (
    last_complete_state,
    loss_scale,
    prepare_loader,
    save_state,
)
from neatpack.graphs.train import model_inputs, step_normalizer
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import tiny_model


class JsonlTracker(GeneralTracker):  # type: ignore[misc]
    """An Accelerate tracker that appends each ``accelerator.log`` call to a JSON-lines file."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @property
    def tracker(self) -> Path:
        return self.path

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")


class Tripwire:
    """A checkpointed object of no state that SIGKILLs rank 0 when saved at step ``kill``."""

    def __init__(self, rank: int, kill: int | None) -> None:
        self.rank, self.kill, self.step = rank, kill, 0

    def state_dict(self) -> dict[str, Any]:
        if self.step == self.kill and self.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def config(corpus: Path) -> NeatVLMConfig:
    return NeatVLMConfig(
        pack_size=1024, media_root=str(corpus.parent / "media"), prefetch=0,
        attn_implementation="eager",
    )  # fmt: skip


def next_token_ce(logits: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of each trained position's logits against the *next input token*
    (a label never crosses a document, so that token is in the same document), and the count.
    neatpack's labels only say which positions train."""
    ids, trained = batch["input_ids"], batch["labels"] != -100
    trained[:, -1] = False
    rows, cols = trained.nonzero(as_tuple=True)
    ce = F.cross_entropy(logits[rows, cols].float(), ids[rows, cols + 1], reduction="sum")
    return ce, len(rows)


def main(spec: dict[str, Any]) -> None:
    dumps = Path(spec["dumps"])
    dumps.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=True, log_with=[JsonlTracker(dumps / "log.jsonl")])
    accelerator.init_trackers("neatpack")
    rank = accelerator.process_index
    proc = load_tiny_processor("qwen2_vl")
    corpus = Path(spec["corpus"])
    model = tiny_model("qwen2_vl", processor=proc, attn_implementation="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = prepare_loader(accelerator, neat_vlm_graph(corpus, proc, config=config(corpus)))
    tripwire = Tripwire(rank, spec.get("kill_in_save"))
    accelerator.register_for_checkpointing(tripwire)
    weights = accelerator.unwrap_model(model)
    step = 0
    if spec.get("resume"):
        resume = spec["resume"]
        resume = last_complete_state(spec["out"]) if resume == "last" else resume
        accelerator.load_state(resume)
        step = int(Path(resume).name.split("-")[1])
        if rank == 0:
            torch.save(weights.state_dict(), dumps / "begin.pt")
    out = (dumps / f"rank{rank}.jsonl").open("a")
    while step < spec["steps"]:
        for batch in batches:
            step += 1
            if step == spec.get("kill_at") and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            n = step_normalizer([batch], device=accelerator.device)
            result = model(**model_inputs(batch, num_items_in_batch=n))
            ce, count = next_token_ce(result.logits, batch)
            total = int(accelerator.reduce(torch.tensor(count), "sum"))  # the step's, all ranks
            accelerator.backward(result.loss * loss_scale(accelerator), retain_graph=True)
            # the gradient the step should have: of next-token CE summed over both ranks / total
            weight = accelerator.unwrap_model(model).lm_head.weight
            (want,) = torch.autograd.grad(ce / total, weight)
            want = accelerator.reduce(want, "sum")
            assert weight.grad is not None
            grad_error = float((weight.grad - want).abs().max() / want.abs().max())
            line = {
                "step": step, "epoch": batches.epoch, "loss": float(result.loss.detach()),
                "reference": float(ce.detach()) / total, "normalizer": int(n),
                "grad_error": grad_error,
                "packs": [[m["sample_ids"], bool(m["padded"])] for m in batch["packs"]],
            }  # fmt: skip
            out.write(json.dumps(line) + "\n")
            out.flush()
            optimizer.step()
            optimizer.zero_grad()
            batches.log_data_metrics(step)
            if step % spec["save_every"] == 0:
                tripwire.step = step
                save_state(accelerator, str(Path(spec["out"]) / f"step-{step}"))
                if rank == 0:
                    torch.save(weights.state_dict(), dumps / f"saved-{step}.pt")
            if step == spec["steps"]:
                break
    accelerator.end_training()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
