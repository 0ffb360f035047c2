"""``neat_vlm_graph`` / ``neat_llm_graph`` over a mixture (``NeatVLMConfig(mixture=...)``,
``NeatLLMConfig(mixture=...)``): the hook.

    sources ─► one length index each (cached) ─► MixtureRecords (global ids)
            ─► neat_vlm_parts(records, lengths=concatenated)   (materialize, collate: as ever)
            ─► its PackSource replaced by MixturePackSource     (the epoch's mixture plan)
            ─► SourceTagger after the Collater                  (batch["doc_sources"])

Everything else (workers, prefetch, checkpoints, elastic resume, ledgers) is the single-source
graph's. The ledger speaks global ids: ``mixture_ledger`` (``pipes/mixtures/mixture_report.py``)
splits it per source.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from neatpack.graphs.families import plan_family
from neatpack.graphs.open_data import MISSING_MEDIA_FIX, EstimateChecked, open_source
from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.runtime.stages import GraphParts
from neatpack.graphs.token_source import TokenSource, token_lengths
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.mixtures.mixture_source import (
    MixtureLayout,
    MixturePackSource,
    MixtureRecords,
    SourceTagger,
)

__all__ = ["mixture_llm_parts", "mixture_parts"]


def mixture_parts(
    processor: Any,
    *,
    config: Any,
    build_parts: Callable[..., GraphParts],
    rank: int | None = None,
    world_size: int | None = None,
    **hooks: Any,
) -> GraphParts:
    """``neat_vlm_parts`` for ``config.mixture`` (``hooks``: its other keyword arguments);
    ``build_parts`` is ``neat_vlm_parts``, run once over all the sources' records."""

    cfg, mix = config, config.mixture
    rank, world_size = resolve_rank(rank, world_size)
    family = plan_family(processor, cfg)
    sources, indexes = [], []
    for spec in mix.sources:
        source = open_source(
            spec.data, spec.media_root, cache_dir=cfg.cache_dir, rank=rank,
            world_size=world_size, max_record_bytes=cfg.max_record_bytes,
        )  # fmt: skip
        estimator = family.estimator(
            processor, cfg.estimate_mode, source, missing_media_fix=MISSING_MEDIA_FIX
        )
        try:
            index = build_length_index(
                source, estimator, cache_dir=cfg.cache_dir, progress=cfg.progress, rank=rank,
                world_size=world_size, num_workers=cfg.index_workers,
                on_error="raise" if cfg.on_bad_sample == "raise" else "skip",
            )  # fmt: skip
        except Exception as exc:
            exc.add_note(f"in mixture source {spec.name!r} ({spec.data!s:.200}); the sample id "
                         "is that source's own")  # fmt: skip
            raise
        if index.fallback_ids.size:  # unreadable for the estimate: on_bad_sample decides
            source = EstimateChecked(source, estimator, index.fallback_ids.tolist())
        sources.append(source)
        indexes.append(index)
    records = MixtureRecords(mix.names, sources)
    fingerprint = hashlib.sha256(
        "|".join(f"{n}:{i.fingerprint}" for n, i in zip(mix.names, indexes, strict=True)).encode()
    ).hexdigest()
    lengths = LengthIndex(
        total=np.concatenate([i.total for i in indexes]).astype(np.int64),
        visual=np.concatenate([i.visual for i in indexes]).astype(np.int64),
        fingerprint=fingerprint,
    )
    parts = build_parts(
        records, processor, config=dataclasses.replace(cfg, mixture=None), rank=rank,
        world_size=world_size, lengths=lengths, **hooks,
    )  # fmt: skip
    return _mixed(parts, records, lengths, cfg, rank, world_size, cfg.packing_ratio)


def mixture_llm_parts(
    *,
    config: Any,
    build_parts: Callable[..., GraphParts],
    rank: int | None = None,
    world_size: int | None = None,
    **hooks: Any,
) -> GraphParts:
    """``neat_llm_parts`` for ``config.mixture``: pre-tokenized sources (``data`` of each is
    what ``TokenSource`` reads; ``media_root`` is unused), exact lengths."""

    cfg, mix = config, config.mixture
    rank, world_size = resolve_rank(rank, world_size)
    sources = [TokenSource(spec.data) for spec in mix.sources]
    total = np.concatenate([token_lengths(s) for s in sources]).astype(np.int64)
    h = hashlib.sha256("|".join(mix.names).encode())
    h.update(np.ascontiguousarray(total, dtype="<i8").tobytes())
    h.update(np.asarray([len(s) for s in sources], dtype="<i8").tobytes())
    lengths = LengthIndex(total=total, visual=np.zeros_like(total), fingerprint=h.hexdigest())
    records = MixtureRecords(mix.names, sources)
    parts = build_parts(
        records, config=dataclasses.replace(cfg, mixture=None), rank=rank,
        world_size=world_size, lengths=total, **hooks,
    )  # fmt: skip
    return _mixed(parts, records, lengths, cfg, rank, world_size, 1.0)


def _mixed(
    parts: GraphParts,
    records: MixtureRecords,
    lengths: LengthIndex,
    cfg: Any,
    rank: int,
    world_size: int,
    packing_ratio: float,
) -> GraphParts:
    """``parts`` of the single-source graph over ``records``, with the mixture's pack source
    and the ``SourceTagger`` after the collater."""
    mix = cfg.mixture
    planned = lengths.total
    if cfg.cp_size > 1:
        from neatpack.pipes.parallel.context_parallel import cp_padded_lengths

        planned = np.asarray(cp_padded_lengths(planned, cfg.cp_size), dtype=np.int64)
    layout = MixtureLayout(
        names=mix.names, sizes=tuple(len(s) for s in records.sources), total=planned,
        visual=lengths.visual, capacity=cfg.pack_size, packing_ratio=packing_ratio,
        overlong=cfg.overlong, seed=cfg.seed, single_source=mix.single_source_packs,
        lengths_fingerprint=lengths.fingerprint,
    )  # fmt: skip
    pack_source = MixturePackSource(
        layout, mix.blend(), on_change=mix.on_change, rank=rank, world_size=world_size,
        batch_size=cfg.batch_size, tail=cfg.tail,
    )  # fmt: skip
    steps: list[Callable[[Any], Any]] = list(parts.steps)
    steps.insert(steps.index(parts.collate) + 1, SourceTagger(records.bounds, mix.names))
    return dataclasses.replace(
        parts,
        source=pack_source,
        steps=tuple(steps),
        config={**parts.config, "mixture": layout.fingerprint[:16]},
    )
