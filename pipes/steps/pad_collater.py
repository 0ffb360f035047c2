"""``PadCollater``: a group of samples -> one padded (not packed) batch with its bookkeeping."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from neatpack.pipes.materializing.transfer import collate_into_shared_memory

from .meta import pack_meta

__all__ = ["PadCollater"]


class PadCollater:
    """``{"ref": ref, "samples": [...]}`` -> one padded batch, ``batch["packs"] = [meta]``.

    The grouped graph's collate: ``pad_collate_fn`` (pad to ``max_length`` or the longest
    sample, then shift: ``[B, S - 1]``; a longer sample is an error naming it unless
    ``truncate=True``). The whole group is ONE entry of the loader's ledger:
    ``pack_meta(ref, real_tokens=...)`` with the samples' shifted lengths summed (each sample
    scores ``len - 1`` tokens). In a worker process the pixels go straight into shared memory.
    """

    def __init__(
        self, processor: Any, max_length: int | None = None, *, truncate: bool = False
    ) -> None:
        self.processor, self.max_length, self.truncate = processor, max_length, truncate
        self.owner_pid = os.getpid()

    def __call__(self, item: Mapping[str, Any]) -> dict[str, Any]:
        from neatpack.pipes.collating.sample_collate import pad_collate_fn

        samples = item["samples"]
        batch = dict(
            pad_collate_fn(
                samples, self.processor, self.max_length, truncate=self.truncate,
                shared_memory=collate_into_shared_memory(self.owner_pid),
            )
        )  # fmt: skip
        real = int(sum(int(s["input_ids"].numel()) - 1 for s in samples))
        batch["packs"] = [pack_meta(item["ref"], real_tokens=real)]
        return batch
