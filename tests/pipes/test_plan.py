"""Planner tests: the seed's greedy knapsack, best-fit decreasing, the pack plan and its order."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from neatpack.pipes.planning.binpack import (
    best_fit_decreasing,
    bfd_bin_ids,
    greedy_knapsack,
    lower_bound,
    overlong_ids,
)
from neatpack.pipes.planning.plan import PackPlan, greedy_knapsack_vt_balanced, plan_packs


def reference_greedy(lengths: list[int], max_length: int) -> list[list[int]]:
    """The seed algorithm as documented in peer_behaviour.md 2.1, written independently."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    heap: list[tuple[int, int]] = []
    for i in order:
        if lengths[i] > max_length:
            continue
        if heap and heap[0][0] + lengths[i] <= max_length:
            fill, b = heapq.heappop(heap)
            bins[b].append(i)
            heapq.heappush(heap, (fill + lengths[i], b))
        else:
            bins.append([i])
            heapq.heappush(heap, (lengths[i], len(bins) - 1))
    return bins


def reference_bfd_fills(lengths: list[int], capacity: int) -> list[int]:
    """Item-by-item best fit decreasing; returns the sorted pack fills."""
    fills: list[int] = []
    for n in sorted(lengths, reverse=True):
        fits = [(capacity - f, b) for b, f in enumerate(fills) if f + n <= capacity]
        if fits:
            fills[min(fits)[1]] += n
        else:
            fills.append(n)
    return sorted(fills)


def csr_packs(offsets: np.ndarray, ids: np.ndarray) -> list[list[int]]:
    return [ids[a:b].tolist() for a, b in itertools.pairwise(offsets)]


capacities = st.integers(min_value=1, max_value=64)


@st.composite
def lengths_and_capacity(draw: st.DrawFn, max_n: int = 60) -> tuple[list[int], int]:
    cap = draw(capacities)
    lengths = draw(st.lists(st.integers(min_value=0, max_value=cap), max_size=max_n))
    return lengths, cap


# -- greedy_knapsack: the seed, literally --------------------------------------------------


@pytest.mark.parametrize(
    ("lengths", "max_length", "expected"),
    [
        ([5, 4, 3, 3, 9, 2], 8, [[0, 3], [1, 2], [5]]),  # peer notes 2.1 smoke (9 dropped)
        ([], 8, []),
        ([0, 5, 3], 8, [[1, 2, 0]]),  # zero length joins the least-filled bin
        ([4, 4, 4, 4], 8, [[0, 1], [2, 3]]),
        ([6, 5, 2, 2], 10, [[0, 3], [1, 2]]),  # worst fit: 2 goes to the emptier bin
        ([3, 3, 3, 3, 3], 7, [[0, 1], [2, 3], [4]]),
        ([8, 1, 8], 8, [[0], [2], [1]]),
    ],
)
def test_greedy_knapsack_literal(
    lengths: list[int], max_length: int, expected: list[list[int]]
) -> None:
    assert greedy_knapsack(lengths, max_length, overlong="drop") == expected


