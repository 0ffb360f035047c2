"""Document ids -> the dense 4D block-causal masks (sdpa, eager).

A packed batch describes its documents with one integer tensor ``doc_ids`` of shape ``[B, S]``:
``1..k`` for the tokens of the k-th document of the row, ``0`` for right padding (the seed's
"indexed attention mask"). Every format function is pure and vectorized (no Python loop over
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

The other formats of the same ids: flash varlen and THD kwargs in ``cu_seqlens.py``, the flex
``BlockMask`` in ``block_mask.py``, positions restarting per document in ``text_positions.py``;
the ids' own check and lengths in ``doc_ids.py``. ``mask_format.py`` names them all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from neatpack.pipes.collating.doc_ids import check_doc_ids, doc_lengths

__all__ = ["to_4d_additive_mask", "to_4d_bool_mask", "to_4d_mask"]


def _fill_block_causal(doc_ids: Tensor, out: Tensor, allowed: float | bool) -> Tensor:
    """Write ``allowed`` into ``out[B, S, S]`` (pre-filled "blocked") wherever attention is allowed.

    Documents are contiguous, so the allowed set of a row is one lower triangle per document plus
    the diagonal of the padding: each is one strided block write (a loop over documents, not
    tokens). For bool masks about 10x faster than comparing ``[B,S,1]`` with ``[B,1,S]`` ids
    (3 ms vs 40 ms at B=4, S=2048 here), and never allocates more than ``out`` and one
    ``[L, L]`` triangle, ``L`` the longest document: at S=8192 an ``[S, S]`` triangle cost
    ~50 ms of the ~130 ms mask (allocating and touching 64 MB), the ``[L, L]`` one ~1 ms.
    """
    lengths = doc_lengths(doc_ids)
    longest = max((n for lens in lengths for n in lens), default=0)
    ar = torch.arange(longest, device=doc_ids.device)
    tril = ar[:, None] >= ar[None, :]  # [L, L] lower triangle, True on and below the diagonal
    for row, lens in enumerate(lengths):
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
