"""Pipeline-parallel micro-batches through the family's handler: ``split_batch_media(batch,
handler, n)`` (what ``PPMediaSplitter`` runs) calls ``Handler.pp_split``, or refuses a handler
that declares ``pp_refused``, naming it and its reason. Qwen-VL's split is
``pp_media.prepare_vlm_media_for_pp`` (patch rows from the grids); the default, for families
whose samples keep their media apart, is below: fixed-length rows, and each micro-batch's media
taken from exactly its own rows.

The family models (Gemma 3/4, LLaVA-OneVision, Idefics3, InternVL, Qwen2.5-Omni) take ONE flat
media input per forward whose items are scattered over the media tokens of the flattened
``[B, S]`` ids in order, so the micro-batch holding rows ``[b0, b1)`` needs exactly the items of
those rows' documents, in order. The batch's media is ``Handler.pack_media`` over all the
batch's samples, row after row (``collate_family.merge_family_media``), so per row and per key the
item count is what ``pack_media`` gives for that row's samples (``family_media_counts``): the
counts come from the samples the packs carry (``pack["media_samples"]``), never from a shape
heuristic. Items lie on dim 0, except Idefics3's and SmolVLM's tiles (``[1, tiles, 3, H, W]``,
dim 1: ``Handler.media_axis``)::

    rows (B=4, n=2)        row 0: [a(2 crops+1), b(0)]  row 1: [c(1)]  row 2: []  row 3: [d(1)]
    Gemma 3 pixel rows     counts [3, 1, 0, 1]    -> micro-batch 0 rows [0:4], 1 rows [4:5]

Every micro-batch must also have the same shapes (pipelining builds its stages from the first
one), so rows are padded to one fixed length: the collater's ``max_length`` (a pack longer than
that is refused there, naming its samples); ``prepare_family_media_for_pp`` checks the width.
In ``neat_vlm_graph`` every row is ``pack_size`` tokens already, and the collater counts each
row's items (``collate(..., media_counts=True)``: ``batch["media_counts"]``) for
``split_family_batch``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from torch import Tensor

from neatpack.pipes.families.registry import Handler, PPSplitFn, resolve_handler
from neatpack.pipes.parallel.pp_media import (
    VLM_PP_MEDIA_KEY,
    microbatch_bounds,
    prepare_vlm_media_for_pp,
)

__all__ = [
    "MEDIA_COUNTS_KEY",
    "check_pp_split",
    "chunk_family_media",
    "family_media_counts",
    "prepare_family_media_for_pp",
    "split_batch_media",
    "split_family_batch",
    "wrap_family_collate_for_pp",
]

#: The batch key of each row's media item counts (``collate(..., media_counts=True)``).
MEDIA_COUNTS_KEY = "media_counts"


def check_pp_split(handler: str | Handler, n_microbatches: int | None = None) -> PPSplitFn:
    """``handler``'s pipeline-parallel media split (``Handler.pp_split``, else
    ``split_family_batch``); ValueError naming the handler, its reason and the fix when it
    declares ``pp_refused``."""
    h = resolve_handler(handler)
    if h.pp_refused is None:
        return h.pp_split or split_family_batch
    raise ValueError(
        f"pp_microbatches={n_microbatches} but handler {h.name!r} declares no pipeline-parallel "
        f"media split (Handler.pp_refused: {h.pp_refused}). Fix: set pp_microbatches=None, or "
        "register the handler without pp_refused (and with pp_split=<fn(batch, handler, rows, "
        "n_microbatches) -> batch> if its media need a split of their own)"
    )


def split_batch_media(
    batch: MutableMapping[str, Any], handler: str | Handler | None, n_microbatches: int
) -> MutableMapping[str, Any]:
    """``batch`` with its media chunked per pipeline-parallel micro-batch at
    ``VLM_PP_MEDIA_KEY``, by ``handler``'s split (``check_pp_split``; ``handler=None``: a batch of
    ``collate.neat_packed_vlm_collater``, split by ``prepare_vlm_media_for_pp``). The rows are
    ``len(batch["packs"])`` (else ``input_ids``' first dim), split as ``torch.tensor_split``."""
    rows = len(batch["packs"]) if "packs" in batch else int(batch["input_ids"].shape[0])
    if handler is None:
        out: MutableMapping[str, Any] = prepare_vlm_media_for_pp(batch, rows, n_microbatches)
        return out
    h = resolve_handler(handler)
    split = check_pp_split(h, n_microbatches)
    return split(batch, h, rows, n_microbatches)  # type: ignore[no-any-return]


def _sample_media(h: Handler, sample: Mapping[str, Any]) -> dict[str, Any]:
    if h.pack_media is not None:
        return dict(h.pack_media([sample]))
    return {"pixel_values": sample["pixel_values"]} if "pixel_values" in sample else {}


def family_media_counts(
    rows: Sequence[Sequence[Mapping[str, Any] | None]], handler: str | Handler
) -> dict[str, list[int]]:
    """Per media key, the items each row contributes to the batch's media: the size along
    the handler's ``media_axis`` of ``pack_media([sample])[key]`` summed over the row's samples
    (``rows[r]``: the samples of row ``r``, e.g. ``pack["media_samples"]``; None entries are
    samples without media). A handler without ``pack_media`` contributes ``pixel_values``."""
    h = resolve_handler(handler)
    axis = h.media_axis
    counts: dict[str, list[int]] = {}
    for r, row in enumerate(rows):
        for sample in row:
            if not sample:
                continue
            for key, value in _sample_media(h, sample).items():
                if isinstance(value, Tensor):
                    counts.setdefault(key, [0] * len(rows))[r] += int(value.shape[axis])
    return counts


def chunk_family_media(
    media: Mapping[str, Tensor],
    counts: Mapping[str, Sequence[int]],
    n_microbatches: int,
    *,
    axis: int = 0,
) -> list[dict[str, Tensor]]:
    """Split each ``media[key]`` along ``axis`` into the items of each micro-batch's rows
    (``counts[key][r]`` items in row ``r``; rows split as ``torch.tensor_split``). A micro-batch
    whose rows have no item of a key does not get that key (the models take no empty media).

    >>> import torch
    >>> pv = torch.arange(5.0)
    >>> [c.get("pixel_values") for c in chunk_family_media({"pixel_values": pv},
    ...                                                    {"pixel_values": [3, 1, 0, 1]}, 3)]
    [tensor([0., 1., 2., 3.]), None, tensor([4.])]
    """
    if set(media) != set(counts):
        raise ValueError(
            f"media keys {sorted(media)} and count keys {sorted(counts)} differ; every media "
            "key needs its items per row (family_media_counts)"
        )
    sizes = {len(c) for c in counts.values()}
    if len(sizes) != 1:
        lens = {k: len(c) for k, c in counts.items()}
        raise ValueError(f"counts cover different numbers of rows: {lens}")
    bounds = microbatch_bounds(sizes.pop(), n_microbatches)
    out: list[dict[str, Tensor]] = [{} for _ in bounds]
    for key, value in media.items():
        cum = [0]
        for c in counts[key]:
            cum.append(cum[-1] + int(c))
        if cum[-1] != int(value.shape[axis]):
            raise ValueError(
                f"{key} has {int(value.shape[axis])} items on dim {axis} but the rows' counts "
                f"{list(counts[key])} sum to {cum[-1]}; the media do not belong to these rows"
            )
        for m, (r0, r1) in enumerate(bounds):
            if cum[r1] > cum[r0]:
                out[m][key] = value.narrow(axis, cum[r0], cum[r1] - cum[r0])
    return out


def prepare_family_media_for_pp(
    batch: MutableMapping[str, Any],
    rows: Sequence[Sequence[Mapping[str, Any] | None]],
    handler: str | Handler,
    n_microbatches: int,
    *,
    seq_len: int | None = None,
) -> MutableMapping[str, Any]:
    """Pop the family's media keys of ``batch`` (a collated batch of ``len(rows)`` rows) and store
    per-micro-batch chunks at ``VLM_PP_MEDIA_KEY`` as ``{key: [chunk or None per micro-batch]}``
    (the Qwen-VL layout). ``seq_len``: the fixed row length every micro-batch must have."""
    h = resolve_handler(handler)
    ids = batch.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2 or int(ids.shape[0]) != len(rows):
        raise ValueError(
            f"input_ids {tuple(getattr(ids, 'shape', ()))} must be [B={len(rows)}, S]: one "
            "row per entry of rows"
        )
    if seq_len is not None and int(ids.shape[1]) != seq_len:
        raise ValueError(
            f"rows are {int(ids.shape[1])} tokens, not the fixed {seq_len=}: pipeline "
            "micro-batches need one shape; collate with max_length=seq_len"
        )
    return _split_counted(batch, family_media_counts(rows, h), h, n_microbatches)


def split_family_batch(
    batch: MutableMapping[str, Any], handler: str | Handler, rows: int, n_microbatches: int
) -> MutableMapping[str, Any]:
    """The split of a handler without ``pp_split``: ``prepare_family_media_for_pp`` with the
    rows' item counts the collater stored at ``batch["media_counts"]`` (popped)."""
    h = resolve_handler(handler)
    counts = batch.pop(MEDIA_COUNTS_KEY, None)
    if counts is None:
        raise ValueError(
            f"handler {h.name!r}: the batch has no {MEDIA_COUNTS_KEY!r} (each row's media items) "
            "to split its media by; collate with media_counts=True (neat_vlm_graph does when "
            "pp_microbatches is set)"
        )
    lens = {len(c) for c in counts.values()}
    if lens - {rows}:
        raise ValueError(f"{MEDIA_COUNTS_KEY} cover {sorted(lens)} rows, not the batch's {rows}")
    return _split_counted(batch, counts, h, n_microbatches)


def _split_counted(
    batch: MutableMapping[str, Any],
    counts: Mapping[str, Sequence[int]],
    h: Handler,
    n_microbatches: int,
) -> MutableMapping[str, Any]:
    media = {k: batch.pop(k) for k in counts if k in batch}
    missing = sorted(set(counts) - set(media))
    if missing:
        raise ValueError(f"the rows' samples have media {missing} that the batch lacks")
    chunks = chunk_family_media(media, counts, n_microbatches, axis=h.media_axis)
    if media:
        batch[VLM_PP_MEDIA_KEY] = {k: [c.get(k) for c in chunks] for k in media}
    return batch


def wrap_family_collate_for_pp(
    collate_fn: Callable[[Any], MutableMapping[str, Any]],
    handler: str | Handler,
    n_microbatches: int,
    seq_len: int,
) -> Callable[[Any], MutableMapping[str, Any]]:
    """Wrap a family collater (packs with ``media_samples`` -> batch, rows padded to
    ``seq_len``, e.g. ``partial(neat_packed_family_collater, handler=..., max_length=seq_len)``)
    so its batches carry media pre-split for ``n_microbatches``."""
    h = resolve_handler(handler)
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1; got {n_microbatches=}")

    def collate(packs: Any) -> MutableMapping[str, Any]:
        batch = collate_fn(packs)
        rows = [list(p.get("media_samples") or []) for p in packs]
        return prepare_family_media_for_pp(batch, rows, h, n_microbatches, seq_len=seq_len)

    return collate
