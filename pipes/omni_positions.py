"""Qwen-Omni mRoPE positions of one sample: from the model (``qwen_omni_position_ids``) and
without it (``qwen_omni_mrope``, for workers), for both Qwen2.5-Omni and Qwen3-Omni.

Re-exported by ``family_qwen_omni`` (where they were first defined).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import Tensor

__all__ = ["qwen_omni_mrope", "qwen_omni_position_ids"]


def qwen_omni_position_ids(sample: Mapping[str, Any], model: Any) -> Tensor:
    """``[3, L]`` mRoPE ids of ONE unshifted sample from the model's own ``get_rope_index``
    (images in 3-D, videos in 3-D with time scaled by ``video_second_per_grid``, audio in time;
    plain ``0..L-1`` on all rows when there is no image or video)."""
    ids = torch.as_tensor(sample["input_ids"]).reshape(1, -1)
    fam = sample.get("feature_attention_mask")
    with torch.no_grad():
        pos, _ = model.model.get_rope_index(
            ids,
            image_grid_thw=sample.get("image_grid_thw"),
            video_grid_thw=sample.get("video_grid_thw"),
            second_per_grids=sample.get("video_second_per_grid"),
            attention_mask=torch.as_tensor(sample["attention_mask"]).reshape(1, -1),
            audio_seqlens=None if fam is None else fam.sum(-1),
        )
    out: Tensor = pos[:, 0, :]
    return out


_FRACTIONAL_TIME: Final = frozenset({"Qwen3OmniMoeProcessor"})
"""Processors whose model keeps a video's temporal ids fractional (Qwen2.5-Omni truncates)."""


def qwen_omni_mrope(sample: Mapping[str, Any], processor: Any) -> Tensor:
    """``[3, L]`` mRoPE ids of ONE unshifted sample WITHOUT the model (for workers).

    Qwen-Omni's ``get_rope_index``: text and audio tokens count up by one on all three rows
    (audio runs in time); an image or a whole video gets its ``t x h x w`` grid (``h``, ``w``
    divided by the merge size) added to the current position, with ``t`` scaled to time:
    ``arange(t) * position_id_per_seconds`` for images (so 0) and ``arange(t) *
    video_second_per_grid * position_id_per_seconds`` for videos (float32, truncated to an
    integer by Qwen2.5-Omni, kept fractional by Qwen3-Omni); the next token starts at the
    block's largest id + 1 (not Qwen2.5-VL's ``start + max(h, w)``, which differs once a video's
    time outruns its width). ``position_id_per_seconds`` is the processor's: the model config
    must use the same. Long ids, or float32 when some Qwen3-Omni video time is fractional.
    Audio interleaved with video (``use_audio_in_video``) is never produced by neatpack. The
    tests check equality with the models' own ``get_rope_index``.

    >>> ids = torch.zeros(8, dtype=torch.long)
    >>> s = {"input_ids": ids, "mm_token_type_ids": torch.tensor([0, 2, 2, 2, 2, 0, 3, 0]),
    ...      "video_grid_thw": torch.tensor([[2, 2, 4]]),
    ...      "video_second_per_grid": torch.tensor([1.0])}  # 2 s per grid step at fps 2
    >>> from neatpack.pipes.family_qwen_omni import load_tiny_qwen_omni_processor
    >>> qwen_omni_mrope(s, load_tiny_qwen_omni_processor()).tolist()  # t step 25 ids per grid
    [[0, 1, 1, 26, 26, 27, 28, 29], [0, 1, 1, 1, 1, 27, 28, 29], [0, 1, 2, 1, 2, 27, 28, 29]]
    """
    mm = torch.as_tensor(sample["mm_token_type_ids"]).reshape(-1)
    keep = torch.as_tensor(sample.get("attention_mask", torch.ones_like(mm))).reshape(-1).bool()
    types = mm[keep].tolist()
    merge = int(processor.image_processor.merge_size)
    pps = processor.position_id_per_seconds
    grids: dict[int, list[list[int]]] = {
        code: [] if g is None else torch.as_tensor(g).tolist()
        for code, g in ((1, sample.get("image_grid_thw")), (2, sample.get("video_grid_thw")))
    }
    seconds = sample.get("video_second_per_grid")
    fractional = type(processor).__name__ in _FRACTIONAL_TIME
    used = {1: 0, 2: 0}
    parts: list[Tensor] = []
    cur = torch.tensor(0.0)
    i = 0
    while i < len(types):
        code, j = types[i], i
        while j < len(types) and types[j] == code:
            j += 1
        if code in (1, 2):
            k = used[code]
            if k >= len(grids[code]):
                raise ValueError(
                    f"sample {sample.get('sample_id')}: more {('image', 'video')[code - 1]} "
                    "blocks than grids"
                )
            t, h, w = (int(x) for x in grids[code][k])
            used[code] += 1
            scale = torch.as_tensor(seconds).float()[k] if code == 2 else torch.tensor(1.0)
            t_idx = torch.arange(t) * scale * pps
            t_idx = t_idx.float() if fractional else t_idx.long().float()
            h, w = h // merge, w // merge
            block = torch.stack([
                t_idx.view(-1, 1).expand(-1, h * w).flatten(),
                torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten().float(),
                torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten().float(),
            ]) + cur  # fmt: skip
            if block.shape[1] != j - i:
                raise ValueError(
                    f"sample {sample.get('sample_id')}: a run of {j - i} media tokens but the "
                    f"grid {[t, h * merge, w * merge]} gives {block.shape[1]}"
                )
        else:
            block = (torch.arange(j - i).float() + cur).expand(3, -1)
        parts.append(block)
        cur = block.max() + 1
        i = j
    pos = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0)
    out = torch.zeros(3, mm.shape[0], dtype=pos.dtype)
    out[:, keep] = pos
    return out.long() if bool((out == out.round()).all()) else out
