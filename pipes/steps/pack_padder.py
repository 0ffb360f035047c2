"""``PackPadder``: a list of packs -> one batch padded to ``[B, S]``, mask not yet built."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from neatpack.pipes.collating.mask_format import check_padded_format
from neatpack.pipes.materializing.transfer import collate_into_shared_memory

__all__ = ["PackPadder"]


class PackPadder:
    """Packs -> the batch padded to ``[B, S]`` in ``mask_format`` (``collate.pad_batch``).

    ``mask_format="doc_ids"`` (default): ``attention_mask`` holds the checked document ids,
    the form ``MaskConverter`` turns into an sdpa / eager mask or a flex ``BlockMask``; a
    mask-free format (flash, position_ids, thd) comes out complete, its boundaries taken from
    the packs' lengths. The prebuilt collate is ``StepChain(PackPadder, MaskConverter)``
    (``Collater.steps``). Keyword arguments go to ``pad_batch`` (``pad_to_multiple_of``,
    ``boundaries``, ``pixel_dtype``...). In a worker process (not the one that built the step)
    the pixels are concatenated straight into shared memory.

    >>> import torch
    >>> pack = {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([6, 7, -100]),
    ...         "attention_mask": torch.tensor([1, 1, 2]), "sample_ids": [4, 9]}
    >>> batch = PackPadder(max_length=4)([pack])
    >>> batch["attention_mask"].tolist(), batch["labels"].tolist()
    ([[1, 1, 2, 0]], [[6, 7, -100, -100]])
    """

    def __init__(
        self,
        padding_idx: int = 0,
        max_length: int | None = None,
        *,
        mask_format: str = "doc_ids",
        **pad_kwargs: Any,
    ) -> None:
        check_padded_format(mask_format)
        self.padding_idx, self.max_length, self.mask_format = padding_idx, max_length, mask_format
        self.pad_kwargs = pad_kwargs
        self.owner_pid = os.getpid()

    def __call__(self, packs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        from neatpack.pipes.collating.collate import pad_batch

        batch: dict[str, Any] = pad_batch(
            packs,
            self.padding_idx,
            self.max_length,
            mask_format=self.mask_format,
            shared_memory=collate_into_shared_memory(self.owner_pid),
            **self.pad_kwargs,
        )
        return batch

    def __repr__(self) -> str:
        return f"PackPadder(mask_format={self.mask_format!r})"
