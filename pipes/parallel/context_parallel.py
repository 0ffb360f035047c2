"""Context-parallel shards of a packed batch: every document split head-and-tail across ranks.

With context parallelism (CP) each of ``cp_size`` ranks holds ``S / cp_size`` tokens of every
row and attends with its local queries to the keys of all ranks (ring / all-gather attention).
Causal attention makes a document's late tokens costlier than its early ones, so each document
(its padded span) is cut into ``2 * cp_size`` equal chunks and rank ``r`` takes chunks ``r``
and ``2 * cp_size - 1 - r`` (Megatron-LM / Transformer Engine's load-balanced split, TE's
``thd_get_partitioned_indices``). Example, ``cp_size=2``, one document of 8 tokens::

    tokens     a b | c d | e f | g h          4 chunks of 2
    rank 0     a b             g h            chunks 0 and 3: causal work 1+2 + 7+8 = 18
    rank 1           c d | e f                chunks 1 and 2: causal work 3+4 + 5+6 = 18

Every document's padded length must be a multiple of ``2 * cp_size``: plan with
:func:`cp_padded_lengths` and build packs with ``alignment = 2 * cp_size`` (the prebuilt graphs
do both when ``cp_size > 1``). A row's tail padding is one more segment, split the same way.

A shard keeps, for its own tokens, the batch's ``input_ids``, ``labels``, ``doc_ids``,
``mm_token_type_ids``, ``seq_idx`` and the positions of the full row (text ``[B, S]`` or mRoPE
``[3|4, B, S]``: each token keeps its global position), the query rows of a 4D mask
(``[B, 1, S/cp, S]``: local queries against all keys), and adds:

==========================  ==============================================================
``packed_seq_params``       THD params of the whole batch (global ``cu_seqlens_q`` real,
                            ``cu_seqlens_q_padded``): what TE's CP attention takes
``cp_cu_seqlens_padded``    int32, this rank's local spans (global padded spans / cp_size)
``cp_cu_seqlens``           int32, this rank's real (unpadded) tokens per document
``cp_token_index``          ``[B, S/cp]`` int64: each local token's index in its full row
``cp_media_index``          int64: for each local media placeholder token (row-major), its
                            index among the full batch's placeholders, to place media
                            embeddings computed before the split
==========================  ==============================================================

Media tensors (``pixel_values``, grids) are kept whole on every rank: the vision tower runs
on all of the batch's media, and ``cp_media_index`` picks the rows of its output this rank
needs.

>>> b = {"input_ids": torch.arange(8)[None], "doc_ids": torch.ones(1, 8, dtype=torch.long)}
>>> [s["input_ids"].tolist() for s in context_parallel_shards(b, 2)]
[[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import torch
from torch import Tensor

from neatpack.pipes.collating.cu_seqlens import thd_params_from_doc_lengths
from neatpack.pipes.collating.doc_ids import doc_lengths

__all__ = [
    "ContextParallelShard",
    "ContextParallelSplitter",
    "attention_work_per_rank",
    "context_parallel_shards",
    "cp_padded_lengths",
    "cp_split_indices",
    "shard_for_context_parallel",
]

#: ``[B, S]`` keys cut along their last dim (positions ``[k, B, S]`` too).
_SEQ_KEYS = (
    "input_ids",
    "labels",
    "label_weights",
    "doc_ids",
    "mm_token_type_ids",
    "seq_idx",
    "position_ids",
)
#: Keys that describe the whole row and have no per-rank meaning once split.
_DROPPED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _check_cp(cp_size: int, cp_rank: int | None = None) -> None:
    if cp_size < 1:
        raise ValueError(f"{cp_size=} must be >= 1")
    if cp_rank is not None and not 0 <= cp_rank < cp_size:
        raise ValueError(f"{cp_rank=} must be in [0, {cp_size=})")


def cp_padded_lengths(lengths: Any, cp_size: int) -> np.ndarray:
    """Lengths rounded up to a multiple of ``2 * cp_size``: what the planner reserves.

    >>> cp_padded_lengths([5, 8, 1], 2).tolist()
    [8, 8, 4]
    """
    _check_cp(cp_size)
    unit = 2 * cp_size
    arr = np.asarray(lengths, dtype=np.int64)
    return np.where(arr > 0, -(-arr // unit) * unit, arr)


def cp_split_indices(spans: Sequence[int], cp_size: int, cp_rank: int) -> list[int]:
    """Indices (into the row) of rank ``cp_rank``'s tokens, for a row made of ``spans``.

    Per span: chunk ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``.

    >>> cp_split_indices([8, 4], 2, 0)
    [0, 1, 6, 7, 8, 11]
    """
    _check_cp(cp_size, cp_rank)
    unit = 2 * cp_size
    out: list[int] = []
    start = 0
    for n in spans:
        if n % unit:
            raise ValueError(
                f"a span of {n} tokens is not a multiple of 2 * {cp_size=}; build packs with "
                f"alignment={unit} and a pack_size that {unit} divides"
            )
        c = n // unit
        for chunk in (cp_rank, unit - 1 - cp_rank):
            out.extend(range(start + chunk * c, start + (chunk + 1) * c))
        start += n
    return out


def _row_spans(doc_ids: Tensor) -> list[list[int]]:
    """Per row: the spans of documents 1..k, then the row's padding run (if any)."""
    s = doc_ids.shape[1]
    spans = []
    for lens in doc_lengths(doc_ids):
        tail = s - sum(lens)
        spans.append(list(lens) + ([tail] if tail else []))
    return spans


