"""Accelerate: a neatpack loader in an ``accelerate`` training loop, checkpointed by ``save_state``.

    accelerator = Accelerator()                      # first: it starts the process group
    loader = neat_vlm_graph(data, processor, config=config)   # reads this rank and world size
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader
    batches = prepare_loader(accelerator, loader)    # checks ranks, registers the state
    step = 0
    accelerator.load_state("ckpt")                   # on resume: the loader continues exactly
    while batches.epoch < epochs:
        for batch in batches:
            step += 1
            n = step_normalizer([batch], device=accelerator.device)
            loss = model(**model_inputs(batch, num_items_in_batch=n)).loss
            accelerator.backward(loss * loss_scale(accelerator))
            optimizer.step(); optimizer.zero_grad()
            batches.log_data_metrics(step)           # wait, fill, ... to the trackers
            accelerator.save_state("ckpt")           # every rank calls it

What Accelerate does with a loader on its own, and why this module exists:

* ``accelerator.prepare(loader)`` returns a ``NeatLoader`` untouched (it wraps only
  ``torch.utils.data.DataLoader``): no device placement, no checkpointing. Do not wrap it in a
  ``DataLoader`` to prepare it either: Accelerate shards what a prepared ``DataLoader`` yields
  over the processes, and the loader's batches are already this rank's share.
* ``accelerator.register_for_checkpointing(loader)`` alone saves the main process's state only
  (``custom_checkpoint_<i>.pkl``, written by rank 0) and every rank loads that file: rank 1
  then gets rank 0's position, which the loader refuses ("state of rank 0 loaded into rank 1").
  :class:`AcceleratorBatches` gathers every rank's state into that one file; each rank loads
  its own, and on another number of processes the loader re-strides the rest of the epoch from
  the global cursor (the same in every rank's state).
* A loader built before ``Accelerator()`` started the process group is rank 0 of 1 on every
  process: each would train the same batches. :func:`prepare_loader` refuses it.
* ``accelerator.backward`` divides the loss by ``gradient_accumulation_steps`` and DDP averages
  the gradients over the processes; a loss normalized by ``step_normalizer`` is already the
  mean over the whole step, so it is multiplied back by :func:`loss_scale`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["STATE_KEY", "AcceleratorBatches", "loss_scale", "prepare_loader"]

#: the key of every rank's loader state in the state ``AcceleratorBatches`` saves
STATE_KEY = "neatpack_loader_ranks"


def prepare_loader(accelerator: Any, loader: Any) -> AcceleratorBatches:
    """``loader`` for an ``accelerate`` loop: its rank and world size checked against the
    accelerator's processes, its state registered with ``accelerator.register_for_checkpointing``
    (``save_state`` / ``load_state`` carry it), batches moved to ``accelerator.device``."""
    source = loader.source
    want = (accelerator.process_index, accelerator.num_processes)
    if (source.rank, source.world_size) != want:
        raise ValueError(
            f"the loader serves rank {source.rank} of {source.world_size} but this process is "
            f"rank {want[0]} of {want[1]} (accelerator.process_index / num_processes): build "
            "the loader after Accelerator() (which starts the process group the graph reads) "
            "or pass rank=accelerator.process_index, world_size=accelerator.num_processes"
        )
    batches = AcceleratorBatches(loader, accelerator)
    accelerator.register_for_checkpointing(batches)
    return batches


def loss_scale(accelerator: Any) -> int:
    """What to multiply a ``step_normalizer``-normalized loss by before
    ``accelerator.backward``: the processes DDP averages over, times the accumulation steps
    ``backward`` divides by."""
    return int(accelerator.num_processes) * int(accelerator.gradient_accumulation_steps)


class AcceleratorBatches:
    """A neatpack loader as Accelerate sees it: its batches on ``accelerator.device``, and a
    state that holds every rank's loader state (saved by the main process alone, loaded by
    each rank: its own entry).

    The state is ``{"neatpack_loader_ranks": [state of rank 0, state of rank 1, ...]}``;
    ``state_dict()`` is a collective (an ``all_gather_object``): ``save_state`` calls it on
    every process, as Accelerate requires anyway.
    """

    def __init__(self, loader: Any, accelerator: Any) -> None:
        self.loader = loader
        self.accelerator = accelerator

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from accelerate.utils import send_to_device

        device = self.accelerator.device
        for batch in self.loader:
            yield send_to_device(batch, device)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (``NeatLoader.epoch``)."""
        return int(self.loader.epoch)

    def log_data_metrics(self, step: int | None = None) -> dict[str, float]:
        """The loader's data figures since the previous call (``NeatLoader.data_metrics``:
        ``data/wait_s``, ``data/fill``, ...) through ``accelerator.log``, to every tracker the
        accelerator logs with; returned too. The main process's figures, plus
        ``data/wait_s_max`` and ``data/wait_fraction_max`` over the processes: a rank that waits
        for data stalls every rank at the next gradient all-reduce, which the main process's
        own wait does not show. A collective like ``save_state``: call it on every process."""
        every = _every_rank(self.loader.data_metrics())
        metrics = dict(every[0])
        for key in ("data/wait_s", "data/wait_fraction"):
            metrics[f"{key}_max"] = max(float(m.get(key, 0.0)) for m in every)
        self.accelerator.log(metrics, step=step)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: _every_rank(self.loader.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get(STATE_KEY) if isinstance(state, dict) else None
        if not isinstance(states, list) or not states:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a state saved by neatpack's AcceleratorBatches (keys: {keys}); it holds "
                f"every rank's loader state under {STATE_KEY!r}. Was the loader registered with "
                "accelerator.register_for_checkpointing(loader) instead of prepare_loader? That "
                "saved rank 0's state only: resume from a checkpoint saved through prepare_loader"
            )
        rank = self.loader.source.rank
        # Same number of processes: each rank its own state. Another number: any rank's state
        # gives the global cursor the loader re-strides from (the loader refuses what cannot).
        own = len(states) == self.loader.source.world_size
        self.loader.load_state_dict(states[rank] if own else states[0])


def _every_rank(value: Any) -> list[Any]:
    """``value`` of every process, by rank (an ``all_gather_object``; one process: itself)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
