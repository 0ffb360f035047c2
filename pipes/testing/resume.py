"""Public test helpers: prove that a node resumes exactly, and that a ledger is exactly-once.

Every neatpack node passes :func:`assert_resumable`; users can run it on the nodes they write.

>>> from torchdata.nodes import IterableWrapper
>>> assert_resumable(lambda: IterableWrapper(range(5)), epochs=1)
5
"""

from __future__ import annotations

import copy
import pickle
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

__all__ = ["assert_exactly_once", "assert_resumable", "same_item"]


def same_item(a: Any, b: Any) -> bool:
    """Deep equality for what nodes yield: tensors, arrays, dicts, lists, scalars.

    >>> same_item({"x": torch.tensor([1, 2])}, {"x": torch.tensor([1, 2])})
    True
    >>> same_item([1, 2], [1, 3])
    False
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if isinstance(a, Mapping):
        return (
            isinstance(b, Mapping)
            and a.keys() == b.keys()
            and all(same_item(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same_item(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def _drain(node: BaseNode[Any], limit: int | None = None) -> list[Any]:
    out: list[Any] = []
    while limit is None or len(out) < limit:
        try:
            out.append(next(node))
        except StopIteration:
            break
    return out


def assert_resumable(
    make_node: Callable[[], BaseNode[Any]],
    *,
    epochs: int = 2,
    positions: Sequence[int] | None = None,
    equal: Callable[[Any, Any], bool] = same_item,
) -> int:
    """Check that ``make_node()`` resumes exactly from its state at every position.

    For each epoch ``e < epochs`` and each position ``k`` (default: every item, and the end),
    a fresh node runs ``e`` whole epochs plus ``k`` items, saves ``state_dict()`` (deep-copied
    and round-tripped through pickle), and a *second fresh node* ``reset(state)`` must yield
    exactly the rest of the reference epoch, then the same following epoch. Taking the state
    must not disturb the first node either.

    Returns the number of items per epoch of the reference run (epoch 0).
    Raises ``AssertionError`` naming the epoch, position and item index that differ.
    """
    reference: list[list[Any]] = []
    node = make_node()
    for _ in range(epochs + 1):
        node.reset()
        reference.append(_drain(node))
    for e in range(epochs):
        n = len(reference[e])
        ks = list(range(n + 1)) if positions is None else [k for k in positions if k <= n]
        for k in ks:
            first = make_node()
            for _ in range(e):
                first.reset()
                _drain(first)
            first.reset()
            head = _drain(first, k)
            state = pickle.loads(pickle.dumps(copy.deepcopy(first.state_dict())))
            rest_first = _drain(first)
            _check(
                equal, head + rest_first, reference[e], f"epoch {e}: taking state at {k} disturbed"
            )
            resumed = make_node()
            resumed.reset(state)
            rest = _drain(resumed)
            _check(equal, head + rest, reference[e], f"epoch {e}: resume at item {k}")
            resumed.reset()
            _check(equal, _drain(resumed), reference[e + 1], f"epoch {e + 1} after resume at {k}")
    return len(reference[0])


def _check(equal: Callable[[Any, Any], bool], got: list[Any], want: list[Any], where: str) -> None:
    if len(got) != len(want):
        raise AssertionError(f"{where}: {len(got)} items, expected {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not equal(g, w):
            raise AssertionError(f"{where}: item {i} differs: {g!r} != {w!r}")


def assert_exactly_once(
    consumed: Iterable[int],
    expected: Iterable[int],
    *,
    excused: Iterable[int] = (),
) -> None:
    """Check a ledger: every expected id consumed exactly once, except the excused ones.

    ``excused`` are ids that a counted policy removed (an overlong sample dropped, an epoch tail
    dropped); they must not be consumed at all.

    >>> assert_exactly_once([3, 1, 2], range(1, 4))
    >>> assert_exactly_once([1, 2], range(1, 4), excused=[3])
    """
    counts = Counter(consumed)
    want = set(expected)
    skip = set(excused)
    dupes = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(want - skip - counts.keys())
    unexpected = sorted(counts.keys() - want)
    wrongly = sorted(skip & counts.keys())
    problems = []
    if dupes:
        problems.append(f"consumed more than once: {dupes[:20]}")
    if missing:
        problems.append(f"never consumed: {missing[:20]} ({len(missing)} in all)")
    if unexpected:
        problems.append(f"not in the expected set: {unexpected[:20]}")
    if wrongly:
        problems.append(f"excused by a policy but consumed: {wrongly[:20]}")
    if problems:
        raise AssertionError("ledger is not exactly-once: " + "; ".join(problems))
