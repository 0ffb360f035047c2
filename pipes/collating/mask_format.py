"""The attention-input formats a batch can be collated into, and the attention inputs of each.

``MASK_FORMATS`` (``attention_formats.py``, with the formats' groups) is the one list of
accepted ``mask_format`` / ``attn_implementation`` values; ``attention_inputs`` builds, from a
batch's document ids, what each format puts in the batch (the functions behind it live in
``mask.py``, ``block_mask.py``, ``cu_seqlens.py``). A new format is one entry in
``MASK_FORMATS`` and one branch in ``attention_inputs``.

A batch is collated in two steps: padded (``collate.pad_batch``, the ``PackPadder`` step) into
its *padded format*, ``padded_format(fmt)``, then, for the formats of ``MASK_CONVERSIONS``, its
mask built from the document ids (``convert_mask``, the ``MaskConverter`` step)::

    sdpa / eager / flex_attention   pad -> doc_ids form -> convert_mask -> the 4D mask / BlockMask
    doc_ids, flash_*, position_ids, thd   pad -> that format (boundaries from the packs' lengths)

>>> padded_format("sdpa"), padded_format("thd")
('doc_ids', 'thd')

>>> resolve_mask_format("flash_attention_2"), resolve_mask_format("sdpa", materialize_4d_mask=False)
('flash_attention_2', 'doc_ids')
>>> sorted(attention_inputs(torch.tensor([[1, 1, 2, 0]]), "flash_attention_2"))
['attention_mask', 'cu_seq_lens_k', 'cu_seq_lens_q', 'max_length_k', 'max_length_q']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from neatpack.pipes.collating.attention_formats import (
    DENSE_FORMATS,
    FLASH_FORMATS,
    MASK_CONVERSIONS,
    MASK_FORMATS,
    MASK_FREE_FORMATS,
    PADDED_FORMATS,
)
from neatpack.pipes.collating.block_mask import to_block_mask
from neatpack.pipes.collating.cu_seqlens import (
    cu_seqlens_from_doc_lengths,
    thd_params_from_doc_lengths,
    to_cu_seqlens,
    to_thd_params,
)
from neatpack.pipes.collating.doc_ids import check_doc_ids
from neatpack.pipes.collating.mask import to_4d_additive_mask, to_4d_bool_mask

__all__ = [
    "FLASH_FORMATS",
    "MASK_CONVERSIONS",
    "MASK_FORMATS",
    "MASK_FREE_FORMATS",
    "PADDED_FORMATS",
    "attention_inputs",
    "check_padded_format",
    "convert_mask",
    "dense_mask_cost",
    "padded_format",
    "resolve_mask_format",
    "warn_dense_mask_on_cuda",
]


def padded_format(fmt: str) -> str:
    """The format to pad into for format ``fmt``: ``doc_ids`` for the formats of
    ``MASK_CONVERSIONS`` (their mask is built after padding), ``fmt`` itself otherwise."""
    return "doc_ids" if fmt in MASK_CONVERSIONS else fmt


def check_padded_format(fmt: str) -> None:
    """ValueError unless ``fmt`` is one of ``PADDED_FORMATS`` (a format to pad a batch into)."""
    if fmt not in PADDED_FORMATS:
        raise ValueError(
            f"mask_format={fmt!r} is not one of {PADDED_FORMATS}: pad into doc_ids, then build "
            f"the mask of {MASK_CONVERSIONS} with MaskConverter (convert_mask)"
        )


def resolve_mask_format(
    attn_implementation: str | None = None,
    mask_format: str | None = None,
    materialize_4d_mask: bool = True,
) -> str:
    """The mask format to build: ``mask_format`` wins, then ``attn_implementation``, then sdpa;
    ``"auto"`` is resolved for this machine (``attention_choice.choose_attention_format``).

    ``materialize_4d_mask=False`` turns the 4D formats (sdpa, eager) into ``doc_ids`` (the
    seed's behaviour, used with context parallelism where the mask is built per shard).
    """
    name = mask_format if mask_format is not None else attn_implementation
    name = "sdpa" if name is None else name
    if name == "auto":  # attention_choice.py: flash_attention_2 on CUDA, sdpa elsewhere
        from neatpack.pipes.collating.attention_choice import choose_attention_format

        name = choose_attention_format(name)
    if name not in MASK_FORMATS:
        raise ValueError(
            f"unknown mask format {name!r} (from {attn_implementation=}, {mask_format=}); "
            f"valid: {', '.join(MASK_FORMATS)}, or auto. Fix: pass one of them: auto (the "
            "fastest exact one here), the model's own attention implementation when listed, else "
            "doc_ids (per-token document ids) or thd (cu_seqlens, no mask)"
        )
    if not materialize_4d_mask and name in DENSE_FORMATS:
        return "doc_ids"
    return name


def attention_inputs(
    doc_ids: Tensor,
    fmt: str,
    doc_lengths: list[list[int]] | None = None,
    *,
    seq_lens: list[list[int]] | None = None,
    mask_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The batch keys of format ``fmt`` (one of ``MASK_FORMATS``) for checked ``[B, S]`` ids.

    ``doc_lengths``: per row, the document lengths the ids were checked to match exactly (the
    collater's fast path), so cu_seqlens / THD params come from them without a scan of the ids.
    ``seq_lens``: the real (unpadded) lengths per row, for THD. The ids are not validated here.
    """
    if fmt not in MASK_FORMATS:
        raise ValueError(f"unknown mask format {fmt!r}; valid: {', '.join(MASK_FORMATS)}")
    out: dict[str, Any] = {}
    if fmt == "sdpa":
        out["attention_mask"] = to_4d_bool_mask(doc_ids, validate=False)
    elif fmt == "eager":
        out["attention_mask"] = to_4d_additive_mask(doc_ids, mask_dtype, validate=False)
    elif fmt == "flex_attention":
        out["attention_mask"] = to_block_mask(doc_ids, validate=False)
    elif fmt == "doc_ids":
        out["attention_mask"] = doc_ids
    else:
        out["attention_mask"] = None
        s = doc_ids.shape[1]
        if fmt in FLASH_FORMATS:
            out.update(
                to_cu_seqlens(doc_ids, validate=False)
                if doc_lengths is None
                else cu_seqlens_from_doc_lengths(doc_lengths, s)
            )
        elif fmt == "thd":
            out["packed_seq_params"] = (
                to_thd_params(doc_ids, seq_lens=seq_lens, validate=False)
                if doc_lengths is None
                else thd_params_from_doc_lengths(doc_lengths, s, seq_lens=seq_lens)
            )
    return out


def convert_mask(
    batch: Mapping[str, Any],
    fmt: str,
    *,
    mask_dtype: torch.dtype = torch.float32,
    validate: bool = True,
) -> dict[str, Any]:
    """A copy of a batch in the ``doc_ids`` form with the attention mask of ``fmt`` (one of
    ``MASK_CONVERSIONS``) built from its ``batch["doc_ids"]``; ``attention_mask`` keeps its
    place among the keys. ``validate=False`` when the ids were checked already (the padding
    step checks them: checking again would scan ``[B, S]`` a second time).

    >>> ids = torch.tensor([[1, 1, 2, 0]])
    >>> convert_mask({"attention_mask": ids, "doc_ids": ids}, "eager")["attention_mask"].shape
    torch.Size([1, 1, 4, 4])
    """
    if fmt not in MASK_CONVERSIONS:
        raise ValueError(
            f"{fmt=} is not one of {MASK_CONVERSIONS}; for the mask-free formats (flash, thd, "
            "position_ids) collate with that attn_implementation"
        )
    doc_ids = batch.get("doc_ids")
    if not isinstance(doc_ids, Tensor) or doc_ids.dim() != 2:
        raise ValueError(
            "MaskConverter needs batch['doc_ids'] [B, S] (collate with "
            f"attn_implementation='doc_ids'); got keys {sorted(batch)}"
        )
    if validate:
        check_doc_ids(doc_ids)
    return dict(batch) | attention_inputs(doc_ids, fmt, mask_dtype=mask_dtype)


def dense_mask_cost(lengths: Any, pack_size: int) -> float:
    """How many times the documents' own attention a dense mask computes on this data: every
    row attends over ``pack_size ** 2`` pairs (packs of ``ceil(sum / pack_size)`` rows, the
    planner fills them to ~100 %), a varlen kernel over ``sum(length ** 2)``.

    >>> round(dense_mask_cost([1024] * 8, 8192), 1)  # eight documents of 1k in one 8k row
    8.0
    """
    import numpy as np

    arr = np.asarray(lengths, dtype=np.float64)
    if arr.size == 0 or float(arr.sum()) == 0.0:
        return 1.0
    rows = np.ceil(arr.sum() / pack_size)
    return float(rows * float(pack_size) ** 2 / float(np.square(arr).sum()))


def warn_dense_mask_on_cuda(fmt: str, lengths: Any, pack_size: int) -> None:
    """On a CUDA machine, say what a dense mask costs (``UserWarning``) and how to avoid it;
    nothing on CPU (the parity tests and CPU runs keep sdpa) or for another format."""
    if fmt not in DENSE_FORMATS or not torch.cuda.is_available():
        return
    import warnings

    ratio = dense_mask_cost(lengths, pack_size)
    warnings.warn(
        f"attn_implementation={fmt!r} gives every packed row a dense [{pack_size}, {pack_size}] "
        f"mask: on this data attention computes about {ratio:.1f}x the documents' own "
        "(notes: a pack of 8,192 trained 1.21x faster through varlen attention on an H200, "
        "2.23x at 32,768). Fix: attn_implementation='auto' (the default; flash_attention_2 "
        "batches here) and neatpack.pipes.use_varlen_attention(model) (PyTorch's own varlen "
        "kernel, no flash-attn build; NeatTrainer calls it), or keep sdpa for a model that "
        "needs it",
        UserWarning,
        stacklevel=4,
    )
