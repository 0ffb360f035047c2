"""Document ids -> a flex-attention ``BlockMask`` (``mask_format="flex_attention"``), built from
per-tile document ranges without a dense ``[B, S, S]`` mask.

>>> bm = to_block_mask(torch.tensor([[1, 1, 2, 2]]), block_size=2)
>>> bm.to_dense()[0, 0].tolist()  # tile (1, 0) is skipped: documents 1 and 2 never meet
[[1, 0], [0, 1]]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from neatpack.pipes.collating.doc_ids import check_doc_ids

__all__ = ["DocumentCausal", "to_block_mask"]


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

    kv_num, kv_idx = tables(partial)
    full_num, full_idx = tables(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=DocumentCausal(ids),
        seq_lengths=(s, s),
    )


class DocumentCausal:
    """The ``mask_mod`` of :func:`to_block_mask`: ``(q, kv)`` attend when both hold one and the
    same document and ``kv <= q``, or ``q == kv``. A class, not a closure, so the ``BlockMask``
    pickles: a loader worker sends it to the trainer (a local function cannot be pickled, and
    ``num_workers > 0`` with ``flex_attention`` failed on every batch).

    >>> mod = DocumentCausal(torch.tensor([[1, 1, 2, 0]]))
    >>> [[bool(mod(torch.tensor(0), None, torch.tensor(q), torch.tensor(k))) for k in range(4)]
    ...  for q in range(4)]  # doctest: +NORMALIZE_WHITESPACE
    [[True, False, False, False], [True, True, False, False], [False, False, True, False],
     [False, False, False, True]]
    """

    def __init__(self, doc_ids: Tensor) -> None:
        self.doc_ids = doc_ids  # [B, S'] right-padded with 0 to whole blocks

    def __call__(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        dq = self.doc_ids[b, q]
        dk = self.doc_ids[b, kv]
        return ((dq == dk) & (dk > 0) & (kv <= q)) | (q == kv)

    def __repr__(self) -> str:
        return f"DocumentCausal(doc_ids of shape {tuple(self.doc_ids.shape)})"
