"""Expand one image placeholder token into the image's merged-patch count, vectorized (the
seed's ``_expand_image_tokens``, for models whose processor leaves one placeholder per image).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "expand_image_tokens",
]


def expand_image_tokens(
    input_ids: Tensor,
    attention_mask: Tensor,
    grid_thws: Tensor,
    media_token_id: int,
    merge_kernel_size: tuple[int, int] = (2, 2),
    *,
    length: int | None = None,
    pad_token_id: int = 0,
) -> tuple[Tensor, Tensor]:
    """Expand each image placeholder to ``(h // mh) * (w // mw)`` copies (mask 1), vectorized.

    With ``length`` the result is right-padded to exactly that many tokens (pad id, mask 0), so
    pipeline-parallel stages see a fixed sequence length before the forward::

        ids [5, 9, 6], grid [[1, 4, 4]], token 9, merge (2, 2)  ->  [5, 9, 9, 9, 9, 6]
    """
    is_ph = input_ids == media_token_id
    n = int(is_ph.sum())
    if n != int(grid_thws.shape[0]):
        raise ValueError(
            f"{n} placeholder tokens ({media_token_id=}) but grid_thws has {grid_thws.shape[0]} "
            "rows; one placeholder per image is required."
        )
    mh, mw = merge_kernel_size
    per_image = (grid_thws[:, 1] // mh) * (grid_thws[:, 2] // mw)
    repeats = torch.ones_like(input_ids, dtype=torch.long)
    repeats[is_ph] = per_image.to(torch.long)
    ids = input_ids.repeat_interleave(repeats)
    mask = attention_mask.repeat_interleave(repeats)
    mask[ids == media_token_id] = 1
    if length is not None:
        if ids.numel() > length:
            raise ValueError(f"expanded sequence has {ids.numel()} tokens > {length=}")
        pad = length - ids.numel()
        ids = torch.cat([ids, ids.new_full((pad,), pad_token_id)])
        mask = torch.cat([mask, mask.new_zeros(pad)])
    return ids, mask
