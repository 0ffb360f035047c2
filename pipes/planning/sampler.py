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

from neatpack.pipes.contracts import Record

__all__ = ["LengthGroupedSampler", "estimate_lengths", "raw_records"]


def raw_records(dataset: Any) -> tuple[Any, npt.NDArray[np.int64] | None]:
    """The raw records under ``dataset`` without calling its ``__getitem__``: ``(source, ids)``.

    Follows ``.dataset`` attributes (a tokenizing wrapper's raw data, as the seed does) to the
    innermost object: a neatpack ``RecordSource`` as is, a Python list or tuple as a
    ``SequenceSource``, a Hugging Face ``datasets.Dataset`` as an ``HFDatasetSource``; any other
    innermost object is indexed itself. ``ids`` maps the outer index to the source's id where a
    level on the way is a ``torch.utils.data.Subset`` (its ``indices``), else ``None``.

    >>> class Tokenizing:  # a wrapper whose __getitem__ would tokenize
    ...     def __init__(self, raw): self.dataset = raw
    ...     def __len__(self): return len(self.dataset)
    ...     def __getitem__(self, i): raise RuntimeError("tokenizes")
    >>> src, ids = raw_records(Tokenizing([{"messages": [{"role": "user", "content": "hi"}]}]))
    >>> type(src).__name__, ids, src[0]["conversation"][0]["content"]
    ('SequenceSource', None, [{'type': 'text', 'text': 'hi'}])
    """
    from neatpack.pipes.reading.read import HFDatasetSource, RecordSource, SequenceSource

    obj, ids, seen = dataset, None, set()
    while not isinstance(obj, RecordSource) and id(obj) not in seen:
        inner = getattr(obj, "dataset", None)
        if inner is None:
            break
        seen.add(id(obj))
        picked = getattr(obj, "indices", None)
        if picked is not None:  # a Subset: outer index i is inner index indices[i]
            arr = np.asarray(picked, dtype=np.int64)
            ids = arr if ids is None else arr[ids]
        obj = inner
    if isinstance(obj, RecordSource):
        source: Any = obj
    elif isinstance(obj, list | tuple):
        source = SequenceSource(obj)
    elif hasattr(obj, "features") and hasattr(obj, "_fingerprint"):  # datasets.Dataset
        source = HFDatasetSource(obj)
    else:
        source = _Indexed(obj)
    n = len(source) if ids is None else ids.size
    if dataset is not obj and hasattr(dataset, "__len__") and len(dataset) != n:
        raise ValueError(
            f"the dataset has {len(dataset)} samples but the raw records under its .dataset "
            f"chain ({type(obj).__name__}) give {n}; pass lengths=<one int per sample>"
        )
    return source, ids


class _Indexed:
    """Records from any indexable object (``to_record`` on ``obj[i]``), for ``raw_records``."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __len__(self) -> int:
        return len(self.obj)

    def __getitem__(self, sample_id: int) -> Record:
        from neatpack.pipes.reading._record import to_record

        return to_record(self.obj[sample_id], int(sample_id), None)


class _Picked:
    """``source[ids[i]]`` as item ``i`` (a Subset on the way to the raw records)."""

    def __init__(self, source: Any, ids: npt.NDArray[np.int64]) -> None:
        self.source, self.ids = source, ids

    def __len__(self) -> int:
        return int(self.ids.size)

    def __getitem__(self, i: int) -> Any:
        return self.source[int(self.ids[i])]


def estimate_lengths(
    dataset: Any, processor: Any = None, estimator: Any = None
) -> npt.NDArray[np.int64]:
    """Total estimated tokens of every sample of ``dataset``, from its raw records
    (``raw_records``: never through a tokenizing wrapper's ``__getitem__``).

    Uses ``estimator`` (a ``LengthEstimator``), else one built from ``processor``, else the
    processor-free default (``_text_tokens`` or chars / 3, 500 tokens per media item). Media
    items estimated by a fallback are counted, with sample ids, in ``estimator.fallbacks``.
    """
    from neatpack.pipes.errors import EmptyConversationError, RecordError
    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.indexing.lengths import estimate_slice

    if estimator is None:
        estimator = LengthEstimator.from_processor(processor) if processor else LengthEstimator()
    source, ids = raw_records(dataset)
    if ids is not None:
        source = _Picked(source, ids)
    # Unreadable records come back as length 0 with the reason "record_error"; each is read
    # again here: an empty conversation keeps its 0 (the seed's heuristic, counted as
    # "empty_conversation"), any other error is raised with the way out.
    total, _, _, fallbacks = estimate_slice(
        source, estimator, 0, len(source), progress=False, on_error="skip"
    )
    for sid, reasons in fallbacks:
        if "record_error" in reasons:
            try:
                estimator.estimate_sample(source[sid])
            except EmptyConversationError:
                reasons = ("empty_conversation",)
            except RecordError as e:
                raise type(e)(
                    f"{e}. LengthGroupedSampler estimates lengths from the raw conversations "
                    "under the dataset (its .dataset chain); give records with a conversation, "
                    "or pass lengths=<one int per sample> (e.g. a LengthIndex's total) instead"
                ) from e
        estimator.fallbacks.add(sid, reasons)
    return total


class LengthGroupedSampler(Sampler[int]):
    """Sample ids grouped by total tokens: chunks of ``batch_size`` shuffled per epoch.

    Lengths: ``lengths=`` as given, else estimated from the raw records under ``dataset``
    (``raw_records``: through its ``.dataset`` chain, never its ``__getitem__``) by
    ``estimator`` or ``LengthEstimator.from_processor(processor)``: text is a precomputed
    ``_text_tokens`` or chars / 3, media a precomputed ``_media_tokens`` or their sizes
    (``images_meta`` / ``videos_meta``, also under ``mm_inputs_meta``, or the image files),
    and a media item with neither (a ``{"type": "image"}`` placeholder without metadata, or no
    processor) counts 500 tokens, listed with its sample id in ``sampler.fallbacks``. A record
    whose conversation is empty sizes 0, as in the seed: it comes last in the order and is
    listed in ``sampler.fallbacks.sample_ids["empty_conversation"]``; any other unreadable
    record raises, naming it.
    The chat template's own tokens (role markers, default system prompt, vision start/end)
    are added to ``_text_tokens``, which the seed's precompute script counts without them;
    if your ``_text_tokens`` already include the template, pass
    ``text_tokens_include_template=True`` (or set it on your ``estimator``).

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
        text_tokens_include_template: bool = False,
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
        from neatpack.pipes.indexing.estimate import FallbackCounter, LengthEstimator

        self.fallbacks = FallbackCounter()
        if lengths is None:
            if estimator is None:
                kw: dict[str, Any] = {
                    "text_tokens_include_template": text_tokens_include_template,
                    "missing_media_fix": "or pass estimator=LengthEstimator.from_processor("
                    "processor, on_missing_media='fallback') to count it as 500 tokens",
                }
                estimator = (
                    LengthEstimator.from_processor(processor, **kw)
                    if processor is not None
                    else LengthEstimator(**kw)
                )
            elif text_tokens_include_template:
                raise ValueError(
                    "text_tokens_include_template=True with an estimator: set it on the "
                    "estimator (LengthEstimator(..., text_tokens_include_template=True))"
                )
            arr = estimate_lengths(dataset, estimator=estimator)
            self.fallbacks = estimator.fallbacks
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
