"""Shift samples and concatenate them into one pack (docs/data_contracts.md section 5).

Each sample is shifted on its own (`input_ids[:-1]`, `labels[1:]`), so no label ever crosses a
document, then the samples are laid end to end. Example, two samples of 4 and 3 tokens,
alignment 1, `pack_size=8`::

    sample 17  ids a b c d   labels  . b c d        (. = -100)
    sample 4   ids e f g     labels  . . g
    shifted    ids a b c | e f       labels b c d | . g
    pack       input_ids          a b c e f 0 0 0
               labels             b c d . g . . .
               attention_mask     1 1 1 2 2 0 0 0   (document ids; 0 = padding)
               text_position_ids  0 1 2 0 1 0 0 0
               seq_lens [3, 2]  seq_lens_padded [3, 2]  sample_ids [17, 4]

>>> import torch
>>> s = [{"sample_id": 17, "input_ids": torch.tensor([5, 6, 7, 8]),
...       "labels": torch.tensor([-100, 6, 7, 8])},
...      {"sample_id": 4, "input_ids": torch.tensor([9, 10, 11]),
...       "labels": torch.tensor([-100, -100, 11])}]
>>> p = build_pack(s, pack_size=8)
>>> p["labels"].tolist(), p["attention_mask"].tolist()
([6, 7, 8, -100, 11, -100, -100, -100], [1, 1, 1, 2, 2, 0, 0, 0])

mRoPE ids (`[3, L]`) are computed per sample from the *unshifted* ids (the vision grids need
the whole sample), then shifted with it; each document's ids start at its own origin.

Alignment (context parallelism): each document is padded to a multiple of `alignment` with
`padding_idx`, label -100 and the document's own id; its positions continue through the pad
(text and all three mRoPE rows count up from the document's largest position + 1), so the pad
looks like trailing text that nothing real attends to. The seed raises NotImplementedError for
mRoPE with alignment; this does not.

Masked tokens (sample `attention_mask == 0`, the vision tokens of an injected fake image):
the seed gives them the document's id, so the rest of the document attends to the fake image
(peer note B8). Here they are moved, in order, to the END of their document, with labels -100.
Causality then hides them from every real token of the document, for every mask format (4D,
cu_seqlens, [4, B, S] positions), and the real tokens keep the positions the model gives them
with that attention mask (the masked tokens are left out of the numbering). A fake image is
only injected into a sample with no media, so the media order is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from neatpack.pipes.contracts import Pack
from neatpack.pipes.materializing._tensors import adjacent_view
from neatpack.pipes.materializing.loss import CROSS_ENTROPY_IGNORE_IDX
from neatpack.pipes.materializing.mrope import (
    MRopeConfig,
    compute_mrope_position_ids,
    mrope_position_ids,
)

IGNORE_INDEX = (
    CROSS_ENTROPY_IGNORE_IDX  # one value for the whole package (pipes/materializing/loss.py)
)
MEDIA_KEYS: tuple[str, ...] = (
    "pixel_values",
    "image_grid_thw",
    "image_position_ids",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)
MRopeSpec = bool | MRopeConfig | Callable[..., Any]


def _flat(x: Any) -> torch.Tensor:
    return torch.as_tensor(x).reshape(-1)


def shift_sample(sample: dict[str, Any], has_mrope: bool = False) -> dict[str, Any]:
    """The per-sample autoregressive shift: `input_ids[:-1]`, `labels[1:]`, the rest `[:-1]`.

    Keeps `sample_id`, media keys (by reference) and `position_ids` (`[..., :-1]`; `has_mrope`
    is accepted for seed compatibility, positions are shifted whenever present). A missing
    `attention_mask` means all ones. Labels on masked tokens become -100. Raises ValueError
    naming the sample when it has fewer than 2 tokens or its tensors disagree in length.
    """
    sid = sample.get("sample_id")
    ids = _flat(sample["input_ids"]).long()
    labels = _flat(sample["labels"]).long()
    n = ids.shape[0]
    am = sample.get("attention_mask")
    mask = torch.ones(n, dtype=torch.long) if am is None else _flat(am).long()
    mm = sample.get("mm_token_type_ids")
    types = torch.zeros(n, dtype=torch.long) if mm is None else _flat(mm).long()
    if n < 2:
        raise ValueError(f"sample {sid}: {n} token(s); a sample needs >= 2 tokens to be shifted")
    for name, t in (("labels", labels), ("attention_mask", mask), ("mm_token_type_ids", types)):
        if t.shape[0] != n:
            raise ValueError(f"sample {sid}: {name} has {t.shape[0]} entries, input_ids has {n}")
    out: dict[str, Any] = {
        "input_ids": ids[:-1],
        "labels": labels[1:].masked_fill(mask[:-1] == 0, IGNORE_INDEX),
        "attention_mask": mask[:-1],
        "mm_token_type_ids": types[:-1],
    }
    if sid is not None:
        out["sample_id"] = int(sid)
    pos = sample.get("position_ids")
    if pos is not None:
        pos = torch.as_tensor(pos)
        pos = pos.reshape(3, -1) if pos.dim() == 3 else pos
        if pos.shape[-1] != n:
            raise ValueError(f"sample {sid}: position_ids {tuple(pos.shape)} vs {n} tokens")
        out["position_ids"] = pos[..., :-1]
    for key in MEDIA_KEYS:
        if sample.get(key) is not None:
            out[key] = sample[key]
    return out


def sample_mrope(sample: dict[str, Any], mrope: MRopeSpec) -> torch.Tensor:
    """`[3, L]` mRoPE ids of an unshifted sample: its own `position_ids` (mrope=True), or
    computed with an `MRopeConfig` or a user `get_rope_index` callable."""
    sid = sample.get("sample_id")
    if isinstance(mrope, MRopeConfig):
        ids = _flat(sample["input_ids"])
        mm = sample.get("mm_token_type_ids")
        return mrope_position_ids(
            ids,
            mrope.token_types(ids) if mm is None else _flat(mm),
            sample.get("image_grid_thw"),
            sample.get("video_grid_thw"),
            sample.get("second_per_grid_ts"),
            config=mrope,
            attention_mask=sample.get("attention_mask"),
        )
    if callable(mrope):
        pos = compute_mrope_position_ids(sample, mrope)
        if pos is None:
            raise ValueError(f"sample {sid}: get_rope_index {mrope!r} has no input_ids argument")
        return pos
    pos = sample.get("position_ids")
    if pos is None or torch.as_tensor(pos).dim() < 2:
        raise ValueError(
            f"sample {sid}: mrope=True needs the sample's [3, L] 'position_ids'; pass "
            "mrope=MRopeConfig.from_processor(processor) to compute them instead"
        )
    return torch.as_tensor(pos).reshape(3, -1)


def _masked_last(doc: dict[str, Any]) -> dict[str, Any]:
    """Move masked tokens (attention_mask 0) to the end of the document, keeping order.
    Also fills a missing attention_mask (ones) / mm_token_type_ids (zeros)."""
    ids = _flat(doc["input_ids"]).long()
    doc = dict(doc, input_ids=ids, labels=_flat(doc["labels"]).long())
    for key in ("attention_mask", "mm_token_type_ids"):
        val = doc.get(key)
        doc[key] = torch.full_like(ids, key == "attention_mask") if val is None else _flat(val)
    if doc.get("position_ids") is not None:
        doc["position_ids"] = torch.as_tensor(doc["position_ids"]).long()
    mask = doc["attention_mask"]
    if bool(mask.all()):
        return doc
    order = torch.cat([torch.nonzero(mask != 0).reshape(-1), torch.nonzero(mask == 0).reshape(-1)])
    out = dict(doc)
    for key in ("input_ids", "labels", "attention_mask", "mm_token_type_ids"):
        out[key] = doc[key][order]
    if doc.get("position_ids") is not None:
        out["position_ids"] = doc["position_ids"][..., order]
    return out


def _cat_media(docs: Sequence[dict[str, Any]], key: str) -> Any:
    vals = [d[key] for d in docs if d.get(key) is not None]
    if not vals:
        return None
    tensors = [torch.as_tensor(v) for v in vals]
    if len(tensors) == 1:
        return tensors[0]  # no copy: pixel rows are the bulk of a pack's bytes
    if len({tuple(t.shape[1:]) for t in tensors}) == 1:
        joined = adjacent_view(tensors)
        return torch.cat(tensors, dim=0) if joined is None else joined
    return [t for v in tensors for t in v]  # seed behaviour: ragged -> one tensor per item


def concat_shifted(
    shifted: Sequence[dict[str, Any]],
    *,
    padding_idx: int = 0,
    alignment: int = 1,
    pack_size: int | None = None,
    mrope: bool = False,
) -> Pack:
    """Lay already-shifted samples end to end into one pack (the core of `build_pack`)."""
    if alignment < 1:
        raise ValueError(f"{alignment=} must be >= 1")
    cols: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("input_ids", "labels", "attention_mask", "mm_token_type_ids", "text_pos")
    }
    mpos: list[torch.Tensor] = []
    seq_lens: list[int] = []
    seq_lens_padded: list[int] = []
    for k, raw in enumerate(shifted, start=1):
        doc = _masked_last(raw)
        n = int(doc["input_ids"].shape[0])
        lp = -(-n // alignment) * alignment
        pad = lp - n
        cols["input_ids"] += [doc["input_ids"], torch.full((pad,), padding_idx)]
        cols["labels"] += [doc["labels"], torch.full((pad,), IGNORE_INDEX)]
        cols["attention_mask"].append(torch.full((lp,), k))
        cols["mm_token_type_ids"] += [doc["mm_token_type_ids"], torch.zeros(pad, dtype=torch.long)]
        cols["text_pos"].append(torch.arange(lp))
        if mrope:
            pos = doc.get("position_ids")
            if pos is None or pos.dim() != 2 or pos.shape[0] != 3:
                raise ValueError(
                    f"sample {doc.get('sample_id')}: mrope=True needs [3, L] position_ids"
                )
            top = int(pos.max()) + 1 if pos.numel() else 0
            mpos += [pos.long(), (torch.arange(pad) + top).expand(3, -1)]
        seq_lens.append(n)
        seq_lens_padded.append(lp)
    total = sum(seq_lens_padded)
    tail = 0
    if pack_size is not None:
        if total > pack_size:
            ids = [d.get("sample_id") for d in shifted]
            raise ValueError(
                f"pack of samples {ids} is {total} tokens after the shift (lengths {seq_lens}, "
                f"{alignment=}) but {pack_size=}; drop or truncate samples first "
                "(materialize_pack's overflow policy), or raise pack_size"
            )
        tail = pack_size - total
    fills = {"input_ids": padding_idx, "labels": IGNORE_INDEX}
    ids = [int(d["sample_id"]) for d in shifted if "sample_id" in d]
    pack: dict[str, Any] = {"sample_ids": ids}
    for key, parts in cols.items():
        parts.append(torch.full((tail,), fills.get(key, 0), dtype=torch.long))
        pack[key] = torch.cat(parts).long()
    pack["text_position_ids"] = pack.pop("text_pos")
    if mrope:
        mpos.append(torch.zeros(3, tail, dtype=torch.long))
        pack["position_ids"] = torch.cat(mpos, dim=1)
    else:
        pack["position_ids"] = pack["text_position_ids"].clone()
    pack["seq_lens"] = seq_lens
    pack["seq_lens_padded"] = seq_lens_padded
    for key in MEDIA_KEYS:
        pack[key] = _cat_media(shifted, key)
    ig, vg = pack["image_grid_thw"], pack["video_grid_thw"]
    pack["n_images"] = 0 if ig is None else int(torch.as_tensor(ig).shape[0])
    pack["n_videos"] = 0 if vg is None else int(torch.as_tensor(vg).shape[0])
    return cast(Pack, pack)  # every key of the contract is set above


def build_pack(
    samples: Sequence[dict[str, Any]],
    *,
    padding_idx: int = 0,
    alignment: int = 1,
    pack_size: int | None = None,
    mrope: MRopeSpec = False,
    shift: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Pack:
    """Shift each UNSHIFTED sample (docs/data_contracts.md section 4) and concatenate them.

    `shift`: the per-sample shift step (default `shift_sample`; `neatpack.pipes.Shifter` or
    a replacement that returns the sample one token shorter, labels[t] scoring token t+1).

    `mrope`: False for 1-D positions; True to use each sample's own `[3, L]` `position_ids`;
    an `MRopeConfig` or a `get_rope_index` callable to compute them (before the shift).
    `pack_size`: pad the tail to it (doc id 0, label -100, position 0), or raise ValueError if
    the shifted, aligned samples do not fit. None: no tail padding.
    """
    shifted = []
    for s in samples:
        if isinstance(mrope, MRopeConfig) and s.get("mm_token_type_ids") is None:
            s = dict(s, mm_token_type_ids=mrope.token_types(_flat(s["input_ids"])))
        if mrope is not False:
            s = dict(s, position_ids=sample_mrope(s, mrope))
        shifted.append(shift_sample(s) if shift is None else shift(s))
    return concat_shifted(
        shifted,
        padding_idx=padding_idx,
        alignment=alignment,
        pack_size=pack_size,
        mrope=mrope is not False,
    )


def build_packed_sample(
    samples: Sequence[dict[str, Any]], pack_size: int, padding_idx: int = 0
) -> dict[str, torch.Tensor]:
    """Seed-compatible public `_build_packed_sample` (LLM path): NO shift (labels are expected
    pre-shifted), document ids 1..k, positions restart per document, padded to `pack_size`.
    The seed returns a row longer than `pack_size` when the samples overflow; this raises."""
    docs = []
    for s in samples:
        ids = _flat(s["input_ids"]).long()
        docs.append(
            {"input_ids": ids, "labels": _flat(s["labels"]).long(),
             "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
        )  # fmt: skip
        if "sample_id" in s:
            docs[-1]["sample_id"] = s["sample_id"]
    pack = concat_shifted(docs, padding_idx=padding_idx, pack_size=pack_size)
    return {k: pack[k] for k in ("input_ids", "labels", "attention_mask", "position_ids")}


def _media_spans(
    types: torch.Tensor, grids: dict[int, list[list[int]]], merge: int, sample_id: str
) -> list[tuple[int, int, int, int]]:
    """(kind, item index, first token, last token) of every image / video, in id order."""
    counts = {
        1: [t * h * w // merge**2 for t, h, w in grids[1]],
        2: [t * h * w // merge**2 for t, h, w in grids[2]],
    }
    spans: list[tuple[int, int, int, int]] = []
    for kind in (1, 2):
        where = torch.nonzero(types == kind).reshape(-1).tolist()
        at = 0
        for item, n in enumerate(counts[kind]):
            if at + n > len(where):
                raise ValueError(
                    f"sample {sample_id}: its media grids need more vision tokens than its "
                    "ids hold; the sample is inconsistent (re-tokenize it)"
                )
            spans.append((kind, item, where[at], where[at + n - 1]))
            at += n
    return spans


def truncate_sample(sample: dict[str, Any], length: int, *, merge: int = 2) -> dict[str, Any]:
    """The first `length` tokens of an UNSHIFTED sample, never cutting through an image or a
    video: the cut moves back to the start of the first media item that would be cut, and the
    media of the items after the cut are dropped (pixel rows, grid rows, `second_per_grid_ts`).
    `position_ids`, if present, are sliced (they were computed on the whole sample)."""
    ids = _flat(sample["input_ids"])
    if length >= ids.shape[0]:
        return dict(sample)
    mm = sample.get("mm_token_type_ids")
    types = torch.zeros_like(ids) if mm is None else _flat(mm)
    grids: dict[int, list[list[int]]] = {
        1: torch.as_tensor(sample.get("image_grid_thw", torch.zeros(0, 3))).tolist(),
        2: torch.as_tensor(sample.get("video_grid_thw", torch.zeros(0, 3))).tolist(),
    }
    spans = _media_spans(types, grids, merge, str(sample.get("sample_id")))
    cut = min([length] + [first for _, _, first, last in spans if last >= length])
    kept = {1: 0, 2: 0}
    for kind, item, first, _ in spans:
        if first < cut:
            kept[kind] = max(kept[kind], item + 1)
    out = dict(sample)
    for key in ("input_ids", "labels", "attention_mask", "mm_token_type_ids"):
        if sample.get(key) is not None:
            out[key] = _flat(sample[key])[:cut]
    if sample.get("position_ids") is not None:
        out["position_ids"] = torch.as_tensor(sample["position_ids"])[..., :cut]
    for kind, grid_key, pv_key in ((1, "image_grid_thw", "pixel_values"),
                                   (2, "video_grid_thw", "pixel_values_videos")):  # fmt: skip
        if sample.get(grid_key) is None:
            continue
        n = kept[kind]
        rows = sum(int(torch.tensor(g).prod()) for g in grids[kind][:n])
        out[grid_key] = torch.as_tensor(sample[grid_key])[:n] if n else None
        if sample.get(pv_key) is not None:
            out[pv_key] = torch.as_tensor(sample[pv_key])[:rows] if n else None
        if kind == 2 and sample.get("second_per_grid_ts") is not None:
            out["second_per_grid_ts"] = (
                torch.as_tensor(sample["second_per_grid_ts"])[:n] if n else None
            )
    return out
