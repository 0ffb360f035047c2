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

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .chat_template import default_estimate, tokenize_default
from .registry import Handler, register_handler

__all__ = [
    "KIMI_K25_HANDLER",
    "kimi_k25_fixed_length_batch",
    "kimi_k25_image_tokens",
    "kimi_k25_pack_media",
]


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
    from neatpack.pipes.collating.collate import neat_packed_vlm_collater
    from neatpack.pipes.materializing.pack import build_pack

    pad = getattr(processor.tokenizer, "pad_token_id", None)
    pad_id = 0 if pad is None else int(pad)
    packs = [build_pack(list(r), padding_idx=pad_id) for r in rows]  # type: ignore[arg-type]
    merge = int(processor.image_processor.merge_size)
    batch: dict[str, Any] = neat_packed_vlm_collater(
        packs,
        padding_idx=pad_id,
        max_length=max_length,
        mask_format=mask_format,
        spatial_merge_size=merge,
    )
    return batch


KIMI_K25_HANDLER = register_handler(
    Handler(
        "kimi_k25",
        tokenize_default,
        min_transformers="5.13",  # Kimi_K25Processor is new in 5.13
        modalities=frozenset({"image"}),
        pack_media=kimi_k25_pack_media,
        description="Kimi K2.5: the default path, images pre-expanded by the processor to "
        "(h // 2) * (w // 2) tokens from image_grid_thw; packs need "
        "kimi.kimi_k25_pack_media (pixels + grids)",
        estimate=default_estimate,
    ),
    ("Kimi_K25Processor",),
)
