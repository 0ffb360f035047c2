"""Collate packs (or plain samples) into one batch, with the attention mask each backend wants.

``neat_packed_vlm_collater`` takes packs (docs/data_contracts.md section 5) and returns a batch
(section 6). Example, two packs of 5 and 3 tokens, ``mask_format="doc_ids"``::

    pack 0  sample_ids [17, 4]   attention_mask (doc ids) [1, 1, 1, 2, 2]
    pack 1  sample_ids [92]      attention_mask (doc ids) [1, 1, 1]

    batch["attention_mask"] = [[1, 1, 1, 2, 2],
                               [1, 1, 1, 0, 0]]      # right padding = 0
    batch["labels"]         = ...  -100 on padding
    batch["sample_ids"]     = [[17, 4], [92]]

The collater does no shift: packs were shifted per sample when they were built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from neatpack.pipes.collating.collate_media import (
    collate_media,
    media_token_counts,
    pack_sample_ids,
)
from neatpack.pipes.collating.mask_format import (
    MASK_CONVERSIONS,
    attention_inputs,
    check_padded_format,
    convert_mask,
    padded_format,
    resolve_mask_format,
)
from neatpack.pipes.collating.pad_packs import pad_packs, pad_packs_fast
from neatpack.pipes.materializing.loss import label_counts

__all__ = [
    "core_collate",
    "core_collate_options",
    "neat_packed_vlm_collater",
    "pad_batch",
]


def neat_packed_vlm_collater(
    batch: Sequence[Mapping[str, Any]],
    padding_idx: int = 0,
    max_length: int | None = None,
    attn_implementation: str | None = None,
    materialize_4d_mask: bool = True,
    *,
    pad_to_multiple_of: int | None = None,
    mask_format: str | None = None,
    mask_dtype: torch.dtype = torch.float32,
    pixel_dtype: torch.dtype | None = None,
    spatial_merge_size: int = 2,
    check_media: bool = True,
    shared_memory: bool = False,
    boundaries: bool = False,
) -> dict[str, Any]:
    """Pad a list of packs to ``[B, S]`` and build the attention inputs for one backend.

    ``S`` is the longest pack, or ``max_length``, rounded up to ``pad_to_multiple_of``. A pack
    longer than ``max_length`` is a ``ValueError`` naming its sample ids (the seed lets it
    through, bug B5). Formats (``mask_format``, else ``attn_implementation``, else sdpa):

    ============== ==================================================================
    sdpa           ``attention_mask`` bool ``[B,1,S,S]``, True = attend
    eager          ``attention_mask`` additive ``mask_dtype`` ``[B,1,S,S]`` (0 / finfo.min)
    flash_*        ``attention_mask=None``; ``cu_seq_lens_q/k``, ``max_length_q/k``
    flex_attention ``attention_mask`` = flex ``BlockMask``
    position_ids   ``attention_mask=None``; boundaries in ``position_ids`` (``use_cache=False``)
    thd            ``attention_mask=None``; ``packed_seq_params`` (THD cu_seqlens, padded too)
    doc_ids        ``attention_mask`` = the ``[B,S]`` document ids
    ============== ==================================================================

    ``position_ids`` is ``[B,S]`` for text packs. For mRoPE packs it is ``[3,B,S]`` with a mask
    and ``[4,B,S]`` (text row + mRoPE rows) for the mask-free formats. Every batch carries
    ``doc_ids``, ``sample_ids`` (list per row) and ``mm_token_type_ids``. Padding rows attend to
    themselves only, so no mask row is fully masked. An empty batch or a zero-length pack is a
    ``ValueError`` (the seed returns ``{}`` / an all-padding row, bug B3). Pixels keep their
    dtype unless ``pixel_dtype`` is given (the seed casts to bf16). ``shared_memory=True`` (set by
    the prebuilt graphs in their worker processes) concatenates the packs' pixels straight into
    shared memory, so handing the batch to the main process copies them no second time.
    ``boundaries=True`` adds ``seq_idx`` and ``cu_seq_lens_q/k`` / ``max_length_q/k`` to every
    format, for models with linear-attention, SSM or conv layers
    (``pipes/collating/boundaries.py``).

    Packs in the data contract's form (int64 CPU tensors, ``seq_lens_padded`` or ``seq_lens``
    matching the document ids) take a fast path: each integer output is padded by one
    ``torch.cat``, the document ids are checked against the packs' lengths exactly in two
    O(B*S) passes, and ``cu_seqlens`` / THD params come from those lengths, not from a scan of
    ``[B, S]``: 3-5x faster at B=4, S=16384 (``general_path`` in benchmarks/bench_collate.py).
    Any other pack (int32 tensors, lists, lengths that disagree with the ids, bad input) goes
    through the general path, which gives the same outputs and the errors quoted above.

    Two steps, the pure cores of the public steps ``PackPadder`` and ``MaskConverter`` that the
    prebuilt graphs' ``Collater`` chains: :func:`pad_batch` into ``padded_format(fmt)``, then
    for sdpa / eager / flex_attention ``convert_mask`` (``pipes/collating/mask_format.py``).
    """
    fmt = resolve_mask_format(attn_implementation, mask_format, materialize_4d_mask)
    out = pad_batch(
        batch,
        padding_idx,
        max_length,
        mask_format=padded_format(fmt),
        pad_to_multiple_of=pad_to_multiple_of,
        pixel_dtype=pixel_dtype,
        spatial_merge_size=spatial_merge_size,
        check_media=check_media,
        shared_memory=shared_memory,
        boundaries=boundaries,
    )
    if fmt in MASK_CONVERSIONS:  # the ids were checked by pad_batch: no second scan
        out = convert_mask(out, fmt, mask_dtype=mask_dtype, validate=False)
    return out


def pad_batch(
    batch: Sequence[Mapping[str, Any]],
    padding_idx: int = 0,
    max_length: int | None = None,
    *,
    mask_format: str = "doc_ids",
    pad_to_multiple_of: int | None = None,
    pixel_dtype: torch.dtype | None = None,
    spatial_merge_size: int = 2,
    check_media: bool = True,
    shared_memory: bool = False,
    boundaries: bool = False,
) -> dict[str, Any]:
    """Packs -> the batch padded to ``[B, S]`` in ``mask_format``, one of ``PADDED_FORMATS``:
    ``doc_ids`` (``attention_mask`` = the checked document ids, the form ``convert_mask`` /
    ``MaskConverter`` turns into a 4D mask or BlockMask) or a mask-free format, whose boundaries
    (``cu_seq_lens``, THD params) come from the packs' lengths. Everything else of
    :func:`neat_packed_vlm_collater` is here: the text tensors, ``doc_ids``, ``sample_ids``,
    media, label counts and, with ``boundaries=True``, ``seq_idx`` / ``cu_seq_lens_q/k``.

    >>> pack = {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([6, 7, -100]),
    ...         "attention_mask": torch.tensor([1, 1, 2]), "sample_ids": [4, 9]}
    >>> out = pad_batch([pack], max_length=4)
    >>> out["attention_mask"].tolist(), out["position_ids"].tolist()
    ([[1, 1, 2, 0]], [[0, 1, 0, 0]])
    """
    check_padded_format(mask_format)
    fmt = mask_format
    if len(batch) == 0:
        raise ValueError("empty batch: neat_packed_vlm_collater needs at least one pack")
    padded = pad_packs_fast(batch, padding_idx, max_length, pad_to_multiple_of, fmt)
    if padded is None:
        padded = pad_packs(batch, padding_idx, max_length, pad_to_multiple_of, fmt)
    doc_ids, doc_lengths = padded.doc_ids, padded.doc_lengths
    out: dict[str, Any] = {
        "input_ids": padded.input_ids,
        "labels": padded.labels,
        "mm_token_type_ids": padded.mm_token_type_ids,
        "position_ids": padded.position_ids,
        "doc_ids": doc_ids,
        "sample_ids": [pack_sample_ids(p) for p in batch],
    }
    out.update(
        attention_inputs(
            doc_ids,
            fmt,
            doc_lengths,
            seq_lens=[list(p["seq_lens"]) for p in batch]
            if all("seq_lens" in p for p in batch)
            else None,
        )
    )
    tokens = (
        media_token_counts(padded.mm_token_type_ids)
        if check_media and doc_lengths is not None
        else None
    )
    out.update(
        collate_media(
            batch, pixel_dtype, spatial_merge_size, check_media, tokens, shared=shared_memory
        )
    )
    out.update(label_counts(out["labels"], doc_ids))
    if boundaries:
        from neatpack.pipes.collating.boundaries import boundary_kwargs

        for key, value in boundary_kwargs(doc_ids, doc_lengths, validate=False).items():
            out.setdefault(key, value)
    return out


def core_collate_options(handler: Any = None, **options: Any) -> dict[str, Any]:
    """``options`` of a family whose packed rows are the core contract, for
    ``neat_packed_vlm_collater`` (or its steps): ``media_counts`` needs nothing more (the
    batch carries ``n_images_per_sample`` / ``n_videos_per_sample``, what the PP split reads);
    ``mask_options`` are refused (the mask is the format's)."""
    mask_options = options.pop("mask_options", None)
    options.pop("media_counts", None)
    if mask_options:
        name = getattr(handler, "name", handler)
        raise ValueError(
            f"mask_options={dict(mask_options)!r} is for a family with its own packed mask "
            f"(Gemma 3 / 4); handler {name!r} builds its mask from attn_implementation: set "
            "mask_options=None"
        )
    return options


def core_collate(
    packs: Sequence[Mapping[str, Any]], handler: Any = None, **options: Any
) -> dict[str, Any]:
    """``Handler.collate`` of a family whose packed rows are the core contract (Qwen-VL):
    ``neat_packed_vlm_collater``. ``Collater`` runs it as the public steps ``PackPadder`` +
    ``MaskConverter`` (``pipes/steps/collater.py``)."""
    return dict(neat_packed_vlm_collater(packs, **core_collate_options(handler, **options)))
