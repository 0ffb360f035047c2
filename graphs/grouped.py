"""``grouped_vlm_graph()``: length-grouped batches, padded not packed, with the same resume.

Samples are sorted by estimated length and cut into batches of ``batch_size`` neighbours, so a
batch wastes little padding. One such batch plays the role of a pack in the plan: the ranks of
one step get neighbouring batches (similar lengths, similar step times), and the epoch shuffles
whole step groups. State, ledger and elastic resume are the packed graphs'.

    sorted by length:   [s7 s2 s9 s4 | s1 s8 s3 s5 | s6 s0 ...]   batch_size 4
    batches:              b0             b1             b2
    epoch order:        step groups of world_size batches, shuffled by (seed, epoch)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from neatpack.graphs.assemble import assemble, loader_of
from neatpack.graphs.config import GroupedConfig
from neatpack.graphs.open_data import open_source
from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.runtime.loader import describe_data
from neatpack.graphs.runtime.stages import GraphParts
from neatpack.pipes.families import get_handler
from neatpack.pipes.indexing.handler_lengths import handler_estimator
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.planning.plan import PackPlan
from neatpack.pipes.steps import ConversationTokenizer, PadCollater, SampleReader

__all__ = ["GroupedConfig", "grouped_plan", "grouped_vlm_graph", "grouped_vlm_parts"]


def grouped_plan(
    total: np.ndarray, batch_size: int, *, group_size: int, seed: int, shuffle: bool
) -> PackPlan:
    """Length-sorted batches of ``batch_size`` ids as a plan (one batch = one plan entry).

    >>> plan = grouped_plan(np.array([5, 1, 9, 3]), 2, group_size=1, seed=0, shuffle=False)
    >>> plan.packs()
    [[1, 3], [0, 2]]
    """
    total = np.asarray(total, dtype=np.int64)
    ids = np.argsort(total, kind="stable").astype(np.int64)
    offsets = np.arange(0, ids.size + batch_size, batch_size, dtype=np.int64)
    offsets[-1] = ids.size
    offsets = np.unique(offsets)
    widest = np.maximum.reduceat(total[ids], offsets[:-1]) if ids.size else np.zeros(0, np.int64)
    counts = np.diff(offsets)
    params = {
        "kind": "grouped",
        "batch_size": batch_size,
        "group_size": group_size,
        "seed": seed,
        "shuffle": shuffle,
    }
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    h.update(np.ascontiguousarray(total, dtype="<i8").tobytes())
    empty = np.zeros(0, dtype=np.int64)
    return PackPlan(
        offsets=offsets,
        ids=ids,
        totals=(widest * counts).astype(np.int64),
        visual=np.zeros(counts.size, dtype=np.int64),
        dropped_ids=empty,
        truncated_ids=empty,
        capacity=int(widest.max(initial=1)) * batch_size,
        packing_ratio=1.0,
        group_size=group_size,
        seed=seed,
        shuffle=shuffle,
        fingerprint=h.hexdigest(),
    )


def grouped_vlm_parts(
    data: Any,
    processor: Any,
    *,
    config: GroupedConfig | None = None,
    lengths: LengthIndex | None = None,
    batch_transform: Callable[[Any], Any] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> GraphParts:
    """The pieces of ``grouped_vlm_graph`` (same arguments): length-grouped, padded batches.

    The graph: ``PackSource -> map_stage(StepChain(SampleReader, ConversationTokenizer,
    PadCollater[, batch_transform]))``, the public steps of ``neatpack.pipes.steps`` (each plan
    entry is one whole batch); the ``batch_transform`` hook runs in the workers on each batch
    (keep ``batch["packs"]``)."""
    cfg = config or GroupedConfig()
    rank, world_size = resolve_rank(rank, world_size)
    handler = get_handler(processor)
    if not handler.core_rows:  # the tokenize and pad steps below make the core rows only
        raise ValueError(
            f"grouped_vlm_graph pads the core rows (Qwen-VL: Handler.collate is core_collate); "
            f"the processor {type(processor).__name__} uses handler {handler.name!r}, whose "
            "rows collate their own way: use neat_vlm_graph (packed) for it"
        )
    source = open_source(data, cfg.media_root, max_record_bytes=cfg.max_record_bytes)
    if lengths is None:
        lengths = build_length_index(
            source,
            handler_estimator(
                processor,
                handler,
                "estimate",
                missing_media_fix="(relative paths resolve against the media_root)",
            ),
            cache_dir=cfg.cache_dir,
            progress=cfg.progress,
            rank=rank,
            world_size=world_size,
            num_workers=cfg.index_workers,
            start_method=cfg.index_start_method,
        )
    total = np.asarray(lengths.total)

    def plan_for(group_size: int) -> PackPlan:
        return grouped_plan(
            total, cfg.batch_size, group_size=group_size, seed=cfg.seed, shuffle=cfg.shuffle
        )

    max_len = cfg.max_length or int(total.max(initial=1)) + 1
    return assemble(
        cfg,
        graph="grouped",
        plan_for=plan_for,
        lengths_fingerprint=lengths.fingerprint,
        steps=[
            SampleReader(source),
            ConversationTokenizer(processor),
            PadCollater(processor, cfg.max_length, truncate=cfg.truncate),
            *([batch_transform] if batch_transform else []),
        ],
        rank=rank,
        world_size=world_size,
        pack_size=max_len * cfg.batch_size,
        data=describe_data(source),
        batched=False,
    )


@loader_of(grouped_vlm_parts)
def grouped_vlm_graph() -> None:
    """This rank's loader of length-grouped, padded batches (no packing; ``grouped_vlm_parts``'
    arguments)."""