def _real_lengths(batch: Mapping[str, Any], spans: list[list[int]]) -> list[list[int]]:
    """Per row, per document, its real (unpadded) length: from the batch's THD params when
    present, else the spans themselves."""
    params = batch.get("packed_seq_params")
    ndocs = [len(doc_lengths(batch["doc_ids"][r : r + 1])[0]) for r in range(len(spans))]
    if isinstance(params, Mapping) and "cu_seqlens_q" in params:
        flat = params["cu_seqlens_q"].diff().tolist()
        out, i = [], 0
        for n in ndocs:
            k = max(n, 1)
            out.append(flat[i : i + k][:n])
            i += k
        return out
    return [row[:n] for row, n in zip(spans, ndocs, strict=True)]


def shard_for_context_parallel(
    batch: Mapping[str, Any], cp_size: int, cp_rank: int
) -> dict[str, Any]:
    """Rank ``cp_rank``'s shard of a collated packed batch (see the module docstring).

    Raises ``ValueError`` when a document's span (or a row's padding) is not a multiple of
    ``2 * cp_size``, or the mask is a flex ``BlockMask`` (build it per shard from ``doc_ids``).
    """
    _check_cp(cp_size, cp_rank)
    doc_ids = batch.get("doc_ids")
    if not isinstance(doc_ids, Tensor):
        raise ValueError(f"context parallel sharding needs 'doc_ids'; got keys {sorted(batch)}")
    b, s = doc_ids.shape
    spans = _row_spans(doc_ids)
    rows = [cp_split_indices(sp, cp_size, cp_rank) for sp in spans]
    index = torch.tensor(rows, dtype=torch.long, device=doc_ids.device)  # [B, S/cp]
    out: dict[str, Any] = {k: v for k, v in batch.items() if k not in _DROPPED}
    for key in _SEQ_KEYS:
        value = batch.get(key)
        if isinstance(value, Tensor) and value.shape[-2:] == (b, s):
            out[key] = value.gather(-1, index.expand(*value.shape[:-1], -1))
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 4:
        rows_idx = index[:, None, :, None].expand(b, mask.shape[1], -1, s)
        out["attention_mask"] = mask.gather(2, rows_idx)  # local queries x all keys
    elif isinstance(mask, Tensor) and mask.shape == (b, s):
        out["attention_mask"] = out["doc_ids"] if mask is doc_ids else mask.gather(1, index)
    elif mask is not None and not isinstance(mask, Tensor):
        raise ValueError(
            f"cannot shard an attention_mask of type {type(mask).__name__} for context "
            "parallelism; collate with mask_format='doc_ids' or 'thd' and build it per shard"
        )
    real = _real_lengths(batch, spans)
    docs_spans = [row[: len(r)] for row, r in zip(spans, real, strict=True)]
    out["packed_seq_params"] = thd_params_from_doc_lengths(
        docs_spans, s, seq_lens=real, device=doc_ids.device
    )
    local_pad: list[int] = []
    local_real: list[int] = []
    for sp, rl in zip(docs_spans, real, strict=True):
        folded = list(sp) or [0]
        folded[-1] += s - sum(sp)
        local_pad += [n // cp_size for n in folded]
        for n, r in zip(sp, rl, strict=True):
            c = n // (2 * cp_size)
            mine = [
                (cp_rank * c, (cp_rank + 1) * c),
                ((2 * cp_size - 1 - cp_rank) * c, n - cp_rank * c),
            ]
            local_real.append(sum(max(0, min(hi, r) - lo) for lo, hi in mine))
        if not sp:
            local_real.append(0)
    out["cp_cu_seqlens_padded"] = torch.tensor(
        list(accumulate(local_pad, initial=0)), dtype=torch.int32
    )
    out["cp_cu_seqlens"] = torch.tensor(list(accumulate(local_real, initial=0)), dtype=torch.int32)
    out["cp_token_index"] = index
    mm = batch.get("mm_token_type_ids")
    if isinstance(mm, Tensor) and mm.shape == (b, s):
        media = mm != 0
        order = media.reshape(-1).long().cumsum(0).view(b, s) - 1  # rank among placeholders
        local = media.gather(1, index)
        out["cp_media_index"] = order.gather(1, index)[local]
    out["cp_size"], out["cp_rank"] = cp_size, cp_rank
    return out


def context_parallel_shards(batch: Mapping[str, Any], cp_size: int) -> list[dict[str, Any]]:
    """The shards of all ``cp_size`` ranks, in rank order."""
    return [shard_for_context_parallel(batch, cp_size, r) for r in range(cp_size)]


def attention_work_per_rank(doc_ids: Tensor, cp_size: int) -> list[int]:
    """Causal attention work of each CP rank: the (query, key) pairs its local queries attend.

    A query at offset ``i`` of its document's padded span attends ``i + 1`` keys (a row's
    padding run counts as one causal segment, as in THD). Closed form per span: chunk ``k`` of
    ``c`` tokens costs ``k * c * c + c * (c + 1) / 2``, so chunks ``r`` and ``2 * cp - 1 - r``
    cost the same for every rank: the head-and-tail split is exactly balanced.

    >>> attention_work_per_rank(torch.ones(1, 8, dtype=torch.long), 2)
    [18, 18]
    """
    _check_cp(cp_size)
    unit = 2 * cp_size
    work = [0] * cp_size
    for spans in _row_spans(doc_ids):
        for n in spans:
            if n % unit:
                raise ValueError(f"a span of {n} tokens is not a multiple of 2 * {cp_size=}")
            c = n // unit
            for r in range(cp_size):
                work[r] += sum(k * c * c + c * (c + 1) // 2 for k in (r, unit - 1 - r))
    return work


class ContextParallelSplitter:
    """Step: a collated packed batch -> ``cp_rank``'s shard of it (the last step of a worker
    ``StepChain``; picklable, so it runs in the workers). ``shard_for_context_parallel`` as a
    step object."""

    def __init__(self, cp_size: int, cp_rank: int) -> None:
        _check_cp(cp_size, cp_rank)
        self.cp_size, self.cp_rank = cp_size, cp_rank

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return shard_for_context_parallel(batch, self.cp_size, self.cp_rank)


class ContextParallelShard:
    """Map function: wraps a batch step (refs -> batch) to return ``cp_rank``'s shard of it.

    The prebuilt graphs use it when given ``cp_rank``; picklable, so it runs in the workers.
    """

    def __init__(self, batch_step: Any, cp_size: int, cp_rank: int) -> None:
        _check_cp(cp_size, cp_rank)
        self.batch_step, self.cp_size, self.cp_rank = batch_step, cp_size, cp_rank

    def __call__(self, refs: Any) -> dict[str, Any]:
        return shard_for_context_parallel(self.batch_step(refs), self.cp_size, self.cp_rank)
