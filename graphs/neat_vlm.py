"""``neat_vlm_graph()``: raw conversations to packed, collated, resumable VLM batches.

    raw records ─► length index ─► plan ─► PackSource ─► ParallelMapper(materialize, workers)
      (read.py)    (lengths.py,    (plan.py,  (this rank,   (tokenize, labels, mRoPE,
                    cached)         global)    cursor)       shift, concat: one pack)
    ─► Batcher(batch_size) ─► Mapper(collate: pad + mask format) ─► Prefetcher ─► NeatLoader

>>> from neatpack.pipes.testing.tiny import load_tiny_processor
>>> from neatpack.pipes.testing.synth import write_corpus
>>> import tempfile
>>> root = tempfile.mkdtemp()
>>> data = write_corpus(root, num_samples=12)
>>> loader = neat_vlm_graph(data, load_tiny_processor(),
...                         config=NeatVLMConfig(pack_size=1024, media_root=f"{root}/media"))
>>> batch = next(iter(loader))
>>> batch["input_ids"].shape[0], batch["attention_mask"].dtype
(1, torch.bool)

Other families (Gemma 3/4, LLaVA-OneVision, Idefics3, InternVL, Qwen2.5-Omni) go through their
``families`` handler, picked from the processor's class (or ``NeatVLMConfig.handler``): the same
planning, packing, workers and checkpoints, with the family's length estimate
(``pipes/indexing/handler_lengths.py``), positions (1-D, or Omni's mRoPE with audio), media merged
over
the batch and attention mask (``pipes/collating/collate_family.py``; ``graphs/families.py`` checks
the
config against the family before anything is built).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from neatpack.graphs.assemble import (
    Hooks,
    loader_of,
    packed_parts,
    probe_boundaries,
)
from neatpack.graphs.config import NeatVLMConfig
from neatpack.graphs.families import FamilyPlan, family_attention, plan_family
from neatpack.graphs.mixture import mixture_parts
from neatpack.graphs.open_data import MISSING_MEDIA_FIX, EstimateChecked, open_source
from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.runtime.loader import describe_data
from neatpack.graphs.runtime.stages import GraphParts
from neatpack.pipes.indexing.estimate import MODES as ESTIMATE_MODES
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.indexing.overlong import check_overlong
from neatpack.pipes.indexing.supervised import supervised_estimator
from neatpack.pipes.materializing.materialize import Materializer
from neatpack.pipes.steps import PackMaterializer

__all__ = [
    "ESTIMATE_MODES",
    "NeatVLMConfig",
    "PackStep",
    "neat_vlm_graph",
    "neat_vlm_parts",
    "open_source",
    "pad_id_of",
]

PackStep = PackMaterializer  # the earlier name of the materialize step


def neat_vlm_parts(
    data: Any,
    processor: Any,
    *,
    config: NeatVLMConfig | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    lengths: LengthIndex | None = None,
    sample_transform: Callable[[Any], Any] | None = None,
    pack_transform: Callable[[Any], Any] | None = None,
    batch_transform: Callable[[Any], Any] | None = None,
    model: Any = None,
    cp_rank: int | None = None,
) -> GraphParts:
    """The pieces of ``neat_vlm_graph`` (same arguments) to compose a graph of your own.

    ``data``: a path, a list of records, a ``datasets.Dataset``, shards, a record source, or a
    ``Mixture`` of several (``pipes/mixtures/mixture.py``). ``parts.loader()`` is
    ``neat_vlm_graph``; ``parts.loader(build)`` runs your graph over ``parts.source`` with the
    same checkpoint key. The hooks are step functions (picklable for spawn workers):
    ``sample_transform`` maps each tokenized, unshifted sample, ``pack_transform`` each
    materialized pack (keep ``pack["meta"]``), ``batch_transform`` each collated batch (keep
    ``batch["packs"]``); all run in the workers. ``model`` (a model or its config) turns on
    boundaries for hybrid models and refuses to pack a model whose layers leak across documents
    (``pipes/collating/leak_probe.py``; docs/long_context.md). ``cfg.cp_size > 1`` plans and
    packs documents padded to a multiple of ``2 * cp_size``; ``cp_rank`` then makes every
    batch that context-parallel rank's shard.
    """
    cfg = family_attention(processor, config or NeatVLMConfig(), model)  # "auto" -> a format
    hooks = Hooks(pack_transform, batch_transform, model, cp_rank)
    mixed = mixture_parts(data, processor, config=cfg, lengths=lengths,
                          build_parts=neat_vlm_parts, rank=rank, world_size=world_size,
                          sample_transform=sample_transform, **hooks._asdict())  # fmt: skip
    if mixed is not None:
        return mixed
    boundaries = probe_boundaries(cfg, hooks)  # before any record is read
    family: FamilyPlan = plan_family(processor, cfg)  # every family; raises on misfit
    rank, world_size = resolve_rank(rank, world_size)
    source = open_source(
        data, cfg.media_root, cache_dir=cfg.cache_dir, rank=rank, world_size=world_size,
        max_record_bytes=cfg.max_record_bytes,
    )  # fmt: skip
    estimator: Any = None
    if lengths is None:
        estimator = family.estimator(
            processor, cfg.estimate_mode, source, missing_media_fix=MISSING_MEDIA_FIX
        )
        if cfg.balance == "supervised":  # counted only when asked (another fingerprint)
            estimator = supervised_estimator(estimator, processor, family.handler)
        lengths = build_length_index(
            source,
            estimator,
            cache_dir=cfg.cache_dir,
            progress=cfg.progress,
            rank=rank,
            world_size=world_size,
            # a record that cannot be read follows on_bad_sample (skipped or replaced, counted)
            on_error="raise" if cfg.on_bad_sample == "raise" else "skip",
            num_workers=cfg.index_workers,
            start_method=cfg.index_start_method,
        )
    index = lengths
    # Overlong samples are known now: say so (by modality, with the fixes) before any batch.
    check_overlong(index.total, index.visual, cfg.pack_size, source, cfg.overlong)
    if estimator is not None and index.fallback_ids.size:
        source = EstimateChecked(source, estimator, index.fallback_ids.tolist())
    padding_idx = pad_id_of(processor)
    materializer = Materializer(
        source,
        processor,
        family.materialize_config(cfg, padding_idx),
        sample_transform=sample_transform,
    )
    return packed_parts(
        cfg,
        graph="neat_vlm",
        total=index.total,
        visual=index.visual,
        # the images budget needs the counts (an index cached before them says how to rebuild)
        images=index.images if cfg.max_images is None else index.require_images("max_images"),
        supervised=(
            index.supervised
            if cfg.balance != "supervised"
            else index.require_supervised("balance='supervised'")
        ),
        packing_ratio=cfg.packing_ratio,
        lengths_fingerprint=index.fingerprint,
        materialize=PackMaterializer(materializer, index.total),
        collate_options={"padding_idx": padding_idx, **family.collate_options},
        extra_steps=family.pp_steps(cfg),
        rank=rank,
        world_size=world_size,
        data=describe_data(source),
        hooks=hooks,
        boundaries=boundaries,
    )


@loader_of(neat_vlm_parts)
def neat_vlm_graph() -> None:
    """Build this rank's checkpointable loader of packed VLM batches (``neat_vlm_parts``'
    arguments).

    ``rank`` / ``world_size`` default to ``torch.distributed`` when it is initialized, else
    0 / 1. ``lengths`` skips building the length index (it is cached under ``cache_dir``).
    The three hooks are per-sample, per-pack and per-batch steps; ``model`` and ``cp_rank``
    are for hybrid models and context parallelism (see ``neat_vlm_parts``).

    The graph: ``PackSource -> Batcher(batch_size) -> map_stage(StepChain(PerPack(
    PackMaterializer), Collater[, PPMediaSplitter][, ContextParallelSplitter]), num_workers)
    -> Prefetcher``.
    """


def pad_id_of(processor: Any) -> int:
    """The processor's pad token id (0 when it has none): what rows are padded with."""
    tok = getattr(processor, "tokenizer", processor)
    pad = getattr(tok, "pad_token_id", None)
    return int(pad) if pad is not None else 0
