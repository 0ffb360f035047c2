"""``Collater``: the step that turns a list of materialized packs into one batch."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from neatpack.pipes.collating.collate import core_collate_options
from neatpack.pipes.materializing.transfer import collate_into_shared_memory

from .chain import StepChain
from .mask_converter import MaskConverter
from .meta import META_KEY
from .pack_padder import PackPadder

__all__ = ["Collater", "collate_steps"]


def collate_steps(
    padding_idx: int = 0,
    max_length: int | None = None,
    attn_implementation: str | None = None,
    materialize_4d_mask: bool = True,
    *,
    mask_format: str | None = None,
    mask_dtype: Any = None,
    **pad_kwargs: Any,
) -> StepChain:
    """The public steps of ``neat_packed_vlm_collater(packs, ...)`` with the same arguments:
    ``PackPadder`` into ``padded_format(fmt)``, then ``MaskConverter(fmt)`` for sdpa / eager /
    flex_attention (the padder checked the ids: no second scan).

    >>> collate_steps(attn_implementation="sdpa")
    StepChain(PackPadder(mask_format='doc_ids'), MaskConverter('sdpa'))
    >>> collate_steps(attn_implementation="flash_attention_2")
    StepChain(PackPadder(mask_format='flash_attention_2'))
    """
    from neatpack.pipes.collating.mask_format import (
        MASK_CONVERSIONS,
        padded_format,
        resolve_mask_format,
    )

    fmt = resolve_mask_format(attn_implementation, mask_format, materialize_4d_mask)
    steps: list[Callable[[Any], Any]] = [
        PackPadder(padding_idx, max_length, mask_format=padded_format(fmt), **pad_kwargs)
    ]
    if fmt in MASK_CONVERSIONS:
        steps.append(MaskConverter(fmt, dtype=mask_dtype, validate=False))
    return StepChain(*steps)


class Collater:
    """A list of materialized packs -> one batch, each pack's ``"meta"`` under ``batch["packs"]``.

    With ``handler=None`` (text packs), or a handler whose packed rows are the core contract
    (``Handler.collate`` is ``core_collate``: Qwen-VL), the batch is made by ``self.steps``, a
    ``StepChain`` of public steps: ``PackPadder`` (pad to ``[B, S]``, the document ids in
    ``attention_mask``, or a mask-free format complete) then ``MaskConverter`` for sdpa, eager
    and flex_attention; the same batch as ``neat_packed_vlm_collater`` with these keyword
    arguments (``padding_idx``, ``attn_implementation``, ``pad_to_multiple_of``,
    ``max_length``...). Any other families handler: its ``Handler.collate``.
    In a worker process the pixels are concatenated straight into shared memory.

    Input: ``[pack0, pack1]`` each with ``"meta"``. Output: ``{"input_ids": [2, S],
    "labels": [2, S], "position_ids", "attention_mask" (the format of attn_implementation),
    ..., "packs": [meta0, meta1]}``. A row whose samples were all skipped (counted in the
    ledger) becomes a one-token document with no labels, so every rank still takes the step.
    """

    def __init__(self, *, handler: str | None = None, **collate_kwargs: Any) -> None:
        self.handler, self.collate_kwargs = handler, collate_kwargs
        self.owner_pid = os.getpid()
        self.steps: StepChain | None = None
        if handler is None or _resolve(handler).core_rows:
            self.steps = collate_steps(**core_collate_options(handler, **collate_kwargs))

    def __call__(self, packs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
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
        batch: dict[str, Any]
        if self.steps is not None:
            batch = self.steps(rows)
        else:
            from neatpack.pipes.collating.collate_family import collate_with_handler

            assert self.handler is not None  # handler=None collates with self.steps
            batch = collate_with_handler(
                rows,
                self.handler,
                shared_memory=collate_into_shared_memory(self.owner_pid),
                **self.collate_kwargs,
            )
        batch["packs"] = metas
        return batch


def _resolve(handler: str) -> Any:
    from neatpack.pipes.families import resolve_handler

    return resolve_handler(handler)
