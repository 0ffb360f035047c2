"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL (and Qwen3-VL-MoE): the default family of neatpack.

Its tokenizer is ``tokenize.tokenize_conversation`` (``*_grid_thw`` checks, fake images, video
metadata) and its positions, collater and length estimate are the core path (``mrope.py``,
``collate.neat_packed_vlm_collater``, ``estimate.LengthEstimator``), so the handler only names
the tokenizer and the processor classes; ``neat_vlm_graph`` keeps the Qwen-VL path for them.

>>> from neatpack.pipes.families import get_handler
>>> from neatpack.pipes.testing.tiny import load_tiny_processor
>>> get_handler(load_tiny_processor("qwen2_vl")).name
'qwen_vl'
"""

from __future__ import annotations

from neatpack.pipes.materializing.tokenize import tokenize_conversation

from .registry import Handler, register_handler

__all__ = ["QWEN_VL_HANDLER", "QWEN_VL_PROCESSORS"]

#: The processor classes of the Qwen-VL family.
QWEN_VL_PROCESSORS: tuple[str, ...] = (
    "Qwen2VLProcessor",
    "Qwen2_5_VLProcessor",
    "Qwen3VLProcessor",
    "Qwen3VLMoeProcessor",
    "Qwen3_5Processor",  # the Qwen3-VL vision path (mrope's qwen3_vl rule)
)

QWEN_VL_HANDLER = register_handler(
    Handler(
        "qwen_vl",
        tokenize_conversation,
        mrope=True,
        description="Qwen2-VL / Qwen2.5-VL / Qwen3-VL: grid_thw checks, fake images, video "
        "metadata (pipes/materializing/tokenize.py)",
    ),
    QWEN_VL_PROCESSORS,
)
