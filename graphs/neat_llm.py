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

from collections.abc import Callable
from typing import Any

import numpy as np

from neatpack.graphs.assemble import (
    Hooks,
    cp_alignment,
    lengths_fingerprint_of,
    loader_of,
    packed_parts,
    probe_boundaries,
)
from neatpack.graphs.config import NeatLLMConfig
from neatpack.graphs.mixture import mixture_parts
from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.runtime.stages import GraphParts
from neatpack.graphs.token_source import TokenSource, token_lengths, token_supervised
from neatpack.pipes.indexing.lengths import LengthIndex
from neatpack.pipes.materializing.pack import build_pack
from neatpack.pipes.steps import PackMaterializer

__all__ = [
    "NeatLLMConfig",
    "TokenPacker",
    "TokenSource",
    "neat_llm_graph",
    "neat_llm_parts",
    "token_lengths",
]


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
    lengths: LengthIndex | np.ndarray | None = None,
    pack_transform: Callable[[Any], Any] | None = None,
    batch_transform: Callable[[Any], Any] | None = None,
    model: Any = None,
    cp_rank: int | None = None,
) -> GraphParts:
    """The pieces of ``neat_llm_graph`` (same arguments) to compose a graph of your own.

    ``data``: pre-tokenized records (a list, a path, a ``datasets.Dataset``) or a ``Mixture``
    of several. ``lengths``: each sample's length after the shift (read from the records when
    None), or a ``LengthIndex`` (a mixture hands its own: ``total``, and the ``supervised``
    label counts, which ``balance="supervised"`` then takes instead of counting them again).
    ``model`` (a model or its transformers config) turns on ``seq_idx`` /
    ``cu_seq_lens`` for hybrid models, and a hybrid model is probed first: packing it when its
    layers leak across documents raises ``PackingLeakError`` unless ``allow_packing_leak``
    (docs/long_context.md). ``cp_size > 1`` plans and packs documents padded to a multiple of
    ``2 * cp_size``; ``cp_rank`` then makes every batch that context-parallel rank's shard
    (``pipes/parallel/context_parallel.py``).
    """
    cfg = (config or NeatLLMConfig()).with_attention(model=model)  # "auto" -> a format
    hooks = Hooks(pack_transform, batch_transform, model, cp_rank)
    mixed = mixture_parts(data, None, config=cfg, lengths=lengths, build_parts=neat_llm_parts,
                          rank=rank, world_size=world_size, **hooks._asdict())  # fmt: skip
    if mixed is not None:
        return mixed
    boundaries = probe_boundaries(cfg, hooks)  # before any record is read
    rank, world_size = resolve_rank(rank, world_size)
    source = TokenSource(data)
    index = lengths if isinstance(lengths, LengthIndex) else None
    if index is not None:
        total = np.asarray(index.total, dtype=np.int64)
    else:
        total = token_lengths(source) if lengths is None else np.asarray(lengths, dtype=np.int64)
    supervised = None if index is None else index.supervised
    if cfg.balance == "supervised" and supervised is None:
        # exact label counts, read only when the steps are balanced on them and not given
        supervised = token_supervised(source)
    fingerprint = lengths_fingerprint_of(total)
    return packed_parts(
        cfg,
        graph="neat_llm",
        total=total,
        lengths_fingerprint=fingerprint[:16],
        supervised=supervised,
        materialize=PackMaterializer(TokenPacker(source, cfg.padding_idx, cp_alignment(cfg))),
        collate_options={"padding_idx": cfg.padding_idx, "max_length": cfg.pack_size},
        rank=rank,
        world_size=world_size,
        # tokenized samples have no content hash: their lengths stand for the data
        data={
            "source": f"{type(data).__name__} of {len(source)} samples",
            "fingerprint": fingerprint,
        },
        hooks=hooks,
        boundaries=boundaries,
    )


@loader_of(neat_llm_parts)
def neat_llm_graph() -> None:
    """Build this rank's checkpointable loader of packed text batches (``neat_llm_parts``'
    arguments; hooks: per-pack and per-batch steps, run in the workers; ``model`` /
    ``cp_rank``: see ``neat_llm_parts``)."""
