"""Length-grouped sampling: padded (not packed) batches of similar length, the same on every rank.

``LengthGroupedSampler`` sorts samples by total tokens (longest first), cuts the order into
chunks of ``batch_size`` and shuffles whole chunks each epoch from ``(seed, epoch)``. Every
rank builds the identical order from its own copy of the lengths, with no collective call, so
it never needs CUDA (the seed's ``.cuda()`` all-reduce failed on CPU/gloo: bug B6).

Example: lengths ``[0, 10, 20, 30, 500]``, ``batch_size=2``: sorted ``[4, 3, 2, 1, 0]``,
chunks ``[4, 3] [2, 1] [0]``, and an epoch yields the chunks in a seeded order, e.g.
``2 1 4 3 0``.

Differences from the seed (``peer_behaviour.md`` 4.3), on purpose: the shuffle uses
``np.random.default_rng([seed, epoch])`` (not ``torch.randperm(seed + epoch)``, so the exact
order differs; seeds ``s`` and ``s + 1`` no longer share shifted streams); samples filtered by
``max_length`` are listed in ``dropped_ids`` instead of vanishing; lengths come from
``lengths=`` (e.g. a length index) or from ``LengthEstimator`` on Records, never by running a
tokenizing wrapper's ``__getitem__`` on every sample (bug B10).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from torch.utils.data import Sampler

__all__ = ["LengthGroupedSampler", "estimate_lengths"]


def estimate_lengths(
    dataset: Any, processor: Any = None, estimator: Any = None
) -> npt.NDArray[np.int64]:
    """Total estimated tokens of every Record in ``dataset`` (``dataset[i]``, ``i < len``).

    Uses ``estimator`` (a ``LengthEstimator``), else one built from ``processor``, else the
    processor-free default (``_text_tokens`` or chars / 3, 500 tokens per media item, counted
    in ``estimator.fallbacks``).
    """
    from .estimate import LengthEstimator

    if estimator is None:
        estimator = LengthEstimator.from_processor(processor) if processor else LengthEstimator()
    out = np.empty(len(dataset), dtype=np.int64)
    for i in range(len(dataset)):
        record = dataset[i]
        if not isinstance(record, dict) or "conversation" not in record:
            got = f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"sample {i}: LengthGroupedSampler needs Records with a 'conversation', got "
                f"{got}. Pass lengths=<one int per sample> (e.g. a LengthIndex's total) instead."
            )
        out[i] = estimator.estimate(record)[0]
    return out


class LengthGroupedSampler(Sampler[int]):
    """Sample ids grouped by total tokens: chunks of ``batch_size`` shuffled per epoch.

    ``max_length`` (optional) keeps samples with ``length <= max_length + length_slack``
    (the seed's 512-token slack for low estimates); the others are in ``dropped_ids``.
    ``truncate_to`` keeps only that many of the longest samples (the rest in
    ``truncated_ids``): with sharded data, pass the smallest shard's kept count on every rank
    so all ranks yield the same number of batches; the seed did this with a CUDA all-reduce.
    ``len(sampler)`` is the number of ids one epoch yields.

    >>> s = LengthGroupedSampler(range(5), seed=0, batch_size=2, lengths=[0, 10, 20, 30, 500])
    >>> s.sorted_ids.tolist(), len(s)
    ([4, 3, 2, 1, 0], 5)
    >>> sorted(list(s)) == list(range(5)), list(s) == list(s)
    (True, True)
    """

    def __init__(
        self,
        dataset: Any,
        seed: int = 42,
        processor: Any = None,
        max_length: int | None = None,
        batch_size: int = 1,
        *,
        lengths: Sequence[int] | npt.ArrayLike | None = None,
        estimator: Any = None,
        length_slack: int = 512,
        truncate_to: int | None = None,
    ) -> None:
        super().__init__()
        if seed < 0:
            raise ValueError(f"{seed=} must be >= 0")
        if max_length is not None and max_length < 1:
            raise ValueError(f"{max_length=} must be None or >= 1")
        self.seed = int(seed)
        self.batch_size = max(1, int(batch_size))  # as the seed: 0 or less means 1
        self.max_length = max_length
        self.epoch = 0
        if lengths is None:
            arr = estimate_lengths(dataset, processor, estimator)
        else:
            arr = np.asarray(lengths)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise ValueError(f"lengths must be 1-D ints, got {arr.dtype} {arr.shape}")
            arr = arr.astype(np.int64)
            if dataset is not None and len(dataset) != arr.size:
                raise ValueError(f"{len(dataset)=} but {arr.size} lengths: one per sample")
        self.lengths = arr
        ids = np.arange(arr.size, dtype=np.int64)
        if max_length is not None:
            keep = arr <= max_length + length_slack
            self.dropped_ids = ids[~keep]
            ids = ids[keep]
        else:
            self.dropped_ids = np.zeros(0, dtype=np.int64)
        # longest first, ties by id (a stable sort of the negated lengths)
        self.sorted_ids = ids[np.argsort(-arr[ids], kind="stable")]
        self.truncated_ids = np.zeros(0, dtype=np.int64)
        if truncate_to is not None:
            if truncate_to < 0:
                raise ValueError(f"{truncate_to=} must be None or >= 0")
            self.truncated_ids = np.sort(self.sorted_ids[truncate_to:])
            self.sorted_ids = self.sorted_ids[:truncate_to]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's chunk order (call it before iterating, on every rank)."""
        if epoch < 0:
            raise ValueError(f"{epoch=} must be >= 0")
        self.epoch = int(epoch)

    def epoch_ids(self, epoch: int) -> npt.NDArray[np.int64]:
        """The ids epoch ``epoch`` yields, as an array."""
        n = self.sorted_ids.size
        n_chunks = -(-n // self.batch_size)
        perm = np.random.default_rng([self.seed, epoch]).permutation(n_chunks)
        starts = perm * self.batch_size
        sizes = np.minimum(starts + self.batch_size, n) - starts
        offsets = np.cumsum(sizes) - sizes
        idx = np.repeat(starts - offsets, sizes) + np.arange(n, dtype=np.int64)
        return self.sorted_ids[idx]

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_ids(self.epoch).tolist())

    def __len__(self) -> int:
        return int(self.sorted_ids.size)