def test_greedy_knapsack_raises_on_overlong_by_default() -> None:
    with pytest.raises(ValueError, match=r"sample 4 \(length 9\).*overlong='drop'"):
        greedy_knapsack([5, 4, 3, 3, 9, 2], 8)
    assert overlong_ids([5, 4, 3, 3, 9, 2], 8) == [4]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lengths": [1, -2], "max_length": 4}, r"negative lengths at sample ids \[1\]"),
        ({"lengths": [1, 2], "max_length": 0}, "capacity=0"),
        ({"lengths": [1.5], "max_length": 4}, "1-D ints"),
        ({"lengths": [1], "max_length": 4, "overlong": "skip"}, r"one of \('raise', 'drop'\)"),
    ],
)
def test_greedy_knapsack_bad_input(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        greedy_knapsack(**kwargs)  # type: ignore[arg-type]


@given(
    st.integers(1, 50).flatmap(
        lambda cap: st.tuples(st.lists(st.integers(0, cap + 5), max_size=80), st.just(cap))
    )
)
def test_greedy_knapsack_equals_reference(case: tuple[list[int], int]) -> None:
    lengths, cap = case
    assert greedy_knapsack(lengths, cap, overlong="drop") == reference_greedy(lengths, cap)


# -- best_fit_decreasing -------------------------------------------------------------------


def test_bfd_literal() -> None:
    offsets, ids = best_fit_decreasing([6, 5, 2, 2], 10)  # best fit: both 2s join the 6
    assert csr_packs(offsets, ids) == [[0, 2, 3], [1]]
    offsets, ids = best_fit_decreasing([6, 6, 6, 1, 1, 4], 10)
    assert csr_packs(offsets, ids) == [[0, 5], [1, 3, 4], [2]]
    offsets, ids = best_fit_decreasing([5, 4, 3, 3, 9, 2], 8, overlong="drop")
    assert csr_packs(offsets, ids) == [[0, 2], [1, 3], [5]]
    assert bfd_bin_ids([5, 4, 3, 3, 9, 2], 8, overlong="drop").tolist() == [0, 1, 0, 1, -1, 2]
    offsets, ids = best_fit_decreasing([], 8)
    assert offsets.tolist() == [0]
    assert ids.tolist() == []
    offsets, ids = best_fit_decreasing([0, 0], 8)  # zero-length samples still get a pack
    assert csr_packs(offsets, ids) == [[0, 1]]
    with pytest.raises(ValueError, match=r"sample 4 \(length 9\)"):
        best_fit_decreasing([5, 4, 3, 3, 9, 2], 8)


@given(lengths_and_capacity())
def test_bfd_properties(case: tuple[list[int], int]) -> None:
    lengths, cap = case
    offsets, ids = best_fit_decreasing(lengths, cap)
    packs = csr_packs(offsets, ids)
    assert sorted(ids.tolist()) == list(range(len(lengths)))  # a partition
    fills = [sum(lengths[i] for i in p) for p in packs]
    assert all(f <= cap for f in fills)
    assert all(p for p in packs)
    assert sum(2 * f <= cap for f in fills) <= 1  # any-fit: at most one pack half full or less
    assert all(  # longest first inside a pack, ties by id
        [(-lengths[i], i) for i in p] == sorted((-lengths[i], i) for i in p) for p in packs
    )
    if any(lengths):  # zero-length samples join a pack; they never open one of their own
        assert sorted(f for f in fills) == reference_bfd_fills([n for n in lengths if n], cap)
    assert lower_bound(lengths, cap) <= len(packs)
    bins = bfd_bin_ids(lengths, cap)
    assert [bins[p].tolist() for p in map(np.asarray, packs)] == [
        [g] * len(p) for g, p in enumerate(packs)
    ]
    again = best_fit_decreasing(np.asarray(lengths, dtype=np.int32), cap)
    assert np.array_equal(again[0], offsets)
    assert np.array_equal(again[1], ids)


def test_bfd_wide_capacity_and_drop() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 90_000, size=2_000)
    offsets, ids = best_fit_decreasing(lengths, 70_000, overlong="drop")  # > 16-bit path
    kept = np.flatnonzero(lengths <= 70_000)
    assert np.array_equal(np.sort(ids), kept)
    assert np.add.reduceat(lengths[ids], offsets[:-1]).max() <= 70_000


def test_lower_bound() -> None:
    assert lower_bound([6, 6, 6, 1, 1], 10) == 3  # L2 beats ceil(20 / 10) = 2
    assert lower_bound([], 10) == 0
    assert lower_bound([10, 10, 1], 10) == 3
    assert lower_bound([3, 3, 3, 3], 10) == 2


# -- plan_packs ----------------------------------------------------------------------------


@st.composite
def plan_cases(draw: st.DrawFn) -> tuple[list[int], list[int], int, int]:
    cap = draw(st.integers(4, 64))
    n = draw(st.integers(0, 60))
    lengths = draw(st.lists(st.integers(0, cap + 3), min_size=n, max_size=n))
    visual = [draw(st.integers(0, x)) for x in lengths]
    return lengths, visual, cap, draw(st.integers(1, 5))


