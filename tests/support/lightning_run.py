"""One Lightning ``Trainer.fit`` on a ``NeatDataModule`` in a process of its own, for the kill and
resume tests (``tests/integrations/test_lightning.py``)::

    python tests/support/lightning_run.py '{"corpus": "...", "out": "...", "dumps": "...",
        "max_epochs": 2, "every": 2, "kill_at": 3, "resume": "last", "devices": 1}'

A tiny real Qwen2-VL model trains on the synthetic corpus through ``neat_vlm_graph``; Lightning's
own ``ModelCheckpoint`` saves every ``every`` steps (and ``last.ckpt``), ``fit(ckpt_path=
resume)`` resumes. Each step appends ``{"step", "epoch", "loss", "ids"}`` (the input ids of its
batch) to ``dumps/steps-rank<r>.jsonl``. ``kill_at: N`` SIGKILLs every rank when step N+1 is about
to train (its batch already fetched), so the last checkpoint is behind the work done. ``devices:
2`` runs DDP on 2 CPU processes (gloo). A list of specs runs one after another.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.integrations.lightning import NeatDataMetrics, NeatDataModule, loss_scale
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import tiny_model


class TinyModule(pl.LightningModule):
    """The model's own loss on the batch as it comes (``model_inputs``), scaled as documented;
    each step recorded."""

    def __init__(self, model: Any, dumps: Path) -> None:
        super().__init__()
        self.model, self.dumps = model, dumps

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        loss = self.model(**batch).loss  # sum / the step's label tokens (every rank's)
        row = {"step": self.global_step, "epoch": self.current_epoch, "loss": float(loss),
               "ids": batch["input_ids"].flatten().tolist()}  # fmt: skip
        with (self.dumps / f"steps-rank{self.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        return loss * loss_scale(self.trainer)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Kill(pl.Callback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(spec: dict[str, Any]) -> None:
    dumps = Path(spec["dumps"])
    dumps.mkdir(parents=True, exist_ok=True)
    corpus = Path(spec["corpus"])
    proc = load_tiny_processor("qwen2_vl")
    cfg = NeatVLMConfig(pack_size=1024, media_root=str(corpus.parent / "media"), prefetch=0)
    data = NeatDataModule(lambda: neat_vlm_graph(corpus, proc, config=cfg))
    module = TinyModule(tiny_model("qwen2_vl", processor=proc, seed=0), dumps)
    devices = int(spec.get("devices", 1))
    save = ModelCheckpoint(
        dirpath=spec["out"], every_n_train_steps=spec["every"], save_top_k=-1, save_last=True
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        max_epochs=spec["max_epochs"],
        callbacks=[save, Kill(spec.get("kill_at")), NeatDataMetrics()],
        logger=CSVLogger(dumps, name="logs"), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=spec.get("resume"))
    print(json.dumps({"global_step": trainer.global_step, "epoch": trainer.current_epoch}))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    for phase in spec if isinstance(spec, list) else [spec]:
        main(phase)
