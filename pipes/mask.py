"""Document ids -> every attention-mask format a packed batch can be fed with.

A packed batch describes its documents with one integer tensor ``doc_ids`` of shape ``[B, S]``:
``1..k`` for the tokens of the k-th document of the row, ``0`` for right padding (the seed's
"indexed attention mask"). Every function here is pure and vectorized (no Python loop over
tokens) and turns that tensor into what one attention backend wants::

    doc_ids = [[1, 1, 2, 2, 2, 0]]        # two documents (2 + 3 tokens), one padding token

    to_4d_bool_mask -> [1, 1, 6, 6] bool, True = may attend     to_text_position_ids
        q\\k 0 1 2 3 4 5                                           -> [[0, 1, 0, 1, 2, 0]]
        0    1 . . . . .
        1    1 1 . . . .                                        to_cu_seqlens (flash varlen)
        2    . . 1 . . .                                           cu_seq_lens_q = [0, 2, 5, 6]
        3    . . 1 1 . .                                           max_length_q = 3
        4    . . 1 1 1 .
        5    . . . . . 1    <- padding attends to itself only

Padding rows attend to themselves (the diagonal), never to a document, and no document token
attends to padding. So no row of a mask is fully masked: SDPA kernels that return NaN for a
fully masked row (peer note B18, pytorch#103749) cannot be hit, and padding outputs stay finite.

Every function validates its input with :func:`check_doc_ids` (a ``ValueError`` naming the bad
row); ``validate=False`` skips that when the caller already checked (the collater does, once).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "check_doc_ids",
    "cu_seqlens_from_doc_lengths",
    "doc_ids_match_lengths",
    "thd_params_from_doc_lengths",
    "to_4d_additive_mask",
    "to_4d_bool_mask",
    "to_4d_mask",
    "to_block_mask",
    "to_cu_seqlens",
    "to_mrope_text_position_ids",
    "to_text_position_ids",
    "to_thd_params",
]


def check_doc_ids(doc_ids: Tensor) -> None:
    """Raise ``ValueError`` unless ``doc_ids`` is a valid ``[B, S]`` document-id tensor.

    Valid: integer dtype, 2-D, no negative value, non-decreasing along each row among the
    document tokens, and padding (0) only as a suffix. Equality of ids then means "same
    contiguous document", which every mask below relies on.
    """
    if doc_ids.dim() != 2:
        raise ValueError(
            f"doc_ids must be [B, S]; got shape {tuple(doc_ids.shape)}. "
            "Stack per-pack document ids into a batch first (use neat_packed_vlm_collater)."
        )
    if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise ValueError(f"doc_ids must be an integer tensor; got {doc_ids.dtype=}")
    if doc_ids.numel() == 0:
        return
    if bool((doc_ids < 0).any()):
        raise ValueError(f"doc_ids must be >= 0 (0 = padding); got min {int(doc_ids.min())}")
    pad = doc_ids == 0
    if bool((pad[:, :-1] & ~pad[:, 1:]).any()):
        row = int((pad[:, :-1] & ~pad[:, 1:]).any(1).nonzero()[0])
        raise ValueError(
            f"doc_ids row {row} has a document token after padding: {doc_ids[row].tolist()[:64]}; "
            "padding (0) must be a right suffix of the row."
        )
    step = doc_ids[:, 1:] - doc_ids[:, :-1]
    if bool(((step < 0) & ~pad[:, 1:]).any()):
        row = int(((step < 0) & ~pad[:, 1:]).any(1).nonzero()[0])
        raise ValueError(
            f"doc_ids row {row} is not non-decreasing: {doc_ids[row].tolist()[:64]}; "
            "documents must be numbered 1..k in order."
        )


def doc_ids_match_lengths(doc_ids: Tensor, doc_lengths: Sequence[Sequence[int]]) -> bool:
    """True iff ``doc_ids`` is exactly ``1`` x L1, ``2`` x L2, ..., ``k`` x Lk, then ``0``, per row.

    This is the form every pack's ``attention_mask`` has by the data contract, with
    ``doc_lengths`` its ``seq_lens_padded``. A match implies :func:`check_doc_ids` passes and
    that ``doc_lengths`` is what :func:`_doc_lengths` would count, so masks can be built from
    the lengths alone. False (never an error) for any mismatch, a non-integer tensor, a length
    < 1, or a row whose lengths sum past ``S`` (a row with no lengths must be all padding).

    Why it is exact: over the flattened rows, the canonical ids change value exactly at the
    segment starts (a document, a row's padding, a row start) whose id differs from the
    previous segment's. So: the positions where ``flat[p] != flat[p - 1]`` must be exactly those
    (their count, and the flag at every segment start), which makes ``flat`` constant on each
    segment; then the id at every segment start must be that segment's id.

    Cost: one ``!=`` pass and one ``count_nonzero`` over ``B*S`` plus two gathers of O(docs)
    values, in numpy on a zero-copy view: ~0.04 ms at B=4, S=16384, where the same passes in
    torch on one thread take ~0.12 ms (per-op dispatch and slower integer kernels there) and
    :func:`check_doc_ids` ~1 ms. A tensor on another device is copied to the CPU first.

    >>> doc_ids_match_lengths(torch.tensor([[1, 1, 2, 0], [1, 1, 1, 1]]), [[2, 1], [4]])
    True
    >>> doc_ids_match_lengths(torch.tensor([[1, 2, 1, 0]]), [[2, 1]])
    False
    """
    if doc_ids.dim() != 2 or doc_ids.shape[0] != len(doc_lengths) or doc_ids.numel() == 0:
        return False
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        return False
    s = doc_ids.shape[1]
    starts: list[int] = []  # flat positions where a segment starts
    values: list[int] = []  # and the id it holds
    for row, lens in enumerate(doc_lengths):
        a = row * s
        for k, n in enumerate(lens, start=1):
            if n < 1:
                return False
            starts.append(a)
            values.append(k)
            a += n
        if a > (row + 1) * s:
            return False
        if a < (row + 1) * s:
            starts.append(a)
            values.append(0)
    flat = doc_ids.detach().cpu().reshape(-1).numpy()
    changes = flat[1:] != flat[:-1]  # changes[p - 1]: flat[p] differs from flat[p - 1]
    expected = np.array([v != u for u, v in pairwise(values)], dtype=bool)  # at starts[1:]
    if np.count_nonzero(changes) != np.count_nonzero(expected):
        return False
    if not np.array_equal(changes[np.array(starts[1:], dtype=np.int64) - 1], expected):
        return False
    return bool(np.array_equal(flat[starts], values))


def _doc_lengths(doc_ids: Tensor) -> list[list[int]]:
    """Per row, the token count of documents 1..k (a bincount per row; no loop over tokens)."""
    b = doc_ids.shape[0]
    k = int(doc_ids.max()) if doc_ids.numel() else 0
    counts = torch.zeros(b, k + 1, dtype=torch.long, device=doc_ids.device)
    counts.scatter_add_(1, doc_ids.long(), torch.ones_like(doc_ids, dtype=torch.long))
    n_docs = doc_ids.amax(dim=1).tolist() if doc_ids.shape[1] else [0] * b
    return [row[1 : n + 1] for row, n in zip(counts.tolist(), n_docs, strict=True)]


def _fill_block_causal(doc_ids: Tensor, out: Tensor, allowed: float | bool) -> Tensor:
    """Write ``allowed`` into ``out[B, S, S]`` (pre-filled "blocked") wherever attention is allowed.

    Documents are contiguous, so the allowed set of a row is one lower triangle per document plus
    the diagonal of the padding: each is one strided block write (a loop over documents, not
    tokens). For bool masks about 10x faster than comparing ``[B,S,1]`` with ``[B,1,S]`` ids
    (3 ms vs 40 ms at B=4, S=2048 here), and never allocates more than ``out`` and one
    ``[L, L]`` triangle, ``L`` the longest document: at S=8192 an ``[S, S]`` triangle cost
    ~50 ms of the ~130 ms mask (allocating and touching 64 MB), the ``[L, L]`` one ~1 ms.
    """
    doc_lengths = _doc_lengths(doc_ids)
    longest = max((n for lens in doc_lengths for n in lens), default=0)
    ar = torch.arange(longest, device=doc_ids.device)
    tril = ar[:, None] >= ar[None, :]  # [L, L] lower triangle, True on and below the diagonal
    for row, lens in enumerate(doc_lengths):
        a = 0
        for n in lens:
            if out.dtype == torch.bool:  # a plain copy is ~10x faster than a masked fill
                out[row, a : a + n, a : a + n] = tril[:n, :n]
            else:
                out[row, a : a + n, a : a + n].masked_fill_(tril[:n, :n], allowed)
            a += n
        out[row, a:, a:].diagonal().fill_(allowed)  # padding rows attend to themselves only
    return out


def to_4d_bool_mask(doc_ids: Tensor, *, validate: bool = True) -> Tensor:
    """Block-causal ``[B, 1, S, S]`` bool mask, ``True`` = may attend (SDPA convention).

    >>> to_4d_bool_mask(torch.tensor([[1, 1, 2, 0]]))[0, 0].int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    """
    if validate:
        check_doc_ids(doc_ids)
    b, s = doc_ids.shape
    out = torch.zeros(b, s, s, dtype=torch.bool, device=doc_ids.device)
    return _fill_block_causal(doc_ids, out, True).unsqueeze(1)


def to_4d_additive_mask(
    doc_ids: Tensor, dtype: torch.dtype = torch.float32, *, validate: bool = True
) -> Tensor:
    """Block-causal ``[B, 1, S, S]`` additive mask: ``0`` = attend, ``finfo(dtype).min`` = blocked.

    Eager attention *adds* the mask to the scores, so a bool mask there is silently wrong (it
    adds 0 or 1). An additive mask in the model's dtype is right for both eager and sdpa.

    >>> to_4d_additive_mask(torch.tensor([[1, 2]]))[0, 0].eq(0).int().tolist()
    [[1, 0], [0, 1]]
    """
    if not dtype.is_floating_point:
        raise ValueError(f"additive masks need a floating dtype; got {dtype=}")
    if validate:
        check_doc_ids(doc_ids)
    b, s = doc_ids.shape
    out = torch.full((b, s, s), torch.finfo(dtype).min, dtype=dtype, device=doc_ids.device)
    return _fill_block_causal(doc_ids, out, 0.0).unsqueeze(1)


def to_4d_mask(
    doc_ids: Tensor, dtype: torch.dtype | None = None, *, validate: bool = True
) -> Tensor:
    """The 4D block-causal mask: bool (``dtype=None``, sdpa) or additive in ``dtype`` (eager)."""
    if dtype is None or dtype == torch.bool:
        return to_4d_bool_mask(doc_ids, validate=validate)
    return to_4d_additive_mask(doc_ids, dtype, validate=validate)


def _segment_starts(doc_ids: Tensor) -> Tensor:
    """Flat bool ``[B*S]``: True where a segment (a document or a row's padding run) starts."""
    b, s = doc_ids.shape
    flat = doc_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts.view(b, s)[:, 0] = True  # every row starts a segment, even with equal ids
    return starts


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
    starts = _segment_starts(doc_ids).nonzero().view(-1).to(torch.int32)
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
        _doc_lengths(doc_ids),
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

    ``doc_lengths`` stands for the ``[B, S]`` ids (what :func:`_doc_lengths` counts from them);
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


def to_block_mask(doc_ids: Tensor, *, block_size: int = 128, validate: bool = True) -> Any:
    """A flex-attention ``BlockMask`` with the same pattern as :func:`to_4d_bool_mask`.

    The block tables are computed from per-block document ranges, vectorized, never from a
    dense ``[B, S, S]`` mask (``create_block_mask`` without compile evaluates the mask function
    on every (q, kv) pair: gigabytes at S=16k). A ``(q_block, kv_block)`` tile is *full* when it
    lies strictly below the diagonal and both tiles hold one and the same document with no
    padding; *partial* (the mask function decides per token) when their document ranges
    overlap and it is on or below the diagonal, or it is a diagonal tile; otherwise skipped.
    This is exactly what ``create_block_mask`` builds (checked in tests).
    """
    from torch.nn.attention.flex_attention import BlockMask

    if validate:
        check_doc_ids(doc_ids)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1; got {block_size=}")
    b, s = doc_ids.shape
    nb = -(-s // block_size)
    ids = torch.nn.functional.pad(doc_ids.long(), (0, nb * block_size - s), value=0)
    tiles = ids.view(b, nb, block_size)
    valid = tiles > 0
    lo = torch.where(valid, tiles, torch.iinfo(torch.long).max).amin(-1)  # [B, nb]
    hi = torch.where(valid, tiles, -1).amax(-1)
    single = (lo == hi) & valid.all(-1)
    q_blk = torch.arange(nb, device=ids.device)[:, None]
    k_blk = torch.arange(nb, device=ids.device)[None, :]
    overlap = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    full = (k_blk < q_blk) & single[:, :, None] & single[:, None, :]
    full &= lo[:, :, None] == lo[:, None, :]
    if block_size == 1:
        full |= k_blk == q_blk  # a 1x1 diagonal tile: the token attends to itself
    partial = ((overlap & (k_blk <= q_blk)) | (k_blk == q_blk)) & ~full

    def tables(blocks: Tensor) -> tuple[Tensor, Tensor]:
        num = blocks.sum(-1, dtype=torch.int32).unsqueeze(1)
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
        return num, order.to(torch.int32).unsqueeze(1)

    def document_causal(bi: Tensor, hi_: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        dq = ids[bi, qi]
        dk = ids[bi, ki]
        return ((dq == dk) & (dk > 0) & (ki <= qi)) | (qi == ki)

    kv_num, kv_idx = tables(partial)
    full_num, full_idx = tables(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=document_causal,
        seq_lengths=(s, s),
    )


def to_text_position_ids(doc_ids: Tensor, *, validate: bool = True) -> Tensor:
    """Positions ``0..L-1`` restarting at every document, ``0`` on padding; ``[B, S]`` int64.

    >>> to_text_position_ids(torch.tensor([[1, 1, 1, 2, 2, 0]])).tolist()
    [[0, 1, 2, 0, 1, 0]]
    """
    if validate:
        check_doc_ids(doc_ids)
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)
    starts = _segment_starts(doc_ids).view(b, s)
    run_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return (idx - run_start).masked_fill_(doc_ids == 0, 0)


def to_mrope_text_position_ids(text_position_ids: Tensor, mrope_position_ids: Tensor) -> Tensor:
    """Stack ``[B, S]`` text positions over ``[3, B, S]`` mRoPE ids into ``[4, B, S]``.

    Qwen-VL text models read row 0 (positions restarting per document) only to find the packed
    documents when ``attention_mask`` is None, and rows 1-3 for rotary embeddings. ``[3, B, S]``
    alone with no mask leaks attention across documents (mRoPE rows jump inside an image).
    Needs ``use_cache=False`` (a cache disables packed-sequence detection).
    """
    if text_position_ids.dim() != 2 or mrope_position_ids.dim() != 3:
        raise ValueError(
            f"need text [B,S] and mRoPE [3,B,S]; got {tuple(text_position_ids.shape)} and "
            f"{tuple(mrope_position_ids.shape)}"
        )
    if mrope_position_ids.shape[0] != 3 or mrope_position_ids.shape[1:] != text_position_ids.shape:
        raise ValueError(
            f"mRoPE ids {tuple(mrope_position_ids.shape)} do not match text positions "
            f"{tuple(text_position_ids.shape)}; expected (3, B, S)."
        )
    return torch.cat(
        [text_position_ids.unsqueeze(0).to(mrope_position_ids.dtype), mrope_position_ids]
    )
