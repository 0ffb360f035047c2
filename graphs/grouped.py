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
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from neatpack.graphs.open_data import open_source
from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.runtime.loader import NeatLoader, describe_data
from neatpack.graphs.runtime.stages import check_start_method, map_stage
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.planning.plan import PackPlan
from neatpack.pipes.planning.source import TAIL_POLICIES, PackSource
from neatpack.pipes.reading.read import MAX_RECORD_BYTES
from neatpack.pipes.steps import ConversationTokenizer, PadCollater, SampleReader, StepChain

__all__ = ["GroupedConfig", "grouped_plan", "grouped_vlm_graph"]


@dataclass(frozen=True, kw_only=True)
class GroupedConfig:
    """Static choices of the length-grouped graph."""

    batch_size: int = 8  # samples per rank per step
    max_length: int | None = None  # longer samples: error naming them (truncate=True cuts text)
    truncate: bool = False
    seed: int = 0
    shuffle: bool = True
    tail: str = "pad"
    media_root: str | None = None
    cache_dir: str | None = None
    num_workers: int = 0
    multiprocessing_context: str | None = "fork"
    prefetch: int = 2
    pin_memory: bool = False  # page-locked batches for non_blocking host-to-GPU copies
    keep_ledger: bool = True
    ledger_epochs: int | None = None  # keep the last N epochs' ledgers (None: all)
    max_record_bytes: int | None = MAX_RECORD_BYTES  # a longer JSONL line: a RecordError

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"{self.batch_size=} must be >= 1")
        if self.max_record_bytes is not None and self.max_record_bytes < 1:
            raise ValueError(f"{self.max_record_bytes=} must be >= 1 byte, or None for no limit")
        if self.tail not in TAIL_POLICIES:
            raise ValueError(f"{self.tail=} is not one of {TAIL_POLICIES}")
        check_start_method(self.multiprocessing_context)


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


def grouped_vlm_graph(
    data: Any,
    processor: Any,
    *,
    config: GroupedConfig | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    lengths: LengthIndex | None = None,
    batch_transform: Callable[[Any], Any] | None = None,
) -> NeatLoader:
    """This rank's loader of length-grouped, padded batches (no packing).

    The graph: ``PackSource -> map_stage(StepChain(SampleReader, ConversationTokenizer,
    PadCollater[, batch_transform]))``, the public steps of ``neatpack.pipes.steps``; the
    ``batch_transform`` hook runs in the workers on each batch (keep ``batch["packs"]``)."""
    cfg = config or GroupedConfig()
    rank, world_size = resolve_rank(rank, world_size)
    source = open_source(data, cfg.media_root, max_record_bytes=cfg.max_record_bytes)
    if lengths is None:
        lengths = build_length_index(
            source,
            LengthEstimator.from_processor(
                processor, missing_media_fix="(relative paths resolve against the media_root)"
            ),
            cache_dir=cfg.cache_dir,
            progress=False,
            rank=rank,
            world_size=world_size,
        )
    total = np.asarray(lengths.total)

    def plan_for(group_size: int) -> PackPlan:
        return grouped_plan(
            total, cfg.batch_size, group_size=group_size, seed=cfg.seed, shuffle=cfg.shuffle
        )

    pack_source = PackSource(
        plan_for, rank=rank, world_size=world_size, batch_size=1, tail=cfg.tail
    )
    step = StepChain(
        SampleReader(source),
        ConversationTokenizer(processor),
        PadCollater(processor, cfg.max_length, truncate=cfg.truncate),
        *([batch_transform] if batch_transform else []),
    )

    def build(src: BaseNode[Any]) -> BaseNode[Any]:
        node: BaseNode[Any] = map_stage(
            src,
            step,
            num_workers=cfg.num_workers,
            multiprocessing_context=cfg.multiprocessing_context,
            prefetch=cfg.prefetch,
            pin_memory=cfg.pin_memory,
        )
        return node

    keep = ("batch_size", "max_length", "truncate", "seed", "shuffle", "tail")
    key = {
        "graph": "grouped",
        "lengths": lengths.fingerprint,
        **{k: v for k, v in asdict(cfg).items() if k in keep},
    }
    max_len = cfg.max_length or int(total.max(initial=1)) + 1
    return NeatLoader(
        pack_source,
        build,
        pack_size=max_len * cfg.batch_size,
        config=key,
        keep_ledger=cfg.keep_ledger,
        ledger_epochs=cfg.ledger_epochs,
        data=describe_data(source),
    )
