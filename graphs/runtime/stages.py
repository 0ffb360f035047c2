"""The worker stage every graph uses: a step (usually a ``StepChain``) over a node, inline or in
worker processes, in order, with an optional prefetch buffer. ``pack_meta`` (the bookkeeping
each pack carries to the loader's ledger) lives in ``neatpack.pipes.steps``."""

from __future__ import annotations

import multiprocessing
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchdata.nodes import BaseNode, Batcher, Mapper, ParallelMapper, PinMemory, Prefetcher

from neatpack.graphs.runtime.heap import InMainProcess
from neatpack.graphs.runtime.loader import NeatLoader
from neatpack.graphs.runtime.watchdog import init_worker, quiet_forked_iterator_gc
from neatpack.pipes.compat.retired_env import check_retired_env
from neatpack.pipes.materializing.transfer import (
    WorkerTransfer,
    activate,
    check_worker_transfer,
    to_transfer,
)
from neatpack.pipes.planning.source import PackSource
from neatpack.pipes.planning.stream_packer import StreamPacker
from neatpack.pipes.steps import Collater, PackMaterializer, StepChain, pack_meta

__all__ = ["GraphParts", "WorkerMethod", "check_start_method", "map_stage", "pack_meta"]

#: Workers as processes, or as threads (free-threaded Python).
WorkerMethod = Literal["process", "thread"]


def check_start_method(multiprocessing_context: str | None) -> None:
    """Refuse, at config time, a start method this platform lacks (else the first iteration
    with workers raises it, far from the config that set it)."""
    valid = (*multiprocessing.get_all_start_methods(), None)
    if multiprocessing_context not in valid:
        raise ValueError(
            f"{multiprocessing_context=} is not one of {valid}; fork starts workers fastest, "
            "spawn or forkserver where a process must not fork"
        )


class InWorker:
    """``fn`` with the worker set-up first (``init_worker``: die with the parent, one torch
    thread per worker, keep freed memory), so any step run by ``map_stage`` gets it; in a
    worker process its result leaves through a reused shared-memory segment
    (``pipes/materializing/transfer.py``), or with ``transfer="torch"`` by torch's own path.
    Picklable when ``fn`` is (the choice travels with it to spawned workers)."""

    def __init__(self, fn: Callable[[Any], Any], transfer: WorkerTransfer = "segment") -> None:
        check_worker_transfer(transfer)
        self.fn, self.owner_pid, self.transfer = fn, os.getpid(), transfer

    def __call__(self, item: Any) -> Any:
        init_worker(self.owner_pid)
        if os.getpid() == self.owner_pid:  # thread workers
            return self.fn(item)
        if self.transfer == "segment":
            activate()  # the batch leaves through a reused segment (materializing/transfer.py)
        return to_transfer(self.fn(item))


