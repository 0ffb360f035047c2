"""What a family Sample carries besides its tokens, and the glue the pack step needs per family.

A Sample of a non-Qwen-VL family (``families`` handlers ``gemma3``, ``llava_onevision``,
``idefics3``, ``chat_template`` for InternVL, ``qwen_omni``, ``qwen3_omni`` ...) holds its media
in the processor's own layout: Gemma 3 ``pixel_values [n, 3, H, W]``, LLaVA-OneVision
``[n, tiles, 3, H, W]`` + ``image_sizes`` + ``batch_num_images``, Idefics3 ``[1, tiles, 3, H, W]`` +
``pixel_attention_mask``, Qwen2.5-Omni patch rows + ``image_grid_thw`` + ``input_features`` +
``feature_attention_mask``. Those layouts cannot be concatenated blindly (tile axes differ), so
the pack step keeps them per sample (``pack["media_samples"]``, in document order) and the
collater merges the whole batch's samples at once with the family's ``Handler.pack_media``
(``collate_family.py``)::

    sample 17  {"input_ids": ..., "labels": ..., "pixel_values": [1, 3, 3, 28, 28],
                "image_sizes": [[40, 60]], "batch_num_images": [1]}
    split_media -> tokens {"input_ids", "labels", ...}
                   media  {"pixel_values", "image_sizes", "batch_num_images"}

>>> import torch
>>> tokens, media = split_media({"sample_id": 3, "input_ids": torch.tensor([1, 2]),
...                              "token_type_ids": torch.tensor([0, 0]),
...                              "pixel_values": torch.zeros(1, 3, 4, 4)})
>>> sorted(tokens), sorted(media)
(['input_ids', 'sample_id', 'token_type_ids'], ['pixel_values'])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["TOKEN_KEYS", "PositionsFn", "media_after", "split_media"]

#: ``[3, L]`` positions of one unshifted sample (a family's ``Handler.positions`` bound to the
#: processor, or the Qwen-VL ``MRopeConfig`` rule)
PositionsFn = Callable[[Mapping[str, Any]], Tensor]

#: Sample keys that are per token (or bookkeeping), never media.
TOKEN_KEYS: frozenset[str] = frozenset(
    {
        "sample_id",
        "input_ids",
        "labels",
        "attention_mask",
        "mm_token_type_ids",
        "token_type_ids",
        "position_ids",
        "text_position_ids",
    }
)


def split_media(sample: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tokens, media)``: the sample's per-token keys and its media keys (by reference)."""
    tokens: dict[str, Any] = {}
    media: dict[str, Any] = {}
    for key, value in sample.items():
        if key in TOKEN_KEYS or value is None:
            tokens[key] = value
        else:
            media[key] = value
    return tokens, media


def media_after(sample: Mapping[str, Any], cut: int) -> bool:
    """Whether an UNSHIFTED sample has a media token (``mm_token_type_ids != 0``) at or after
    token ``cut``: cutting it there would leave media tensors without their tokens."""
    mm = sample.get("mm_token_type_ids")
    if mm is None:
        return False
    return bool(torch.as_tensor(mm).reshape(-1)[cut:].any())
