"""InternVL (``InternVLProcessor`` / ``InternVLForConditionalGeneration``): NO family code.

InternVL goes through the processor-agnostic default (``registry`` handler ``chat_template``):
labels from the derived ``<|im_start|>assistant\\n`` markers, image tokens from the processor's
``image_token_ids`` (``<IMG_CONTEXT>`` plus the ``<img>`` / ``</img>`` brackets) checked against
its ``_get_num_multimodal_tokens`` (``2 + image_seq_length * crops``), the length from
``chat_template.default_estimate``, and a packed row from ``registry.packed_model_inputs``
(crops concatenated on dim 0, block-causal mask, 1-D positions). This module only ships the tiny
processor loader and the tiny model builder the tests use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from neatpack.pipes.tiny_family_models import init_tiny_model

__all__ = ["load_tiny_internvl_processor", "tiny_internvl_model"]

_FOLDER = Path(__file__).resolve().parents[1] / "_assets" / "processors" / "internvl"


def load_tiny_internvl_processor() -> Any:
    """The shipped tiny ``InternVLProcessor`` (``scripts/build_tiny_family_processors.py``)."""
    if not (_FOLDER / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny InternVL processor missing in {_FOLDER}; rebuild it with "
            "`python scripts/build_tiny_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_FOLDER), local_files_only=True)  # type: ignore[no-untyped-call]


def tiny_internvl_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``InternVLForConditionalGeneration`` for the tiny processor (28 px
    crops, patch 7, CLS dropped, pixel shuffle 0.5 -> ``image_seq_length`` 4; Qwen2 text)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    tok = processor.tokenizer
    side = int(processor.image_processor.size["height"])
    cfg = InternVLConfig(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": [side, side],
                       "patch_size": [7, 7]},
        text_config={"model_type": "qwen2", "vocab_size": len(tok), "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "max_position_embeddings": 4096,
                     "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id},
        image_token_id=int(processor.image_token_id),
        image_seq_length=int(processor.image_seq_length),
    )  # fmt: skip
    return init_tiny_model(InternVLForConditionalGeneration, cfg, seed=seed, attn=attn)
