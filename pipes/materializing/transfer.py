"""Worker -> main batch transfer through shared memory the worker reuses.

A loader worker process hands each batch to the trainer's process by pickling it. torch's own
path moves every tensor into a fresh shared-memory file and passes one file descriptor per
tensor: per batch a dozen descriptors, and every page of the pixel rows (tens of MB) faulted
in new, zeroed by the kernel, then unmapped after the batch. Measured here (pack 4096, B=2,
~64 MB of pixels a batch): that was ~18k page faults and ~40 ms of system time per batch,
a quarter of a worker's time, so one worker ran 25 % slower than the same steps in the
trainer's process.

Here a worker writes the whole batch (every top-level tensor, and lists of tensors) into one
**segment**: a ``memfd`` it keeps mapped and reuses. The batch travels as the segment's
descriptor plus the layout; the trainer's process maps it and gets plain tensors viewing it
(``torch.frombuffer``). The segment's first byte is its lease flag: the worker sets it when it
fills the segment, the trainer's process clears it when the last tensor viewing that mapping
is freed (a ``weakref.finalize`` on the mapping, which ``torch.frombuffer`` keeps alive for as
long as any view of it lives, slices included). The worker fills only segments whose flag is
clear, so a batch the trainer still holds (a list of batches, a slice kept for logging) is
never overwritten; when none is free it makes a new one. In steady state a worker cycles
through a few segments (in flight + prefetched + the one the step holds) and faults nothing;
beyond :data:`KEEP_FREE` free ones (after the trainer held many batches at once) it closes
the smallest.

Only process workers use it (``activate`` is called in the worker by the graph's stage
wrapper); thread workers and the trainer's own process hand batches over as they are.
``worker_transfer="torch"`` (the graphs' configs, ``map_stage(transfer=...)``) keeps torch's
path: the memory of each batch goes back when the trainer frees it, where a worker keeps its
segments mapped for its next batches. What travels is exactly the batch:
same keys in the same order, same dtypes, shapes and values (tensors arrive contiguous); other
values are pickled as usual.

>>> import torch
>>> batch = {"input_ids": torch.arange(6).view(2, 3), "n": 2, "pixels": [torch.ones(2)]}
>>> packed = to_transfer(batch)  # in this process (not a worker) it is the batch itself
>>> packed is batch
True
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Literal, get_args

import torch

__all__ = [
    "KEEP_FREE",
    "WORKER_TRANSFERS",
    "WorkerTransfer",
    "activate",
    "active",
    "check_worker_transfer",
    "collate_into_shared_memory",
    "enabled",
    "segments_seen",
    "to_transfer",
]

_HEADER = mmap.PAGESIZE  # the lease flag lives in the first page; tensors start after it
_ALIGN = 64
_GROW = 1.25  # a new segment has room for a batch this much larger than the one that made it
_ROUND = 2 << 20
#: Free segments a worker keeps mapped for its next batches (the largest ones); more are closed.
KEEP_FREE = 2

#: How a worker process hands a batch to the trainer's: through a reused segment (this
#: module), or torch's own path (a fresh shared-memory file per tensor per batch).
WorkerTransfer = Literal["segment", "torch"]
WORKER_TRANSFERS: tuple[str, ...] = get_args(WorkerTransfer)

_active_pid = -1
_ids = itertools.count()


def check_worker_transfer(worker_transfer: str) -> None:
    """Refuse a transfer that is not one of :data:`WORKER_TRANSFERS`, listing them.

    >>> check_worker_transfer("torch")
    """
    if worker_transfer not in WORKER_TRANSFERS:
        raise ValueError(
            f"{worker_transfer=} is not one of {WORKER_TRANSFERS}; segment is faster (reused "
            "shared memory), torch returns each batch's memory when the trainer frees it"
        )


def enabled() -> bool:
    """Whether this platform has segments (Linux ``memfd``); elsewhere torch's path is used."""
    return hasattr(os, "memfd_create")


def activate() -> None:
    """Called in a worker process before its step runs when the graph's ``worker_transfer`` is
    ``"segment"``: this process's batches go through segments (and the collater need not write
    pixels into torch's shared memory itself)."""
    global _active_pid
    if enabled():
        _active_pid = os.getpid()


def active() -> bool:
    """Whether this process was activated (a forked child of an active worker is not)."""
    return _active_pid == os.getpid()


def collate_into_shared_memory(owner_pid: int) -> bool:
    """Whether a collating step should write pixels straight into torch's shared memory: in a
    worker process (not ``owner_pid``, the trainer's) whose batches leave by torch's own path.
    Through a segment they are copied there anyway, so a plain heap tensor is cheaper."""
    return os.getpid() != owner_pid and not active()


