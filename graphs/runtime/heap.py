"""Reuse freed heap memory while a graph step runs in the main process (``num_workers=0``).

A pack's pixel tensors are tens of MB (the processor's stacked and patchified images, the
pack's ``pixel_values``, the batch's). glibc serves every allocation over its mmap threshold
(32 MiB at most) with fresh pages and unmaps them on free, so the next pack faults every page
in again, zeroed by the kernel. Worker processes avoid that for good
(:func:`neatpack.graphs.runtime.watchdog.keep_freed_memory`); the main process is the trainer's, so
there the setting is switched on only while a step runs::

    step = InMainProcess(chain)       # what map_stage runs when num_workers == 0
    batch = step(pack_refs)           # mmap off inside the step, back on after it

Inside the step large allocations come from the heap (``M_MMAP_MAX=0``) and what they free
stays there for the next step (``M_TRIM_THRESHOLD`` = :data:`KEEP_FREED_BYTES`). After the
step ``M_MMAP_MAX`` is restored, so the trainer's own large tensors are mapped and unmapped as
before; ``M_MMAP_THRESHOLD`` is pinned at glibc's dynamic ceiling (32 MiB), the value glibc
itself moves to once a large block has been freed (setting any malloc parameter freezes the
dynamic threshold, so it is set to where it would have gone). Cost: the process keeps up to
its peak step heap plus :data:`KEEP_FREED_BYTES` resident.

Measured (``python benchmarks/bench_loader.py``, 0 workers, CPU time per real token, same run):
without it the graph ran at 0.6-0.7x the bare processor's rate, most of the gap page-fault
system time; with it 0.94-1.06x. It never lost in these measurements, so there is no switch
(``NEATPACK_MAIN_MALLOC`` is retired: ``pipes/compat/retired_env.py``).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["KEEP_FREED_BYTES", "InMainProcess", "heap_reuse"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
#: glibc's defaults / ceilings on 64-bit Linux (malloc.c: DEFAULT_MMAP_MAX,
#: DEFAULT_MMAP_THRESHOLD_MAX).
_DEFAULT_MMAP_MAX, _MMAP_THRESHOLD_MAX = 65536, 32 * 1024 * 1024
#: Free heap kept at the top instead of being returned to the kernel.
KEEP_FREED_BYTES = 1 << 30

_libc: Any = None
_tuned = False
_depth = 0  # blocks open now, over all threads: mmap is back on when the last one closes
_lock = threading.Lock()


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None (not glibc)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.mallopt  # noqa: B018  (AttributeError where there is no mallopt)
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return None
    fn: Callable[[int, int], int] = _libc.mallopt
    return fn


@contextmanager
def heap_reuse() -> Iterator[bool]:
    """Large allocations from the heap, kept after free, for the ``with`` block.

    Yields whether the settings apply (glibc). Nested and concurrent blocks
    (graphs in several threads) are counted: ``M_MMAP_MAX`` goes back to glibc's default when
    the last one closes; the trim threshold stays (the kept memory is what the next block
    reuses).

    >>> with heap_reuse() as on:
    ...     isinstance(on, bool)
    True
    """
    global _tuned, _depth
    mallopt = _mallopt()
    if mallopt is None:
        yield False
        return
    with _lock:
        if not _tuned:
            mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
            mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES)
            _tuned = True
        if _depth == 0:
            mallopt(_M_MMAP_MAX, 0)
        _depth += 1
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)


class InMainProcess:
    """``fn`` run inside :func:`heap_reuse`: the step ``map_stage`` runs with no workers.
    Picklable when ``fn`` is; ``repr`` shows ``fn``."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, item: Any) -> Any:
        with heap_reuse():
            return self.fn(item)

    def __repr__(self) -> str:
        return f"InMainProcess({self.fn!r})"
