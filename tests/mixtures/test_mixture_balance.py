"""Cost-balanced steps of mixtures whose sources are used more than once (#27): as even as one
plan of the same uses, every use served once, no pack holding a sample twice, whole made
step groups in the serving order, and the other balances' plans as they were."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from neatpack.pipes.mixtures import mixture_plan
from neatpack.pipes.mixtures.mixture import epoch_counts
from neatpack.pipes.mixtures.mixture_plan import (
    MixturePlan,
    mix_order,
    plan_mixture,
    replan_from_cursor,
)
from neatpack.pipes.mixtures.mixture_uses import TRADE_MAX, separate_copies
from neatpack.pipes.planning.balance import COST_TERMS, imbalance, pack_cost_terms, pack_costs
from neatpack.pipes.planning.plan import plan_packs


def _repeated(seed: int = 0) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Sources of 6,000 and 1,500 samples, the second used 2 or 3 times (2.5 on average)."""
    rng = np.random.default_rng(seed)
    total = rng.integers(50, 3000, 7500)
    visual = np.where(rng.random(total.size) < 0.5, total // 2, 0)
    counts = [np.ones(6000, np.int64), 2 + (rng.random(1500) < 0.5).astype(np.int64)]
    return counts, total, visual


def _step_p95(plan: MixturePlan, total: np.ndarray, visual: np.ndarray, world: int,
              per_rank: int) -> tuple[float, float]:  # fmt: skip
    """p95 over the served steps of max/mean over ranks of attention and of vision cost."""
    terms = pack_cost_terms(plan.offsets, plan.ids, total, visual)
    attention, vision = terms[:, COST_TERMS.index("attention")], pack_costs(terms)[1]
    unit = world * per_rank
    slots = plan.order[: plan.order.size // unit * unit].reshape(-1, per_rank, world)
    return tuple(  # type: ignore[return-value]
        float(np.percentile(imbalance(cost[slots].sum(axis=1)), 95)) for cost in (attention, vision)
    )


def _check_uses(plan: MixturePlan, entries: np.ndarray) -> None:
    """Every use served once (each pack once in the order), no pack holding a sample twice."""
    assert Counter(plan.ids.tolist()) == Counter(entries.tolist())
    assert sorted(plan.order.tolist()) == list(range(len(plan)))
    for p in range(len(plan)):
        ids = plan.pack(p)
        assert len(ids) == len(set(ids)), f"pack {p} holds a sample twice: {ids}"


@pytest.mark.parametrize("per_rank", [1, 2])
def test_repeated_source_mixture_steps_are_as_even_as_one_plan(per_rank: int) -> None:
    """Before: one plan a round, step groups cut across the plans' boundaries: p95 attention
    max/mean 1.34 at 8 ranks. Now the uses are planned together: as one plan of them."""
    counts, total, visual = _repeated()
    entries = np.concatenate([np.repeat(np.arange(6000), counts[0]),
                              np.repeat(np.arange(6000, 7500), counts[1])])  # fmt: skip
    plan = plan_mixture(counts, total, visual, capacity=8192, epoch=0, group_size=8,
                        balance="cost", per_rank=per_rank)  # fmt: skip
    _check_uses(plan, entries)
    attention, vision = _step_p95(plan, total, visual, 8, per_rank)
    assert attention <= 1.05, (attention, vision)
    assert vision <= 1.05, (attention, vision)
    best_fit = plan_packs(total[entries], 8192, world_size=8)  # copies may share a pack there
    fill = float(total[plan.ids].sum()) / (len(plan) * 8192)
    assert fill >= best_fit.utilization() - 0.002


@pytest.mark.parametrize("trade_max", [TRADE_MAX, 0])
def test_one_source_a_pack_stays_one_source_and_keeps_every_use(
    trade_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``single_source``: the second source's own plan has 709 second copies, 24 of which
    find no trade (best fit put a short sample's copies together): best fit's packs are
    planned again by rounds; with ``TRADE_MAX`` 0 they always are. Every use served once."""
    monkeypatch.setattr(mixture_plan, "TRADE_MAX", trade_max)
    counts, total, visual = _repeated(1)
    entries = np.concatenate([np.repeat(np.arange(6000), counts[0]),
                              np.repeat(np.arange(6000, 7500), counts[1])])  # fmt: skip
    plan = plan_mixture(counts, total, visual, capacity=8192, epoch=0, group_size=8,
                        balance="cost", single_source=True)  # fmt: skip
    _check_uses(plan, entries)
    for p in range(len(plan)):
        assert len(set(plan.pack_sources(p))) == 1
    assert int(total[plan.ids].sum()) / (len(plan) * 8192) >= 0.99


def test_mix_order_serves_made_groups_whole() -> None:
    """Packs 0-7 are two made groups: the tail (14 % 4 = 2 packs) comes from the others, so
    no served group holds part of a made group (drawn from any pack, it shifted them)."""
    tokens = np.ones((14, 2), dtype=np.int64)
    for seed in range(20):
        order = mix_order(tokens, 4, np.random.default_rng(seed), free_from=8)
        assert sorted(order.tolist()) == list(range(14))
        groups = [sorted(g) for g in order[:12].reshape(-1, 4).tolist()]
        assert [0, 1, 2, 3] in groups
        assert [4, 5, 6, 7] in groups
        assert set(order[12:].tolist()) <= set(range(8, 14))
    with pytest.raises(ValueError, match="free_from=6 must be a whole number of groups of 4"):
        mix_order(tokens, 4, np.random.default_rng(0), free_from=6)


def test_separate_copies_trades_within_budgets_and_reports_what_it_cannot() -> None:
    # sample 9 twice in pack 0; pack 1 has room only for a trade of equal tokens
    offsets = np.array([0, 3, 5])
    ids = np.array([9, 9, 2, 3, 4])
    total = np.array([0, 0, 4, 5, 3, 0, 0, 0, 0, 3])
    out, stuck = separate_copies(offsets, ids, total, None, None, capacity=10)
    assert out.tolist() == [9, 4, 2, 3, 9]
    assert stuck.size == 0
    visual = np.array([0, 0, 0, 4, 0, 0, 0, 0, 0, 2])  # the trade would put 6 visual in pack 1
    out, stuck = separate_copies(offsets, ids, total, visual, None, capacity=10, max_visual=4)
    assert out.tolist() == ids.tolist()
    assert stuck.tolist() == [1]


@pytest.mark.parametrize(("balance", "single", "fingerprint"), [
    ("tokens", False, "6a3388974d772ee0"), ("tokens", True, "f83f3114d1382383"),
    ("lm", False, "2712c1cc7966310a"), ("vision", True, "6514422ccf4b1188"),
])  # fmt: skip
def test_other_balances_plan_as_they_did(balance: str, single: bool, fingerprint: str) -> None:
    """Fingerprints of the code before #27's mixture change: saved states still load."""
    rng = np.random.default_rng(5)
    total = rng.integers(10, 300, 60)
    visual = np.where(rng.random(60) < 0.5, total // 3, 0)
    counts = [np.ones(40, np.int64), np.array([2, 3, 1, 2] * 5)]
    plan = plan_mixture(counts, total, visual, capacity=700, epoch=1, group_size=3, seed=2,
                        single_source=single, balance=balance)  # type: ignore[arg-type]  # fmt: skip
    assert plan.fingerprint[:16] == fingerprint


class Case(NamedTuple):
    counts: list[np.ndarray]
    total: np.ndarray
    visual: np.ndarray
    group_size: int
    per_rank: int | None
    single_source: bool
    max_visual: int | None
    images: np.ndarray
    max_images: int | None
    seed: int


@st.composite
def mixtures(draw: st.DrawFn) -> Case:
    """Up to 3 sources of up to 40 samples, each used 0 to 4 times, packs of 150 tokens."""
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    n = sum(sizes)
    total = np.asarray(draw(st.lists(st.integers(1, 120), min_size=n, max_size=n)))
    share = draw(st.sampled_from([0, 2, 3]))  # visual tokens: none, a half, a third
    return Case(
        counts=[
            np.asarray(draw(st.lists(st.integers(0, 4), min_size=s, max_size=s)), dtype=np.int64)
            for s in sizes
        ],
        total=total,
        visual=total // share if share else np.zeros_like(total),
        group_size=draw(st.integers(1, 4)),
        per_rank=draw(st.sampled_from([None, 1, 2])),
        single_source=draw(st.booleans()),
        max_visual=draw(st.sampled_from([None, 60])),
        images=np.asarray(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))),
        max_images=draw(st.sampled_from([None, 3])),
        seed=draw(st.integers(0, 3)),
    )


def _plan(case: Case) -> MixturePlan:
    return plan_mixture(case.counts, case.total, case.visual, capacity=150, epoch=0,
                        group_size=case.group_size, balance="cost", seed=case.seed,
                        single_source=case.single_source, max_visual=case.max_visual,
                        images=case.images, max_images=case.max_images,
                        per_rank=case.per_rank)  # fmt: skip


@given(mixtures(), st.integers(0, 30))
def test_cost_mixture_plans_serve_every_use_once(case: Case, cut: int) -> None:
    bounds = np.cumsum([0] + [c.size for c in case.counts])
    entries = np.concatenate([np.repeat(np.arange(c.size) + bounds[s], c)
                              for s, c in enumerate(case.counts)])  # fmt: skip
    plan = _plan(case)
    _check_uses(plan, entries)
    assert _plan(case).fingerprint == plan.fingerprint  # a pure function of its inputs
    for p in range(len(plan)):
        ids = plan.pack(p)
        assert int(case.total[ids].sum()) <= 150
        if case.max_visual is not None:
            assert int(case.visual[ids].sum()) <= case.max_visual
        if case.max_images is not None:
            assert int(case.images[ids].sum()) <= case.max_images
        if case.single_source:
            assert len(set(plan.pack_sources(p))) == 1
    # a re-plan from a cursor keeps the served packs and serves its uses once too
    cursor = min(cut, len(plan))
    targets = [int(c.sum()) + 1 for c in case.counts]
    new = replan_from_cursor(
        plan, cursor, targets, [f"s{s}" for s in range(len(targets))], case.total,
        case.visual, capacity=150, balance="cost", seed=case.seed,
        single_source=case.single_source, max_visual=case.max_visual, images=case.images,
        max_images=case.max_images, per_rank=case.per_rank,
    )  # fmt: skip
    for slot in range(cursor):
        assert new.pack(int(new.order[slot])) == plan.pack(int(plan.order[slot]))
    assert sorted(new.order.tolist()) == list(range(len(new)))
    for p in range(len(new)):
        ids = new.pack(p)
        assert len(ids) == len(set(ids))
        assert int(case.total[ids].sum()) <= 150
        if case.max_images is not None:
            assert int(case.images[ids].sum()) <= case.max_images
    served = np.bincount(new.source_of(new.ids), minlength=len(targets))
    assert served.tolist() == targets


def test_epoch_counts_mixture_through_the_layout_is_even_at_64_ranks() -> None:
    """A blend as the graphs plan it (``epoch_counts``), 64 ranks: the small source's
    uses (2.5 each) planned with the big one's, steps as even as one plan's."""
    rng = np.random.default_rng(3)
    sizes = [40_000, 10_000]
    total = rng.integers(50, 3000, sum(sizes))
    visual = np.where(rng.random(total.size) < 0.5, total // 2, 0)
    counts = epoch_counts([40_000, 25_000], sizes, ["big", "small"], seed=0, epoch=0)
    plan = plan_mixture(counts, total, visual, capacity=8192, epoch=0, group_size=64,
                        balance="cost", per_rank=1)  # fmt: skip
    attention, vision = _step_p95(plan, total, visual, 64, 1)
    assert attention <= 1.05, (attention, vision)
    assert vision <= 1.05, (attention, vision)
