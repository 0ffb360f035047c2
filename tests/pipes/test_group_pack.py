"""``group_pack``: packs made for their step groups (``balance="cost"``) keep every budget,
place every sample exactly once, come out the same from the same input, and keep their groups
whole through the epoch shuffle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neatpack.pipes.planning import group_pack
from neatpack.pipes.planning.binpack import best_fit_decreasing
from neatpack.pipes.planning.plan import plan_packs


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int, int | None]:
    """(lengths, visual, capacity, group size, visual budget): a third text-only samples."""
    cap = draw(st.integers(8, 300))
    size = draw(st.integers(2, 6))
    n = draw(st.integers(size, 150))
    lengths = np.array(draw(st.lists(st.integers(1, cap), min_size=n, max_size=n)))
    share = np.array(draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)))
    text_only = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    visual = np.where(text_only, 0, np.floor(share * lengths)).astype(np.int64)
    budget = draw(st.sampled_from([None, int(visual.max(initial=0)) or None, 2 * cap]))
    return lengths, visual, cap, size, budget


def check(made: tuple[np.ndarray, np.ndarray, int], case: tuple) -> None:  # type: ignore[type-arg]
    lengths, visual, cap, size, budget = case
    offsets, ids, grouped = made
    assert np.array_equal(np.sort(ids), np.arange(lengths.size))  # each sample exactly once
    assert grouped % size == 0
    assert 0 <= grouped <= offsets.size - 1
    assert (np.diff(offsets) > 0).all()  # no empty pack
    assert (np.add.reduceat(lengths[ids], offsets[:-1]) <= cap).all()
    if budget is not None:
        assert (np.add.reduceat(visual[ids], offsets[:-1]) <= budget).all()


@settings(max_examples=150, deadline=None)
@given(cases())
def test_made_packs_keep_both_budgets_and_every_sample_once(case: tuple) -> None:  # type: ignore[type-arg]
    lengths, visual, cap, size, budget = case
    split = group_pack._split(lengths, visual)
    n_best = best_fit_decreasing(lengths, cap)[0].size - 1
    for span in group_pack.TUPLE_SPANS:  # every candidate, chosen or not
        made = group_pack._build(lengths, visual, cap, size, budget, span, n_best, split)
        if made is not None:
            check(made, case)
    chosen = group_pack.group_packs(lengths, visual, cap, size, max_visual=budget)
    assert chosen is not None
    offsets, ids, order, grouped = chosen
    check((offsets, ids, grouped), case)
    assert np.array_equal(np.sort(order), np.arange(offsets.size - 1))
    assert np.array_equal(order[:grouped], np.arange(grouped))  # made groups stay in place
    again = group_pack.group_packs(lengths, visual, cap, size, max_visual=budget)
    assert again is not None
    for a, b in zip(chosen, again, strict=True):  # deterministic
        assert np.array_equal(a, b)


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(0, 3))
def test_cost_plan_keeps_made_groups_whole_in_every_epoch(case: tuple, seed: int) -> None:  # type: ignore[type-arg]
    lengths, visual, cap, size, budget = case
    kw = {"visual": visual, "world_size": size, "seed": seed, "max_visual": budget}
    plan = plan_packs(lengths, cap, balance="cost", **kw)  # type: ignore[arg-type]
    assert np.array_equal(np.sort(plan.ids), np.arange(lengths.size))
    assert (plan.totals <= cap).all()
    if budget is not None:
        assert (plan.visual <= budget).all()
    assert plan.free_from % size == 0
    twin = plan_packs(lengths, cap, balance="cost", **kw)  # type: ignore[arg-type]
    assert np.array_equal(twin.ids, plan.ids)
    assert twin.fingerprint == plan.fingerprint
    for epoch in (0, 1, 4):
        order = plan.epoch_order(epoch)
        assert sorted(order.tolist()) == list(range(len(plan)))
        cut = len(plan) - len(plan) % size
        assert (order[cut:] >= plan.free_from).all()  # the short last group: free packs only
        for group in order[:cut].reshape(-1, size):
            if group.min() < plan.free_from:  # a made group: whole, as made
                assert sorted(group.tolist()) == list(range(group.min(), group.min() + size))
                assert group.min() % size == 0


def test_made_groups_even_the_ranks_and_keep_the_fill() -> None:
    rng = np.random.default_rng(0)
    n = 20_000
    text_only = rng.random(n) < 0.35
    images = np.where(text_only, 0, rng.integers(1, 5, size=n))
    visual = (rng.integers(64, 1281, size=(n, 4)) * (np.arange(4) < images[:, None])).sum(1)
    total = np.rint(rng.lognormal(np.log(300.0), 0.9, size=n)).astype(np.int64) + 1 + visual
    total = np.minimum(total, 8192)
    kw = {"visual": visual, "world_size": 8}
    made = plan_packs(total, 8192, balance="cost", **kw)  # type: ignore[arg-type]
    tokens = plan_packs(total, 8192, **kw)  # type: ignore[arg-type]
    assert np.array_equal(np.sort(made.ids), np.arange(n))  # every sample once (both passes)
    assert made.free_from > 0.9 * len(made)  # nearly every step group made
    assert made.utilization() >= tokens.utilization() - 0.002
    groups = np.arange(made.free_from).reshape(-1, 8)
    attention = np.array([sum(int(total[i]) ** 2 for i in made.pack(g)) for g in range(len(made))])
    ratio = attention[groups].max(1) / attention[groups].mean(1)
    assert np.percentile(ratio, 95) < 1.02  # tuples of alike samples: alike attention


def test_small_worlds_and_corpora_fall_back_to_best_fit() -> None:
    assert group_pack.group_packs([3, 2], [0, 0], 8, 1) is None
    assert group_pack.group_packs([3], [0], 8, 2) is None
    plan = plan_packs([5, 4, 3, 3, 2], 8, balance="cost")  # one rank: best fit, cost order
    assert plan.free_from == 0
    assert sorted(plan.packs()) == sorted(plan_packs([5, 4, 3, 3, 2], 8).packs())


@pytest.mark.parametrize("size", [2, 3])
def test_a_plan_for_another_world_size_is_its_own(size: int) -> None:
    """Elastic resume re-plans for the new world size: a pure function of it."""
    rng = np.random.default_rng(size)
    total = rng.integers(20, 400, size=600)
    visual = np.where(rng.random(600) < 0.4, 0, total // 2)
    a = plan_packs(total, 1024, visual=visual, world_size=size, balance="cost")
    b = plan_packs(total, 1024, visual=visual, world_size=size, balance="cost")
    other = plan_packs(total, 1024, visual=visual, world_size=size + 2, balance="cost")
    assert np.array_equal(a.ids, b.ids)
    assert a.free_from == b.free_from
    assert a.fingerprint != other.fingerprint
    assert np.array_equal(np.sort(other.ids), np.arange(600))
