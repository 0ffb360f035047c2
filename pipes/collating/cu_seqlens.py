"""Document ids -> the varlen kwargs of padding-free attention: flash ``cu_seq_lens`` and THD
``packed_seq_params`` (Megatron / Transformer Engine names).

The batch is seen as one stream of ``B*S`` tokens; each function has a twin that takes the
per-row document lengths instead of the ``[B, S]`` ids (the collater's fast path)::

    doc_ids = [[1, 1, 1, 1, 2, 2], [1, 1, 0, 0, 0, 0]]
    to_cu_seqlens  -> cu_seq_lens_q = [0, 4, 6, 8, 12], max_length_q = 4   (padding: a segment)
    to_thd_params  -> cu_seqlens_q_padded = [0, 4, 6, 12] (a row's padding joins its last doc)
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import Any

import torch
from torch import Tensor

from neatpack.pipes.collating.doc_ids import check_doc_ids, doc_lengths, segment_starts

__all__ = [
    "cu_seqlens_from_doc_lengths",
    "thd_params_from_doc_lengths",
    "to_cu_seqlens",
    "to_thd_params",
]


def to_cu_seqlens(doc_ids: Tensor, *, validate: bool = True) -> dict[str, Any]:
    """Flash-attention varlen kwargs for the padding-free path of transformers 5.x.

    The batch is seen as one stream of ``B*S`` tokens (transformers reshapes q/k/v to
    ``[B*S, H, D]`` when these kwargs are given and ``attention_mask`` is None). A segment starts
    at every document and at every row start; a row's padding run is its own segment, so
    ``cu_seq_lens_q[-1] == B*S``. Names and types are those of
    ``transformers.modeling_flash_attention_utils.FlashAttentionKwargs``: int32 tensors and
    Python ints.

    >>> kw = to_cu_seqlens(torch.tensor([[1, 1, 1, 1, 2, 2], [1, 1, 0, 0, 0, 0]]))
    >>> kw["cu_seq_lens_q"].tolist(), kw["max_length_q"]
    ([0, 4, 6, 8, 12], 4)
    """
    if validate:
        check_doc_ids(doc_ids)
    n = doc_ids.numel()
    starts = segment_starts(doc_ids).nonzero().view(-1).to(torch.int32)
    cu = torch.cat([starts, torch.tensor([n], dtype=torch.int32, device=doc_ids.device)])
    max_len = int(cu.diff().max()) if cu.numel() > 1 else 0
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }


def cu_seqlens_from_doc_lengths(doc_lengths: Sequence[Sequence[int]], s: int) -> dict[str, Any]:
    """:func:`to_cu_seqlens` of the ``[B, S]`` ids that ``doc_lengths`` describe, without them.

    Per row: documents of these lengths (each >= 1, summing to at most ``s``) from the row
    start, then padding. O(documents) in Python instead of a scan of ``B*S`` ids; the collater
    uses it once :func:`doc_ids_match_lengths` has confirmed the ids.

    >>> kw = cu_seqlens_from_doc_lengths([[4, 2], [2]], 6)
    >>> kw["cu_seq_lens_q"].tolist(), kw["max_length_q"]
    ([0, 4, 6, 8, 12], 4)
    """
    starts: list[int] = []
    for row, lens in enumerate(doc_lengths):
        a, end = row * s, (row + 1) * s
        if any(n < 1 for n in lens) or a + sum(lens) > end:
            raise ValueError(
                f"row {row}: doc_lengths={list(lens)} must be >= 1 each and sum to at most {s=}"
            )
        for n in lens:
            starts.append(a)
            a += n
        if a < end:
            starts.append(a)  # the row's padding run is a segment of its own
    starts.append(len(doc_lengths) * s)
    cu = torch.tensor(starts, dtype=torch.int32)
    max_len = max(e - a for a, e in pairwise(starts)) if len(starts) > 1 else 0
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }


def to_thd_params(
    doc_ids: Tensor,
    seq_lens_padded: list[list[int]] | None = None,
    *,
    seq_lens: list[list[int]] | None = None,
    validate: bool = True,
) -> dict[str, Any]:
    """Packed-sequence parameters in the THD layout (Megatron ``PackedSeqParams`` / TE names).

    The batch is flattened to ``B*S`` tokens. The run of tokens with one document id is that
    document's *padded* span (a pack built with ``sequence_alignment`` puts the alignment pad
    inside the document's id); the row's tail padding is folded into the row's last document, so
    ``cu_seqlens_q_padded[-1] == B*S``. ``seq_lens`` gives the real (unpadded) lengths per row,
    defaulting to the spans; ``seq_lens_padded``, when given (the pack's field), is checked
    against the spans. A row with no document is one span of real length 0.

    >>> p = to_thd_params(torch.tensor([[1, 1, 1, 1, 2, 2, 0, 0]]), seq_lens=[[3, 2]])
    >>> p["cu_seqlens_q"].tolist(), p["cu_seqlens_q_padded"].tolist()
    ([0, 3, 5], [0, 4, 8])
    """
    if validate:
        check_doc_ids(doc_ids)
    return thd_params_from_doc_lengths(
        doc_lengths(doc_ids),
        doc_ids.shape[1],
        seq_lens_padded=seq_lens_padded,
        seq_lens=seq_lens,
        device=doc_ids.device,
    )


def thd_params_from_doc_lengths(
    doc_lengths: Sequence[Sequence[int]],
    s: int,
    seq_lens_padded: list[list[int]] | None = None,
    *,
    seq_lens: list[list[int]] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """:func:`to_thd_params` from per-row document lengths (the spans of ids ``1..k``).

    ``doc_lengths`` stands for the ``[B, S]`` ids (what :func:`doc_lengths` counts from them);
    the collater passes the packs' ``seq_lens_padded`` once :func:`doc_ids_match_lengths` has
    confirmed them, so no ``[B, S]`` scan is needed. Same checks and errors as
    :func:`to_thd_params`.

    >>> thd_params_from_doc_lengths([[4, 2]], 8, seq_lens=[[3, 2]])["cu_seqlens_q_padded"]
    tensor([0, 4, 8], dtype=torch.int32)
    """
    spans: list[list[int]] = []
    reals: list[list[int]] = []
    for row, docs_in in enumerate(doc_lengths):
        docs = list(docs_in)
        if seq_lens_padded is not None and list(seq_lens_padded[row]) != docs:
            raise ValueError(
                f"row {row}: seq_lens_padded={list(seq_lens_padded[row])} does not match the "
                f"document spans {docs} in doc_ids; pass the pack's own seq_lens_padded."
            )
        real = docs if seq_lens is None else list(seq_lens[row])
        if len(real) != len(docs) or any(r < 0 or r > d for r, d in zip(real, docs, strict=True)):
            raise ValueError(
                f"row {row}: seq_lens={real} must give one length per document, each at most "
                f"its span in doc_ids {docs}."
            )
        span = list(docs) or [0]
        span[-1] += s - sum(docs)  # fold the row's tail padding into its last document
        spans.append(span)
        reals.append(list(real) or [0])
    flat_pad = [x for r in spans for x in r]
    flat_real = [x for r in reals for x in r]
    cu_pad = torch.tensor(list(accumulate(flat_pad, initial=0)), dtype=torch.int32, device=device)
    cu = torch.tensor(list(accumulate(flat_real, initial=0)), dtype=torch.int32, device=device)
    max_len = max(flat_pad) if flat_pad else 0
    return {
        "qkv_format": "thd",
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": cu_pad,
        "cu_seqlens_kv_padded": cu_pad,
        "max_seqlen_q": max_len,
        "max_seqlen_kv": max_len,
    }
