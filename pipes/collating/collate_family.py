"""Collate packs of a family whose samples keep their media apart (``Handler.media_per_sample``,
the default ``Handler.collate``): the text side of ``neat_packed_vlm_collater``, the family's
media merged over the whole batch and the family's attention mask. ``collate_with_handler``
is what the graph's ``Collater`` calls: the handler's own ``collate`` (Qwen-VL's is
``neat_packed_vlm_collater``), or, for a handler without one, the function below.

``neat_packed_family_collater(packs, "gemma3", ...)`` pads tokens, labels, document ids and
positions exactly as :func:`collate.neat_packed_vlm_collater` (same fast path, same formats):
``position_ids`` ``[B, S]`` restarting per document (the packs' ``text_position_ids``), or
``[3, B, S]`` for an mRoPE family (Qwen2.5-Omni). Then:

* media: every model of these families takes ONE flat media input for the whole batch, whose
  items are scattered over the image / audio tokens of the flattened ``[B, S]`` ids in order
  (``masked_scatter`` in Gemma 3/4, LLaVA-OneVision, InternVL, the Omni Thinker; Idefics3's
  ``inputs_merger``). So the batch's media is ``Handler.pack_media`` over ALL the packs'
  samples, row after row, document after document: for two rows holding samples ``[a, b]`` and
  ``[c]`` it is ``pack_media([a, b, c])``, e.g. LLaVA-OneVision tiles zero-padded to the
  batch's most tiled image with ``image_sizes`` / ``batch_num_images`` in that order, Idefics3
  tiles ``[1, all tiles, 3, H, W]``, Omni ``input_features`` / ``feature_attention_mask``
  stacked per audio clip. A handler without ``pack_media`` (InternVL through
  ``chat_template``) gets each key concatenated on dim 0 (:func:`collate.merge_media`).
* mask: for ``sdpa`` / ``eager`` the handler's ``packed_mask(doc_ids, mm_token_type_ids,
  **mask_options)`` when it has one (Gemma 3: image tokens see each other both ways, as a dict
  per layer type), else the block-causal mask of ``mask_format``. A family whose mask is not
  block-causal cannot use the mask-free formats (flash, position_ids, thd), doc_ids or flex:
  :func:`check_family_mask_format` says so before the loader is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from neatpack.pipes.collating.attention_formats import DENSE_FORMATS
from neatpack.pipes.collating.collate import neat_packed_vlm_collater
from neatpack.pipes.collating.collate_media import merge_media
from neatpack.pipes.collating.mask import to_4d_additive_mask
from neatpack.pipes.collating.mask_format import resolve_mask_format
from neatpack.pipes.families import Handler, resolve_handler

__all__ = [
    "FAMILY_4D_FORMATS",
    "check_family_mask_format",
    "collate_with_handler",
    "family_mask_is_block_causal",
    "merge_family_media",
    "neat_packed_family_collater",
]

#: The formats that carry an arbitrary 4D mask (the only ones a non-block-causal family takes).
FAMILY_4D_FORMATS: tuple[str, ...] = DENSE_FORMATS

# A probe row: two documents, an image run of 2 tokens in each, one padding token.
_PROBE_DOC = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 0]])
_PROBE_MM = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]])


def family_mask_is_block_causal(
    handler: str | Handler, mask_options: Mapping[str, Any] | None = None
) -> bool:
    """Whether the handler's packed mask (with ``mask_options``) equals the block-causal mask on
    a probe row with image runs: then document ids alone describe it and every format works."""
    h = resolve_handler(handler)
    if h.packed_mask is None:
        return True
    got = h.packed_mask(_PROBE_DOC, _PROBE_MM, **dict(mask_options or {}))
    want = to_4d_additive_mask(_PROBE_DOC).eq(0)
    # a None entry (Nemotron-H's Mamba layers) is a layer type without a mask: no format can
    # give it one, so it does not decide which formats express the masks there are
    masks = [m for m in (got.values() if isinstance(got, Mapping) else [got]) if m is not None]
    return all(torch.equal(m if m.dtype == torch.bool else m.eq(0), want) for m in masks)


def check_family_mask_format(
    handler: str | Handler, fmt: str, mask_options: Mapping[str, Any] | None = None
) -> None:
    """ValueError when mask format ``fmt`` cannot express the family's attention mask."""
    h = resolve_handler(handler)
    if fmt in FAMILY_4D_FORMATS or family_mask_is_block_causal(h, mask_options):
        return
    raise ValueError(
        f"attn_implementation={fmt!r} cannot express the {h.name!r} attention mask with "
        f"{mask_options=}: its media tokens attend to each other in both directions, which "
        "document boundaries (cu_seqlens, position_ids, doc ids, a block-causal BlockMask) do "
        f"not carry. Fix: use attn_implementation in {FAMILY_4D_FORMATS} (a 4D mask from "
        f"the handler's packed_mask), or mask_options that keep the mask block-causal"
    )


