"""Seed-compatible lazy packed dataset: `PackedDatasetWrapper` and `neat_pack_dataset_vlm`.

Same signatures as the seed (peer notes 3.6, 3.7), map-style, one pack built per
`__getitem__` from an inner dataset of tokenized, UNSHIFTED samples. For new code prefer the
node graph (`materialize_pack` in a `ParallelMapper`). Seed bugs fixed here:

* B3: an overlong sample no longer becomes a silent zero-length pack: `neat_pack_dataset_vlm`
  raises at plan time unless `drop_long_samples=True`, and any runtime drop is counted in the
  pack's `report`.
* B4: an empty pack keeps the position rank (`[3, 0]` with mRoPE), so collation cannot fail.
* B8: fake-image tokens stay masked (moved to the end of their document, see
`pipes/materializing/pack.py`).
* B14 / B15: overflow drops and replacements are listed in `pack["report"]`, not DEBUG logs.
* B17: a `get_rope_index` whose signature cannot be used is an error, not a silent 1-D fallback.
* B20: `max_retries` is used: a failing inner sample is replaced deterministically
  (`random.Random(f"{seed}:{sample_id}:{attempt}")`), at most `max_retries` times.
* mRoPE with `sequence_alignment > 1` works (the seed raised NotImplementedError).
* B1 / B12: `robust_collate` no longer delegates to the inner (unpacked) dataset: a failing
  collate is retried on replacement *packs* of this dataset, drawn from an RNG seeded by
  (`seed`, attempt, ids), never the global one; failures are logged and listed with their ids.
* B2: `max_packs` keeps the first packs in creation order, before the balancing order.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from neatpack.pipes.collating.robust_collate import RobustCollate
from neatpack.pipes.contracts import Pack
from neatpack.pipes.materializing.mrope import compute_mrope_position_ids
from neatpack.pipes.materializing.pack import concat_shifted, shift_sample


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class PackedDatasetWrapper(Dataset[Pack]):
    """A Dataset that materializes pack `k` (`bins[k]`, sample indices into `inner_dataset`)
    lazily in `__getitem__`: load, mRoPE (if `get_rope_index`), shift, first-fit into
    `pack_size` in bin order, concatenate. No tail padding (the collater pads), as in the seed.
    Each pack also carries `report`: `{"planned", "packed", "dropped", "replaced", "failed"}`.
    """

    def __init__(
        self,
        inner_dataset: Any,
        bins: Sequence[Sequence[int]],
        pack_size: int,
        padding_idx: int = 0,
        sequence_alignment: int = 1,
        get_rope_index: Callable[..., Any] | None = None,
        max_retries: int = 10,
        *,
        seed: int = 0,
    ) -> None:
        if sequence_alignment < 1:
            raise ValueError(f"{sequence_alignment=} must be >= 1")
        if pack_size < 1:
            raise ValueError(f"{pack_size=} must be >= 1")
        if get_rope_index is not None:
            try:
                ok = "input_ids" in inspect.signature(get_rope_index).parameters
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(
                    f"{get_rope_index=} has no readable `input_ids` parameter; pass "
                    "model.model.get_rope_index (it lives on the base model, not on "
                    "*ForConditionalGeneration)"
                )
        self.inner = inner_dataset
        self.bins = [list(b) for b in bins]
        self.pack_size = pack_size
        self.padding_idx = padding_idx
        self.sequence_alignment = sequence_alignment
        self.get_rope_index = get_rope_index
        self.has_mrope = get_rope_index is not None
        self.max_retries = max_retries
        self.seed = seed
        # neat_pack_dataset_vlm's FallbackCounter: media items planned by a fallback, with ids
        self.fallbacks: Any = None

    def __len__(self) -> int:
        return len(self.bins)

    def _load(self, idx: int, replaced: list[list[int]], failed: list[int]) -> dict[str, Any]:
        current = idx
        for attempt in range(self.max_retries + 1):
            try:
                sample = dict(self.inner[current])
                break
            except Exception as exc:  # the inner dataset may raise anything; counted, retried
                failed.append(current)
                if attempt == self.max_retries:
                    raise RuntimeError(
                        f"sample {idx} and {attempt} replacement(s) failed to load "
                        f"(last id {current}): {exc}"
                    ) from exc
                rng = random.Random(f"{self.seed}:{idx}:{attempt + 1}")
                current = rng.randrange(len(self.inner))
        if current != idx:
            replaced.append([idx, current])
        sample.setdefault("sample_id", current)
        mm = sample.get("mm_token_type_ids")
        if mm is not None:
            sample["mm_token_type_ids"] = torch.as_tensor(mm).reshape(-1)
        if self.get_rope_index is not None:
            sample["position_ids"] = compute_mrope_position_ids(sample, self.get_rope_index)
        return sample

    def __getitem__(self, pack_idx: int) -> Pack:
        replaced: list[list[int]] = []
        failed: list[int] = []
        dropped: list[int] = []
        kept: list[dict[str, Any]] = []
        total = 0
        for idx in self.bins[pack_idx]:
            sh = shift_sample(self._load(idx, replaced, failed))
            n = _aligned(int(sh["input_ids"].shape[0]), self.sequence_alignment)
            if total + n > self.pack_size:  # seed rule: later, shorter samples may still fit
                dropped.append(int(sh["sample_id"]))
                continue
            kept.append(sh)
            total += n
        pack = concat_shifted(
            kept, padding_idx=self.padding_idx, alignment=self.sequence_alignment,
            mrope=self.has_mrope,
        )  # fmt: skip
        pack["report"] = {
            "planned": list(self.bins[pack_idx]), "packed": list(pack["sample_ids"]),
            "dropped": dropped, "replaced": replaced, "failed": failed,
        }  # fmt: skip
        return pack

    def robust_collate(self, collate_fn: Callable[..., Any]) -> RobustCollate:
        """Wrap `collate_fn`: a batch whose collate raises is replaced by packs of this dataset.

        Up to `max_retries` attempts; replacement pack indices come from `seed`, the attempt
        and the failing batch's sample ids (the same on every rank, run and worker), whether or
        not the inner dataset has a `robust_collate` of its own (the seed delegated to it and
        retried with unpacked samples, B1). Every failure is logged and recorded, with the
        sample ids and pack indices, in the wrapper's `failures` and beside the retried batch's
        keys (`batch.collate_failures`); when every attempt fails a `RuntimeError` names the
        batches.

        >>> ds = PackedDatasetWrapper([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}], [[0]], 8)
        >>> collate = ds.robust_collate(lambda packs: [p["sample_ids"] for p in packs])
        >>> collate([{"broken": True}])  # KeyError: retried with pack 0 of the dataset
        [[0]]
        >>> collate.failures[0]["replacement"]
        [0]
        """
        return RobustCollate(self, collate_fn, self.max_retries, seed=self.seed)


def neat_pack_dataset_vlm(
    dataset: Any,
    pack_size: int,
    padding_idx: int = 0,
    drop_long_samples: bool = False,
    max_packs: int | None = None,
    get_rope_index: Callable[..., Any] | None = None,
    ds_raw: Any = None,
    packing_ratio: float = 1.0,
    processor: Any = None,
    balance_media_tokens: bool = True,
    sequence_alignment: int = 1,
    *,
    text_tokens_include_template: bool = False,
) -> PackedDatasetWrapper:
    """Plan packs from estimated lengths and return a lazy `PackedDatasetWrapper`.

    With `ds_raw` (raw records, or a neatpack `RecordSource`) each sample is estimated with
    `LengthEstimator.from_processor(processor)` (shifted, aligned). Without it every sample is
    estimated at half the capacity, so packs hold 2 samples in index order (seed behaviour).
    Samples estimated longer than `pack_size` raise a ValueError naming them unless
    `drop_long_samples=True` (the seed kept them and produced empty packs, B3).

    Planning reads no media: a media block may be a placeholder (`{"type": "image"}`) sized
    by `mm_inputs_meta: {"images_meta": [[h, w], ...], "videos_meta": [...]}` (smart_resize
    with the processor's settings), or by a precomputed `_media_tokens`. A media item with
    neither, or every item when `processor` is None, counts the seed's 500 tokens; those are
    listed by reason with their sample ids in the returned wrapper's `fallbacks`. Only
    materializing (`wrapper[k]`) needs the pixels.

    Text is a precomputed `_text_tokens` or chars / 3, plus the chat template's own tokens
    (role markers, default system prompt, vision start/end), which the seed's precompute
    script leaves out (its packs overflowed). If your `_text_tokens` already count the
    template, pass `text_tokens_include_template=True`.

    >>> recs = [{"conversation": [{"role": "user", "content": [{"type": "image"}, "What?"]},
    ...                           {"role": "assistant", "content": "A cat."}],
    ...          "mm_inputs_meta": {"images_meta": None}}] * 3
    >>> packed = neat_pack_dataset_vlm(recs, pack_size=2048, ds_raw=recs)
    >>> packed.bins, dict(packed.fallbacks.counts)
    ([[0, 1, 2]], {'image_no_config': 3})
    """
    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.indexing.lengths import estimate_slice
    from neatpack.pipes.planning.binpack import greedy_knapsack
    from neatpack.pipes.planning.plan import greedy_knapsack_vt_balanced
    from neatpack.pipes.reading.read import SequenceSource

    if sequence_alignment < 1:
        raise ValueError(f"{sequence_alignment=} must be >= 1")
    if not 0 < packing_ratio <= 1:
        raise ValueError(f"{packing_ratio=} must be in (0, 1]")
    capacity = int(pack_size * packing_ratio)
    lengths: list[int] = []
    visual: list[int] = []
    valid: list[int] = []
    too_long: list[int] = []
    whole = text_tokens_include_template
    est = (
        LengthEstimator.from_processor(processor, text_tokens_include_template=whole)
        if processor
        else LengthEstimator(text_tokens_include_template=whole)
    )
    if ds_raw is not None:
        source = ds_raw if hasattr(ds_raw, "content_fingerprint") else SequenceSource(ds_raw)
        # the length index's block estimator: raw records on its fast path, the rest one by one
        totals, visuals, _, fallbacks = estimate_slice(source, est, 0, len(source), progress=False)
        for sid, reasons in fallbacks:
            est.fallbacks.add(sid, reasons)
        for i, (total, vt) in enumerate(zip(totals.tolist(), visuals.tolist(), strict=True)):
            total = _aligned(max(total, 0), sequence_alignment)
            if total > pack_size:
                too_long.append(i)
                continue
            valid.append(i)
            lengths.append(min(total, capacity))
            visual.append(vt)
        if too_long and not drop_long_samples:
            raise ValueError(
                f"{len(too_long)} sample(s) are estimated longer than {pack_size=} (first ids "
                f"{too_long[:10]}); set drop_long_samples=True or raise pack_size"
            )
    else:
        n = len(dataset)
        half = min(_aligned(capacity // 2, sequence_alignment), capacity)
        valid, lengths, visual = list(range(n)), [half] * n, [0] * n
    if not valid:
        raise ValueError("No samples remaining after filtering.")
    bins = greedy_knapsack(lengths, capacity)
    if balance_media_tokens and any(v > 0 for v in visual):
        # the same bins, in balanced order; B2 fix: max_packs keeps the first bins created
        first = {tuple(b) for b in bins[:max_packs]}
        bins = [b for b in greedy_knapsack_vt_balanced(lengths, capacity, visual)
                if tuple(b) in first]  # fmt: skip
    else:
        bins = bins[:max_packs]
    bins = [[valid[i] for i in b] for b in bins]
    wrapper = PackedDatasetWrapper(
        dataset, bins, pack_size, padding_idx=padding_idx,
        sequence_alignment=sequence_alignment, get_rope_index=get_rope_index,
    )  # fmt: skip
    wrapper.fallbacks = est.fallbacks
    return wrapper
