"""Pad packs to ``[B, S]``: the text tensors of a batch (ids, labels, token types, document ids,
positions) before any attention mask is built.

``S`` is the longest pack, or ``max_length``, rounded up to ``pad_to_multiple_of``; padding is
``padding_idx`` in ``input_ids``, ``-100`` in labels and ``0`` (no document) in the ids::

    packs (doc ids) [1, 1, 1, 2, 2] and [1, 1, 1]   ->   [[1, 1, 1, 2, 2],
                                                           [1, 1, 1, 0, 0]]

``pad_packs_fast`` handles packs in the data contract's form (one ``torch.cat`` per output);
``pad_packs`` everything else, with the errors that name the bad pack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from neatpack.pipes.collating.collate_media import pack_sample_ids as _ids
from neatpack.pipes.collating.doc_ids import check_doc_ids, doc_ids_match_lengths
from neatpack.pipes.collating.mask_format import MASK_FREE_FORMATS
from neatpack.pipes.collating.text_positions import to_mrope_text_position_ids, to_text_position_ids
from neatpack.pipes.materializing.loss import CROSS_ENTROPY_IGNORE_IDX

__all__ = [
    "PaddedPacks",
    "pad_packs",
    "pad_packs_fast",
    "target_length",
]

IGNORE_INDEX = (
    CROSS_ENTROPY_IGNORE_IDX  # one value for the whole package (pipes/materializing/loss.py)
)


def target_length(
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


class PaddedPacks(NamedTuple):
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


def pad_packs_fast(
    batch: Sequence[Mapping[str, Any]],
    padding_idx: int,
    max_length: int | None,
    multiple: int | None,
    fmt: str,
) -> PaddedPacks | None:
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
    not, None sends the batch to :func:`pad_packs`, whose checks raise the error that names
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
        s = target_length(lengths, batch, max_length, multiple)
    except ValueError:
        return None  # raised by pad_packs, after the per-pack checks that come first there
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
    if not doc_ids_match_lengths(doc_ids, doc_lengths):
        return None  # checked first: an off-contract batch costs one cat before pad_packs
    positions: list[_Plane] = []
    if need_text:
        positions.append(([p["text_position_ids"] for p in batch], zeros))
    if mrope:
        rows = [p["position_ids"].unbind(0) for p in batch]
        positions.extend(([r[j] for r in rows], zeros) for j in range(3))
    elif has_pos:
        positions.append(([p["position_ids"] for p in batch], zeros))
    return PaddedPacks(
        input_ids=padded([([p["input_ids"] for p in batch], pad_ids)], (b, s)),
        labels=padded([([p["labels"] for p in batch], pad_labels)], (b, s)),
        mm_token_type_ids=padded([([p.get("mm_token_type_ids") for p in batch], zeros)], (b, s)),
        doc_ids=doc_ids,
        # [4, B, S] (text row + mRoPE), [3, B, S], or [B, S] (the packs' or text positions)
        position_ids=padded(positions, (len(positions), b, s) if mrope else (b, s)),
        doc_lengths=doc_lengths,
    )


def pad_packs(
    batch: Sequence[Mapping[str, Any]],
    padding_idx: int,
    max_length: int | None,
    multiple: int | None,
    fmt: str,
) -> PaddedPacks:
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
    s = target_length(lengths, batch, max_length, multiple)
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
        check_doc_ids(doc_ids)
    except ValueError:
        for row, pack in enumerate(batch):  # error path only: find the pack to name
            try:
                check_doc_ids(doc_ids[row : row + 1])
            except ValueError as err:
                raise ValueError(
                    f"pack {row} (sample_ids={_ids(pack)}): bad attention_mask (document ids "
                    f"1..k in order, 0 = padding at the end): {err}"
                ) from err
        raise
    if not has_text_pos:
        text_pos = to_text_position_ids(doc_ids, validate=False)
    if not pos_dims:
        pos = text_pos
    elif mrope and fmt in MASK_FREE_FORMATS:
        pos = to_mrope_text_position_ids(text_pos, pos)
    return PaddedPacks(input_ids, labels, mm, doc_ids, pos, None)