@given(plan_cases(), st.integers(0, 3), st.sampled_from([None, 1, 3]))
def test_plan_properties(
    case: tuple[list[int], list[int], int, int], seed: int, max_packs: int | None
) -> None:
    lengths, visual, cap, world = case
    kw = {"visual": visual, "overlong": "drop", "world_size": world, "seed": seed}
    plan = plan_packs(lengths, cap, max_packs=max_packs, **kw)  # type: ignore[arg-type]
    kept = plan.ids.tolist()
    every = sorted(kept + plan.dropped_ids.tolist() + plan.truncated_ids.tolist())
    assert every == list(range(len(lengths)))  # each id exactly once
    assert plan.dropped_ids.tolist() == [i for i, n in enumerate(lengths) if n > cap]
    assert all(lengths[i] > cap for i in plan.dropped_ids.tolist())
    packs = plan.packs()
    assert [plan.pack(g) for g in range(len(plan))] == packs
    assert plan.totals.tolist() == [sum(lengths[i] for i in p) for p in packs]
    assert plan.visual.tolist() == [sum(visual[i] for i in p) for p in packs]
    assert all(t <= cap for t in plan.totals.tolist())
    loads = list(zip(plan.visual.tolist(), plan.totals.tolist(), strict=True))
    assert loads == sorted(loads)  # stored by load
    if max_packs is None:
        assert sum(2 * t <= cap for t in plan.totals.tolist()) <= 1
    else:
        assert len(plan) <= max_packs
    twin = plan_packs(lengths, cap, max_packs=max_packs, **kw)  # type: ignore[arg-type]
    assert twin.fingerprint == plan.fingerprint
    assert np.array_equal(twin.ids, plan.ids)
    assert np.array_equal(twin.offsets, plan.offsets)
    for epoch in (0, 1, 5):
        order = plan.epoch_order(epoch)
        assert sorted(order.tolist()) == list(range(len(plan)))
        assert np.array_equal(order, twin.epoch_order(epoch))
        cut = len(plan) - len(plan) % world
        rest = np.setdiff1d(np.arange(len(plan)), order[cut:])  # load order without the tail
        for group in np.searchsorted(rest, order[:cut]).reshape(-1, world):
            assert group.max() - group.min() == world - 1  # neighbours in load order