def merge_family_media(
    samples: Sequence[Mapping[str, Any]], handler: str | Handler, *, shared: bool = False
) -> dict[str, Any]:
    """The media model inputs of ``samples`` (the batch's samples in row, then document order):
    ``Handler.pack_media(samples)``, or each key concatenated on dim 0 without one."""
    h = resolve_handler(handler)
    if h.pack_media is not None:
        return dict(h.pack_media(samples))
    keys: list[str] = []
    for s in samples:
        keys += [k for k in s if k not in keys]
    out: dict[str, Any] = {}
    for key in keys:
        values = [s[key] for s in samples if s.get(key) is not None]
        if values:
            out[key] = merge_media(values, shared=shared)
    return out


def neat_packed_family_collater(
    batch: Sequence[Mapping[str, Any]],
    handler: str | Handler,
    padding_idx: int = 0,
    max_length: int | None = None,
    attn_implementation: str | None = None,
    *,
    pad_to_multiple_of: int | None = None,
    mask_format: str | None = None,
    mask_options: Mapping[str, Any] | None = None,
    shared_memory: bool = False,
    boundaries: bool = False,
    media_counts: bool = False,
) -> dict[str, Any]:
    """Packs built with a family handler (``materialize_pack`` with ``handler=...``: media per
    sample in ``pack["media_samples"]``) -> one batch. See the module docstring.

    Besides the keys of ``neat_packed_vlm_collater`` (``input_ids``, ``labels``,
    ``position_ids``, ``attention_mask``, ``doc_ids``, ``mm_token_type_ids``, ``sample_ids``) the
    batch holds the family's media keys (``Handler.pack_media``) and ``n_media_samples``, the
    number of samples per row with any media. ``media_counts=True`` (the graph sets it for
    pipeline parallelism) adds ``batch["media_counts"]``: per media key, the items each row
    contributes (``pp_family_media.family_media_counts``), which the PP split reads.
    """
    h = resolve_handler(handler)
    fmt = resolve_mask_format(attn_implementation, mask_format)
    check_family_mask_format(h, fmt, mask_options)
    own_mask = h.packed_mask if fmt in FAMILY_4D_FORMATS else None
    out = neat_packed_vlm_collater(
        batch,
        padding_idx,
        max_length,
        mask_format="doc_ids" if own_mask is not None else fmt,
        pad_to_multiple_of=pad_to_multiple_of,
        check_media=False,
        shared_memory=shared_memory,
        boundaries=boundaries,
    )
    if own_mask is not None:
        doc_ids: Tensor = out["doc_ids"]
        out["attention_mask"] = own_mask(
            doc_ids, out["mm_token_type_ids"], **dict(mask_options or {})
        )
    rows = [list(p.get("media_samples") or []) for p in batch]
    samples = [m for row in rows for m in row if m]
    if samples:
        out.update(merge_family_media(samples, h, shared=shared_memory))
    out["n_media_samples"] = torch.tensor([sum(1 for m in r if m) for r in rows], dtype=torch.long)
    if media_counts:
        from neatpack.pipes.parallel.pp_family_media import family_media_counts

        out["media_counts"] = family_media_counts(rows, h)
    return out


def collate_with_handler(
    packs: Sequence[Mapping[str, Any]], handler: str | Handler, **options: Any
) -> dict[str, Any]:
    """``Handler.collate(packs, handler, **options)``: one batch of ``handler``'s packed rows
    (``options``: those of ``neat_packed_vlm_collater`` plus ``mask_options`` and
    ``media_counts``)."""
    h = resolve_handler(handler)
    if h.collate is None:
        return neat_packed_family_collater(packs, h, **options)
    return dict(h.collate(packs, h, **options))
