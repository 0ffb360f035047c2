"""How many processes build a length index, and how they start.

The index build is pure Python per record (JSON parse, text stats or tokenization, header
arithmetic), so it scales with processes over slices of the records; the slices are
concatenated in order, so the index is the same for any number of workers (and its cache
fingerprint does not depend on it)::

    build_length_index(source, est, num_workers=None)  # index_workers(this rank's records)

Workers start with ``fork`` where the platform has it (Linux), as the graph's loader workers do
by default: a forked worker starts in milliseconds, where a spawned one re-imports torch and
transformers (seconds per worker; measured here, 2 spawned workers over 20k records took longer
than one process alone). ``start_method="spawn"`` (or ``forkserver``; the graphs'
``index_start_method``) starts them fresh, for a process that must not fork (one with CUDA or
NCCL threads already running); the worker count then defaults to 0, as above.
HF tokenizers switch their own thread pool off in a forked child, so exact mode is safe too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Literal, get_args

from neatpack.pipes.compat.retired_env import check_retired_env

__all__ = [
    "INDEX_START_METHODS",
    "MIN_RECORDS_PER_WORKER",
    "IndexStartMethod",
    "index_start_method",
    "index_workers",
]

#: How the length index's worker processes start (``multiprocessing`` start methods).
IndexStartMethod = Literal["fork", "spawn", "forkserver"]
INDEX_START_METHODS: tuple[str, ...] = get_args(IndexStartMethod)

#: Below this many records per worker a pool costs more than it saves (measured with fork:
#: starting a pool and pickling the estimator is ~0.1-0.3 s; one process does ~5-10k records/s
#: in exact mode and ~10-100k in estimate mode).
MIN_RECORDS_PER_WORKER = 16_384


def index_start_method(start_method: str | None = None) -> str:
    """``start_method`` checked against this platform, or (None) ``fork`` where available, else
    ``spawn``. The error lists the valid values.

    >>> index_start_method(), index_start_method("spawn")  # on Linux
    ('fork', 'spawn')
    """
    check_retired_env("NEATPACK_INDEX_START")
    methods = tuple(m for m in INDEX_START_METHODS if m in mp.get_all_start_methods())
    if start_method is None:
        return "fork" if "fork" in methods else "spawn"
    if start_method not in methods:
        raise ValueError(
            f"index_start_method={start_method!r} is not one of {methods} (this platform's); "
            "fork starts index workers fastest, spawn or forkserver where a process must not fork"
        )
    return start_method


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _local_ranks() -> int:
    """Training processes on this machine (``LOCAL_WORLD_SIZE``, set by torchrun), at least 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def index_workers(
    num_records: int, *, cpus: int | None = None, start_method: str | None = None
) -> int:
    """Worker processes for an index over ``num_records`` (this rank's slice): 0 (this
    process) when the records are too few to pay for a pool (< 2 x
    :data:`MIN_RECORDS_PER_WORKER`) or when ``start_method`` (see :func:`index_start_method`)
    is not fork, else one per usable core, at most
    one per ``MIN_RECORDS_PER_WORKER`` records. ``cpus`` defaults to this process's usable
    cores divided among the machine's ranks (``LOCAL_WORLD_SIZE``): 8 ranks on 16 cores build
    their slices with 2 workers each, not 16.

    >>> index_workers(1_000, cpus=8), index_workers(40_000, cpus=8), index_workers(10**6, cpus=8)
    (0, 2, 8)
    """
    n_cpus = _cpus() // _local_ranks() if cpus is None else cpus
    if n_cpus < 2 or index_start_method(start_method) != "fork":
        return 0
    by_size = num_records // MIN_RECORDS_PER_WORKER
    return 0 if by_size < 2 else min(n_cpus, by_size)
