"""A weighted mixture of sources: the spec, each source's samples per epoch, and which samples.

A ``Mixture`` names its sources (any reader, each with its own media root) and, per source,
either a ``weight`` (its share of the epoch's tokens, among the weighted sources) or a fixed
number of ``samples`` per epoch. A source asked for more samples than it has is upsampled
(whole repeats plus a seeded partial repeat); fewer, downsampled (a seeded subset).

Which samples: ``epoch_counts`` gives, per source, how many times each sample is used this
epoch, drawn with ``np.random.default_rng([seed, epoch, crc32(name)])``. Counts are filled
level by level (``fill_counts``): no sample is used a second time before every sample of its
source has been used once, so a source of 10 samples asked for 25 uses every sample twice and
5 of them (seeded) a third time::

    sizes       A: 10 samples  weight 0.6  ->  A: 25 uses  = 2 whole repeats + 5 drawn
    counts      A: [3 2 2 3 2 3 2 3 2 3]   (each 2 or 3; which ones get 3 is seeded)

The part of the spec a run may change (weights, fixed samples, ``epoch_tokens``) is the
*blend*: plain values, saved in the loader state with its fingerprint so a resume knows which
blend the saved epoch was planned with (``Mixture.on_change`` decides what a change does).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "CHANGE_POLICIES",
    "Blend",
    "Mixture",
    "MixtureSource",
    "blend_fingerprint",
    "check_mixture_config",
    "epoch_counts",
    "fill_counts",
    "source_targets",
]

CHANGE_POLICIES = ("refuse", "next_epoch", "cursor")

IntArray = npt.NDArray[np.int64]
# {"epoch_tokens": int | None, "sources": [[name, weight | None, samples | None], ...]}
Blend = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class MixtureSource:
    """One source of a mixture: ``data`` is anything ``open_source`` reads (a ``.jsonl`` /
    ``.json`` path, tar or Parquet shards, a list of dicts, a ``datasets.Dataset``, a record
    source), ``media_root`` its own media folder. Exactly one of ``weight`` (share of the
    epoch's tokens) and ``samples`` (fixed uses per epoch) is set."""

    name: str
    data: Any = field(compare=False, repr=False)
    media_root: str | None = None
    weight: float | None = None
    samples: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"mixture source name={self.name!r} must be a non-empty string")
        if (self.weight is None) == (self.samples is None):
            raise ValueError(
                f"mixture source {self.name!r}: set exactly one of weight (share of the "
                f"epoch's tokens) and samples (uses per epoch); got weight={self.weight!r}, "
                f"samples={self.samples!r}"
            )
        if self.weight is not None and not float(self.weight) > 0.0:
            raise ValueError(f"mixture source {self.name!r}: weight={self.weight!r} must be > 0")
        if self.samples is not None and (
            isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1
        ):
            raise ValueError(
                f"mixture source {self.name!r}: samples={self.samples!r} must be an int >= 1 "
                "(leave a source out of the mixture to use none of it)"
            )


@dataclass(frozen=True, kw_only=True)
class Mixture:
    """The mixture spec of ``NeatVLMConfig(mixture=...)``.

    ``epoch_tokens``: the weighted sources' token budget per epoch (None: their tokens once).
    ``single_source_packs``: every pack holds one source's samples (per-source losses).
    ``on_change``: what a resume does when the state was saved with another blend:
    ``"next_epoch"`` (the default: finish the saved epoch with the saved blend, then the new
    one), ``"cursor"`` (re-plan the rest of the saved epoch from the samples not yet consumed;
    the ones the new blend drops are listed) or ``"refuse"`` (raise, naming the change).

    >>> mix = Mixture(sources=[MixtureSource(name="ocr", data=[], weight=0.7),
    ...                        MixtureSource(name="chat", data=[], samples=100)])
    >>> mix.blend()
    {'epoch_tokens': None, 'sources': [['ocr', 0.7, None], ['chat', None, 100]]}
    """

    sources: Sequence[MixtureSource]
    epoch_tokens: int | None = None
    single_source_packs: bool = False
    on_change: str = "next_epoch"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))
        if not self.sources or not all(isinstance(s, MixtureSource) for s in self.sources):
            raise ValueError(
                f"Mixture(sources={self.sources!r}) needs one or more MixtureSource(...)"
            )
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"mixture source names must be unique: {dupes} repeat")
        if self.on_change not in CHANGE_POLICIES:
            raise ValueError(f"{self.on_change=} is not one of {CHANGE_POLICIES}")
        if self.epoch_tokens is not None and self.epoch_tokens < 1:
            raise ValueError(f"{self.epoch_tokens=} must be None or >= 1")
        if self.epoch_tokens is not None and all(s.weight is None for s in self.sources):
            raise ValueError(
                f"{self.epoch_tokens=} shares tokens among weighted sources, but every source "
                "has fixed samples: drop epoch_tokens or give sources a weight"
            )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    def blend(self) -> Blend:
        """The changeable part, as plain values (saved in the loader state)."""
        return {
            "epoch_tokens": self.epoch_tokens,
            "sources": [
                [s.name, None if s.weight is None else float(s.weight), s.samples]
                for s in self.sources
            ],
        }


def blend_fingerprint(blend: Blend) -> str:
    """A short hash of a blend (``Mixture.blend()``)."""
    return hashlib.sha256(json.dumps(blend, sort_keys=True).encode()).hexdigest()[:16]


