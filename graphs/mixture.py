"""``neat_vlm_graph`` / ``neat_llm_graph`` over a mixture (a ``Mixture`` passed as the data):
the hook.

    sources ─► one length index each (cached) ─► MixtureRecords (global ids)
            ─► neat_vlm_parts / neat_llm_parts(records, lengths=the concatenated index)
               (materialize, collate: as ever; the index's label counts are not counted again)
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

from neatpack.graphs.config import check_mixture_options, legacy_mixture
from neatpack.graphs.families import plan_family
from neatpack.graphs.open_data import MISSING_MEDIA_FIX, EstimateChecked, open_source
from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.runtime.stages import GraphParts
from neatpack.graphs.token_source import TokenSource, token_lengths, token_supervised
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.indexing.supervised import supervised_estimator
from neatpack.pipes.mixtures.mixture import Mixture
from neatpack.pipes.mixtures.mixture_source import (
    MixtureLayout,
    MixturePackSource,
    MixtureRecords,
    SourceTagger,
)

__all__ = ["as_mixture", "mixture_parts"]


def mixture_parts(
    data: Any,
    processor: Any,
    *,
    config: Any,
    lengths: Any,
    build_parts: Callable[..., GraphParts],
    rank: int | None = None,
    world_size: int | None = None,
    **hooks: Any,
) -> GraphParts | None:
    """None when ``data`` (with ``config``) is one source; for a mixture, ``build_parts``
    (``neat_vlm_parts``, or ``neat_llm_parts`` with ``processor=None``) run once over all its
    sources' records, with the mixture's pack source (``hooks``: the graph's other keyword
    arguments)."""
    mix = as_mixture(data, config, lengths)
    if mix is None:
        return None
    cfg = dataclasses.replace(config)  # without a deprecated config(mixture=...)
    rank, world_size = resolve_rank(rank, world_size)
    # each graph gets the mixture's length index (lengths, and the label counts under
    # balance="supervised"): nothing is counted twice
    if processor is None:  # pre-tokenized sources: exact lengths, no headroom
        records, lengths = _token_sources(mix, cfg.balance)
        parts = build_parts(records, config=cfg, rank=rank, world_size=world_size,
                            lengths=lengths, **hooks)  # fmt: skip
    else:
        records, lengths = _record_sources(mix, processor, cfg, rank, world_size)
        parts = build_parts(records, processor, config=cfg, rank=rank, world_size=world_size,
                            lengths=lengths, **hooks)  # fmt: skip
    ratio = float(getattr(cfg, "packing_ratio", 1.0))
    return _mixed(parts, mix, records, lengths, cfg, rank, world_size, ratio)


def as_mixture(data: Any, config: Any, lengths: Any) -> Mixture | None:
    """The mixture a graph serves: ``data`` itself when it is a ``Mixture``, or the deprecated
    ``config(mixture=...)`` with ``data=None``; None for one source. A mixture names its own
    sources, so ``lengths`` (and, for the deprecated form, ``data``) must be None; ``max_packs``
    and ``shuffle=False`` contradict its plan (ValueError naming the fix)."""
    legacy = legacy_mixture(config)
    if legacy is not None and (data is not None or lengths is not None):
        raise ValueError(
            f"{type(config).__name__}(mixture=...) names the data: pass data=None and no lengths "
            f"(got data of type {type(data).__name__}, lengths={lengths is not None}); better, "
            "pass the mixture as the data"
        )
    mixture = data if isinstance(data, Mixture) else legacy
    if mixture is None:
        return None
    if lengths is not None:
        raise ValueError(
            "a mixture builds one length index per source: pass no lengths= with a Mixture"
        )
    check_mixture_options(config)
    return mixture


def _record_sources(
    mix: Mixture, processor: Any, cfg: Any, rank: int, world_size: int
) -> tuple[MixtureRecords, LengthIndex]:
    """Raw-record sources: each its own (cached) length index, concatenated in global ids."""
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
        if cfg.balance == "supervised":  # counted only when asked, as for one source
            estimator = supervised_estimator(estimator, processor, family.handler)
        try:
            index = build_length_index(
                source, estimator, cache_dir=cfg.cache_dir, progress=cfg.progress, rank=rank,
                world_size=world_size, num_workers=cfg.index_workers,
                start_method=cfg.index_start_method,
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
    fingerprint = hashlib.sha256(
        "|".join(f"{n}:{i.fingerprint}" for n, i in zip(mix.names, indexes, strict=True)).encode()
    ).hexdigest()
    lengths = LengthIndex(
        total=np.concatenate([i.total for i in indexes]).astype(np.int64),
        visual=np.concatenate([i.visual for i in indexes]).astype(np.int64),
        fingerprint=fingerprint,
        images=None  # unknown when any source's cached index predates the counts
        if any(i.images is None for i in indexes)
        else np.concatenate([i.require_images("max_images") for i in indexes]),
        supervised=None
        if cfg.balance != "supervised"
        else np.concatenate([i.require_supervised("balance='supervised'") for i in indexes]),
    )
    return MixtureRecords(mix.names, sources), lengths


def _token_sources(mix: Mixture, balance: str = "tokens") -> tuple[MixtureRecords, LengthIndex]:
    """Pre-tokenized sources (``data`` of each is what ``TokenSource`` reads; ``media_root`` is
    unused): exact lengths, fingerprinted by the names, the lengths and the sizes."""
    sources = [TokenSource(spec.data) for spec in mix.sources]
    total = np.concatenate([token_lengths(s) for s in sources]).astype(np.int64)
    h = hashlib.sha256("|".join(mix.names).encode())
    h.update(np.ascontiguousarray(total, dtype="<i8").tobytes())
    h.update(np.asarray([len(s) for s in sources], dtype="<i8").tobytes())
    supervised = None
    if balance == "supervised":  # exact label counts, read only under that balance
        supervised = np.concatenate([token_supervised(s) for s in sources])
    lengths = LengthIndex(total=total, visual=np.zeros_like(total), fingerprint=h.hexdigest(),
                          supervised=supervised)  # fmt: skip
    return MixtureRecords(mix.names, sources), lengths


def _mixed(
    parts: GraphParts,
    mix: Mixture,
    records: MixtureRecords,
    lengths: LengthIndex,
    cfg: Any,
    rank: int,
    world_size: int,
    packing_ratio: float,
) -> GraphParts:
    """``parts`` of the single-source graph over ``records``, with the mixture's pack source
    and the ``SourceTagger`` after the collater."""
    planned = lengths.total
    max_images = getattr(cfg, "max_images", None)  # the VLM graph's option
    images = lengths.images if max_images is None else lengths.require_images("max_images")
    if cfg.cp_size > 1:
        from neatpack.pipes.parallel.context_parallel import cp_padded_lengths

        planned = np.asarray(cp_padded_lengths(planned, cfg.cp_size), dtype=np.int64)
    layout = MixtureLayout(
        names=mix.names, sizes=tuple(len(s) for s in records.sources), total=planned,
        visual=lengths.visual, capacity=cfg.pack_size, packing_ratio=packing_ratio,
        overlong=cfg.overlong, seed=cfg.seed, single_source=mix.single_source_packs,
        lengths_fingerprint=lengths.fingerprint, balance=cfg.balance,
        max_visual=getattr(cfg, "max_visual_tokens", None),  # the VLM graph's option
        images=None if images is None else np.asarray(images, np.int64),
        max_images=max_images,
        supervised=None if lengths.supervised is None else np.asarray(lengths.supervised, np.int64),
        # the step shape the cost plan makes its groups for (the other balances do not read
        # it), as the single-source graph passes
        per_rank=cfg.batch_size,
    )  # fmt: skip
    pack_source = MixturePackSource(
        layout, mix.blend(), on_change=mix.on_change, rank=rank, world_size=world_size,
        batch_size=cfg.batch_size, tail=cfg.tail,
    )  # fmt: skip
    steps: list[Callable[[Any], Any]] = list(parts.steps)
    assert parts.collate is not None  # a packed graph's parts
    steps.insert(steps.index(parts.collate) + 1, SourceTagger(records.bounds, mix.names))
    return dataclasses.replace(
        parts,
        source=pack_source,
        steps=tuple(steps),
        config={**parts.config, "mixture": layout.fingerprint[:16]},
    )
