"""``Collater``: the step that turns a list of materialized packs into one batch."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from neatpack.pipes.materializing.transfer import collate_into_shared_memory

from .meta import META_KEY

__all__ = ["Collater"]


class Collater:
    """A list of materialized packs -> one batch, each pack's ``"meta"`` under ``batch["packs"]``.

    Wraps ``neat_packed_vlm_collater`` (``handler=None``: Qwen-VL and text packs) or
    ``neat_packed_family_collater`` (a families handler name); keyword arguments go to it
    (``padding_idx``, ``attn_implementation``, ``pad_to_multiple_of``, ``max_length``...).
    In a worker process the pixels are concatenated straight into shared memory.

    Input: ``[pack0, pack1]`` each with ``"meta"``. Output: ``{"input_ids": [2, S],
    "labels": [2, S], "position_ids", "attention_mask" (the format of attn_implementation),
    ..., "packs": [meta0, meta1]}``. A row whose samples were all skipped (counted in the
    ledger) becomes a one-token document with no labels, so every rank still takes the step.
    """

    def __init__(self, *, handler: str | None = None, **collate_kwargs: Any) -> None:
        self.handler, self.collate_kwargs = handler, collate_kwargs
        self.owner_pid = os.getpid()

    def __call__(self, packs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        from neatpack.pipes.collating.collate import neat_packed_vlm_collater

        rows = [dict(p) for p in packs]
        missing = [i for i, p in enumerate(rows) if META_KEY not in p]
        if missing:
            raise ValueError(
                f"Collater: packs {missing} of this batch have no {META_KEY!r} (the loader's "
                "bookkeeping): build them with PackMaterializer, or keep pack['meta'] in "
                "any step that rebuilds a pack"
            )
        metas = [p.pop(META_KEY) for p in rows]
        for p in rows:
            mask = p["attention_mask"]
            if mask.numel() and not bool(mask.any()):
                # Every sample of this pack was skipped or dropped (counted in the ledger).
                # The collater refuses an all-padding row, and the step must still happen on
                # every rank: make the first pad token a one-token document with no labels.
                p["attention_mask"] = mask.clone()
                p["attention_mask"][0] = 1
        shared = collate_into_shared_memory(self.owner_pid)
        if self.handler is None:
            batch = dict(
                neat_packed_vlm_collater(rows, shared_memory=shared, **self.collate_kwargs)
            )
        else:
            from neatpack.pipes.collating.collate_family import neat_packed_family_collater

            batch = neat_packed_family_collater(
                rows, self.handler, shared_memory=shared, **self.collate_kwargs
            )
        batch["packs"] = metas
        return batch
