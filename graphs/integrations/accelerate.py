"""Accelerate: a neatpack loader in an ``accelerate`` training loop, checkpointed by ``save_state``.

    accelerator = Accelerator()                      # first: it starts the process group
    loader = neat_vlm_graph(data, processor, config=config)   # reads this rank and world size
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader
    batches = prepare_loader(accelerator, loader, model=model)  # ranks, state, varlen on CUDA
    step = 0
    accelerator.load_state(last_complete_state("ckpt"))   # on resume: the newest complete one
    while batches.epoch < epochs:
        for batch in batches:
            step += 1
            n = step_normalizer([batch], device=accelerator.device)
            loss = model(**model_inputs(batch, num_items_in_batch=n, model=model)).loss
            accelerator.backward(loss * loss_scale(accelerator))
            optimizer.step(); optimizer.zero_grad()
            batches.log_data_metrics(step)           # wait, fill, ... to the trackers
            save_state(accelerator, f"ckpt/step-{step}")  # every rank; marks it complete

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
* A run killed while ``accelerator.save_state`` writes leaves a torn folder (weights, no
  optimizer or loader state, ...), and ``load_state`` on it fails on the missing file (or
  ``load_state()`` under ``automatic_checkpoint_naming`` picks it, being the newest).
  :func:`save_state` writes ``neatpack_complete.json`` after ``save_state`` has returned on
  every process; :func:`last_complete_state` takes the newest folder that has it and warns
  about each newer torn one it skips (the same rule as ``NeatTrainer``'s checkpoints).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import torch

from neatpack.graphs.checkpoint_dirs import atomic_file, json_problem, newest_complete
from neatpack.graphs.train import use_varlen_attention_for

__all__ = [
    "COMPLETE",
    "STATE_KEY",
    "AcceleratorBatches",
    "last_complete_state",
    "loss_scale",
    "prepare_loader",
    "save_state",
    "state_problem",
]

logger = logging.getLogger(__name__)
#: the key of every rank's loader state in the state ``AcceleratorBatches`` saves
STATE_KEY = "neatpack_loader_ranks"
#: written into a checkpoint folder after ``accelerator.save_state`` returned on every process
COMPLETE = "neatpack_complete.json"
#: a checkpoint folder's name: a word, then its number (``checkpoint_3``, ``step-40``)
_NUMBERED = re.compile(r"^\D*(\d+)$")


def prepare_loader(
    accelerator: Any, loader: Any, *, model: Any = None, varlen_attention: bool = True
) -> AcceleratorBatches:
    """``loader`` for an ``accelerate`` loop: its rank and world size checked against the
    accelerator's processes, its state registered with ``accelerator.register_for_checkpointing``
    (``save_state`` / ``load_state`` carry it), batches moved to ``accelerator.device``.
    ``model`` with ``varlen_attention`` (default): a loader of boundary batches
    (``attn_implementation="auto"`` on CUDA) switches it to neatpack's varlen attention on CUDA
    (``train.use_varlen_attention_for``); check each batch with ``model_inputs(batch,
    model=model)``."""
    if model is not None and varlen_attention:
        use_varlen_attention_for(accelerator.unwrap_model(model), loader)
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


def save_state(accelerator: Any, output_dir: str | None = None, **kwargs: Any) -> str:
    """``accelerator.save_state(output_dir, **kwargs)``, then :data:`COMPLETE` once every
    process has returned from it: a folder without it is torn (:func:`last_complete_state`
    skips it). Call it on every process, as ``save_state``. Returns the folder.

    Saving into a folder again removes its marker first (it is torn until the new save ends).
    Under ``ProjectConfiguration(automatic_checkpoint_naming=True)`` a torn
    ``checkpoint_<iteration>`` left by a killed run is removed, with a warning: Accelerate
    refuses to save into an existing folder, and a resumed run saves that iteration again."""
    auto = accelerator.project_configuration.automatic_checkpoint_naming
    if auto:
        name = f"checkpoint_{accelerator.save_iteration}"
        target = os.path.join(accelerator.project_dir, "checkpoints", name)
    elif output_dir is None:
        raise ValueError(
            "save_state(accelerator) needs output_dir, or an Accelerator with "
            "ProjectConfiguration(automatic_checkpoint_naming=True)"
        )
    else:
        target = os.fspath(output_dir)
    each_node = accelerator.project_configuration.save_on_each_node
    writer = accelerator.is_local_main_process if each_node else accelerator.is_main_process
    marker = os.path.join(target, COMPLETE)
    if writer and not auto and os.path.exists(marker):
        os.remove(marker)
    elif writer and auto and os.path.isdir(target) and state_problem(target) is not None:
        logger.warning("removing %s, torn by a run killed while saving it", target)
        shutil.rmtree(target)
    accelerator.wait_for_everyone()  # nobody writes into the folder while it counts complete
    location = str(accelerator.save_state(output_dir, **kwargs))
    accelerator.wait_for_everyone()  # every process's files are written
    if writer:
        with atomic_file(marker) as f:
            f.write(json.dumps({"processes": accelerator.num_processes}).encode())
    return location


def state_problem(folder: str | os.PathLike[str]) -> str | None:
    """Why a checkpoint folder cannot be resumed from (torn by a kill while it was saved, or
    saved by ``accelerator.save_state`` alone), or None when :func:`save_state` completed it."""
    return json_problem(folder, COMPLETE)


def last_complete_state(output_dir: str | os.PathLike[str]) -> str:
    """The newest complete checkpoint folder in ``output_dir`` (folders named a word then a
    number: ``step-40``, or ``checkpoint_3`` in ``project_dir/checkpoints`` under automatic
    naming), for ``accelerator.load_state``. Newer torn ones are skipped with a warning naming
    each; ``ValueError`` when none is complete."""
    return newest_complete(
        output_dir, _NUMBERED, state_problem,
        fix="train from scratch, or save with neatpack's save_state(accelerator, ...), which "
        f"marks a folder complete ({COMPLETE}) once every process has saved",
    )  # fmt: skip


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
        # Every rank's state: the loader takes its own on the same number of processes; on
        # another, a planned graph re-strides from the global cursor (in any rank's state) and
        # a stream redistributes what every rank had left (the loader refuses what cannot).
        self.loader.load_state_dict(states)


def _every_rank(value: Any) -> list[Any]:
    """``value`` of every process, by rank (an ``all_gather_object``; one process: itself)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
