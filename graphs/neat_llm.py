"""``neat_llm_graph()``: pre-tokenized text samples to packed, resumable batches.

Each record holds ``input_ids`` and either ``labels`` or a ``loss_mask`` (1 = train on this
token); without both, every token is a label. Lengths are exact (``len(input_ids) - 1`` after
the shift), so packs never overflow. The rest is the VLM graph's machinery: the same plan,
rank-strided source, ledger and state.

>>> records = [{"input_ids": list(range(1, n + 1))} for n in (5, 9, 3, 7, 4, 6)]
>>> cfg = NeatLLMConfig(pack_size=16, attn_implementation="doc_ids")
>>> loader = neat_llm_graph(records, config=cfg)
>>> batch = next(iter(loader))
>>> batch["input_ids"].shape, batch["attention_mask"].tolist()[0][:9]
(torch.Size([1, 16]), [1, 1, 1, 1, 1, 2, 2, 2, 2])
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.runtime.loader import NeatLoader
from neatpack.graphs.runtime.stages import GraphParts, check_start_method
from neatpack.graphs.token_source import TokenSource, token_lengths
from neatpack.pipes.collating.leak_probe import packing_boundaries
from neatpack.pipes.collating.mask_format import resolve_mask_format
from neatpack.pipes.materializing.pack import build_pack
from neatpack.pipes.materializing.transfer import WorkerTransfer, check_worker_transfer
from neatpack.pipes.mixtures.mixture import Mixture, check_mixture_config, check_mixture_data
from neatpack.pipes.parallel.context_parallel import ContextParallelSplitter, cp_padded_lengths
from neatpack.pipes.planning.binpack import OVERLONG_POLICIES
from neatpack.pipes.planning.plan import PackPlan, plan_packs
from neatpack.pipes.planning.source import TAIL_POLICIES, PackSource
from neatpack.pipes.steps import Collater, PackMaterializer, PerPack

__all__ = [
    "NeatLLMConfig",
    "TokenPacker",
    "TokenSource",
    "neat_llm_graph",
    "neat_llm_parts",
    "token_lengths",
]


@dataclass(frozen=True, kw_only=True)
class NeatLLMConfig:
    """Static choices of the text graph."""

    pack_size: int = 4096
    batch_size: int = 1
    seed: int = 0
    shuffle: bool = True
    overlong: str = "raise"  # raise, or drop (counted in plan.dropped_ids)
    tail: str = "pad"
    max_packs: int | None = None
    padding_idx: int = 0
    attn_implementation: str = "sdpa"
    pad_to_multiple_of: int | None = None
    num_workers: int = 0
    multiprocessing_context: str | None = "fork"
    prefetch: int = 2
    pin_memory: bool = False  # page-locked batches for non_blocking host-to-GPU copies
    keep_ledger: bool = True
    ledger_epochs: int | None = None  # keep the last N epochs' ledgers (None: all)
    boundaries: bool = False  # seq_idx + cu_seq_lens for linear-attention / SSM layers
    allow_packing_leak: bool = False  # pack a model whose leak probe fails (#20)
    cp_size: int = 1  # context parallel: documents padded to a multiple of 2 * cp_size
    # several weighted sources instead of `data` (#16; pipes/mixtures/mixture.py, graphs/mixture.py)
    mixture: Mixture | None = None
    # worker switches (#26); not in the checkpoint key (a resume may change it)
    # worker -> trainer batches: "segment" (reused shared memory, faster) or "torch" (torch's own)
    worker_transfer: WorkerTransfer = "segment"

    def __post_init__(self) -> None:
        if self.mixture is not None:
            check_mixture_config(max_packs=self.max_packs, shuffle=self.shuffle)
        if self.pack_size < 2:
            raise ValueError(f"{self.pack_size=} must be at least 2 tokens")
        if self.cp_size < 1 or (self.cp_size > 1 and self.pack_size % (2 * self.cp_size)):
            raise ValueError(
                f"{self.cp_size=} must be >= 1 and 2 * cp_size must divide {self.pack_size=} "
                "(every document and the row are split into 2 * cp_size chunks)"
            )
        if self.batch_size < 1:
            raise ValueError(f"{self.batch_size=} must be >= 1")
        if self.tail not in TAIL_POLICIES:
            raise ValueError(f"{self.tail=} is not one of {TAIL_POLICIES}")
        # checked here, not at the plan (overlong) or the first collate in a worker (the format)
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(
                f"{self.overlong=} is not one of {OVERLONG_POLICIES}; drop counts and skips "
                "a sample longer than pack_size"
            )
        resolve_mask_format(self.attn_implementation)  # the collate's own check
        check_start_method(self.multiprocessing_context)
        check_worker_transfer(self.worker_transfer)  # worker switches (#26)


class TokenPacker:
    """A pack reference -> the packed text sample of its ids (picklable; the materialize step of
    the text graph, wrapped in ``PackMaterializer`` for the loader's bookkeeping). ``alignment``
    pads each document to a multiple (``2 * cp_size`` for context parallelism)."""

    def __init__(self, source: TokenSource, padding_idx: int, alignment: int = 1) -> None:
        self.source, self.padding_idx, self.alignment = source, padding_idx, alignment

    def __call__(self, ref: dict[str, Any]) -> dict[str, Any]:
        samples = [self.source[i] for i in ref["sample_ids"]]
        return dict(build_pack(samples, padding_idx=self.padding_idx, alignment=self.alignment))


def neat_llm_parts(
    data: Any,
    *,
    config: NeatLLMConfig | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    lengths: np.ndarray | None = None,
    pack_transform: Callable[[Any], Any] | None = None,
    batch_transform: Callable[[Any], Any] | None = None,
    model: Any = None,
    cp_rank: int | None = None,
) -> GraphParts:
    """The pieces of ``neat_llm_graph`` (same arguments) to compose a graph of your own.

    ``model`` (a model or its transformers config) turns on ``seq_idx`` / ``cu_seq_lens`` for
    hybrid models, and a hybrid model is probed first: packing it when its layers leak across
    documents raises ``PackingLeakError`` unless ``allow_packing_leak`` (docs/long_context.md).
    ``cp_size > 1`` plans and packs documents padded to a multiple of ``2 * cp_size``;
    ``cp_rank`` then makes every batch that context-parallel rank's shard
    (``pipes/parallel/context_parallel.py``).
    """
    cfg = config or NeatLLMConfig()
    if cfg.mixture is not None:
        check_mixture_data("NeatLLMConfig", data, lengths)
        from neatpack.graphs.mixture import mixture_llm_parts

        return mixture_llm_parts(
            config=cfg, build_parts=neat_llm_parts, rank=rank, world_size=world_size,
            pack_transform=pack_transform, batch_transform=batch_transform, model=model,
            cp_rank=cp_rank,
        )  # fmt: skip
    boundaries = packing_boundaries(
        model, boundaries=cfg.boundaries, allow_leak=cfg.allow_packing_leak
    )
    rank, world_size = resolve_rank(rank, world_size)
    source = TokenSource(data)
    total = token_lengths(source) if lengths is None else np.asarray(lengths, dtype=np.int64)
    planned = total if cfg.cp_size == 1 else cp_padded_lengths(total, cfg.cp_size)

    def plan_for(group_size: int) -> PackPlan:
        return plan_packs(
            planned,
            cfg.pack_size,
            max_packs=cfg.max_packs,
            overlong=cfg.overlong,
            world_size=group_size,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
        )

    pack_source = PackSource(
        plan_for, rank=rank, world_size=world_size, batch_size=cfg.batch_size, tail=cfg.tail
    )
    alignment = 2 * cfg.cp_size if cfg.cp_size > 1 else 1
    materialize = PackMaterializer(TokenPacker(source, cfg.padding_idx, alignment))
    collate = Collater(
        padding_idx=cfg.padding_idx,
        max_length=cfg.pack_size,
        attn_implementation=cfg.attn_implementation,
        pad_to_multiple_of=cfg.pad_to_multiple_of,
        boundaries=boundaries,
    )
    steps: list[Callable[[Any], Any]] = [PerPack(materialize)]
    if pack_transform is not None:
        steps.append(PerPack(pack_transform))
    steps.append(collate)
    if batch_transform is not None:
        steps.append(batch_transform)
    if cp_rank is not None:
        steps.append(ContextParallelSplitter(cfg.cp_size, cp_rank))
    plan_key = {
        k: v
        for k, v in ((f.name, getattr(cfg, f.name)) for f in fields(cfg))  # no deep copy
        if k
        not in (
            "mixture",
            "num_workers",
            "multiprocessing_context",
            "prefetch",
            "pin_memory",
            "keep_ledger",
            "ledger_epochs",
            "boundaries",
            "allow_packing_leak",
            "cp_size",
            "worker_transfer",
        )
    }
    if cfg.cp_size > 1:  # only when set: older checkpoints keep their key
        plan_key["cp_size"] = cfg.cp_size
    fingerprint = hashlib.sha256(np.ascontiguousarray(total, dtype="<i8").tobytes()).hexdigest()
    return GraphParts(
        source=pack_source,
        materialize=materialize,
        collate=collate,
        steps=tuple(steps),
        batch_size=cfg.batch_size,
        pack_size=cfg.pack_size,
        config={"graph": "neat_llm", "lengths": fingerprint[:16], **plan_key},
        num_workers=cfg.num_workers,
        multiprocessing_context=cfg.multiprocessing_context,
        prefetch=cfg.prefetch,
        pin_memory=cfg.pin_memory,
        transfer=cfg.worker_transfer,
        keep_ledger=cfg.keep_ledger,
        ledger_epochs=cfg.ledger_epochs,
        # tokenized samples have no content hash: their lengths stand for the data
        data={
            "source": f"{type(data).__name__} of {len(source)} samples",
            "fingerprint": fingerprint,
        },
    )


def neat_llm_graph(
    data: Any,
    *,
    config: NeatLLMConfig | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    lengths: np.ndarray | None = None,
    pack_transform: Callable[[Any], Any] | None = None,
    batch_transform: Callable[[Any], Any] | None = None,
    model: Any = None,
    cp_rank: int | None = None,
) -> NeatLoader:
    """Build this rank's checkpointable loader of packed text batches (hooks: per-pack and
    per-batch steps, run in the workers; ``model`` / ``cp_rank``: see ``neat_llm_parts``)."""
    return neat_llm_parts(
        data,
        config=config,
        rank=rank,
        world_size=world_size,
        lengths=lengths,
        pack_transform=pack_transform,
        batch_transform=batch_transform,
        model=model,
        cp_rank=cp_rank,
    ).loader()
