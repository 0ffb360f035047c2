"""Gemma 3 (``Gemma3Processor`` / ``Gemma3ForConditionalGeneration``): what really differs.

* Tokenization is the processor-agnostic default (``chat_template.tokenize_default``): labels
  from the ``<start_of_turn>model\\n`` ... ``<end_of_turn>`` markers derived from the template,
  ``<image_soft_token>`` as the image token (``processor.image_token_ids``), ``image_seq_length``
  tokens per image, or per crop with pan-and-scan (``gemma3_pan_and_scan`` below). Images only: a
  video or audio block is a ``SampleError`` naming the sample.
* Attention: Gemma 3 lets the soft tokens of ONE image attend to each other in both directions
  (``token_type_ids == 1`` runs, ``modeling_gemma3.get_block_sequence_ids_for_mask``). A packed
  row therefore needs ``gemma3_packed_mask``: block-causal per document plus bidirectional
  within each image run, handed to the model as ``{"full_attention": m, "sliding_attention": m}``
  (valid while the row is shorter than ``sliding_window``; ``gemma3_packed_mask`` checks it).
* Positions are 1-D (no mRoPE): the pack's ``text_position_ids``.
* Length: ``Gemma3LengthEstimator``: the text estimate of ``LengthEstimator`` plus the exact
  per-image expansion (``"\\n\\n<start_of_image>" + soft * image_seq_length``
  ``+ "<end_of_image>\\n\\n"``; with pan-and-scan the processor's own "Here is the original
  image ..." text and one such run per crop); ``mode="exact"`` tokenizes the expanded templated
  text, so it equals the real length.

Pan-and-scan (``gemma3_pan_and_scan(processor)``): an image whose aspect ratio reaches
``min_ratio_to_activate`` is also cut into 2..``max_num_crops`` crops along its long side, each
crop resized to the full image size and given its own soft-token run after the thumbnail's::

    140x56 image, min_crop_size=28, image_seq_length=4   ->  num_crops = 2
    "Here is the original image \\n\\n<boi>SSSS<eoi>\\n\\n and here are some crops to help you
     see better \\n\\n<boi>SSSS<eoi>\\n\\n \\n\\n<boi>SSSS<eoi>\\n\\n"    pixel_values rows: 1 + 2

>>> import torch
>>> m = gemma3_packed_mask(torch.tensor([[1, 1, 1, 2, 2]]), torch.tensor([[0, 1, 1, 0, 0]]))
>>> m[0, 0].eq(0).int().tolist()  # the two image tokens (1, 2) see each other
[[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from neatpack.pipes.collating.mask import to_4d_additive_mask
from neatpack.pipes.indexing._media_meta import (
    EstimateError,
    aligned_meta,
    image_hw,
    positive_meta,
    record_media,
)
from neatpack.pipes.indexing.estimate import LengthEstimator, SampleEstimate

from .chat_template import tokenize_default
from .processor_compat import set_call_defaults
from .registry import Handler, register_handler

__all__ = [
    "GEMMA3_HANDLER",
    "Gemma3LengthEstimator",
    "PanAndScan",
    "gemma3_estimator",
    "gemma3_image_tokens",
    "gemma3_num_crops",
    "gemma3_pack_media",
    "gemma3_packed_mask",
    "gemma3_packed_masks",
    "gemma3_pan_and_scan",
    "gemma3_pan_and_scan_settings",
    "gemma3_soft_tokens",
    "tokenize_gemma3",
]


def gemma3_image_tokens(processor: Any) -> int:
    """Tokens one image adds to the row (its ``<start_of_image>`` placeholder excluded)."""
    tok = processor.tokenizer
    ids = tok(processor.full_image_sequence, add_special_tokens=False)["input_ids"]
    return len(ids) - 1


class PanAndScan(NamedTuple):
    """The processor's effective pan-and-scan settings (``Gemma3Processor.images_kwargs``)."""

    min_crop_size: int
    max_num_crops: int
    min_ratio_to_activate: float


