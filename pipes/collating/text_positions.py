"""Document ids -> positions that restart at every document (``position_ids`` for text packs,
row 0 of the ``[4, B, S]`` mRoPE layout of the mask-free formats)::

    doc_ids  [[1, 1, 1, 2, 2, 0]]   ->   text positions [[0, 1, 2, 0, 1, 0]]
"""

from __future__ import annotations

import torch
from torch import Tensor

from neatpack.pipes.collating.doc_ids import check_doc_ids, segment_starts

__all__ = ["to_mrope_text_position_ids", "to_text_position_ids"]


def to_text_position_ids(doc_ids: Tensor, *, validate: bool = True) -> Tensor:
    """Positions ``0..L-1`` restarting at every document, ``0`` on padding; ``[B, S]`` int64.

    >>> to_text_position_ids(torch.tensor([[1, 1, 1, 2, 2, 0]])).tolist()
    [[0, 1, 2, 0, 1, 0]]
    """
    if validate:
        check_doc_ids(doc_ids)
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)
    starts = segment_starts(doc_ids).view(b, s)
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
