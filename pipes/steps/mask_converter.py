"""``MaskConverter``: a batch in the document-id form -> the attention inputs of a backend."""

from __future__ import annotations

from typing import Any

from neatpack.pipes.collating.mask_format import MASK_CONVERSIONS, convert_mask

__all__ = ["MASK_CONVERSIONS", "MaskConverter"]


class MaskConverter:
    """A batch collated with ``attn_implementation="doc_ids"`` -> the same batch with the
    attention mask of another backend, built from its ``[B, S]`` document ids (``mask.py``).

    ``sdpa``: bool ``[B,1,S,S]`` (True = attend); ``eager``: additive ``[B,1,S,S]`` in
    ``dtype``; ``flex_attention``: a ``BlockMask``. The ids stay in ``batch["doc_ids"]``. The
    second step of the prebuilt collate, after ``PackPadder`` (``Collater.steps``), which
    checked the ids already: there it runs with ``validate=False``.

    >>> import torch
    >>> ids = torch.tensor([[1, 1, 2, 0]])
    >>> batch = {"attention_mask": ids, "doc_ids": ids}
    >>> MaskConverter("sdpa")(batch)["attention_mask"][0, 0].int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    """

    def __init__(
        self, attn_implementation: str, *, dtype: Any = None, validate: bool = True
    ) -> None:
        if attn_implementation not in MASK_CONVERSIONS:
            raise ValueError(
                f"{attn_implementation=} is not one of {MASK_CONVERSIONS}; for the mask-free "
                "formats (flash, thd, position_ids) collate with that attn_implementation"
            )
        self.attn_implementation, self.dtype, self.validate = attn_implementation, dtype, validate

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import torch

        dtype = self.dtype or torch.float32
        out: dict[str, Any] = convert_mask(
            batch, self.attn_implementation, mask_dtype=dtype, validate=self.validate
        )
        return out

    def __repr__(self) -> str:
        return f"MaskConverter({self.attn_implementation!r})"
