"""Feeding batches to a transformers model: which keys go in, and a minimal training step.

A neatpack batch carries bookkeeping next to the model inputs (``doc_ids``, ``sample_ids``,
``packs``, ``n_images_per_sample``, ``packed_seq_params``). ``model_inputs(batch)`` keeps only
what a Hugging Face VLM/LLM forward accepts, and sets ``use_cache=False``: with packing, a
cache makes transformers ignore the document boundaries carried by ``position_ids``.

Which mask format for which attention implementation (``NeatVLMConfig.attn_implementation``):

=====================  =========================================  ======================
model attention        batch["attention_mask"] / extra kwargs     note
=====================  =========================================  ======================
``sdpa``               4D bool ``[B,1,S,S]`` block-causal          True = attend
``eager``              4D additive float (0 / dtype min)           a bool mask is wrong
``flash_attention_2``  ``cu_seq_lens_q/k``, ``max_length_q/k``     varlen, no 4D mask
``flex_attention``     a ``BlockMask`` (document-causal)
``position_ids``       None; ``position_ids`` ``[4,B,S]`` (VL)     needs ``use_cache=False``
=====================  =========================================  ======================
"""

from __future__ import annotations

from typing import Any

__all__ = ["BOOKKEEPING_KEYS", "model_inputs"]

BOOKKEEPING_KEYS = frozenset(
    {
        "doc_ids",
        "sample_ids",
        "packs",
        "n_images_per_sample",
        "n_videos_per_sample",
        "packed_seq_params",
        "dropped_sample_ids",
        "seq_lens",
        "seq_lens_padded",
    }
)


def model_inputs(batch: dict[str, Any], *, keep_labels: bool = True) -> dict[str, Any]:
    """The keyword arguments for ``model(**model_inputs(batch))``.

    >>> model_inputs({"input_ids": 1, "doc_ids": 2, "labels": 3, "packs": []})
    {'input_ids': 1, 'labels': 3, 'use_cache': False}
    """
    out = {k: v for k, v in batch.items() if k not in BOOKKEEPING_KEYS and v is not None}
    if not keep_labels:
        out.pop("labels", None)
    if "attention_mask" in batch and batch["attention_mask"] is None:
        out["attention_mask"] = None
    out["use_cache"] = False
    return out
