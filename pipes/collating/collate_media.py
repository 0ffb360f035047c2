"""The media of a batch: pixels and grids concatenated across packs (or samples), each pack's
images and videos checked against its placeholder tokens, counts per row.

Two packs with 1 and 2 images give ``pixel_values`` = the three images' patch rows in order,
``image_grid_thw`` = their 3 grid rows and ``n_images_per_sample = [1, 2]``; a pack whose
placeholder tokens do not match its grids is a ``ValueError`` naming its sample ids.

>>> merge_media([torch.zeros(4, 3), torch.ones(2, 3)]).shape  # same trailing shape: one tensor
torch.Size([6, 3])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from neatpack.pipes.materializing._tensors import cat_shared

__all__ = [
    "MEDIA_CAT_KEYS",
    "PIXEL_KEYS",
    "check_pack_media",
    "collate_media",
    "media_token_counts",
    "merge_media",
    "pack_sample_ids",
]

PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
MEDIA_CAT_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "image_position_ids")


def merge_media(
    values: Sequence[Any], dtype: torch.dtype | None = None, *, shared: bool = False
) -> Tensor | list[Tensor]:
    """Concatenate pixel tensors on dim 0, or a flat list when their trailing shapes differ.

    A value may be a tensor or a list of per-image tensors (variable resolution). ``dtype``
    casts (the seed always casts to bf16; here float32 is kept unless asked). ``shared`` writes
    the concatenation straight into shared memory (for a loader worker: see ``cat_shared``).
    """
    parts: list[Tensor] = []
    as_list = False
    for v in values:
        if isinstance(v, Tensor):
            parts.append(v)
        else:
            as_list = True
            parts.extend(v)
    if parts and not as_list and all(p.shape[1:] == parts[0].shape[1:] for p in parts):
        # One part: no copy (pixel rows are most of a batch's bytes).
        if len(parts) > 1 and shared:
            return cat_shared(parts, dtype)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out if dtype is None else out.to(dtype)
    return [p if dtype is None else p.to(dtype) for p in parts]


def pack_sample_ids(pack: Mapping[str, Any]) -> list[int]:
    """The pack's ``sample_ids`` as ints (empty when it has none), for error messages and the
    batch's ``sample_ids``."""
    return [int(i) for i in pack.get("sample_ids", [])]


def check_pack_media(
    pack: Mapping[str, Any], row: int, merge: int, tokens_known: tuple[int, int] | None = None
) -> tuple[int, int]:
    """Images / videos in the pack, checked against its placeholder tokens. Raises ValueError.

    ``tokens_known``: the pack's (image, video) placeholder counts when the caller already has
    them (the packed collater counts the whole ``[B, S]`` plane at once instead of 2 passes per
    pack).
    """
    counts = []
    mm = pack.get("mm_token_type_ids")
    for i, (kind, grid_key, pix_key, token_type) in enumerate(
        (
            ("image", "image_grid_thw", "pixel_values", 1),
            ("video", "video_grid_thw", "pixel_values_videos", 2),
        )
    ):
        grid = pack.get(grid_key)
        n = 0 if grid is None else int(grid.shape[0])
        declared = pack.get(f"n_{kind}s")
        if declared is not None and int(declared) != n:
            raise ValueError(
                f"pack {row} (sample_ids={pack_sample_ids(pack)}): n_{kind}s={int(declared)} but "
                f"{grid_key} has {n} rows; rebuild the pack."
            )
        patches = 0 if grid is None else int(grid.long().prod(dim=-1).sum())
        if tokens_known is not None:
            tokens = tokens_known[i]
        else:
            tokens = 0 if mm is None else int((torch.as_tensor(mm) == token_type).sum())
        if mm is None and n:
            raise ValueError(
                f"pack {row} (sample_ids={pack_sample_ids(pack)}) has {n} {kind}(s) but no "
                "mm_token_type_ids; transformers 5 needs them with media."
            )
        if tokens * merge * merge != patches:
            raise ValueError(
                f"pack {row} (sample_ids={pack_sample_ids(pack)}): {tokens} {kind} placeholder "
                f"tokens but {grid_key} implies {patches} patches = {patches // (merge * merge)} "
                f"tokens at spatial_merge_size={merge}; the media and the text disagree."
            )
        pix = pack.get(pix_key)
        if isinstance(pix, Tensor) and pix.dim() == 2 and n and pix.shape[0] != patches:
            raise ValueError(
                f"pack {row} (sample_ids={pack_sample_ids(pack)}): {pix_key} has {pix.shape[0]} "
                f"patch rows but {grid_key} implies {patches}."
            )
        counts.append(n)
    return counts[0], counts[1]


def media_token_counts(mm: Tensor) -> list[tuple[int, int]]:
    """Per row of a CPU ``[B, S]`` mm_token_type_ids: (image tokens, video tokens).

    numpy on a zero-copy view: a text-only batch costs one ``count_nonzero`` pass (~15 us at
    B=4, S=16384, about half of torch's on one thread).
    """
    types = mm.numpy()
    if not np.count_nonzero(types):
        return [(0, 0)] * mm.shape[0]
    images = np.count_nonzero(types == 1, axis=1).tolist()
    videos = np.count_nonzero(types == 2, axis=1).tolist()
    return list(zip(images, videos, strict=True))


def collate_media(
    batch: Sequence[Mapping[str, Any]],
    pixel_dtype: torch.dtype | None,
    merge: int,
    check: bool,
    tokens: Sequence[tuple[int, int]] | None = None,
    *,
    shared: bool = False,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n_img, n_vid = [], []
    for row, pack in enumerate(batch):
        if check:
            i, v = check_pack_media(pack, row, merge, None if tokens is None else tokens[row])
        else:
            i = int(pack.get("n_images") or 0)
            v = int(pack.get("n_videos") or 0)
        n_img.append(i)
        n_vid.append(v)
    for key in PIXEL_KEYS:
        vals = [p[key] for p in batch if p.get(key) is not None]
        if vals:
            out[key] = merge_media(vals, pixel_dtype, shared=shared)
    for key in MEDIA_CAT_KEYS:
        vals = [p[key] for p in batch if p.get(key) is not None]
        if vals:
            out[key] = torch.cat(vals)
    if any(n_img):
        out["n_images_per_sample"] = torch.tensor(n_img, dtype=torch.long)
    if any(n_vid):
        out["n_videos_per_sample"] = torch.tensor(n_vid, dtype=torch.long)
    return out
