"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL (and Qwen3-VL-MoE): a family like the others, every fact on
its ``Handler``.

* tokenize: ``tokenize.tokenize_conversation`` (``*_grid_thw`` checks, fake images, video
  metadata); a pack's records share ONE processor call (``PackTokenizer``:
  ``prepare_conversation`` per record, ``finish_conversations`` for the pack), and the pack
  keeps the processor's media concatenated (``media_per_sample=False``);
* lengths: ``estimate.LengthEstimator`` (estimate / exact; calibrated:
  ``LengthEstimator.calibrate`` on records of the source);
* positions: mRoPE ``[3, L]`` per document (``mrope.MRopeConfig.from_processor``);
* collate: ``collate.neat_packed_vlm_collater`` (the mask comes from the attention format: the
  packed rows are block-causal, so every format works);
* pipeline parallelism: ``pp_media.prepare_vlm_media_for_pp`` (patch rows counted from the
  grids, ``n_images_per_sample``).

>>> from neatpack.pipes.families import get_handler
>>> from neatpack.pipes.testing.tiny import load_tiny_processor
>>> h = get_handler(load_tiny_processor("qwen2_vl"))
>>> h.name, h.estimate_modes, h.fake_image, h.media_per_sample
('qwen_vl', ('estimate', 'calibrated', 'exact'), True, False)
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from torch import Tensor

from neatpack.pipes.collating.collate import core_collate
from neatpack.pipes.materializing.tokenize import (
    finish_conversations,
    prepare_conversation,
    tokenize_conversation,
)

from .registry import Handler, PackTokenizer, register_handler

__all__ = [
    "QWEN_VL_HANDLER",
    "QWEN_VL_PROCESSORS",
    "qwen_vl_calibrate",
    "qwen_vl_estimator",
    "qwen_vl_positions",
    "qwen_vl_pp_split",
]

#: The processor classes of the Qwen-VL family.
QWEN_VL_PROCESSORS: tuple[str, ...] = (
    "Qwen2VLProcessor",
    "Qwen2_5_VLProcessor",
    "Qwen3VLProcessor",
    "Qwen3VLMoeProcessor",
    "Qwen3_5Processor",  # the Qwen3-VL vision path (mrope's qwen3_vl rule)
)


def qwen_vl_estimator(processor: Any, mode: str, **options: Any) -> Any:
    """``LengthEstimator.from_processor(processor, mode=mode, **options)``."""
    from neatpack.pipes.indexing.estimate import LengthEstimator

    return LengthEstimator.from_processor(processor, mode=mode, **options)


def qwen_vl_calibrate(source: Any, processor: Any, **options: Any) -> Any:
    """``LengthEstimator.calibrate``: ``chars_per_token`` and the template overhead fitted on the
    real tokenizer's count of 200 records of ``source`` (seed 0)."""
    from neatpack.pipes.indexing.estimate import LengthEstimator

    return LengthEstimator.calibrate(source, processor, mode="calibrated", **options)


def qwen_vl_positions(sample: Mapping[str, Any], processor: Any) -> Tensor:
    """The ``[3, L]`` mRoPE ids of one unshifted sample (``pack.sample_mrope`` with the
    processor's ``MRopeConfig``)."""
    from neatpack.pipes.materializing.mrope import MRopeConfig
    from neatpack.pipes.materializing.pack import sample_mrope

    ids: Tensor = sample_mrope(dict(sample), MRopeConfig.from_processor(processor))
    return ids


def qwen_vl_pp_split(
    batch: MutableMapping[str, Any], handler: Any, rows: int, n_microbatches: int
) -> MutableMapping[str, Any]:
    """``pp_media.prepare_vlm_media_for_pp(batch, rows, n_microbatches)``."""
    from neatpack.pipes.parallel.pp_media import prepare_vlm_media_for_pp

    out: MutableMapping[str, Any] = prepare_vlm_media_for_pp(batch, rows, n_microbatches)
    return out


QWEN_VL_HANDLER = register_handler(
    Handler(
        "qwen_vl",
        tokenize_conversation,
        mrope=True,
        positions=qwen_vl_positions,
        estimator=qwen_vl_estimator,
        calibrate=qwen_vl_calibrate,
        collate=core_collate,  # the core rows: Collater runs PackPadder + MaskConverter
        pp_split=qwen_vl_pp_split,
        pack_tokenizer=PackTokenizer(prepare_conversation, finish_conversations),
        media_per_sample=False,
        fake_image=True,
        description="Qwen2-VL / Qwen2.5-VL / Qwen3-VL: grid_thw checks, fake images, video "
        "metadata (pipes/materializing/tokenize.py), one processor call per pack, mRoPE",
    ),
    QWEN_VL_PROCESSORS,
)