def gemma3_pan_and_scan(
    processor: Any,
    *,
    min_crop_size: int = 256,
    max_num_crops: int = 4,
    min_ratio_to_activate: float = 1.2,
) -> Any:
    """Turn pan-and-scan on for ``processor`` (returned, changed in place).

    transformers merges ``Gemma3Processor.images_kwargs`` (``do_pan_and_scan=False``...) OVER the
    image processor's own attributes, so setting ``image_processor.do_pan_and_scan = True`` is
    silently ignored; the processor's ``images_kwargs`` is what every call (and this module's
    token counts and estimator) reads. transformers 5.17 reads its class's
    ``valid_processor_kwargs._defaults`` instead: ``processor_compat.set_call_defaults`` writes
    both, and ``tokenize_gemma3`` also passes the settings with each call (what 5.0 honours).
    Defaults are the processor's (crops of >= 256 pixels)."""
    if min_crop_size < 1 or max_num_crops < 2 or not min_ratio_to_activate >= 1.0:
        raise ValueError(
            f"pan-and-scan needs {min_crop_size=} >= 1, {max_num_crops=} >= 2 and "
            f"{min_ratio_to_activate=} >= 1.0"
        )
    return set_call_defaults(
        processor,
        "images_kwargs",
        {
            "do_pan_and_scan": True,
            "pan_and_scan_min_crop_size": int(min_crop_size),
            "pan_and_scan_max_num_crops": int(max_num_crops),
            "pan_and_scan_min_ratio_to_activate": float(min_ratio_to_activate),
        },
    )


def gemma3_pan_and_scan_settings(processor: Any) -> PanAndScan | None:
    """``PanAndScan`` when the processor's calls crop images, else None."""
    kw = getattr(processor, "images_kwargs", None) or {}
    if not kw.get("do_pan_and_scan"):
        return None
    return PanAndScan(
        int(kw["pan_and_scan_min_crop_size"]),
        int(kw["pan_and_scan_max_num_crops"]),
        float(kw["pan_and_scan_min_ratio_to_activate"]),
    )


def _pan_and_scan_kwargs(pas: PanAndScan) -> dict[str, Any]:
    return {
        "do_pan_and_scan": True,
        "pan_and_scan_min_crop_size": pas.min_crop_size,
        "pan_and_scan_max_num_crops": pas.max_num_crops,
        "pan_and_scan_min_ratio_to_activate": pas.min_ratio_to_activate,
    }


def gemma3_num_crops(processor: Any, height: int, width: int) -> int:
    """Crops the processor cuts from a ``height`` x ``width`` image (0: thumbnail only).

    Runs the image processor's own ``pan_and_scan_batched`` on an EMPTY ``[0, h, w]`` tensor:
    it reads only the shape, so the rule is the library's, at no pixel cost."""
    pas = gemma3_pan_and_scan_settings(processor)
    if pas is None:
        return 0
    return _num_crops(processor.image_processor, int(height), int(width), pas)


def _num_crops(ip: Any, height: int, width: int, pas: PanAndScan) -> int:
    fn = getattr(ip, "pan_and_scan_batched", None)
    if fn is None:
        raise ValueError(
            f"{type(ip).__name__} has no pan_and_scan_batched (the PIL backend); install "
            "torchvision so AutoProcessor picks Gemma3ImageProcessor"
        )
    return len(fn(torch.empty(0, height, width), *pas))


def gemma3_image_text(processor: Any, num_crops: int) -> str:
    """The text one image (with ``num_crops`` crops) expands to: the processor's own
    ``replace_image_token`` (no copy of its layout)."""
    return str(processor.replace_image_token({"num_crops": [int(num_crops)]}, 0))


