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

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from neatpack.pipes.labels import RoleMarkers, derive_role_markers
from neatpack.pipes.tiny_family_models import init_tiny_model

from . import Handler, register_handler
from ._shared import images_meta_estimate
from .chat_template import tokenize_default

__all__ = [
    "IDEFICS3_HANDLER",
    "idefics3_estimate",
    "idefics3_image_tokens",
    "idefics3_markers",
    "idefics3_pack_media",
    "load_tiny_idefics3_processor",
    "tiny_idefics3_model",
    "tokenize_idefics3",
]

_FOLDER = Path(__file__).resolve().parents[1] / "_assets" / "processors" / "idefics3"
_MARKERS: dict[int, tuple[Any, RoleMarkers]] = {}


def load_tiny_idefics3_processor() -> Any:
    """The shipped tiny ``Idefics3Processor`` (``scripts/build_tiny_family_processors.py``)."""
    if not (_FOLDER / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Idefics3 processor missing in {_FOLDER}; rebuild it with "
            "`python scripts/build_tiny_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_FOLDER), local_files_only=True)  # type: ignore[no-untyped-call]


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


def tiny_idefics3_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``Idefics3ForConditionalGeneration`` for the tiny processor (28 px
    tiles, patch 7, pixel shuffle 2 -> ``image_seq_len`` 4; Llama text, 1-D positions)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    return tiny_tile_model(
        processor, Idefics3Config, Idefics3ForConditionalGeneration, seed=seed, attn=attn
    )


def tiny_tile_model(
    processor: Any, config_cls: Any, model_cls: Any, *, seed: int = 0, attn: str = "eager"
) -> Any:
    """The tiny Idefics3-layout model as ``model_cls(config_cls(...))``: Idefics3 and SmolVLM
    take the same config fields (SmolVLM is Idefics3's architecture under another name)."""
    tok = processor.tokenizer
    side = int(processor.image_processor.max_image_size["longest_edge"])
    cfg = config_cls(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": side, "patch_size": 7},
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "max_position_embeddings": 4096,
                     "pad_token_id": tok.pad_token_id},
        image_token_id=int(processor.image_token_id),
        scale_factor=2,
    )  # fmt: skip
    return init_tiny_model(model_cls, cfg, seed=seed, attn=attn)


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
