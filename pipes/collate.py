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

import hashlib
import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from . import mask as M
from ._tensors import cat_shared
from .loss import CROSS_ENTROPY_IGNORE_IDX, add_label_counts, label_counts

__all__ = [
    "FLASH_FORMATS",
    "MASK_FORMATS",
    "RobustCollate",
    "default_collate_fn",
    "expand_image_tokens",
    "make_robust_collate",
    "merge_media",
    "neat_packed_vlm_collater",
    "pad_collate_fn",
    "resolve_mask_format",
]

IGNORE_INDEX = CROSS_ENTROPY_IGNORE_IDX  # one value for the whole package (pipes/loss.py)
FLASH_FORMATS = ("flash_attention_2", "flash_attention_3")
#: Every accepted ``attn_implementation`` / ``mask_format`` value; the check uses this tuple.
MASK_FORMATS = ("sdpa", "eager", *FLASH_FORMATS, "flex_attention", "position_ids", "thd", "doc_ids")
#: Formats with no attention mask: document boundaries travel in positions or cu_seqlens.
MASK_FREE_FORMATS = (*FLASH_FORMATS, "position_ids", "thd")
_LOG = logging.getLogger(__name__)
PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
MEDIA_CAT_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "image_position_ids")


def resolve_mask_format(
    attn_implementation: str | None = None,
    mask_format: str | None = None,
    materialize_4d_mask: bool = True,
) -> str:
    """The mask format to build: ``mask_format`` wins, then ``attn_implementation``, then sdpa.

    ``materialize_4d_mask=False`` turns the 4D formats (sdpa, eager) into ``doc_ids`` (the
    seed's behaviour, used with context parallelism where the mask is built per shard).
    """
    name = mask_format if mask_format is not None else attn_implementation
    name = "sdpa" if name is None else name
    if name not in MASK_FORMATS:
        raise ValueError(
            f"unknown mask format {name!r} (from {attn_implementation=}, {mask_format=}); "
            f"valid: {', '.join(MASK_FORMATS)}"
        )
    if not materialize_4d_mask and name in ("sdpa", "eager"):
        return "doc_ids"
    return name


def merge_media(
    values: Sequence[Any], dtype: torch.dtype | None = None, *, shared: bool = False
) -> Tensor | list[Tensor]:
    """Concatenate pixel tensors on dim 0, or a flat list when their trailing shapes differ.

    A value may be a tensor or a list of per-image tensors (variable resolution). ``dtype``
    casts (the seed always casts to bf16; here float32 is kept unless asked). ``shared`` writes
    the concatenation straight into shared memory (for a loader worker: see ``cat_shared``).
    """
    parts: list[Tensor] = []
    as_list = False
    for v in values:
        if isinstance(v, Tensor):
            parts.append(v)
        else:
            as_list = True
            parts.extend(v)
    if parts and not as_list and all(p.shape[1:] == parts[0].shape[1:] for p in parts):
        # One part: no copy (pixel rows are most of a batch's bytes).
        if len(parts) > 1 and shared:
            return cat_shared(parts, dtype)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out if dtype is None else out.to(dtype)
    return [p if dtype is None else p.to(dtype) for p in parts]


def _ids(pack: Mapping[str, Any]) -> list[int]:
    return [int(i) for i in pack.get("sample_ids", [])]


