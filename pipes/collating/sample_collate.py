"""Collate unpacked samples, one per row: ``pad_collate_fn`` (pre-tokenized samples) and
``default_collate_fn`` (raw conversations, tokenized here). Both right-pad, then shift::

    samples [5, 6, 7] and [8, 9]  ->  input_ids [[5, 6], [8, 9]], labels [[6, 7], [9, -100]]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from neatpack.pipes.collating.collate_media import collate_media
from neatpack.pipes.contracts import Sample
from neatpack.pipes.materializing.loss import CROSS_ENTROPY_IGNORE_IDX, add_label_counts

__all__ = [
    "TOKEN_KEYS",
    "default_collate_fn",
    "pad_collate_fn",
]

IGNORE_INDEX = (
    CROSS_ENTROPY_IGNORE_IDX  # one value for the whole package (pipes/materializing/loss.py)
)
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
    examples: Sequence[Sample],
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
        collate_media(examples, pixel_dtype, spatial_merge_size, True, shared=shared_memory)
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

    Each record goes through ``neatpack.pipes.materializing.tokenize.tokenize_conversation`` (chat
    template,
    media, labels from role markers). With ``max_length`` and ``drop_overlong`` the samples
    longer than ``max_length`` are dropped and listed in ``dropped_sample_ids``; without
    ``drop_overlong`` an overlong sample is a ``ValueError`` (the seed truncates silently).
    ``_post_tokenize_hook(batch, processor) -> batch`` runs on the padded, unshifted batch.
    """
    from neatpack.pipes.materializing.tokenize import tokenize_conversation

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
    batch.update(collate_media(samples, None, 2, True))
    return dict(add_label_counts(batch))
