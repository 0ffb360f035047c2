"""LLaVA-OneVision (``LlavaOnevisionProcessor`` / ``LlavaOnevisionForConditionalGeneration``).

What differs from the default path:

* image tokens: the images of a sample go to the processor as a flat list (as the seed's
  ``llava_onevision_collate_fn`` does), so the processor treats each as a single image: AnyRes
  tiles chosen from ``image_grid_pinpoints``, unpadded features plus a newline per row
  (``_get_number_of_features``), and returns ``batch_num_images = [1] * n``.
  ``llava_onevision_image_tokens`` is that rule from ``(height, width)`` (the processor's
  ``_get_num_multimodal_tokens``), checked per sample and used by ``llava_onevision_estimate``;
* media keys: ``pixel_values`` is ``[n_images, n_tiles, 3, H, W]`` with ``n_tiles`` padded to the
  most tiled image of the processor call, and the model needs ``image_sizes`` and
  ``batch_num_images`` (which decides AnyRes vs. base tile per image group).
  ``llava_onevision_pack_media`` builds them for a pack: tiles zero-padded to the pack's most
  tiled image (the model slices each image's own tile count from ``image_sizes``),
  ``image_sizes`` and ``batch_num_images`` concatenated in document order;
* positions are 1-D and attention is causal: a packed row needs only the block-causal mask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._shared import images_meta_estimate
from .chat_template import tokenize_default
from .registry import Handler, register_handler

__all__ = [
    "LLAVA_ONEVISION_HANDLER",
    "llava_onevision_estimate",
    "llava_onevision_image_tokens",
    "llava_onevision_pack_media",
    "tokenize_llava_onevision",
]


def llava_onevision_image_tokens(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Image tokens per image from the images' ``(height, width)`` (each image AnyRes)."""
    if not sizes:
        return []
    data = processor._get_num_multimodal_tokens(image_sizes=[list(s) for s in sizes])
    return [int(n) for n in data.num_image_tokens]


def _count(processor: Any, images: list[Any]) -> int:
    return sum(llava_onevision_image_tokens(processor, [(im.height, im.width) for im in images]))


def tokenize_llava_onevision(
    record: Mapping[str, Any], processor: Any, **options: Any
) -> dict[str, Any]:
    """The default path with LLaVA-OneVision's image-token rule; images only (video not done)."""
    options.setdefault("image_token_count", _count)
    return tokenize_default(record, processor, modalities=frozenset({"image"}), **options)


def llava_onevision_estimate(
    record: Mapping[str, Any], processor: Any, *, mode: str = "exact"
) -> int:
    """Length after the shift: the text (``LengthEstimator`` in ``mode``, media placeholders
    excluded) plus the image tokens from ``record["images_meta"]`` (``[height, width]`` each)."""
    return images_meta_estimate(record, processor, llava_onevision_image_tokens, mode=mode)


def llava_onevision_pack_media(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``pixel_values`` / ``image_sizes`` / ``batch_num_images`` for the documents of one pack,
    in document order (module docstring). Empty dict when no document has images."""
    pvs = [s["pixel_values"] for s in samples if s.get("pixel_values") is not None]
    if not pvs:
        return {}
    tiles = max(int(p.shape[1]) for p in pvs)
    padded = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, tiles - p.shape[1])) for p in pvs]
    return {
        "pixel_values": torch.cat(padded, dim=0),
        "image_sizes": torch.cat(
            [s["image_sizes"] for s in samples if s.get("pixel_values") is not None], dim=0
        ),
        "batch_num_images": torch.cat(
            [s["batch_num_images"] for s in samples if s.get("pixel_values") is not None]
        ).long(),
    }


LLAVA_ONEVISION_HANDLER = register_handler(
    Handler(
        "llava_onevision",
        tokenize_llava_onevision,
        modalities=frozenset({"image"}),
        pack_media=llava_onevision_pack_media,
        description="LLaVA-OneVision: AnyRes image-token rule; packs need "
        "llava_onevision.llava_onevision_pack_media (image_sizes, batch_num_images)",
        estimate=llava_onevision_estimate,
    ),
    ("LlavaOnevisionProcessor",),
)
