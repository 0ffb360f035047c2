"""``MaskConverter``: a batch in the document-id form -> the attention inputs of a backend."""

from __future__ import annotations

from typing import Any

__all__ = ["MASK_CONVERSIONS", "MaskConverter"]

MASK_CONVERSIONS = ("sdpa", "eager", "flex_attention")


class MaskConverter:
    """A batch collated with ``attn_implementation="doc_ids"`` -> the same batch with the
    attention mask of another backend, built from its ``[B, S]`` document ids (``mask.py``).

    ``sdpa``: bool ``[B,1,S,S]`` (True = attend); ``eager``: additive ``[B,1,S,S]`` in
    ``dtype``; ``flex_attention``: a ``BlockMask``. The ids stay in ``batch["doc_ids"]``.

    >>> import torch
    >>> ids = torch.tensor([[1, 1, 2, 0]])
    >>> batch = {"attention_mask": ids, "doc_ids": ids}
    >>> MaskConverter("sdpa")(batch)["attention_mask"][0, 0].int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    """

    def __init__(self, attn_implementation: str, *, dtype: Any = None) -> None:
        if attn_implementation not in MASK_CONVERSIONS:
            raise ValueError(
                f"{attn_implementation=} is not one of {MASK_CONVERSIONS}; for the mask-free "
                "formats (flash, thd, position_ids) collate with that attn_implementation"
            )
        self.attn_implementation, self.dtype = attn_implementation, dtype

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import torch

        from neatpack.pipes.collating.doc_ids import check_doc_ids
        from neatpack.pipes.collating.mask_format import attention_inputs

        doc_ids = batch.get("doc_ids")
        if doc_ids is None or doc_ids.dim() != 2:
            raise ValueError(
                "MaskConverter needs batch['doc_ids'] [B, S] (collate with "
                f"attn_implementation='doc_ids'); got keys {sorted(batch)}"
            )
        check_doc_ids(doc_ids)
        dtype = self.dtype or torch.float32
        return dict(batch) | attention_inputs(doc_ids, self.attn_implementation, mask_dtype=dtype)
