"""Gemma 3 (``Gemma3Processor`` / ``Gemma3ForConditionalGeneration``): what really differs.

* Tokenization is the processor-agnostic default (``family_default.tokenize_default``): labels
  from the ``<start_of_turn>model\\n`` ... ``<end_of_turn>`` markers derived from the template,
  ``<image_soft_token>`` as the image token (``processor.image_token_ids``), a fixed
  ``image_seq_length`` tokens per image (no pan-and-scan). Images only: a video or audio block is
  a ``SampleError`` naming the sample.
* Attention: Gemma 3 lets the soft tokens of ONE image attend to each other in both directions
  (``token_type_ids == 1`` runs, ``modeling_gemma3.get_block_sequence_ids_for_mask``). A packed
  row therefore needs ``gemma3_packed_mask``: block-causal per document plus bidirectional
  within each image run, handed to the model as ``{"full_attention": m, "sliding_attention": m}``
  (valid while the row is shorter than ``sliding_window``; ``gemma3_packed_mask`` checks it).
* Positions are 1-D (no mRoPE): the pack's ``text_position_ids``.
* Length: the text estimate of ``LengthEstimator`` plus the exact per-image expansion
  (``"\\n\\n<start_of_image>" + soft * image_seq_length + "<end_of_image>\\n\\n"``).

>>> import torch
>>> m = gemma3_packed_mask(torch.tensor([[1, 1, 1, 2, 2]]), torch.tensor([[0, 1, 1, 0, 0]]))
>>> m[0, 0].eq(0).int().tolist()  # the two image tokens (1, 2) see each other
[[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .estimate import LengthEstimator
from .mask import to_4d_additive_mask

__all__ = [
    "gemma3_estimator",
    "gemma3_image_tokens",
    "gemma3_pack_media",
    "gemma3_packed_mask",
    "gemma3_packed_masks",
    "load_tiny_gemma3_processor",
    "tiny_gemma3_model",
]

_FOLDER = Path(__file__).resolve().parent / "_assets" / "processors" / "gemma3"


def load_tiny_gemma3_processor() -> Any:
    """The shipped tiny ``Gemma3Processor`` (``scripts/build_tiny_family_processors.py``)."""
    if not (_FOLDER / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Gemma 3 processor missing in {_FOLDER}; rebuild it with "
            "`python scripts/build_tiny_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_FOLDER), local_files_only=True)  # type: ignore[no-untyped-call]


def gemma3_image_tokens(processor: Any) -> int:
    """Tokens one image adds to the row (its ``<start_of_image>`` placeholder excluded)."""
    tok = processor.tokenizer
    ids = tok(processor.full_image_sequence, add_special_tokens=False)["input_ids"]
    return len(ids) - 1


def gemma3_estimator(processor: Any, **kw: Any) -> LengthEstimator:
    """``LengthEstimator`` for Gemma 3: template overhead probed from the processor, every image
    ``gemma3_image_tokens`` (through ``media_fallback``, so each image is listed in the
    estimator's fallback counter with reason "no image config")."""
    from ._template_probe import probe_overhead, tokenizer_id

    kw.setdefault("overhead", probe_overhead(processor))
    kw.setdefault("on_missing_media", "fallback")
    return LengthEstimator(
        image=None,
        media_fallback=gemma3_image_tokens(processor),
        processor=processor,
        tokenizer_id=tokenizer_id(processor),
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
    out = to_4d_additive_mask(doc_ids, dtype)  # block-causal; padding rows as mask.py sets them
    return out.masked_fill((same_doc & same_img).unsqueeze(1), 0.0)


def tiny_gemma3_model(processor: Any, *, seed: int = 0, attn_implementation: str = "eager") -> Any:
    """A tiny random fp32 ``Gemma3ForConditionalGeneration`` matching the tiny processor (28x28
    images, patch 7 -> 4x4 patches pooled to ``image_seq_length`` = 4 soft tokens)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = processor.tokenizer
    side = int(processor.image_processor.size["height"])
    text = {
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "sliding_window": 2048, "max_position_embeddings": 4096,
        "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16,
        "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }  # fmt: skip
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "image_size": side, "patch_size": side // 4,
    }  # fmt: skip
    cfg = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=int(processor.image_seq_length),
        boi_token_index=int(tok.boi_token_id),
        eoi_token_index=int(tok.eoi_token_id),
        image_token_index=int(tok.image_token_id),
    )
    cfg._attn_implementation = attn_implementation
    for sub in (cfg.text_config, cfg.vision_config):
        sub._attn_implementation = attn_implementation  # type: ignore[union-attr]
    torch.manual_seed(seed)  # init only: tests own the process
    model = Gemma3ForConditionalGeneration(cfg)
    model.config.use_cache = False
    model.eval()  # type: ignore[no-untyped-call]
    return model


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