def test_epoch_order_depends_on_epoch_and_keeps_groups() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(50, 2000, size=3000)
    visual = (lengths * rng.random(3000)).astype(np.int64)
    plan = plan_packs(lengths, 4096, visual=visual, world_size=4, seed=7)
    orders = [plan.epoch_order(e) for e in range(3)]
    assert not np.array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[1], orders[2])
    fixed = plan_packs(lengths, 4096, visual=visual, world_size=4, seed=7, shuffle=False)
    assert np.array_equal(fixed.epoch_order(0), fixed.epoch_order(3))
    assert np.array_equal(fixed.epoch_order(0), plan.epoch_order(0))
    other = plan_packs(lengths, 4096, visual=visual, world_size=4, seed=8)
    assert not np.array_equal(other.epoch_order(0), plan.epoch_order(0))
    # balance: within each step the visual loads are close
    steps = plan.visual[orders[0][: len(plan) // 4 * 4].reshape(-1, 4)]
    ratio = steps.max(axis=1) / np.maximum(steps.mean(axis=1), 1)
    assert np.median(ratio) < 1.05
    # no curriculum: the first and second halves of an epoch carry similar visual load
    half = len(plan) // 2
    first, second = plan.visual[orders[0][:half]].mean(), plan.visual[orders[0][half:]].mean()
    assert abs(first - second) < 0.2 * plan.visual.mean()


def test_fingerprint_covers_data_and_parameters() -> None:
    lengths, visual = [5, 4, 3, 3, 2], [0, 1, 0, 1, 0]
    base = plan_packs(lengths, 8, visual=visual).fingerprint
    variants = [
        plan_packs([5, 4, 3, 3, 1], 8, visual=visual),
        plan_packs(lengths, 8, visual=[0, 1, 0, 0, 0]),
        plan_packs(lengths, 8),
        plan_packs(lengths, 9, visual=visual),
        plan_packs(lengths, 8, visual=visual, world_size=2),
        plan_packs(lengths, 8, visual=visual, seed=1),
        plan_packs(lengths, 8, visual=visual, shuffle=False),
        plan_packs(lengths, 8, visual=visual, packing_ratio=0.9),
        plan_packs(lengths, 8, visual=visual, max_packs=2),
        plan_packs(lengths, 8, visual=visual, overlong="drop"),
    ]
    prints = [p.fingerprint for p in variants]
    assert base not in prints
    assert len(set(prints)) == len(prints)
    assert plan_packs(lengths, 8, visual=visual).fingerprint == base


def test_plan_literal_and_overlong() -> None:
    plan = plan_packs([5, 4, 3, 3, 9, 2], 8, visual=[0, 2, 0, 1, 5, 0], overlong="drop")
    assert plan.packs() == [[5], [0, 2], [1, 3]]  # sorted by (visual, total)
    assert plan.totals.tolist() == [2, 8, 7]
    assert plan.visual.tolist() == [0, 0, 3]
    assert plan.dropped_ids.tolist() == [4]
    assert isinstance(plan, PackPlan)
    assert plan.group_size == 1
    assert len(plan) == 3
    with pytest.raises(ValueError, match=r"sample 4 \(length 9\).*overlong='drop'"):
        plan_packs([5, 4, 3, 3, 9, 2], 8)
    with pytest.raises(IndexError, match="pack index=3"):
        plan.pack(3)
    with pytest.raises(ValueError, match="read-only"):
        plan.ids[0] = 1


def test_packing_ratio_headroom() -> None:
    lengths = [7, 3, 3, 2, 2, 2, 1]
    plan = plan_packs(lengths, 8, packing_ratio=0.75)  # plan for 6 tokens per pack
    for pack, total in zip(plan.packs(), plan.totals.tolist(), strict=True):
        assert total <= 6 or pack == [0]  # 7 fits the pack but not the headroom: alone
    assert sorted(plan.ids.tolist()) == list(range(7))


def test_max_packs_keeps_an_unbiased_sample() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(100, 1000, size=4000)
    visual = np.where(rng.random(4000) < 0.5, 0, lengths // 2)
    full = plan_packs(lengths, 4096, visual=visual, world_size=2)
    cut = plan_packs(lengths, 4096, visual=visual, world_size=2, max_packs=len(full) // 4)
    assert len(cut) == len(full) // 4
    assert sorted(cut.ids.tolist() + cut.truncated_ids.tolist()) == list(range(4000))
    # the seed kept the lowest-visual packs; a fair sample has about the full mean
    assert abs(cut.visual.mean() - full.visual.mean()) < 0.15 * full.visual.mean()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"packing_ratio": 0.0}, "packing_ratio=0.0"),
        ({"packing_ratio": 1.5}, "packing_ratio=1.5"),
        ({"max_packs": 0}, "max_packs=0"),
        ({"world_size": 0}, "world_size=0"),
        ({"seed": -1}, "seed=-1"),
        ({"overlong": "truncate"}, r"overlong='truncate' is not one of \('raise', 'drop'\)"),
        ({"visual": [1, 2]}, "one per sample"),
        ({"visual": [0, 0, 9]}, "sample 2 has visual=9, length=3"),
    ],
)
def test_plan_bad_parameters(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_packs([1, 2, 3], 8, **kwargs)  # type: ignore[arg-type]


def test_epoch_must_be_non_negative() -> None:
    with pytest.raises(ValueError, match="epoch=-1"):
        plan_packs([1, 2], 4).epoch_order(-1)


def test_vt_balanced_literal_and_grouping() -> None:
    bins = greedy_knapsack_vt_balanced(
        [5, 4, 3, 3, 9, 2], 8, [0, 100, 0, 50, 0, 10], overlong="drop", group_size=1
    )
    assert sorted(bins) == sorted(greedy_knapsack([5, 4, 3, 3, 9, 2], 8, overlong="drop"))
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 600, size=800).tolist()
    vt = [int(x * f) for x, f in zip(lengths, rng.random(800), strict=True)]
    out = greedy_knapsack_vt_balanced(lengths, 2048, vt, group_size=4, seed=3)
    ref = greedy_knapsack(lengths, 2048)
    assert sorted(out) == sorted(ref)
    sums = np.array([sum(vt[i] for i in b) for b in out])
    rank = np.argsort(np.argsort(sums, kind="stable"), kind="stable")
    body = rank[: len(out) // 4 * 4].reshape(-1, 4)
    assert (body.max(axis=1) - body.min(axis=1) <= 4 + len(out) % 4).all()
    assert not np.array_equal(sums, np.sort(sums))  # not the seed's monotone sort


def test_the_old_on_overlong_keyword_still_plans_and_names_the_new_one() -> None:
    """``on_overlong=`` became ``overlong=`` (the graphs' word, issue #26); the old keyword
    gives the same bins with a DeprecationWarning."""
    with pytest.warns(
        DeprecationWarning, match=r"greedy_knapsack\(on_overlong=...\) is deprecated: use overlong"
    ):
        old = greedy_knapsack([5, 4, 3, 3, 9, 2], 8, on_overlong="drop")
    assert old == greedy_knapsack([5, 4, 3, 3, 9, 2], 8, overlong="drop")
    with pytest.raises(TypeError, match="both on_overlong= and overlong="):
        greedy_knapsack([5], 8, on_overlong="drop", overlong="drop")
