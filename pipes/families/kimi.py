"""Kimi K2.5 (``Kimi_K25Processor`` / ``Kimi_K25ForConditionalGeneration``): pre-expanded image
tokens and fixed-length rows for pipeline parallelism.

What differs from the default path, and what does not:

* tokenization IS the processor-agnostic default (``registry`` handler ``kimi_k25`` =
  ``chat_template.tokenize_default``): labels from the derived
  ``<|im_assistant|>assistant<|im_middle|>`` ... ``<|im_end|>`` markers, images only (a video or
  audio block is a ``SampleError`` naming the sample; the video path is not done);
* pre-expanded image tokens: the chat template writes ONE ``<|media_pad|>`` per image and the
  real processor expands it to ``N = t * (h // 2) * (w // 2)`` tokens from ``image_grid_thw``
  (``kimi_k25_image_tokens``), exactly the number of features the model's
  ``get_image_features`` returns for that image, so a row's length is known before the model
  runs (the seed's ``kimi_k25_vl_collate_fn`` expands in the collate for the same reason;
  ``collate.expand_image_tokens`` still does that for one-placeholder ids)::

      200x90 image, tiny processor (at most 8 patches a side): resized 112x50, padded to
      112x56 (multiple of 14 * 2); grid [1, 4, 8] -> 4 // 2 * 8 // 2 = 8 <|media_pad|> tokens,
      32 patch rows of [3, 14, 14]

* a packed row needs ``pixel_values`` AND ``image_grid_thw`` in document order
  (``kimi_k25_pack_media``); positions are 1-D (DeepSeek-V3 text), the mask block-causal;
* fixed-length rows (``kimi_k25_fixed_length_batch``): every packed row is padded to exactly
  ``max_length`` (pad id, label -100, document id 0); a longer row is a ``ValueError`` naming its
  sample ids (``collate.neat_packed_vlm_collater``'s own check, reused).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from neatpack.pipes.tiny_family_models import init_tiny_model

from . import Handler, register_handler
from .chat_template import default_estimate, tokenize_default

__all__ = [
    "KIMI_K25_HANDLER",
    "kimi_k25_fixed_length_batch",
    "kimi_k25_image_tokens",
    "kimi_k25_pack_media",
    "load_tiny_kimi_k25_processor",
    "tiny_kimi_k25_model",
]

_FOLDER = Path(__file__).resolve().parents[1] / "_assets" / "processors" / "kimi_k25"


def load_tiny_kimi_k25_processor() -> Any:
    """The shipped tiny ``Kimi_K25Processor`` (``scripts/build_tiny_crop_family_processors.py``)."""
    if not (_FOLDER / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Kimi K2.5 processor missing in {_FOLDER}; rebuild it with "
            "`python scripts/build_tiny_crop_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_FOLDER), local_files_only=True)  # type: ignore[no-untyped-call]


def kimi_k25_image_tokens(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """``<|media_pad|>`` tokens per image of ``(height, width)``: the processor's own
    ``_get_num_multimodal_tokens`` (patches of the navit-resized, padded image // merge**2)."""
    if not sizes:
        return []
    data = processor._get_num_multimodal_tokens(image_sizes=[list(s) for s in sizes])
    return [int(n) for n in data.num_image_tokens]


def kimi_k25_pack_media(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``pixel_values`` (patch rows) and ``image_grid_thw`` of one pack, in document order; the
    model splits the features per image by the grid. Empty dict when no document has images."""
    have = [s for s in samples if s.get("pixel_values") is not None]
    if not have:
        return {}
    return {
        "pixel_values": torch.cat([s["pixel_values"] for s in have]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in have]),
    }


def kimi_k25_fixed_length_batch(
    rows: Sequence[Sequence[Mapping[str, Any]]],
    processor: Any,
    *,
    max_length: int,
    mask_format: str = "eager",
) -> dict[str, Any]:
    """One batch of packed rows, each padded to exactly ``max_length`` tokens (after the shift).

    ``rows``: per row, its UNSHIFTED samples. Every stage of a pipeline then sees ``[B,
    max_length]`` whatever the images, because the image tokens are already expanded. Padding:
    the tokenizer's pad id, label -100, document id 0. A row longer than ``max_length`` is a
    ``ValueError`` naming the row's sample ids (plan with ``capacity <= max_length``). Media
    keys: ``pixel_values`` / ``image_grid_thw`` concatenated over the rows and
    ``n_images_per_sample`` (per row), ready for ``pp_media.prepare_vlm_media_for_pp``.
    """
    from neatpack.pipes.collate import neat_packed_vlm_collater
    from neatpack.pipes.pack import build_pack

    pad = getattr(processor.tokenizer, "pad_token_id", None)
    pad_id = 0 if pad is None else int(pad)
    packs = [build_pack(list(r), padding_idx=pad_id) for r in rows]  # type: ignore[arg-type]
    merge = int(processor.image_processor.merge_size)
    return neat_packed_vlm_collater(
        packs,
        padding_idx=pad_id,
        max_length=max_length,
        mask_format=mask_format,
        spatial_merge_size=merge,
    )


def tiny_kimi_k25_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``Kimi_K25ForConditionalGeneration`` for the tiny processor: a 2-layer
    32-wide MoonViT (patch 14, merge 2x2) and a 2-layer DeepSeek-V3 text model (MLA attention,
    one dense layer then 4 routed experts, top-2); about 0.4 M parameters, 1-D positions."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    tok = processor.tokenizer
    cfg = Kimi_K25Config(
        text_config={"model_type": "deepseek_v3", "vocab_size": len(tok), "hidden_size": 64,
                     "intermediate_size": 128, "moe_intermediate_size": 32,
                     "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1,
                     "topk_group": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
                     "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 4096,
                     "pad_token_id": tok.pad_token_id, "bos_token_id": None,
                     "eos_token_id": tok.eos_token_id},
        vision_config={"patch_size": int(processor.image_processor.patch_size),
                       "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "pos_emb_height": 8, "pos_emb_width": 8,
                       "pos_emb_time": 4},
        projection_hidden_size=32,
        image_token_id=int(processor.image_token_id),
        video_token_id=int(processor.video_token_id),
        vision_start_token_id=int(tok.convert_tokens_to_ids("<|media_begin|>")),
        vision_end_token_id=int(tok.convert_tokens_to_ids("<|media_end|>")),
    )  # fmt: skip
    return init_tiny_model(Kimi_K25ForConditionalGeneration, cfg, seed=seed, attn=attn)


KIMI_K25_HANDLER = register_handler(
    Handler(
        "kimi_k25",
        tokenize_default,
        modalities=frozenset({"image"}),
        pack_media=kimi_k25_pack_media,
        description="Kimi K2.5: the default path, images pre-expanded by the processor to "
        "(h // 2) * (w // 2) tokens from image_grid_thw; packs need "
        "kimi.kimi_k25_pack_media (pixels + grids)",
        estimate=default_estimate,
    ),
    ("Kimi_K25Processor",),
)
