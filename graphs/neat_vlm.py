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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from neatpack.graphs.families import FamilyPlan, plan_family
from neatpack.graphs.open_data import MISSING_MEDIA_FIX, EstimateChecked, open_source
from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.runtime.loader import NeatLoader, describe_data
from neatpack.graphs.runtime.stages import GraphParts, check_start_method
from neatpack.pipes.collating.mask_format import resolve_mask_format
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.indexing.overlong import check_overlong
from neatpack.pipes.materializing.materialize import (
    FAILURE_POLICIES,
    OVERFLOW_POLICIES,
    MaterializeConfig,
    Materializer,
)
from neatpack.pipes.mixtures.mixture import Mixture, check_mixture_config, check_mixture_data
from neatpack.pipes.planning.binpack import OVERLONG_POLICIES
from neatpack.pipes.planning.plan import PackPlan, plan_packs
from neatpack.pipes.planning.source import TAIL_POLICIES, PackSource
from neatpack.pipes.reading.read import MAX_RECORD_BYTES
from neatpack.pipes.steps import Collater, PackMaterializer, PerPack, PPMediaSplitter

__all__ = [
    "ESTIMATE_MODES",
    "NeatVLMConfig",
    "PackStep",
    "neat_vlm_graph",
    "neat_vlm_parts",
    "open_source",
]

ESTIMATE_MODES = ("estimate", "calibrated", "exact")
WORKER_METHODS: tuple[Literal["process", "thread"], ...] = ("process", "thread")


