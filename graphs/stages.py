"""Pieces every prebuilt graph shares: the map stage (inline or worker processes) and the
bookkeeping each pack carries to the loader's ledger."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from torchdata.nodes import BaseNode, Mapper, ParallelMapper, Prefetcher

from neatpack.graphs.watchdog import quiet_forked_iterator_gc

__all__ = ["map_stage", "pack_meta"]


def map_stage(
    node: BaseNode[Any],
    fn: Callable[[Any], Any],
    *,
    num_workers: int,
    method: Literal["process", "thread"] = "process",
    multiprocessing_context: str | None = "fork",
    prefetch: int = 0,
) -> BaseNode[Any]:
    """``fn`` over ``node``: inline when ``num_workers == 0``, else in worker processes (or
    threads), always in order (out-of-order delivery loses items on resume in torchdata 0.11),
    then an optional prefetch buffer."""
    out: BaseNode[Any]
    if num_workers > 0 and method == "process":
        quiet_forked_iterator_gc()
    if num_workers > 0:
        out = ParallelMapper(
            node,
            fn,
            num_workers=num_workers,
            in_order=True,
            method=method,
            multiprocessing_context=multiprocessing_context if method == "process" else None,
        )
    else:
        out = Mapper(node, fn)
    return Prefetcher(out, prefetch) if prefetch else out


def pack_meta(
    ref: dict[str, Any],
    *,
    real_tokens: int,
    estimated_tokens: int | None = None,
    report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the loader's ledger and stats read of one pack (no tensors)."""
    return {
        "epoch": ref["epoch"],
        "slot": ref["slot"],
        "pack_index": ref["pack_index"],
        "padded": ref["padded"],
        "sample_ids": list(ref["sample_ids"]),
        "real_tokens": int(real_tokens),
        "estimated_tokens": estimated_tokens,
        "report": report,
    }