class _Segment:
    """A memfd mapped in the worker; byte 0 is the lease flag (1: the trainer holds it)."""

    def __init__(self, capacity: int) -> None:
        self.id = next(_ids)
        self.capacity = capacity
        self.fd = os.memfd_create("neatpack-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, _HEADER + capacity)
            self.map = mmap.mmap(self.fd, _HEADER + capacity)
        except BaseException:
            os.close(self.fd)
            raise

    def leased(self) -> bool:
        return self.map[0] != 0

    def close(self) -> None:
        self.map.close()  # BufferError while a tensor here views it (nothing is closed then)
        os.close(self.fd)


class _Pool:
    """This worker's segments."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.segments: list[_Segment] = []

    def take(self, nbytes: int) -> _Segment:
        free = [s for s in self.segments if not s.leased()]
        fits = [s for s in free if s.capacity >= nbytes]
        if fits:
            seg = min(fits, key=lambda s: s.capacity)
            free.remove(seg)
        else:  # the free ones are too small for batches this size: replace them
            self._drop(free)
            free = []
            size = -(-int(nbytes * _GROW) // _ROUND) * _ROUND
            seg = _Segment(max(size, _ROUND))
            self.segments.append(seg)
        seg.map[0] = 1
        # Batches the trainer held for a while (and then freed) leave many free segments:
        # keep a few for the next batches, give the rest back.
        self._drop(sorted(free, key=lambda s: s.capacity)[:-KEEP_FREE] if KEEP_FREE else free)
        return seg

    def _drop(self, segments: list[_Segment]) -> None:
        for s in segments:
            try:
                s.close()
            except BufferError:  # a tensor of this process still views it: keep it for now
                continue
            self.segments.remove(s)


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _this_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = _Pool()  # a forked child starts its own
        return _pool


def _is_plain(t: Any) -> bool:
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and not t.requires_grad
    )


#: ``(key, index in its list or None, byte offset, byte size, dtype, shape)`` of one tensor
Entry = tuple[Any, int | None, int, int, torch.dtype, tuple[int, ...]]


class TransferBatch:
    """A batch written into a segment; pickles to the descriptor and layout, unpickles (in the
    trainer's process) to the plain batch dict."""

    def __init__(
        self, seg: _Segment, size: int, entries: list[Entry], order: list[Any], rest: dict[Any, Any]
    ) -> None:
        self.seg, self.size, self.entries, self.order, self.rest = seg, size, entries, order, rest

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing.reduction import DupFd

        return _rebuild, (
            DupFd(self.seg.fd),
            (os.getpid(), self.seg.id),
            _HEADER + self.size,
            self.entries,
            self.order,
            self.rest,
        )


def to_transfer(batch: Any) -> Any:
    """``batch`` ready to leave this worker: a :class:`TransferBatch` when this process is an
    active worker and ``batch`` is a dict holding tensors (top level, or lists of tensors),
    else ``batch`` itself (also when a segment cannot be made: torch's path then carries it).
    """
    if not active() or not isinstance(batch, dict):
        return batch
    picked: list[tuple[Any, int | None, torch.Tensor]] = []
    for k, v in batch.items():
        if _is_plain(v):
            picked.append((k, None, v))
        elif isinstance(v, list) and v and all(_is_plain(x) for x in v):
            picked.extend((k, i, x) for i, x in enumerate(v))
    if not picked:
        return batch
    entries: list[Entry] = []
    off = 0
    for k, i, t in picked:
        off = -(-off // _ALIGN) * _ALIGN
        n = t.numel() * t.element_size()
        entries.append((k, i, off, n, t.dtype, tuple(t.shape)))
        off += n
    try:
        seg = _this_pool().take(off)
    except OSError:  # no memory for a segment: torch's own path
        return batch
    buf = torch.frombuffer(seg.map, dtype=torch.uint8, offset=_HEADER, count=max(off, 1))
    for (_, _, start, n, dtype, shape), (_, _, t) in zip(entries, picked, strict=True):
        if n:
            buf[start : start + n].view(dtype).view(shape).copy_(t)
    keys = {k for k, _, _ in picked}
    rest = {k: v for k, v in batch.items() if k not in keys}
    return TransferBatch(seg, off, entries, list(batch), rest)


def _assemble(
    buf: torch.Tensor, entries: list[Entry], order: list[Any], rest: Mapping[Any, Any]
) -> dict[Any, Any]:
    got: dict[Any, Any] = {}
    for k, i, start, n, dtype, shape in entries:
        t = (
            buf[_HEADER + start : _HEADER + start + n].view(dtype).view(shape)
            if n
            else torch.empty(shape, dtype=dtype)
        )
        if i is None:
            got[k] = t
        else:
            got.setdefault(k, []).append(t)
    return {k: got[k] if k in got else rest[k] for k in order}


_seen: set[tuple[int, int]] = set()


def segments_seen() -> int:
    """How many distinct worker segments this process has received batches from (what a
    worker reuses shows here: a long epoch sees a handful, not one per batch)."""
    return len(_seen)


def _release(flag: mmap.mmap) -> None:
    try:
        flag[0] = 0  # the worker may fill this segment again
    finally:
        flag.close()


def _rebuild(
    dupfd: Any,
    key: tuple[int, int],
    size: int,
    entries: list[Entry],
    order: list[Any],
    rest: dict[Any, Any],
) -> dict[Any, Any]:
    """In the trainer's process: map the segment, give the batch as tensors viewing it, and
    clear the lease flag once the last of them is gone."""
    fd = dupfd.detach()
    try:
        data = mmap.mmap(fd, size)
        flag = mmap.mmap(fd, mmap.PAGESIZE)
    finally:
        os.close(fd)
    weakref.finalize(data, _release, flag)
    _seen.add(key)
    return _assemble(torch.frombuffer(data, dtype=torch.uint8), entries, order, rest)
