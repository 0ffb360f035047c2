"""Idefics3 / SmolVLM-style (``Idefics3Processor`` / ``Idefics3ForConditionalGeneration``).

What differs from the default path:

* image tokens: each image is split into up to ``rows x cols`` tiles of ``max_image_size`` plus a
  global tile; every tile is ``image_seq_len`` ``<image>`` tokens wrapped in
  ``<fake_token_around_image>`` and ``<row_r_col_c>`` / ``<global-img>`` tags. The processor's
  ``_get_num_multimodal_tokens`` gives the whole block length and the tile count; the ``<image>``
  count is ``image_seq_len * tiles`` (``idefics3_image_tokens``), the block length feeds the
  estimate (``idefics3_estimate``);
* labels: the template writes ``<|im_start|>Assistant: answer``, so the markers are derived by
  rendering (``idefics3_markers``; the ``<|im_start|>`` fast path would look for
  ``<|im_start|>assistant\n`` and find nothing); the space merges into the answer's first BPE
  token, so the derived start marker ends in a bare space token and the merged token (it carries
  content) is labelled (``labels.RoleMarkers.start_tail_alternatives``);
* media keys: ``pixel_values`` / ``pixel_attention_mask`` are ``[1, tiles, 3, H, W]`` per sample;
  a pack concatenates them on the tile axis (``idefics3_pack_media``; the model drops all-zero
  padding tiles and scatters the tiles' features over the ``<image>`` tokens in order);
* positions are 1-D and attention causal: a packed row needs only the block-causal mask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from neatpack.pipes.materializing.labels import RoleMarkers, derive_role_markers

from ._shared import images_meta_estimate
from .chat_template import tokenize_default
from .registry import Handler, register_handler

__all__ = [
    "IDEFICS3_HANDLER",
    "idefics3_estimate",
    "idefics3_image_tokens",
    "idefics3_markers",
    "idefics3_pack_media",
    "tokenize_idefics3",
]

_MARKERS: dict[int, tuple[Any, RoleMarkers]] = {}


def idefics3_image_tokens(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """``<image>`` tokens per image (``image_seq_len`` per tile) from ``(height, width)``."""
    if not sizes:
        return []
    data = processor._get_num_multimodal_tokens(image_sizes=[list(s) for s in sizes])
    return [int(processor.image_seq_len) * int(n) for n in data.num_image_patches]


def _count(processor: Any, images: list[Any]) -> int:
    return sum(idefics3_image_tokens(processor, [(im.height, im.width) for im in images]))


def _block_tokens(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Each image's whole block (tags and ``<image>`` tokens), the processor's own count."""
    data = processor._get_num_multimodal_tokens(image_sizes=[list(s) for s in sizes])
    return [int(b) for b in data.num_image_tokens]


def idefics3_markers(processor: Any) -> RoleMarkers:
    """Markers derived from the template by rendering (cached per processor). The template uses
    ``<|im_start|>``, so ``labels.resolve_role_markers`` would take its Qwen fast path
    (``<|im_start|>assistant\n``) and find no turn: the role here is ``Assistant:``."""
    hit = _MARKERS.get(id(processor))
    if hit is not None and hit[0] is processor:
        return hit[1]
    markers = derive_role_markers(processor)
    if len(_MARKERS) >= 16:  # bounded: the cache keeps its processors alive
        _MARKERS.clear()
    _MARKERS[id(processor)] = (processor, markers)
    return markers


def tokenize_idefics3(record: Mapping[str, Any], processor: Any, **options: Any) -> dict[str, Any]:
    """The default path with derived markers and the Idefics3 tile rule; images only."""
    options.setdefault("image_token_count", _count)
    options.setdefault("markers", idefics3_markers(processor))
    return tokenize_default(record, processor, modalities=frozenset({"image"}), **options)


def idefics3_estimate(record: Mapping[str, Any], processor: Any, *, mode: str = "exact") -> int:
    """Length after the shift: the text (``LengthEstimator`` in ``mode``, the ``<image>``
    placeholder excluded) plus each image's whole block from ``record["images_meta"]``."""
    return images_meta_estimate(record, processor, _block_tokens, mode=mode)


def idefics3_pack_media(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``pixel_values`` / ``pixel_attention_mask`` ``[1, all tiles, ...]`` for one pack, in
    document order. Empty dict when no document has images."""
    have = [s for s in samples if s.get("pixel_values") is not None]
    if not have:
        return {}
    return {
        "pixel_values": torch.cat([s["pixel_values"] for s in have], dim=1),
        "pixel_attention_mask": torch.cat([s["pixel_attention_mask"] for s in have], dim=1),
    }


IDEFICS3_HANDLER = register_handler(
    Handler(
        "idefics3",
        tokenize_idefics3,
        modalities=frozenset({"image"}),
        pack_media=idefics3_pack_media,
        description="Idefics3 / SmolVLM-style tiles: image_seq_len per tile; packs need "
        "idefics3.idefics3_pack_media (tiles on axis 1)",
        estimate=idefics3_estimate,
        media_axis=1,
    ),
    ("Idefics3Processor",),
)