def _check_pack_media(
    pack: Mapping[str, Any], row: int, merge: int, tokens_known: tuple[int, int] | None = None
) -> tuple[int, int]:
    """Images / videos in the pack, checked against its placeholder tokens. Raises ValueError.

    ``tokens_known``: the pack's (image, video) placeholder counts when the caller already has
    them (the packed collater counts the whole ``[B, S]`` plane at once instead of 2 passes per
    pack).
    """
    counts = []
    mm = pack.get("mm_token_type_ids")
    for i, (kind, grid_key, pix_key, token_type) in enumerate(
        (
            ("image", "image_grid_thw", "pixel_values", 1),
            ("video", "video_grid_thw", "pixel_values_videos", 2),
        )
    ):
        grid = pack.get(grid_key)
        n = 0 if grid is None else int(grid.shape[0])
        declared = pack.get(f"n_{kind}s")
        if declared is not None and int(declared) != n:
            raise ValueError(
                f"pack {row} (sample_ids={_ids(pack)}): n_{kind}s={int(declared)} but "
                f"{grid_key} has {n} rows; rebuild the pack."
            )
        patches = 0 if grid is None else int(grid.long().prod(dim=-1).sum())
        if tokens_known is not None:
            tokens = tokens_known[i]
        else:
            tokens = 0 if mm is None else int((torch.as_tensor(mm) == token_type).sum())
        if mm is None and n:
            raise ValueError(
                f"pack {row} (sample_ids={_ids(pack)}) has {n} {kind}(s) but no "
                "mm_token_type_ids; transformers 5 needs them with media."
            )
        if tokens * merge * merge != patches:
            raise ValueError(
                f"pack {row} (sample_ids={_ids(pack)}): {tokens} {kind} placeholder tokens but "
                f"{grid_key} implies {patches} patches = {patches // (merge * merge)} tokens at "
                f"spatial_merge_size={merge}; the media and the text disagree."
            )
        pix = pack.get(pix_key)
        if isinstance(pix, Tensor) and pix.dim() == 2 and n and pix.shape[0] != patches:
            raise ValueError(
                f"pack {row} (sample_ids={_ids(pack)}): {pix_key} has {pix.shape[0]} patch rows "
                f"but {grid_key} implies {patches}."
            )
        counts.append(n)
    return counts[0], counts[1]


