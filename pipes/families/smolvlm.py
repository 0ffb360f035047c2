"""SmolVLM (``SmolVLMProcessor`` / ``SmolVLMForConditionalGeneration``): Idefics3's layout, one gap.

SmolVLM writes exactly Idefics3's image blocks (tiles of ``image_seq_len`` ``<image>`` tokens in
``<fake_token_around_image>`` + ``<row_r_col_c>`` / ``<global-img>`` tags), takes the same media
keys (``pixel_values`` / ``pixel_attention_mask`` ``[1, tiles, ...]``) and the same template, so
labels (derived ``Assistant:`` markers), packs (``idefics3.idefics3_pack_media``) and the
block-causal packed mask are Idefics3's. What differs: ``SmolVLMProcessor`` has no
``_get_num_multimodal_tokens``, which the ``idefics3`` handler counts with (it fails with an
``AttributeError``). Here the tile layout comes from the image processor's own
``get_number_of_image_patches`` (tiles incl. the global one, rows, cols) and the block text from
the processor's own ``replace_image_token``::

    60x40 image, 28 px tiles, longest edge 56: 2 x 2 tiles + global = 5 x 4 = 20 <image>,
    block = 4 x (fake + row_col + 4) + 2 newlines + "\\n" + fake + global + 4 + fake = 33 tokens

The processor imports ``num2words`` (a test-only extra for neatpack); images only here (SmolVLM
video frames: not done).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._shared import images_meta_estimate
from .idefics3 import idefics3_pack_media, tokenize_idefics3
from .registry import Handler, register_handler

__all__ = [
    "SMOLVLM_HANDLER",
    "smolvlm_estimate",
    "smolvlm_image_block_tokens",
    "smolvlm_image_tokens",
    "tokenize_smolvlm",
]


def _layouts(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    ip = processor.image_processor
    return [tuple(int(v) for v in ip.get_number_of_image_patches(int(h), int(w))) for h, w in sizes]  # type: ignore[misc]


def smolvlm_image_tokens(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """``<image>`` tokens per image of ``(height, width)``: ``image_seq_len`` per tile (the
    global tile included)."""
    return [int(processor.image_seq_len) * n for n, _, _ in _layouts(processor, sizes)]


def smolvlm_image_block_tokens(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Every token of each image's block, from the processor's own ``replace_image_token``."""
    tok = processor.tokenizer
    out = []
    for _, rows, cols in _layouts(processor, sizes):
        text = processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
        out.append(len(tok(text, add_special_tokens=False)["input_ids"]))
    return out


def _count(processor: Any, images: list[Any]) -> int:
    return sum(smolvlm_image_tokens(processor, [(im.height, im.width) for im in images]))


def tokenize_smolvlm(record: Mapping[str, Any], processor: Any, **options: Any) -> dict[str, Any]:
    """``idefics3.tokenize_idefics3`` with the count from ``smolvlm_image_tokens``."""
    options.setdefault("image_token_count", _count)
    return tokenize_idefics3(record, processor, **options)


def smolvlm_estimate(record: Mapping[str, Any], processor: Any, *, mode: str = "exact") -> int:
    """Length after the shift: the text (``LengthEstimator`` in ``mode``, the ``<image>``
    placeholder excluded) plus each image's whole block from ``record["images_meta"]``."""
    return images_meta_estimate(record, processor, smolvlm_image_block_tokens, mode=mode)


SMOLVLM_HANDLER = register_handler(
    Handler(
        "smolvlm",
        tokenize_smolvlm,
        modalities=frozenset({"image"}),
        pack_media=idefics3_pack_media,
        description="SmolVLM: Idefics3's tiles and markers, token count from the image "
        "processor's layout (no _get_num_multimodal_tokens; pipes/families/smolvlm.py)",
        estimate=smolvlm_estimate,
        media_axis=1,
    ),
    ("SmolVLMProcessor",),
)
