"""The worker-side steps of a packed graph, as public, picklable step objects.

A prebuilt graph runs ``StepChain(PerPack(PackMaterializer(...)), Collater(...))`` over each
batch of pack references in worker processes: the same objects a user chains by hand, with
their own steps in between (a pack augmentation, a batch transform) or one of them replaced.
Each step is a plain callable ``item -> item`` with no state, so the chain can run in any worker
and be recomputed after a resume. Stateful work belongs in a node in the main process.

    pack refs [r0, r1]                                   (from Batcher(PackSource))
      PerPack(PackMaterializer)   -> [pack0, pack1]      each pack carries "meta"
                                                         (its Materializer shifts each
                                                         sample with Shifter, replaceable)
      PerPack(my_pack_step)       -> [pack0', pack1']    optional user step
      Collater                    -> batch               batch["packs"] = [meta0, meta1]
      MaskConverter (optional)    -> batch               doc ids -> a backend's mask
      PPMediaSplitter             -> batch               media chunked per PP micro-batch

``batch["packs"]`` is the bookkeeping ``NeatLoader`` advances its cursor and ledger with: a
collate of your own must keep it (``pack_meta`` builds one entry).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from neatpack.pipes.materializing.materialize import Materializer
from neatpack.pipes.materializing.transfer import collate_into_shared_memory

__all__ = [
    "Collater",
    "MaskConverter",
    "PPMediaSplitter",
    "PackMaterializer",
    "PerPack",
    "Shifter",
    "StepChain",
    "pack_meta",
]

META_KEY = "meta"


def pack_meta(
    ref: Mapping[str, Any],
    *,
    real_tokens: int,
    estimated_tokens: int | None = None,
    report: dict[str, Any] | None = None,
    seq_lens: Sequence[int] | None = None,
) -> dict[str, Any]:
    """What the loader's ledger and stats read of one pack (no tensors). ``seq_lens``: the real
    length of each packed document in pack order (a mixture counts its sources' tokens by it).

    >>> ref = {"epoch": 0, "slot": 3, "pack_index": 7, "padded": False, "sample_ids": [4, 9]}
    >>> pack_meta(ref, real_tokens=120)["sample_ids"], pack_meta(ref, real_tokens=120)["slot"]
    ([4, 9], 3)
    """
    return {
        "epoch": ref["epoch"],
        "slot": ref["slot"],
        "pack_index": ref["pack_index"],
        "padded": ref["padded"],
        "sample_ids": list(ref["sample_ids"]),
        "real_tokens": int(real_tokens),
        "estimated_tokens": estimated_tokens,
        "report": report,
        "seq_lens": None if seq_lens is None else [int(n) for n in seq_lens],
    }


class PackMaterializer:
    """A pack reference -> the materialized pack, with the loader's bookkeeping in ``"meta"``.

    Input: ``{"epoch": 0, "slot": 3, "pack_index": 7, "padded": False, "sample_ids": [4, 9]}``
    (one item of ``PackSource``). Output: the pack of ``materialize_pack`` (``input_ids``,
    ``labels``, ``position_ids``, ``attention_mask`` as document ids, ``seq_lens``, media...)
    plus ``pack["meta"] = pack_meta(ref, real_tokens=..., estimated_tokens=..., report=...)``.
    ``estimated`` is the plan's per-sample length (``LengthIndex.total``), for the estimate
    error figures; ``materializer`` any callable ``ref -> pack`` (``Materializer``, or the text
    graph's token packer).
    """

    def __init__(
        self, materializer: Materializer | Callable[[Any], Any], estimated: Any = None
    ) -> None:
        self.materializer = materializer
        self.estimated = None if estimated is None else np.asarray(estimated)

    def __call__(self, ref: Mapping[str, Any]) -> dict[str, Any]:
        pack = dict(self.materializer(ref))
        ids = ref["sample_ids"]
        seq_lens = pack.get("seq_lens", [])
        real = int(sum(seq_lens))
        if self.estimated is None:
            estimated = real
        else:
            estimated = int(self.estimated[list(ids)].sum()) if len(ids) else 0
        pack[META_KEY] = pack_meta(
            ref,
            real_tokens=real,
            estimated_tokens=estimated,
            report=pack.pop("report", None),
            seq_lens=seq_lens,
        )
        return pack


class PerPack:
    """Apply a one-pack step to every pack of a list (a batch's rows).

    >>> PerPack(lambda p: {**p, "seen": True})([{"x": 1}, {"x": 2}])
    [{'x': 1, 'seen': True}, {'x': 2, 'seen': True}]
    """

    def __init__(self, step: Callable[[Any], Any]) -> None:
        self.step = step

    def __call__(self, items: Sequence[Any]) -> list[Any]:
        return [self.step(item) for item in items]

    def __repr__(self) -> str:
        return f"PerPack({self.step!r})"


class Collater:
    """A list of materialized packs -> one batch, each pack's ``"meta"`` under ``batch["packs"]``.

    Wraps the packed collate of a families handler (``handler``: a registered name;
    ``Handler.collate``, e.g. ``neat_packed_vlm_collater`` for ``"qwen_vl"``,
    ``neat_packed_family_collater`` by default), or ``neat_packed_vlm_collater`` itself for
    ``handler=None`` (text packs); keyword arguments go to it (``padding_idx``,
    ``attn_implementation``, ``pad_to_multiple_of``, ``max_length``...).
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
            from neatpack.pipes.collating.collate_family import collate_with_handler

            batch = collate_with_handler(
                rows, self.handler, shared_memory=shared, **self.collate_kwargs
            )
        batch["packs"] = metas
        return batch


class Shifter:
    """The per-sample autoregressive shift as a step: ``input_ids[:-1]``, ``labels[1:]``.

    ``Materializer(..., shift=Shifter())`` is the default; pass a replacement (a step of the same
    contract: the sample one token shorter, ``labels[t]`` scoring token ``t + 1``) to change it,
    e.g. to shift a per-token key of your own along with the ids.

    >>> import torch
    >>> out = Shifter()({"sample_id": 0, "input_ids": torch.tensor([5, 6, 7]),
    ...                  "labels": torch.tensor([-100, 6, 7])})
    >>> out["input_ids"].tolist(), out["labels"].tolist()
    ([5, 6], [6, 7])
    """

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        from neatpack.pipes.materializing.pack import shift_sample

        return shift_sample(sample)


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


class PPMediaSplitter:
    """A batch -> the same batch with its media chunked per pipeline-parallel micro-batch.

    Asks the families ``handler`` (a registered name) for its split (``Handler.pp_split``;
    ``pp_family_media.split_batch_media``): the media keys move to per-micro-batch chunks on the
    ``tensor_split`` boundaries of the text rows (``len(batch["packs"])`` rows). A handler that
    declares no split is refused here, naming it. ``handler=None``: a batch of
    ``neat_packed_vlm_collater`` (``prepare_vlm_media_for_pp``). A batch without media is
    returned unchanged.
    """

    def __init__(self, microbatches: int, *, handler: str | None = None) -> None:
        if microbatches < 1:
            raise ValueError(f"{microbatches=} must be >= 1")
        self.microbatches, self.handler = microbatches, handler
        if handler is not None:
            from neatpack.pipes.parallel.pp_family_media import check_pp_split

            check_pp_split(handler, microbatches)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        from neatpack.pipes.parallel.pp_family_media import split_batch_media

        return dict(split_batch_media(batch, self.handler, self.microbatches))


class StepChain:
    """Steps run one after the other on each item: ``StepChain(f, g)(x) == g(f(x))``.

    The unit of work a worker stage (``neatpack.graphs.map_stage``) runs in its workers. Steps
    must be pure (stateless): a worker's state is never saved, so a step that defines
    ``get_state`` is refused; make it a node in the main process instead.

    >>> StepChain(lambda x: x + 1, lambda x: x * 10)(2)
    30
    """

    def __init__(self, *steps: Callable[[Any], Any]) -> None:
        for step in steps:
            inner = step.step if isinstance(step, PerPack) else step
            if not callable(step):
                raise TypeError(f"StepChain: step {step!r} is not callable")
            if hasattr(inner, "get_state"):
                raise TypeError(
                    f"StepChain: step {inner!r} has get_state(): a step with state cannot run "
                    "in worker processes (its state is never saved, so a resume would restart "
                    "it empty). Make it a node in the main process, before or after the "
                    "worker stage (see README 'Compose your own graph')"
                )
        self.steps = tuple(steps)

    def __call__(self, item: Any) -> Any:
        for step in self.steps:
            item = step(item)
        return item

    def __repr__(self) -> str:
        return "StepChain(" + ", ".join(repr(s) for s in self.steps) + ")"
