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

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from neatpack.pipes.tiny_family_models import init_tiny_model

from . import Handler, register_handler
from ._shared import images_meta_estimate
from .chat_template import tokenize_default

__all__ = [
    "LLAVA_ONEVISION_HANDLER",
    "llava_onevision_estimate",
    "llava_onevision_image_tokens",
    "llava_onevision_pack_media",
    "load_tiny_llava_onevision_processor",
    "tiny_llava_onevision_model",
    "tokenize_llava_onevision",
]

_FOLDER = Path(__file__).resolve().parents[1] / "_assets" / "processors" / "llava_onevision"


def load_tiny_llava_onevision_processor() -> Any:
    """The shipped tiny ``LlavaOnevisionProcessor`` (built by
    ``scripts/build_tiny_family_processors.py``)."""
    if not (_FOLDER / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny LLaVA-OneVision processor missing in {_FOLDER}; rebuild it with "
            "`python scripts/build_tiny_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_FOLDER), local_files_only=True)  # type: ignore[no-untyped-call]


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


def tiny_llava_onevision_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``LlavaOnevisionForConditionalGeneration`` for the tiny processor
    (SigLIP tower 28 px / patch 7 -> 16 features per tile, Qwen2 text, 1-D positions)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    tok = processor.tokenizer
    side = int(processor.image_processor.size["height"])
    cfg = LlavaOnevisionConfig(
        text_config={
            "model_type": "qwen2", "vocab_size": len(tok), "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 4096,
            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
        },
        vision_config={
            "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": side,
            "patch_size": 7,
        },
        image_token_index=int(processor.image_token_id),
        video_token_index=int(processor.video_token_id),
        image_grid_pinpoints=[list(p) for p in processor.image_processor.image_grid_pinpoints],
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        vision_feature_layer=-1,
        vision_aspect_ratio=processor.vision_aspect_ratio,
    )  # fmt: skip
    return init_tiny_model(LlavaOnevisionForConditionalGeneration, cfg, seed=seed, attn=attn)


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