def gemma3_soft_tokens(processor: Any, images: list[Any]) -> int:
    """Soft tokens of ``images`` (PIL): ``image_seq_length`` per image and per crop (the
    ``image_token_count`` check of ``tokenize_default``; the processor's own
    ``_get_num_multimodal_tokens`` ignores crops)."""
    crops = sum(gemma3_num_crops(processor, im.height, im.width) for im in images)
    return int(processor.image_seq_length) * (len(images) + crops)


def tokenize_gemma3(record: Mapping[str, Any], processor: Any, **options: Any) -> dict[str, Any]:
    """The default path, images only, soft tokens checked per crop (``gemma3_soft_tokens``)."""
    options.setdefault("image_token_count", gemma3_soft_tokens)
    pas = gemma3_pan_and_scan_settings(processor)
    if pas is not None:  # call-time kwargs win on every 5.x (5.0 reads no stored default)
        options.setdefault("call_kwargs", {"images_kwargs": _pan_and_scan_kwargs(pas)})
    return tokenize_default(record, processor, modalities=frozenset({"image"}), **options)


@dataclass(frozen=True, kw_only=True)
class Gemma3LengthEstimator(LengthEstimator):
    """``LengthEstimator`` with Gemma 3's image expansion (crops counted from each image's
    ``images_meta`` ``[height, width]`` or file header when ``pan_and_scan`` is set).

    ``mode="exact"`` renders the template, expands every ``<start_of_image>`` as the processor
    does and tokenizes the result once: equal to the real length. An image without a size under
    pan-and-scan counts as uncropped and is listed in ``fallbacks`` ("image_no_size")."""

    pan_and_scan: PanAndScan | None = None

    def estimate_sample(self, record: Mapping[str, Any]) -> SampleEstimate:
        if self.mode != "exact":
            return super().estimate_sample(record)
        sid = int(record.get("sample_id", -1))
        conv = record.get("conversation")
        if not conv:
            raise EstimateError(f"sample_id={sid}: empty conversation; nothing to estimate")
        crops, reasons = self._crops(record)
        proc = self.processor
        parts = proc.apply_chat_template(conv, tokenize=False).split(proc.boi_token)
        if len(parts) - 1 != len(crops):
            raise EstimateError(
                f"sample_id={sid}: the template renders {len(parts) - 1} image placeholder(s) "
                f"for {len(crops)} image block(s); fix the conversation's image blocks"
            )
        text = parts[0] + "".join(
            gemma3_image_text(proc, c) + p for c, p in zip(crops, parts[1:], strict=True)
        )
        total = len(proc.tokenizer(text)["input_ids"])
        visual = sum(self._image_tokens(c) for c in crops)
        return SampleEstimate(max(total - 1, 0), visual, reasons)

    def visual_tokens(self, record: Mapping[str, Any]) -> tuple[int, tuple[str, ...], int]:
        crops, reasons = self._crops(record)
        return sum(self._image_tokens(c) for c in crops), reasons, 0

    def _image_tokens(self, num_crops: int) -> int:
        """Tokens of the image's expansion minus its ``<start_of_image>`` placeholder (the
        template's text count already has it), as ``gemma3_image_tokens``."""
        text = gemma3_image_text(self.processor, num_crops)
        return len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]) - 1

    def _crops(self, record: Mapping[str, Any]) -> tuple[list[int], tuple[str, ...]]:
        sid = int(record.get("sample_id", -1))
        images, _ = record_media(record)
        if self.pan_and_scan is None:
            return [0] * len(images), ()
        crops, reasons = [], []
        for value, meta in zip(images, aligned_meta(record, "images_meta", len(images), sid),
                               strict=True):  # fmt: skip
            if meta is not None:
                h, w = positive_meta(sid, "images", meta, 2)
                size: tuple[int, int] | str = (int(h), int(w))
            else:
                size = image_hw(value, sid)
            if isinstance(size, str):
                reasons.append("image_no_size")
                crops.append(0)
                continue
            crops.append(_num_crops(self.processor.image_processor, *size, self.pan_and_scan))
        return crops, tuple(reasons)


