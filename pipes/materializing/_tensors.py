"""Tensor plumbing shared by the pack builder, the collater and the loader's workers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["adjacent_view", "cat_shared"]


def adjacent_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The whole storage as one tensor when ``tensors`` tile it back to back, in order (the pixel
    rows of a pack that ``tokenize_conversations`` produced in one processor call), else None.
    Taking it saves copying the pack's largest tensor again; the caller cats otherwise. Parts
    that cover only some of their storage (a sample dropped or cut on overflow) give None: a
    view of part of a storage would carry the rest along whenever it is pickled."""
    first = tensors[0]
    if not first.is_contiguous() or first.storage_offset() != 0:
        return None
    storage, row = first.untyped_storage().data_ptr(), first[0].numel() if first.numel() else 0
    end = first.storage_offset() + first.numel()
    for t in tensors[1:]:
        if (
            not t.is_contiguous()
            or t.dtype != first.dtype
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != end
        ):
            return None
        end += t.numel()
    rows = sum(int(t.shape[0]) for t in tensors)
    if row * rows != end or end * first.element_size() != first.untyped_storage().nbytes():
        return None
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return strides[::-1]


def cat_shared(parts: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.cat(parts)`` written straight into shared memory (what DataLoader's default collate
    does in its workers). A worker's result travels to the main process by pickling, which moves
    every tensor not already shared into shared memory, a second full copy; for pixel rows
    (tens of MB per batch) that copy costs as much as the cat. Parts share trailing shape and
    dtype; ``dtype`` casts on the way (one pass, as ``torch.cat(parts).to(dtype)`` gives).
    """
    first = parts[0]
    dtype = dtype or first.dtype
    rows = sum(int(p.shape[0]) for p in parts)
    shape = (rows, *first.shape[1:])
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    storage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    out = torch.empty(0, dtype=dtype).set_(storage, 0, shape, _contiguous_strides(shape))
    return torch.cat(list(parts), out=out)