@dataclass(frozen=True, kw_only=True)
class NeatVLMConfig:
    """Static choices of the VLM graph. Runtime context (processor, rank) is passed apart."""

    pack_size: int = 8192
    batch_size: int = 1  # packs per rank per step
    packing_ratio: float = 1.0  # plan to this fraction of pack_size: headroom for estimate error
    seed: int = 0
    shuffle: bool = True
    # exact: real lengths (one batched template + tokenizer call per block of the index), so
    # packs fill to the brim and nothing is cut; "estimate" / "calibrated" build faster
    # (bench_utilization.py has the trade-off table)
    estimate_mode: str = "exact"
    media_root: str | None = None
    cache_dir: str | None = None
    overlong: str = "raise"  # a single sample longer than the pack: raise or drop (counted)
    overflow: str = "truncate"  # a pack longer than pack_size once built: raise/truncate/drop
    on_bad_sample: str = "raise"  # a sample that fails to load: raise/skip/replace (counted)
    tail: str = "pad"  # last step of an epoch: pad (repeat packs) or drop, so ranks stay even
    max_packs: int | None = None
    attn_implementation: str = "sdpa"  # sdpa, eager, flash_attention_2, flex_attention, ...
    pad_to_multiple_of: int | None = None
    fake_image: bool = False
    num_workers: int = 0
    worker_method: Literal["process", "thread"] = "process"
    multiprocessing_context: str | None = "fork"
    prefetch: int = 2
    pin_memory: bool = False  # page-locked batches for non_blocking host-to-GPU copies
    progress: bool = False
    keep_ledger: bool = True
    ledger_epochs: int | None = None  # keep the last N epochs' ledgers (None: all)
    pp_microbatches: int | None = None  # split media per pipeline-parallel micro-batch
    handler: str | None = None  # registry handler; None: from the processor's class
    mask_options: Mapping[str, Any] | None = None  # to the handler's packed_mask (Gemma)
    boundaries: bool = False  # seq_idx + cu_seq_lens for linear-attention / SSM layers (#20)
    allow_packing_leak: bool = False  # pack a model whose leak probe fails (#20)
    cp_size: int = 1  # context parallel: documents padded to a multiple of 2 * cp_size (#20)
    # several weighted sources instead of `data` (#16; pipes/mixtures/mixture.py, graphs/mixture.py)
    mixture: Mixture | None = None
    # length index build: None (default) one forked process per core this rank may use once
    # its slice is large enough to pay (pipes/indexing/index_workers.py), N exactly N, 0 this
    # process;
    # the index is the same for any number
    index_workers: int | None = None
    # a JSONL line longer than this is refused by its id under on_bad_sample (None: no limit);
    # tokenizing costs ~200 bytes of memory per byte of text (pipes/reading/read.py
    # MAX_RECORD_BYTES)
    max_record_bytes: int | None = MAX_RECORD_BYTES

    def __post_init__(self) -> None:
        if self.pack_size < 2:
            raise ValueError(f"{self.pack_size=} must be at least 2 tokens")
        if self.batch_size < 1:
            raise ValueError(f"{self.batch_size=} must be >= 1")
        if not 0.0 < self.packing_ratio <= 1.0:
            raise ValueError(f"{self.packing_ratio=} must be in (0, 1]")
        if self.estimate_mode not in ESTIMATE_MODES:
            raise ValueError(f"{self.estimate_mode=} is not one of {ESTIMATE_MODES}")
        if self.tail not in TAIL_POLICIES:
            raise ValueError(f"{self.tail=} is not one of {TAIL_POLICIES}")
        # the policies below were checked only when the graph was built; the mask format only
        # at the first collate, in a worker
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(
                f"{self.overlong=} is not one of {OVERLONG_POLICIES}; drop counts and skips "
                "a sample longer than pack_size"
            )
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(
                f"{self.overflow=} is not one of {OVERFLOW_POLICIES}; pick one for a pack "
                "built longer than pack_size"
            )
        if self.on_bad_sample not in FAILURE_POLICIES:
            raise ValueError(
                f"{self.on_bad_sample=} is not one of {FAILURE_POLICIES}; skip and replace "
                "count the samples that fail to load"
            )
        resolve_mask_format(self.attn_implementation)  # the collate's own check
        check_start_method(self.multiprocessing_context)
        if self.worker_method not in WORKER_METHODS:
            raise ValueError(f"{self.worker_method=} is not one of {WORKER_METHODS}")
        if self.index_workers is not None and self.index_workers < 0:
            raise ValueError(f"{self.index_workers=} must be >= 0, or None for one per core")
        if self.max_record_bytes is not None and self.max_record_bytes < 1:
            raise ValueError(f"{self.max_record_bytes=} must be >= 1 byte, or None for no limit")
        if self.num_workers < 0 or self.prefetch < 0:
            raise ValueError(f"{self.num_workers=} and {self.prefetch=} must be >= 0")
        if self.pp_microbatches is not None and not 1 <= self.pp_microbatches <= self.batch_size:
            raise ValueError(
                f"{self.pp_microbatches=} must be between 1 and {self.batch_size=} (one "
                "micro-batch needs at least one pack row)"
            )
        if self.cp_size < 1 or (self.cp_size > 1 and self.pack_size % (2 * self.cp_size)):
            raise ValueError(
                f"{self.cp_size=} must be >= 1 and 2 * cp_size must divide {self.pack_size=} "
                "(every document and the row are split into 2 * cp_size chunks)"
            )
        if self.mixture is not None:
            check_mixture_config(max_packs=self.max_packs, shuffle=self.shuffle)
        if self.handler is not None:
            from neatpack.pipes.families import HANDLERS

            if self.handler not in HANDLERS:
                raise ValueError(
                    f"{self.handler=} is not a registered handler; valid: {sorted(HANDLERS)} "
                    "(or None to pick it from the processor)"
                )

    def plan_key(self) -> dict[str, Any]:
        """The fields a checkpoint must agree on (the rest may change on resume)."""
        keep = (
            "pack_size",
            "batch_size",
            "packing_ratio",
            "seed",
            "shuffle",
            "estimate_mode",
            "overlong",
            "overflow",
            "on_bad_sample",
            "tail",
            "max_packs",
            "attn_implementation",
            "pad_to_multiple_of",
            "fake_image",
        )
        key = {k: getattr(self, k) for k in keep}  # not asdict: it deep-copies mixture data
        if self.handler is not None:  # only when set: older checkpoints keep their key
            key["handler"] = self.handler
        if self.cp_size > 1:  # only when set: older checkpoints keep their key
            key["cp_size"] = self.cp_size
        return key


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

    ``parts.loader()`` is ``neat_vlm_graph``; ``parts.loader(build)`` runs your graph over
    ``parts.source`` with the same checkpoint key. The hooks are step functions (picklable for
    spawn workers): ``sample_transform`` maps each tokenized, unshifted sample,
    ``pack_transform`` each materialized pack (keep ``pack["meta"]``), ``batch_transform``
    each collated batch (keep ``batch["packs"]``); all run in the workers.
    ``model`` (a model or its config) turns on boundaries for hybrid models and refuses to pack
    a model whose layers leak across documents (``pipes/collating/leak_probe.py``;
    docs/long_context.md).
    ``cfg.cp_size > 1`` plans and packs documents padded to a multiple of ``2 * cp_size``;
    ``cp_rank`` then makes every batch that context-parallel rank's shard.
    """
    cfg = config or NeatVLMConfig()
    if cfg.mixture is not None:
        check_mixture_data("NeatVLMConfig", data, lengths)
        from neatpack.graphs.mixture import mixture_parts

        return mixture_parts(
            processor, config=cfg, build_parts=neat_vlm_parts, rank=rank, world_size=world_size,
            sample_transform=sample_transform, pack_transform=pack_transform,
            batch_transform=batch_transform, model=model, cp_rank=cp_rank,
        )  # fmt: skip
    from neatpack.pipes.collating.leak_probe import packing_boundaries

    boundaries = packing_boundaries(
        model, boundaries=cfg.boundaries, allow_leak=cfg.allow_packing_leak
    )
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
        )
    index = lengths
    # Overlong samples are known now: say so (by modality, with the fixes) before any batch.
    check_overlong(index.total, index.visual, cfg.pack_size, source, cfg.overlong)
    if estimator is not None and index.fallback_ids.size:
        source = EstimateChecked(source, estimator, index.fallback_ids.tolist())

    from neatpack.pipes.parallel.context_parallel import ContextParallelSplitter, cp_padded_lengths

    planned = index.total if cfg.cp_size == 1 else cp_padded_lengths(index.total, cfg.cp_size)

    def plan_for(group_size: int) -> PackPlan:
        return plan_packs(
            planned,
            cfg.pack_size,
            visual=index.visual,
            packing_ratio=cfg.packing_ratio,
            max_packs=cfg.max_packs,
            overlong=cfg.overlong,
            world_size=group_size,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
        )

    pack_source = PackSource(
        plan_for, rank=rank, world_size=world_size, batch_size=cfg.batch_size, tail=cfg.tail
    )
    padding_idx = _pad_id(processor)
    materializer = Materializer(
        source,
        processor,
        MaterializeConfig(
            pack_size=cfg.pack_size,
            padding_idx=padding_idx,
            overflow=cfg.overflow,
            on_failure=cfg.on_bad_sample,
            fake_image=cfg.fake_image,
            seed=cfg.seed,
            alignment=1 if cfg.cp_size == 1 else 2 * cfg.cp_size,
            **family.materialize_options,
        ),
        sample_transform=sample_transform,
    )
    materialize = PackMaterializer(materializer, np.asarray(index.total))
    collate = Collater(
        padding_idx=padding_idx,
        attn_implementation=cfg.attn_implementation,
        pad_to_multiple_of=cfg.pad_to_multiple_of,
        boundaries=boundaries,
        **family.collate_options,
    )
    steps: list[Callable[[Any], Any]] = [PerPack(materialize)]
    if pack_transform is not None:
        steps.append(PerPack(pack_transform))
    steps.append(collate)
    if batch_transform is not None:
        steps.append(batch_transform)
    if cfg.pp_microbatches:
        steps.append(PPMediaSplitter(cfg.pp_microbatches, handler=family.handler.name))
    if cp_rank is not None:
        steps.append(ContextParallelSplitter(cfg.cp_size, cp_rank))
    return GraphParts(
        source=pack_source,
        materialize=materialize,
        collate=collate,
        steps=tuple(steps),
        batch_size=cfg.batch_size,
        pack_size=cfg.pack_size,
        config={"graph": "neat_vlm", "lengths": index.fingerprint, **cfg.plan_key()},
        num_workers=cfg.num_workers,
        method=cfg.worker_method,
        multiprocessing_context=cfg.multiprocessing_context,
        prefetch=cfg.prefetch,
        pin_memory=cfg.pin_memory,
        keep_ledger=cfg.keep_ledger,
        ledger_epochs=cfg.ledger_epochs,
        data=describe_data(source),
    )


def neat_vlm_graph(
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
) -> NeatLoader:
    """Build this rank's checkpointable loader of packed VLM batches.

    ``rank`` / ``world_size`` default to ``torch.distributed`` when it is initialized, else
    0 / 1. ``lengths`` skips building the length index (it is cached under ``cache_dir``).
    The three hooks are per-sample, per-pack and per-batch steps; ``model`` and ``cp_rank``
    are for hybrid models and context parallelism (see ``neat_vlm_parts``).

    The graph: ``PackSource -> Batcher(batch_size) -> map_stage(StepChain(PerPack(
    PackMaterializer), Collater[, PPMediaSplitter][, ContextParallelSplitter]), num_workers)
    -> Prefetcher``.
    """
    return neat_vlm_parts(
        data,
        processor,
        config=config,
        rank=rank,
        world_size=world_size,
        lengths=lengths,
        sample_transform=sample_transform,
        pack_transform=pack_transform,
        batch_transform=batch_transform,
        model=model,
        cp_rank=cp_rank,
    ).loader()


def _pad_id(processor: Any) -> int:
    tok = getattr(processor, "tokenizer", processor)
    pad = getattr(tok, "pad_token_id", None)
    return int(pad) if pad is not None else 0