def gemma3_estimator(processor: Any, **kw: Any) -> Gemma3LengthEstimator:
    """``Gemma3LengthEstimator`` for ``processor``: template overhead probed from it, an uncropped
    image ``gemma3_image_tokens``, its pan-and-scan settings (None when off)."""
    from neatpack.pipes.indexing._template_probe import probe_overhead, tokenizer_id

    kw.setdefault("overhead", probe_overhead(processor))
    kw.setdefault("on_missing_media", "fallback")
    return Gemma3LengthEstimator(
        image=None,
        media_fallback=gemma3_image_tokens(processor),
        processor=processor,
        tokenizer_id=tokenizer_id(processor),
        pan_and_scan=gemma3_pan_and_scan_settings(processor),
        **kw,
    )


def gemma3_packed_mask(
    doc_ids: Tensor,
    token_type_ids: Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    sliding_window: int | None = None,
    vision_codes: tuple[int, ...] = (1,),
) -> Tensor:
    """Additive ``[B, 1, S, S]`` mask for a packed Gemma 3 row: ``mask.to_4d_additive_mask``
    (causal inside each document, ``doc_ids`` 1..k, 0 = padding), plus both directions inside
    each run of image tokens (``token_type_ids`` in ``vision_codes``; Gemma 4 adds video, 2)."""
    if doc_ids.shape != token_type_ids.shape or doc_ids.dim() != 2:
        raise ValueError(
            f"doc_ids {tuple(doc_ids.shape)} and token_type_ids {tuple(token_type_ids.shape)} "
            "must both be [B, S]"
        )
    s = doc_ids.shape[1]
    if sliding_window is not None and s > sliding_window:
        raise ValueError(
            f"packed row of {s} tokens > {sliding_window=}: a single mask cannot serve the "
            "sliding-window layers; pack shorter rows or build a sliding mask"
        )
    img = torch.isin(token_type_ids, torch.tensor(vision_codes, device=token_type_ids.device))
    start = img & ~torch.nn.functional.pad(img, (1, 0))[:, :-1]
    block = torch.where(img, torch.cumsum(start.long(), dim=1), 0)
    same_doc = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] > 0)
    same_img = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] > 0)
    # block-causal; padding rows as mask.py sets them
    out: Tensor = to_4d_additive_mask(doc_ids, dtype)
    return out.masked_fill((same_doc & same_img).unsqueeze(1), 0.0)


def gemma3_packed_masks(
    doc_ids: Tensor, token_type_ids: Tensor, *, sliding_window: int | None = None
) -> dict[str, Tensor]:
    """``{"full_attention", "sliding_attention"}``: the same ``gemma3_packed_mask`` for both
    layer types (Gemma 3 applies the image runs on every layer)."""
    mask = gemma3_packed_mask(doc_ids, token_type_ids, sliding_window=sliding_window)
    return {"full_attention": mask, "sliding_attention": mask}


def gemma3_pack_media(samples: Any) -> dict[str, Tensor]:
    """``pixel_values`` of the pack's images in document order (with an explicit mask the model
    needs no ``token_type_ids``)."""
    pvs = [s["pixel_values"] for s in samples if s.get("pixel_values") is not None]
    return {"pixel_values": torch.cat(pvs, dim=0)} if pvs else {}


def _gemma3_estimator(processor: Any, mode: str, **options: Any) -> Gemma3LengthEstimator:
    return gemma3_estimator(processor, mode=mode, **options)


GEMMA3_HANDLER = register_handler(
    Handler(
        "gemma3",
        tokenize_gemma3,
        modalities=frozenset({"image"}),
        pack_media=gemma3_pack_media,
        packed_mask=gemma3_packed_masks,
        description="Gemma 3: the default path, images only, pan-and-scan crops counted; packed "
        "rows need gemma3.gemma3_packed_mask (bidirectional image tokens)",
        estimator=_gemma3_estimator,
    ),
    ("Gemma3Processor",),
)
