"""Retry a failing collate on a deterministic replacement batch (the seed's
``make_robust_collate``), recording every failure: see ``RobustCollate``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "RetriedBatch",
    "RobustCollate",
    "make_robust_collate",
]

_LOG = logging.getLogger(__name__)


def _stable_seed(seed: int, examples: Sequence[Any], attempt: int) -> int:
    ids: list[int] = []
    for ex in examples:
        if isinstance(ex, Mapping):
            ids.extend(int(i) for i in ex.get("sample_ids", [ex.get("sample_id", -1)]))
        elif isinstance(ex, int):  # a dataset index of a replacement batch
            ids.append(ex)
    key = f"{seed}:{attempt}:{ids}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class RetriedBatch(dict):  # type: ignore[type-arg]
    """A collate's dict output, keys unchanged, that needed retries: ``collate_failures`` (an
    attribute, pickled with the dict) lists them. A ``"collate_failures"`` key instead reached
    ``model(**batch)`` as an unexpected argument. Built like a dict (so code that rebuilds a
    mapping with ``type(batch)({...})``, as ``transformers.Trainer`` does, still works; such a
    copy has no failures).

    >>> batch = RetriedBatch({"input_ids": [1]})
    >>> batch.collate_failures = [{"attempt": 0}]
    >>> list(batch), batch.collate_failures, RetriedBatch(batch).collate_failures
    (['input_ids'], [{'attempt': 0}], ())
    """

    collate_failures: Sequence[dict[str, Any]] = ()


def _with_failures(out: Any, failures: list[dict[str, Any]]) -> Any:
    """``out`` with ``failures`` beside its keys: a plain dict as a ``RetriedBatch``, any other
    object that takes attributes (a ``BatchFeature``, a tensor) with the attribute set; one
    that takes none (a tuple) is returned as it is (``RobustCollate.failures`` and the log
    still have them)."""
    if type(out) is dict:
        out = RetriedBatch(out)
    with contextlib.suppress(AttributeError):
        out.collate_failures = failures
    return out


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
    next), and a batch that needed a retry carries the same list beside its keys, as the
    attribute ``batch.collate_failures`` (a plain dict comes back as a ``RetriedBatch``, the
    same keys): it travels out of DataLoader worker processes with the batch, where
    ``failures`` does not, and ``model(**batch)`` still gets only the collate's own keys.

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
            return _with_failures(out, failures) if failures else out
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