def map_stage(
    node: BaseNode[Any],
    fn: Callable[[Any], Any],
    *,
    num_workers: int,
    method: WorkerMethod = "process",
    multiprocessing_context: str | None = "fork",
    prefetch: int = 0,
    pin_memory: bool = False,
    transfer: WorkerTransfer = "segment",
) -> BaseNode[Any]:
    """``fn`` over ``node``: inline when ``num_workers == 0``, else in worker processes (or
    threads), always in order (out-of-order delivery loses items on resume in torchdata 0.11),
    then an optional prefetch buffer, then (``pin_memory=True`` and CUDA present) a torchdata
    ``PinMemory`` thread that copies every batch tensor into page-locked memory, so
    ``batch[k].to("cuda", non_blocking=True)`` overlaps the copy with compute. Without CUDA the
    option is ignored with a warning, as ``torch.utils.data.DataLoader`` does (torchdata's
    ``PinMemory`` cannot even be built there). ``transfer``: how a worker process hands a
    batch over (``"segment"`` or ``"torch"``, ``pipes/materializing/transfer.py``).

    The result is plain torchdata (``Mapper`` / ``ParallelMapper``, ``Prefetcher``), so its state
    is theirs: the snapshot of ``node``'s state at the last item handed on. ``fn`` must be
    picklable with ``method="process"`` and a spawn/forkserver context (fork needs no pickling).
    """
    check_worker_transfer(transfer)
    out: BaseNode[Any]
    if num_workers > 0 and method == "process":
        check_retired_env("NEATPACK_WORKER_ARENA", "NEATPACK_WORKER_MALLOC")
        quiet_forked_iterator_gc()
    elif num_workers == 0:
        check_retired_env("NEATPACK_MAIN_MALLOC")
    if num_workers > 0:
        out = ParallelMapper(
            node,
            InWorker(fn, transfer),
            num_workers=num_workers,
            in_order=True,
            method=method,
            multiprocessing_context=multiprocessing_context if method == "process" else None,
        )
    else:  # in the trainer's process: freed step memory is reused, see graphs/runtime/heap.py
        out = Mapper(node, InMainProcess(fn))
    if prefetch:
        out = Prefetcher(out, prefetch)
    if pin_memory:
        if torch.cuda.is_available():
            out = PinMemory(out)
        else:
            warnings.warn(
                "pin_memory=True is ignored: no CUDA device (batches stay in pageable memory)",
                UserWarning,
                stacklevel=3,
            )
    return out


@dataclass(frozen=True, kw_only=True)
class GraphParts:
    """The pieces of a prebuilt graph, to compose your own graph from (README "Compose your
    own graph"): this rank's ``PackSource``, the worker steps, and what ``NeatLoader`` needs.

    ``steps`` is the prebuilt worker chain in order (``PerPack(PackMaterializer)``, the
    user's hooks, ``Collater``, ``PPMediaSplitter``); ``build`` is the prebuilt graph over a
    source; ``loader(build)`` wraps any graph of yours in a ``NeatLoader`` with the same
    checkpoint key, so it resumes (and refuses foreign states) like the prebuilt one.
    """

    source: PackSource | StreamPacker  # a stream's: graphs/neat_stream.py
    materialize: PackMaterializer | None  # None: a graph without a materialize step (grouped)
    collate: Collater | None  # None: a graph without a Collater (grouped)
    steps: tuple[Callable[[Any], Any], ...]
    batch_size: int
    pack_size: int
    config: dict[str, Any]
    num_workers: int = 0
    method: WorkerMethod = "process"
    multiprocessing_context: str | None = "fork"
    prefetch: int = 0
    pin_memory: bool = False
    transfer: WorkerTransfer = "segment"  # how worker batches reach the trainer (transfer.py)
    keep_ledger: bool = True
    ledger_epochs: int | None = None
    data: dict[str, str] | None = None  # the data's name and fingerprint (resume messages)
    # False: each plan entry is already a whole batch (the grouped graph): no Batcher
    batched: bool = True

    def build(self, src: BaseNode[Any]) -> BaseNode[Any]:
        """The prebuilt graph: ``Batcher(src) -> map_stage(StepChain(*steps))``."""
        return map_stage(
            Batcher(src, self.batch_size, drop_last=False) if self.batched else src,
            StepChain(*self.steps),
            num_workers=self.num_workers,
            method=self.method,
            multiprocessing_context=self.multiprocessing_context,
            prefetch=self.prefetch,
            pin_memory=self.pin_memory,
            transfer=self.transfer,
        )

    def loader(self, build: Callable[[BaseNode[Any]], BaseNode[Any]] | None = None) -> NeatLoader:
        """A ``NeatLoader`` over ``build(source)`` (default: the prebuilt graph)."""
        return NeatLoader(
            self.source,
            build or self.build,
            pack_size=self.pack_size,
            config=self.config,
            keep_ledger=self.keep_ledger,
            ledger_epochs=self.ledger_epochs,
            data=self.data,
        )
