"""PyTorch Lightning on a neatpack loader, resumed exactly by ``fit(ckpt_path=...)``.

    datamodule = NeatDataModule(lambda: neat_vlm_graph(data, processor, config=cfg))
    trainer = L.Trainer(callbacks=[ModelCheckpoint(every_n_train_steps=500, save_last=True)])
    trainer.fit(module, datamodule=datamodule)            # or fit(..., ckpt_path="last")

    class Module(L.LightningModule):                      # the model's own loss
        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

What it relies on in Lightning (2.6), and what it adds:

* Lightning saves the state of a train dataloader that has ``state_dict`` / ``load_state_dict``
  in its checkpoint (the fit loop's ``combined_loader`` entry) and loads it before a resumed
  ``fit`` first iterates it. The loader has a length, so Lightning fetches no batch ahead: the
  state saved at step N is exactly the N batches trained, and the resume starts at batch N+1.
* The loader is built in ``train_dataloader()``, after Lightning has started the process group,
  so the graph reads its rank and world size from ``torch.distributed``.
* Only rank 0 writes the checkpoint: the saved state holds every rank's loader state (gathered
  when it is saved) and each rank loads its own. A resume on another number of processes is
  refused: Lightning ends the resumed epoch after ``len(loader)`` batches per process counted
  from the old layout, which would skip packs (the plain loader itself reshards).
* Batches are ``model_inputs(batch)`` (:class:`~neatpack.graphs.hf_trainer.TrainerBatches`):
  the already shifted labels go in as ``labels`` and ``shift_labels``, so ``model(**batch).loss``
  is next-token cross-entropy (``labels`` alone would score each token against the one after
  next). The loss is each micro-batch's token mean, Lightning's own convention.
* A checkpoint saved after an epoch's last step resumes with the next epoch, not an empty one
  (``TrainerBatches``): Lightning, like ``transformers.Trainer``, would count the empty
  remainder of the finished epoch as a whole epoch.
* :class:`NeatDataMetrics` (a callback) logs the loader's ``data_metrics()`` (``data/wait_s``,
  ``data/fill``, ...) with ``self.log_dict`` on each step Lightning writes its logs, so every
  logger of the trainer (CSV, TensorBoard, W&B) shows when the data is the bottleneck.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from neatpack.graphs.dist import resolve_rank
from neatpack.graphs.hf_trainer import TrainerBatches

__all__ = ["RANKS_KEY", "LightningBatches", "NeatDataMetrics", "NeatDataModule"]

RANKS_KEY = "neatpack_loader_ranks"  # every rank's loader state, by rank


class LightningBatches(TrainerBatches):
    """:class:`TrainerBatches` whose state is every rank's loader state (Lightning's checkpoint
    is written by rank 0 alone); ``load_state_dict`` takes this rank's."""

    def state_dict(self) -> dict[str, Any]:
        own = super().state_dict()
        _, world_size = resolve_rank(None, None)
        states: list[Any] = [own]
        if world_size > 1:  # every rank saves (Lightning's save_checkpoint runs on all ranks)
            states = [None] * world_size
            dist.all_gather_object(states, own)
        return {RANKS_KEY: states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if RANKS_KEY not in state:
            raise ValueError(
                f"the checkpoint's train dataloader state has keys {sorted(state)[:5]}, not "
                f"{RANKS_KEY!r}: it was not saved from a NeatDataModule; resume with the "
                "dataloader it was saved with, or train from scratch (no ckpt_path)"
            )
        states = state[RANKS_KEY]
        rank, world_size = resolve_rank(None, None)
        if len(states) != world_size:
            # Lightning restores how many of the epoch's batches each process has done and ends
            # the epoch by that count; the loader re-strides its remainder over the new number
            # of processes, so the two disagree (1 -> 2 processes after 2 of 6 steps: Lightning
            # takes 1 more step on each, the loader has 2 each; 2 packs would be skipped).
            raise ValueError(
                f"the checkpoint's loader state was saved by {len(states)} process(es); this "
                f"run has {world_size}. Lightning counts the epoch's batches per process, so "
                "on another number of processes the resumed epoch would not match the loader's "
                f"remainder (more processes skip packs): resume on {len(states)} process(es)"
            )
        super().load_state_dict(states[rank])


class NeatDataModule(pl.LightningDataModule):
    """A ``LightningDataModule`` over one neatpack loader, built by ``build_loader()`` when
    Lightning first asks for the train dataloader (after the process group starts) and closed
    (threads, workers) at teardown. ``self.loader`` is the loader (its ledger, stats)."""

    def __init__(self, build_loader: Callable[[], Any]) -> None:
        super().__init__()
        self.build_loader = build_loader
        self.loader: Any = None
        self.batches: LightningBatches | None = None

    def train_dataloader(self) -> LightningBatches:
        # The same object on every call: a reload (reload_dataloaders_every_n_epochs) goes on
        # with the loader's next epoch instead of building the graph again.
        if self.batches is None:
            self.loader = self.build_loader()
            self.batches = LightningBatches(self.loader)
        return self.batches

    def teardown(self, stage: str) -> None:
        if self.loader is not None:
            self.loader.close()


class NeatDataMetrics(pl.Callback):
    """Logs the loader's ``data_metrics()`` (the figures since the previous log: wait time,
    fill, estimate error, per-source tokens) through ``LightningModule.log_dict`` on the steps
    Lightning writes to its loggers (every ``log_every_n_steps`` optimizer steps), so one window
    spans exactly the steps between two log rows. Figures are this rank's; rank 0's are written.
    """

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Once per optimizer step, after its accumulation micro-batches; Lightning writes the
        # logs of step N (0-based) when (N + 1) % log_every_n_steps == 0.
        every = trainer.log_every_n_steps
        if not every or (trainer.global_step + 1) % every:
            return
        loader = getattr(trainer.train_dataloader, "loader", None)
        if loader is not None:
            pl_module.log_dict(loader.data_metrics(), on_step=True, on_epoch=False)
