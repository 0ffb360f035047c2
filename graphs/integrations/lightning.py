"""PyTorch Lightning on a neatpack loader, resumed exactly by ``fit(ckpt_path=...)``.

    datamodule = NeatDataModule(lambda: neat_vlm_graph(data, processor, config=cfg))
    trainer = L.Trainer(callbacks=[ModelCheckpoint(every_n_train_steps=500, save_last=True)])
    trainer.fit(module, datamodule=datamodule)            # or fit(..., ckpt_path="last")

    class Module(L.LightningModule):                      # the model's own loss
        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss * loss_scale(self.trainer)

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
  next). Each batch also carries ``num_items_in_batch``: the label tokens of its whole optimizer
  step (the ``accumulate_grad_batches`` micro-batches, over every rank; ``step_normalizer``),
  so the loss is ``sum / step tokens`` and the step's gradient is that of the token mean over
  the step, whatever the packing, the number of processes or the accumulation. Lightning
  divides each loss by ``accumulate_grad_batches`` and DDP averages over the processes;
  :func:`loss_scale` multiplies both back. A mean of micro-batch means weighs a token by how
  its micro-batch was filled: with micro-batches of 119 and 191 label tokens (the test's first
  step), a token of the first counted 1.6 times one of the second.
* A checkpoint saved after an epoch's last step resumes with the next epoch, not an empty one
  (``TrainerBatches``): Lightning, like ``transformers.Trainer``, would count the empty
  remainder of the finished epoch as a whole epoch.
* :class:`NeatDataMetrics` (a callback) logs the loader's ``data_metrics()`` (``data/wait_s``,
  ``data/fill``, ...) with ``self.log_dict`` on each step Lightning writes its logs, so every
  logger of the trainer (CSV, TensorBoard, W&B) shows when the data is the bottleneck.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from neatpack.graphs.hf_trainer import TrainerBatches
from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.train import step_normalizer, use_varlen_attention_for

__all__ = [
    "RANKS_KEY",
    "WINDOW_KEY",
    "LightningBatches",
    "NeatDataMetrics",
    "NeatDataModule",
    "loss_scale",
]

RANKS_KEY = "neatpack_loader_ranks"  # every rank's loader state, by rank
WINDOW_KEY = "neatpack_window"  # saved inside an accumulation window: [trained, window size]


def loss_scale(trainer: Any) -> int:
    """What to multiply the loss of a :class:`NeatDataModule` batch by in ``training_step``:
    Lightning divides it by ``accumulate_grad_batches`` and DDP averages the gradients over the
    ``world_size`` processes, but ``num_items_in_batch`` already counts the whole step."""
    return int(trainer.accumulate_grad_batches) * int(trainer.world_size)


class LightningBatches(TrainerBatches):
    """:class:`TrainerBatches` whose state is every rank's loader state (Lightning's checkpoint
    is written by rank 0 alone); ``load_state_dict`` takes this rank's.

    Each batch carries ``num_items_in_batch``, the label tokens of its optimizer step: the
    batches are fetched one accumulation window at a time (``trainer.accumulate_grad_batches``,
    read at each window, so a ``GradientAccumulationScheduler`` is followed) and counted with
    :func:`step_normalizer` (an all-reduce over the ranks, on ``trainer.strategy.root_device``).
    Lightning's windows are the same: ``accumulate_grad_batches`` batches from the epoch's
    first, the epoch's last batch closing a shorter one. A checkpoint inside a window (Lightning
    writes one at the first micro-batch after a resume: ``ModelCheckpoint`` does not restore
    the step it last saved) holds the loader's state before the window and the number of its
    batches trained; the resume fetches the window again and goes on after those.
    """

    def __init__(self, loader: Any, trainer: Any = None, model: Any = None) -> None:
        super().__init__(loader, model)
        self.trainer = trainer
        # Inside a window the loader is ahead of training, so the state saved there is the
        # loader's state before the window plus how many of its batches were trained.
        self._window: tuple[Any, int, int] | None = None  # (state before, trained, size)
        self._resume_window: tuple[int, int] = (0, 0)  # (trained, size) from load_state_dict

    def __iter__(self) -> Iterator[dict[str, Any]]:
        (skip, size), self._resume_window = self._resume_window, (0, 0)
        source = self.loader_batches()
        while True:
            accumulate = self._accumulate()
            before = self.loader.state_dict() if accumulate > 1 else None
            window = list(itertools.islice(source, accumulate))
            self._window = None
            if not window:  # every rank has as many batches: all skip the all-reduce together
                return
            if skip and len(window) != size:
                raise ValueError(
                    f"the checkpoint was saved after {skip} of the {size} micro-batches of an "
                    f"accumulation window; this run's window has {len(window)} "
                    f"(accumulate_grad_batches={accumulate}): resume with "
                    f"accumulate_grad_batches={size}, or from a checkpoint saved on a step"
                )
            device = None if self.trainer is None else self.trainer.strategy.root_device
            n = step_normalizer(window, device=device)  # the same on resume: the same window
            for i in range(skip, len(window)):
                trained = i + 1
                self._window = (before, trained, len(window)) if trained < len(window) else None
                yield {**self.inputs(window[i]), "num_items_in_batch": n}
            skip = 0

    def _accumulate(self) -> int:
        return 1 if self.trainer is None else int(self.trainer.accumulate_grad_batches)

    def state_dict(self) -> dict[str, Any]:
        window = self._window
        own = super().state_dict() if window is None else dict(window[0])
        _, world_size = resolve_rank(None, None)
        states: list[Any] = [own]
        if world_size > 1:  # every rank saves (Lightning's save_checkpoint runs on all ranks)
            states = [None] * world_size
            dist.all_gather_object(states, own)
        out: dict[str, Any] = {RANKS_KEY: states}
        if window is not None:  # the same on every rank: each trains its window in lockstep
            out[WINDOW_KEY] = [window[1], window[2]]
        return out

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
        trained, size = state.get(WINDOW_KEY, (0, 0))
        self._resume_window = (int(trained), int(size))


class NeatDataModule(pl.LightningDataModule):
    """A ``LightningDataModule`` over one neatpack loader, built by ``build_loader()`` when
    Lightning first asks for the train dataloader (after the process group starts) and closed
    (threads, workers) at teardown. ``self.loader`` is the loader (its ledger, stats).

    ``model``: the transformers model the module trains. Each batch is then checked against its
    attention (``model_inputs(batch, model=model)``), and with ``varlen_attention`` (default)
    a loader of boundary batches (``attn_implementation="auto"`` on CUDA) switches it to
    neatpack's varlen attention on CUDA (``hf_trainer.use_varlen_attention_for``)."""

    def __init__(
        self, build_loader: Callable[[], Any], *, model: Any = None, varlen_attention: bool = True
    ) -> None:
        super().__init__()
        self.build_loader = build_loader
        self.model = model
        self.varlen_attention = varlen_attention
        self.loader: Any = None
        self.batches: LightningBatches | None = None

    def train_dataloader(self) -> LightningBatches:
        # The same object on every call: a reload (reload_dataloaders_every_n_epochs) goes on
        # with the loader's next epoch instead of building the graph again.
        if self.batches is None:
            self.loader = self.build_loader()
            if self.model is not None and self.varlen_attention:
                use_varlen_attention_for(self.model, self.loader)
            self.batches = LightningBatches(self.loader, self.trainer, self.model)
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