def _target_length(
    lengths: list[int],
    packs: Sequence[Mapping[str, Any]],
    max_length: int | None,
    multiple: int | None,
) -> int:
    if multiple is not None and multiple < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1; got {multiple=}")
    if max_length is not None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1; got {max_length=}")
        if multiple is not None and max_length % multiple:
            raise ValueError(f"{max_length=} is not a multiple of pad_to_multiple_of={multiple}")
        for row, t in enumerate(lengths):
            if t > max_length:
                raise ValueError(
                    f"pack {row} (sample_ids={_ids(packs[row])}) has {t} tokens > {max_length=}; "
                    "packs are never cut here: plan with a capacity <= max_length."
                )
        return max_length
    s = max(lengths)
    return s if multiple is None else -(-s // multiple) * multiple


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
    format, for models with linear-attention, SSM or conv layers (``pipes/boundaries.py``).

    Packs in the data contract's form (int64 CPU tensors, ``seq_lens_padded`` or ``seq_lens``
    matching the document ids) take a fast path: each integer output is padded by one
    ``torch.cat``, the document ids are checked against the packs' lengths exactly in two
    O(B*S) passes, and ``cu_seqlens`` / THD params come from those lengths, not from a scan of
    ``[B, S]``: 3-5x faster at B=4, S=16384 (``general_path`` in benchmarks/bench_collate.py).
    Any other pack (int32 tensors, lists, lengths that disagree with the ids, bad input) goes
    through the general path, which gives the same outputs and the errors quoted above.
    """
    fmt = resolve_mask_format(attn_implementation, mask_format, materialize_4d_mask)
    if len(batch) == 0:
        raise ValueError("empty batch: neat_packed_vlm_collater needs at least one pack")
    padded = _pad_packs_fast(batch, padding_idx, max_length, pad_to_multiple_of, fmt)
    if padded is None:
        padded = _pad_packs(batch, padding_idx, max_length, pad_to_multiple_of, fmt)
    doc_ids, doc_lengths = padded.doc_ids, padded.doc_lengths
    out: dict[str, Any] = {
        "input_ids": padded.input_ids,
        "labels": padded.labels,
        "mm_token_type_ids": padded.mm_token_type_ids,
        "position_ids": padded.position_ids,
        "doc_ids": doc_ids,
        "sample_ids": [_ids(p) for p in batch],
    }
    if fmt == "sdpa":
        out["attention_mask"] = M.to_4d_bool_mask(doc_ids, validate=False)
    elif fmt == "eager":
        out["attention_mask"] = M.to_4d_additive_mask(doc_ids, mask_dtype, validate=False)
    elif fmt == "flex_attention":
        out["attention_mask"] = M.to_block_mask(doc_ids, validate=False)
    elif fmt == "doc_ids":
        out["attention_mask"] = doc_ids
    else:
        out["attention_mask"] = None
        s = doc_ids.shape[1]
        if fmt in FLASH_FORMATS:
            out.update(
                M.to_cu_seqlens(doc_ids, validate=False)
                if doc_lengths is None
                else M.cu_seqlens_from_doc_lengths(doc_lengths, s)
            )
        elif fmt == "thd":
            seq_lens = (
                [list(p["seq_lens"]) for p in batch]
                if all("seq_lens" in p for p in batch)
                else None
            )
            out["packed_seq_params"] = (
                M.to_thd_params(doc_ids, seq_lens=seq_lens, validate=False)
                if doc_lengths is None
                else M.thd_params_from_doc_lengths(doc_lengths, s, seq_lens=seq_lens)
            )
    tokens = (
        _media_token_counts(padded.mm_token_type_ids)
        if check_media and doc_lengths is not None
        else None
    )
    out.update(
        _collate_media(
            batch, pixel_dtype, spatial_merge_size, check_media, tokens, shared=shared_memory
        )
    )
    out.update(label_counts(out["labels"], doc_ids))
    if boundaries:
        from .boundaries import boundary_kwargs

        for key, value in boundary_kwargs(doc_ids, doc_lengths, validate=False).items():
            out.setdefault(key, value)
    return out


class _Padded(NamedTuple):
    """A batch's text tensors padded to ``[B, S]``, before any mask is built.

    ``position_ids`` already has the layout of the format (``[4, B, S]`` for mRoPE packs in a
    mask-free format). ``doc_lengths`` (per row, the document lengths that ``doc_ids`` was
    checked to match exactly) is set by the fast path only.
    """

    input_ids: Tensor
    labels: Tensor
    mm_token_type_ids: Tensor
    doc_ids: Tensor
    position_ids: Tensor
    doc_lengths: list[list[int]] | None


#: One ``[B, S]`` plane of a padded output: each pack's row (None: zeros) and its pad constant.
_Plane = tuple[list[Tensor | None], Tensor]


def _is_long_cpu(value: Any, shape: tuple[int, ...]) -> bool:
    """``value`` is an int64 CPU tensor of exactly ``shape``, with no autograd history."""
    return (
        isinstance(value, Tensor)
        and value.dtype is torch.long
        and value.shape == shape
        and value.is_cpu
        and not value.requires_grad
    )


def _pad_packs_fast(
    batch: Sequence[Mapping[str, Any]],
    padding_idx: int,
    max_length: int | None,
    multiple: int | None,
    fmt: str,
) -> _Padded | None:
    """Pad packs in the data contract's form, one ``torch.cat`` per output; None for others.

    Eligible: every key an int64 CPU tensor of the pack's length (mRoPE positions ``[3, T]``),
    and ``seq_lens_padded`` (else ``seq_lens``) a non-empty list of positive ints summing to at
    most ``T``. Each output (input_ids, labels, mm_token_type_ids, doc ids, positions) is
    written by one ``torch.cat`` of the pack tensors and slices of pad constants: one
    allocation and one pass per output instead of a ``torch.full`` / ``torch.zeros`` per key and
    a copy per (key, row), ~40 tensor ops that cost ~10 us each in dispatch alone. The
    ``[4, B, S]`` positions of mRoPE mask-free formats (text row + 3 mRoPE rows) come out of
    their own cat directly. Every output owns its storage, as before: views of one shared
    buffer would measure the same but plain ``pickle`` writes a view's whole storage (5x the
    bytes for 5 views). The doc ids are accepted only if they equal the canonical ids of the
    lengths (``1..k`` then ``0``), checked by :func:`mask.doc_ids_match_lengths`; when they do
    not, None sends the batch to :func:`_pad_packs`, whose checks raise the error that names
    the pack. Errors of the arguments (``max_length``) are left to that path too, so the first
    error is the same.
    """
    first_pos = batch[0].get("position_ids")
    has_pos = "position_ids" in batch[0]
    mrope = isinstance(first_pos, Tensor) and first_pos.dim() == 2
    # Text positions are an output only as row 0 of [4, B, S] or when packs have no positions.
    need_text = (mrope and fmt in MASK_FREE_FORMATS) or not has_pos
    lengths: list[int] = []
    doc_lengths: list[list[int]] = []
    mm_missing = False
    for pack in batch:
        ids = pack.get("input_ids")
        if not isinstance(ids, Tensor) or ids.dim() != 1:
            return None
        t = int(ids.shape[0])
        shape = (t,)
        spans = pack.get("seq_lens_padded", pack.get("seq_lens"))
        if not isinstance(spans, list | tuple) or not spans:
            return None
        if not all(type(n) is int and n >= 1 for n in spans) or sum(spans) > t:
            return None
        if not (
            _is_long_cpu(ids, shape)
            and _is_long_cpu(pack.get("labels"), shape)
            and _is_long_cpu(pack.get("attention_mask"), shape)
            and has_pos == ("position_ids" in pack)
            and (not has_pos or _is_long_cpu(pack["position_ids"], (3, t) if mrope else shape))
            and (not need_text or _is_long_cpu(pack.get("text_position_ids"), shape))
        ):
            return None
        mm = pack.get("mm_token_type_ids")
        if mm is None:
            mm_missing = True
        elif not _is_long_cpu(mm, shape):
            return None
        lengths.append(t)
        doc_lengths.append(list(spans))
    try:
        s = _target_length(lengths, batch, max_length, multiple)
    except ValueError:
        return None  # raised by _pad_packs, after the per-pack checks that come first there
    b = len(batch)
    n_pad = s - min(lengths)
    zeros = torch.zeros(s if mm_missing else n_pad, dtype=torch.long)
    pad_ids = zeros if padding_idx == 0 else torch.full((n_pad,), padding_idx, dtype=torch.long)
    pad_labels = torch.full((n_pad,), IGNORE_INDEX, dtype=torch.long)
    # Each row's tail of each pad constant, sliced once for all outputs (~2 us a slice).
    tails = {
        id(pad): [pad[: s - t] if t < s else None for t in lengths]
        for pad in {id(p): p for p in (pad_ids, pad_labels, zeros)}.values()
    }

    def padded(planes: list[_Plane], size: tuple[int, ...]) -> Tensor:
        """One output: its planes' rows and pad tails, in a single ``torch.cat``.

        Written through a flat view into a tensor allocated with its final shape, so the result
        is a plain tensor (not a view, owning exactly its bytes), like the general path's.
        """
        pieces: list[Tensor] = []
        for values, pad in planes:
            for value, t, tail in zip(values, lengths, tails[id(pad)], strict=True):
                pieces.append(zeros[:t] if value is None else value)
                if tail is not None:
                    pieces.append(tail)
        out = torch.empty(size, dtype=torch.long)
        torch.cat(pieces, out=out.view(-1))
        return out

    doc_ids = padded([([p["attention_mask"] for p in batch], zeros)], (b, s))
    if not M.doc_ids_match_lengths(doc_ids, doc_lengths):
        return None  # checked first: an off-contract batch costs one cat before _pad_packs
    positions: list[_Plane] = []
    if need_text:
        positions.append(([p["text_position_ids"] for p in batch], zeros))
    if mrope:
        rows = [p["position_ids"].unbind(0) for p in batch]
        positions.extend(([r[j] for r in rows], zeros) for j in range(3))
    elif has_pos:
        positions.append(([p["position_ids"] for p in batch], zeros))
    return _Padded(
        input_ids=padded([([p["input_ids"] for p in batch], pad_ids)], (b, s)),
        labels=padded([([p["labels"] for p in batch], pad_labels)], (b, s)),
        mm_token_type_ids=padded([([p.get("mm_token_type_ids") for p in batch], zeros)], (b, s)),
        doc_ids=doc_ids,
        # [4, B, S] (text row + mRoPE), [3, B, S], or [B, S] (the packs' or text positions)
        position_ids=padded(positions, (len(positions), b, s) if mrope else (b, s)),
        doc_lengths=doc_lengths,
    )


def _pad_packs(
    batch: Sequence[Mapping[str, Any]],
    padding_idx: int,
    max_length: int | None,
    multiple: int | None,
    fmt: str,
) -> _Padded:
    """Pad any packs key by key, validating the document ids; raises ValueError naming a pack."""
    lengths = []
    for row, pack in enumerate(batch):
        missing = [k for k in ("input_ids", "labels", "attention_mask") if k not in pack]
        if missing:
            raise ValueError(f"pack {row} (sample_ids={_ids(pack)}) lacks keys {missing}")
        t = int(pack["input_ids"].shape[-1])
        if t == 0 or not bool(torch.as_tensor(pack["attention_mask"]).any()):
            raise ValueError(
                f"pack {row} (sample_ids={_ids(pack)}) has no document token; it would be an "
                "all-padding row. Drop it before collating (its samples were likely overlong)."
            )
        lengths.append(t)
    s = _target_length(lengths, batch, max_length, multiple)
    b = len(batch)
    pos_dims = {int(torch.as_tensor(p["position_ids"]).dim()) for p in batch if "position_ids" in p}
    if len(pos_dims) > 1 or (pos_dims and len([p for p in batch if "position_ids" in p]) < b):
        raise ValueError(
            "packs disagree on position_ids: some are mRoPE [3,T], some [T] or missing "
            f"(sample_ids={[_ids(p) for p in batch]}); build every pack with the same has_mrope."
        )
    mrope = pos_dims == {2}

    input_ids = torch.full((b, s), padding_idx, dtype=torch.long)
    labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.long)
    doc_ids = torch.zeros((b, s), dtype=torch.long)
    mm = torch.zeros((b, s), dtype=torch.long)
    pos = torch.zeros((3, b, s) if mrope else (b, s), dtype=torch.long)
    text_pos = torch.zeros((b, s), dtype=torch.long)
    has_text_pos = all("text_position_ids" in p for p in batch)
    for row, (pack, t) in enumerate(zip(batch, lengths, strict=True)):
        input_ids[row, :t] = pack["input_ids"]
        labels[row, :t] = pack["labels"]
        doc_ids[row, :t] = pack["attention_mask"]
        if pack.get("mm_token_type_ids") is not None:
            mm[row, :t] = torch.as_tensor(pack["mm_token_type_ids"]).reshape(-1)
        if "position_ids" in pack:
            pos[..., row, :t] = torch.as_tensor(pack["position_ids"])
        if has_text_pos:
            text_pos[row, :t] = pack["text_position_ids"]
    try:
        M.check_doc_ids(doc_ids)
    except ValueError:
        for row, pack in enumerate(batch):  # error path only: find the pack to name
            try:
                M.check_doc_ids(doc_ids[row : row + 1])
            except ValueError as err:
                raise ValueError(
                    f"pack {row} (sample_ids={_ids(pack)}): bad attention_mask (document ids "
                    f"1..k in order, 0 = padding at the end): {err}"
                ) from err
        raise
    if not has_text_pos:
        text_pos = M.to_text_position_ids(doc_ids, validate=False)
    if not pos_dims:
        pos = text_pos
    elif mrope and fmt in MASK_FREE_FORMATS:
        pos = M.to_mrope_text_position_ids(text_pos, pos)
    return _Padded(input_ids, labels, mm, doc_ids, pos, None)


def _media_token_counts(mm: Tensor) -> list[tuple[int, int]]:
    """Per row of a CPU ``[B, S]`` mm_token_type_ids: (image tokens, video tokens).

    numpy on a zero-copy view: a text-only batch costs one ``count_nonzero`` pass (~15 us at
    B=4, S=16384, about half of torch's on one thread).
    """
    types = mm.numpy()
    if not np.count_nonzero(types):
        return [(0, 0)] * mm.shape[0]
    images = np.count_nonzero(types == 1, axis=1).tolist()
    videos = np.count_nonzero(types == 2, axis=1).tolist()
    return list(zip(images, videos, strict=True))


def _collate_media(
    batch: Sequence[Mapping[str, Any]],
    pixel_dtype: torch.dtype | None,
    merge: int,
    check: bool,
    tokens: Sequence[tuple[int, int]] | None = None,
    *,
    shared: bool = False,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n_img, n_vid = [], []
    for row, pack in enumerate(batch):
        if check:
            i, v = _check_pack_media(pack, row, merge, None if tokens is None else tokens[row])
        else:
            i = int(pack.get("n_images") or 0)
            v = int(pack.get("n_videos") or 0)
        n_img.append(i)
        n_vid.append(v)
    for key in PIXEL_KEYS:
        vals = [p[key] for p in batch if p.get(key) is not None]
        if vals:
            out[key] = merge_media(vals, pixel_dtype, shared=shared)
    for key in MEDIA_CAT_KEYS:
        vals = [p[key] for p in batch if p.get(key) is not None]
        if vals:
            out[key] = torch.cat(vals)
    if any(n_img):
        out["n_images_per_sample"] = torch.tensor(n_img, dtype=torch.long)
    if any(n_vid):
        out["n_videos_per_sample"] = torch.tensor(n_vid, dtype=torch.long)
    return out


# --------------------------------------------------------------------------------------------
# Non-packed collates (one sample per row), placeholder expansion, robust retry wrapper.
# --------------------------------------------------------------------------------------------

TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids")


def _pad_id(processor: Any) -> int:
    tok = getattr(processor, "tokenizer", processor)
    pad = getattr(tok, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def _pad_samples(
    examples: Sequence[Mapping[str, Any]], pad_to: int | None, pad_id: int, truncate: bool
) -> dict[str, Any]:
    """Right-pad unshifted samples to ``[B, pad_to]`` (no shift). Overlong: error or cut."""
    if len(examples) == 0:
        raise ValueError("empty batch: a collate needs at least one sample")
    ids = [torch.as_tensor(ex["input_ids"]).reshape(-1) for ex in examples]
    s = max(int(t.numel()) for t in ids) if pad_to is None else pad_to
    b = len(examples)
    out = {
        "input_ids": torch.full((b, s), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((b, s), dtype=torch.long),
        "labels": torch.full((b, s), IGNORE_INDEX, dtype=torch.long),
        "mm_token_type_ids": torch.zeros((b, s), dtype=torch.long),
    }
    fill = {"attention_mask": 1, "labels": None, "mm_token_type_ids": 0}
    for row, ex in enumerate(examples):
        n = int(ids[row].numel())
        sid = ex.get("sample_id", row)
        if n > s:
            mm = ex.get("mm_token_type_ids")
            cuts_media = mm is not None and bool(torch.as_tensor(mm).reshape(-1)[s:].any())
            if not truncate or cuts_media:
                why = "would cut multimodal tokens" if truncate else "pass truncate=True to cut"
                raise ValueError(
                    f"sample {sid} has {n} tokens > max_length={s}; {why} (or drop the sample)."
                )
            n = s
        out["input_ids"][row, :n] = ids[row][:n]
        for key, default in fill.items():
            v = ex.get(key)
            if v is not None:
                out[key][row, :n] = torch.as_tensor(v).reshape(-1)[:n]
            elif default is not None:
                out[key][row, :n] = default
            else:
                raise ValueError(f"sample {sid} has no {key!r}; tokenize it with labels first")
    return out


def _shift(batch: dict[str, Any]) -> dict[str, Any]:
    """The autoregressive shift: ``labels[:, 1:]`` and every other token tensor ``[:, :-1]``."""
    batch["labels"] = batch["labels"][:, 1:]
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        batch[key] = batch[key][:, :-1]
    return batch


def pad_collate_fn(
    examples: Sequence[Mapping[str, Any]],
    processor: Any,
    max_length: int | None = None,
    *,
    truncate: bool = False,
    pixel_dtype: torch.dtype | None = None,
    spatial_merge_size: int = 2,
    shared_memory: bool = False,
) -> dict[str, Any]:
    """Collate pre-tokenized, *unshifted* samples (docs/data_contracts.md section 4), unpacked.

    Pads to ``max_length`` (or the longest sample) with the tokenizer's pad id, ``-100`` labels
    and a 0 mask, then shifts: outputs are ``[B, pad_to - 1]``. A sample longer than
    ``max_length`` is a ``ValueError`` naming it unless ``truncate=True`` (the seed truncates
    silently, even through image tokens; here a cut into media is always an error). Media are
    concatenated with ``n_images_per_sample`` / ``n_videos_per_sample`` (into shared memory with
    ``shared_memory=True``, as ``neat_packed_vlm_collater``); ``sample_ids`` is ``[[id], ...]``.
    """
    batch = _pad_samples(examples, max_length, _pad_id(processor), truncate)
    batch = _shift(batch)
    batch["sample_ids"] = [[int(ex["sample_id"])] if "sample_id" in ex else [] for ex in examples]
    batch.update(
        _collate_media(examples, pixel_dtype, spatial_merge_size, True, shared=shared_memory)
    )
    return dict(add_label_counts(batch))


def default_collate_fn(
    examples: Sequence[Mapping[str, Any]],
    processor: Any,
    max_length: int | None = None,
    drop_overlong: bool = False,
    _post_tokenize_hook: Any = None,
) -> dict[str, Any]:
    """Tokenize raw conversations (records) with the real processor, pad, label and shift.

    Each record goes through ``neatpack.pipes.tokenize.tokenize_conversation`` (chat template,
    media, labels from role markers). With ``max_length`` and ``drop_overlong`` the samples
    longer than ``max_length`` are dropped and listed in ``dropped_sample_ids``; without
    ``drop_overlong`` an overlong sample is a ``ValueError`` (the seed truncates silently).
    ``_post_tokenize_hook(batch, processor) -> batch`` runs on the padded, unshifted batch.
    """
    from .tokenize import tokenize_conversation

    # Seed-style examples carry only "conversation": their row in the batch is their id.
    samples = [
        tokenize_conversation({"sample_id": row, **dict(ex)}, processor)
        for row, ex in enumerate(examples)
    ]
    dropped: list[int] = []
    if max_length is not None and drop_overlong:
        keep = [s for s in samples if int(s["input_ids"].numel()) <= max_length]
        dropped = [int(s["sample_id"]) for s in samples if int(s["input_ids"].numel()) > max_length]
        if not keep:
            raise ValueError(f"all {len(samples)} samples exceed {max_length=}: {dropped=}")
        samples = keep
    batch = _pad_samples(samples, max_length, _pad_id(processor), truncate=False)
    if _post_tokenize_hook is not None:
        batch = _post_tokenize_hook(batch, processor)
    batch = _shift(batch)
    batch["sample_ids"] = [[int(s["sample_id"])] for s in samples]
    batch["dropped_sample_ids"] = dropped
    batch.update(_collate_media(samples, None, 2, True))
    return dict(add_label_counts(batch))


def expand_image_tokens(
    input_ids: Tensor,
    attention_mask: Tensor,
    grid_thws: Tensor,
    media_token_id: int,
    merge_kernel_size: tuple[int, int] = (2, 2),
    *,
    length: int | None = None,
    pad_token_id: int = 0,
) -> tuple[Tensor, Tensor]:
    """Expand each image placeholder to ``(h // mh) * (w // mw)`` copies (mask 1), vectorized.

    With ``length`` the result is right-padded to exactly that many tokens (pad id, mask 0), so
    pipeline-parallel stages see a fixed sequence length before the forward::

        ids [5, 9, 6], grid [[1, 4, 4]], token 9, merge (2, 2)  ->  [5, 9, 9, 9, 9, 6]
    """
    is_ph = input_ids == media_token_id
    n = int(is_ph.sum())
    if n != int(grid_thws.shape[0]):
        raise ValueError(
            f"{n} placeholder tokens ({media_token_id=}) but grid_thws has {grid_thws.shape[0]} "
            "rows; one placeholder per image is required."
        )
    mh, mw = merge_kernel_size
    per_image = (grid_thws[:, 1] // mh) * (grid_thws[:, 2] // mw)
    repeats = torch.ones_like(input_ids, dtype=torch.long)
    repeats[is_ph] = per_image.to(torch.long)
    ids = input_ids.repeat_interleave(repeats)
    mask = attention_mask.repeat_interleave(repeats)
    mask[ids == media_token_id] = 1
    if length is not None:
        if ids.numel() > length:
            raise ValueError(f"expanded sequence has {ids.numel()} tokens > {length=}")
        pad = length - ids.numel()
        ids = torch.cat([ids, ids.new_full((pad,), pad_token_id)])
        mask = torch.cat([mask, mask.new_zeros(pad)])
    return ids, mask


_expand_image_tokens = expand_image_tokens  # the seed's name


def _stable_seed(seed: int, examples: Sequence[Any], attempt: int) -> int:
    ids: list[int] = []
    for ex in examples:
        if isinstance(ex, Mapping):
            ids.extend(int(i) for i in ex.get("sample_ids", [ex.get("sample_id", -1)]))
        elif isinstance(ex, int):  # a dataset index of a replacement batch
            ids.append(ex)
    key = f"{seed}:{attempt}:{ids}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class RobustCollate:
    """Retry a failing collate on a deterministic replacement batch; every failure is recorded.

    On an exception the whole batch is replaced by ``len(examples)`` rows ``dataset[k]``, the
    indices ``k`` drawn from ``random.Random`` seeded by ``(seed, attempt, sample ids of the
    failing batch)``: the same on every rank and every run, never the global RNG (peer bug
    B12). ``dataset[k]`` must return what ``collate_fn`` takes, so a dataset of packs gives
    packs (peer bug B1 resampled unpacked samples there). A replacement row that fails to load
    counts as a failed attempt too. After ``max_retries`` failed attempts (the first included)
    a ``RuntimeError`` names every failing batch.

    Nothing is silent: each failure is logged (WARNING) and appended to ``failures`` as
    ``{"attempt", "sample_ids", "rows", "error", "replacement"}`` (``rows``: the dataset indices
    of the failing batch, ``None`` for the caller's own; ``replacement``: the indices tried
    next), and a dict batch that needed a retry carries the same list under
    ``"collate_failures"`` (it travels out of worker processes, where ``failures`` does not).

    >>> robust = RobustCollate(["a", "b", "c"], lambda rows: "".join(rows).upper(), seed=1)
    >>> robust(["a", 1])  # "".join fails on the int: retried on rows of the dataset
    'CC'
    >>> robust.failures[0]["rows"], robust.failures[0]["replacement"]
    (None, [2, 2])
    """

    def __init__(self, dataset: Any, collate_fn: Any, max_retries: int = 10, *, seed: int = 0):
        if max_retries < 1:
            raise ValueError(f"max_retries must be >= 1; got {max_retries=}")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.max_retries = max_retries
        self.seed = seed
        self.failures: list[dict[str, Any]] = []

    def __call__(self, examples: Sequence[Any]) -> Any:
        batch: list[Any] = list(examples)
        rows: list[int] | None = None  # dataset indices of `batch`; None: the caller's batch
        failures: list[dict[str, Any]] = []
        last: Exception | None = None
        for attempt in range(self.max_retries):
            try:
                if rows is not None:
                    batch = [self.dataset[k] for k in rows]
                out = self.collate_fn(batch)
            except Exception as err:  # the collate (or a replacement row) may raise anything
                last = err
                ids = [_row_ids(ex) for ex in batch] if batch else None
                picks = self._replacement(batch if rows is None else rows, attempt, len(examples))
                failure = {"attempt": attempt, "sample_ids": ids, "rows": rows,
                           "error": repr(err), "replacement": picks}  # fmt: skip
                failures.append(failure)
                self.failures.append(failure)
                _LOG.warning("collate failed (attempt %d, rows %s, sample ids %s): %r; retrying "
                             "with dataset rows %s", attempt, rows, ids, err, picks)  # fmt: skip
                rows, batch = picks, []
                continue
            if failures and isinstance(out, dict):
                out["collate_failures"] = failures
            return out
        raise RuntimeError(
            f"Collate failed after {self.max_retries} retries. Last error: {last}. Failing "
            f"batches (attempt, dataset rows or None for the original, sample ids): "
            f"{[(f['attempt'], f['rows'], f['sample_ids']) for f in failures]}. Fix the rows "
            "named here or the collate function; raise max_retries to try more replacements"
        ) from last

    def _replacement(self, batch: Sequence[Any], attempt: int, n: int) -> list[int]:
        size = len(self.dataset)
        if size == 0:
            raise RuntimeError(
                "RobustCollate: the dataset is empty; there is nothing to retry with"
            )
        rng = random.Random(_stable_seed(self.seed, batch, attempt))
        return [rng.randrange(size) for _ in range(n)]


def _row_ids(example: Any) -> Any:
    if isinstance(example, Mapping):
        return example.get("sample_ids", example.get("sample_id"))
    return None


def make_robust_collate(dataset: Any, collate_fn: Any, max_retries: int = 10) -> RobustCollate:
    """Wrap ``collate_fn`` so that on failure the entire batch is re-sampled (see RobustCollate)."""
    return RobustCollate(dataset, collate_fn, max_retries)