def source_targets(blend: Blend, sizes: Sequence[int], tokens: Sequence[int]) -> IntArray:
    """Samples per epoch per source: ``samples`` as given; a weighted source gets
    ``round(weight / sum(weights) * budget / mean_length)``, ``budget`` being ``epoch_tokens``
    or the weighted sources' tokens once.

    >>> blend = {"epoch_tokens": None, "sources": [["a", 0.6, None], ["b", 0.4, None],
    ...                                            ["c", None, 7]]}
    >>> source_targets(blend, sizes=[100, 10, 5], tokens=[1000, 100, 50]).tolist()
    [66, 44, 7]
    """
    entries = blend["sources"]
    if not len(entries) == len(sizes) == len(tokens):
        raise ValueError(f"{len(entries)} blend entries, {len(sizes)} sizes, {len(tokens)} tokens")
    weighted = [i for i, (_, w, _) in enumerate(entries) if w is not None]
    budget = blend["epoch_tokens"]
    if budget is None:
        budget = sum(int(tokens[i]) for i in weighted)
    total_weight = sum(float(entries[i][1]) for i in weighted)
    out = np.zeros(len(entries), dtype=np.int64)
    for i, (name, weight, samples) in enumerate(entries):
        if sizes[i] < 1:
            raise ValueError(f"mixture source {name!r} has no samples: remove it or fill it")
        if weight is None:
            out[i] = int(samples)
            continue
        mean = max(int(tokens[i]), 1) / int(sizes[i])
        out[i] = max(round(float(weight) / total_weight * budget / mean), 1)
    return out


def fill_counts(
    base: npt.ArrayLike,
    extra: int,
    rng: np.random.Generator,
    cap: npt.ArrayLike | None = None,
) -> IntArray:
    """How many more times to use each sample: ``extra`` uses spread so the lowest counts rise
    first (water filling), never more than ``cap[i]`` for sample ``i``; ties drawn from ``rng``.

    >>> rng = np.random.default_rng(0)
    >>> fill_counts([0, 0, 0, 0], 6, rng).tolist()  # one whole repeat, 2 of 4 drawn again
    [1, 1, 2, 2]
    >>> fill_counts([2, 0, 1, 0], 3, rng).tolist()  # the unseen ones first
    [0, 2, 0, 1]
    """
    have = np.asarray(base, dtype=np.int64)
    n = int(have.size)
    limit = None if cap is None else np.asarray(cap, dtype=np.int64)
    if extra < 0:
        raise ValueError(f"{extra=} must be >= 0")
    if limit is not None and extra > int(limit.sum()):
        raise ValueError(f"{extra=} uses asked of samples that allow {int(limit.sum())}")
    if extra == 0 or n == 0:
        if extra and n == 0:
            raise ValueError(f"{extra=} uses asked of a source with no samples")
        return np.zeros(n, dtype=np.int64)
    if limit is None and (have == have[0]).all():  # the common case: whole repeats + a draw
        out = np.full(n, extra // n, dtype=np.int64)
        out[rng.choice(n, size=extra % n, replace=False)] += 1
        return out

    def added(level: int) -> IntArray:
        a = np.maximum(level - have, 0)
        return a if limit is None else np.minimum(a, limit)

    lo, hi = int(have.min()), int(have.max()) + extra // n + 1
    if limit is not None:
        hi = max(hi, int((have + limit).max()))
    while lo < hi:  # the highest level whose fill fits in extra
        mid = (lo + hi + 1) // 2
        if int(added(mid).sum()) <= extra:
            lo = mid
        else:
            hi = mid - 1
    out = added(lo)
    rest = extra - int(out.sum())
    if rest:
        room = np.flatnonzero(added(lo + 1) > out)
        out[rng.choice(room, size=rest, replace=False)] += 1
    return out


def source_rng(seed: int, epoch: int, name: str, *more: int) -> np.random.Generator:
    """The generator of one source's draws in one epoch (``more``: a re-plan's cursor)."""
    return np.random.default_rng([seed, epoch, zlib.crc32(name.encode()), *more])


def epoch_counts(
    targets: Sequence[int] | IntArray,
    sizes: Sequence[int],
    names: Sequence[str],
    seed: int,
    epoch: int,
) -> list[IntArray]:
    """Per source, the uses of each sample this epoch (``targets[s]`` in all).

    >>> [c.tolist() for c in epoch_counts([5, 2], [2, 4], ["a", "b"], seed=0, epoch=0)]
    [[3, 2], [1, 0, 1, 0]]
    """
    return [
        fill_counts(np.zeros(int(n), np.int64), int(t), source_rng(seed, epoch, name))
        for t, n, name in zip(targets, sizes, names, strict=True)
    ]


def check_mixture_config(
    *,
    max_packs: int | None,
    shuffle: bool,
) -> None:
    """ValueError when a graph config's other fields contradict a mixture (both graphs)."""
    if max_packs is not None:
        raise ValueError(
            f"max_packs={max_packs!r} with a mixture: give sources fixed samples per epoch "
            "(MixtureSource(samples=...)) or weights with Mixture(epoch_tokens=...) instead"
        )
    if not shuffle:
        raise ValueError(
            f"shuffle={shuffle!r} with a mixture: its serving order spreads the sources over "
            "the epoch from the seed; keep shuffle=True and fix the order with seed"
        )
