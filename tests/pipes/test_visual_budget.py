"""The second budget per pack (#27 item 4): ``plan_packs(max_visual=)`` keeps every pack within
the visual tokens it allows and within ``capacity``, places every sample exactly once, and
sends a sample over the budget alone through the overlong policy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from neatpack.graphs import NeatVLMConfig
from neatpack.graphs.config import checkpoint_key
from neatpack.pipes.planning.plan import PackPlan, plan_packs


def vlm_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """35% text-only samples, the rest 1-4 images of 64..1280 visual tokens, within 8192."""
    rng = np.random.default_rng(seed)
    text_only = rng.random(n) < 0.35
    n_images = np.where(text_only, 0, rng.choice([1, 2, 3, 4], size=n, p=[0.5, 0.25, 0.15, 0.1]))
    visual = (rng.integers(64, 1281, size=(n, 4)) * (np.arange(4) < n_images[:, None])).sum(1)
    text = np.where(text_only, rng.lognormal(6.0, 0.9, n), rng.lognormal(5.0, 0.8, n))
    total = np.minimum(np.rint(text).astype(np.int64) + 1 + visual, 8192)
    return total, np.minimum(visual, total).astype(np.int64)


def check_plan(
    plan: PackPlan, total: np.ndarray, visual: np.ndarray, capacity: int, budget: int
) -> None:
    placed = np.concatenate([plan.ids, plan.dropped_ids])
    assert np.array_equal(np.sort(placed), np.arange(total.size)), "every sample exactly once"
    for pack in plan.packs():
        assert int(visual[pack].sum()) <= budget
        assert int(total[pack].sum()) <= capacity
    assert np.array_equal(plan.visual, [int(visual[p].sum()) for p in plan.packs()])


@given(
    st.lists(
        st.tuples(st.integers(1, 100), st.integers(0, 100)).map(lambda t: (t[0], min(t))),
        max_size=60,
    ),
    st.integers(1, 100),
    st.integers(1, 4),
)
def test_every_pack_keeps_both_budgets_and_every_sample_is_placed_once(
    samples: list[tuple[int, int]], budget: int, world_size: int
) -> None:
    total = np.array([t for t, _ in samples], dtype=np.int64)
    visual = np.array([v for _, v in samples], dtype=np.int64)
    plan = plan_packs(
        total, 100, visual=visual, max_visual=budget, overlong="drop", world_size=world_size
    )
    check_plan(plan, total, visual, 100, budget)
    assert plan.dropped_ids.tolist() == np.flatnonzero(visual > budget).tolist()


def test_the_budget_moves_samples_that_the_token_plan_puts_together() -> None:
    total, visual = vlm_lengths(5000, seed=1)
    plain = plan_packs(total, 8192, visual=visual)
    assert plain.visual.max() > 6500  # without the budget, packs carry more vision than allowed
    assert (plain.visual > 6500).sum() > 50
    plan = plan_packs(total, 8192, visual=visual, max_visual=6500, world_size=8, seed=3)
    check_plan(plan, total, visual, 8192, 6500)
    assert plan.dropped_ids.size == 0
    # fill within 0.2 points of the token-only plan (the mean load per pack is ~5,800)
    assert plan.utilization() >= plain.utilization() - 0.002
    assert plan.fingerprint != plain.fingerprint


def test_a_budget_that_never_binds_leaves_the_plan_as_it_was() -> None:
    total, visual = vlm_lengths(2000, seed=2)
    plain = plan_packs(total, 8192, visual=visual, world_size=4)
    loose = plan_packs(total, 8192, visual=visual, world_size=4, max_visual=8192)
    assert loose.packs() == plain.packs()
    unset = plan_packs(total, 8192, visual=visual, world_size=4, max_visual=None)
    assert unset.fingerprint == plain.fingerprint


def test_a_sample_over_the_budget_alone_follows_the_overlong_policy() -> None:
    total = np.array([900, 300, 800, 50])
    visual = np.array([850, 200, 100, 0])
    with pytest.raises(ValueError, match=r"max_visual=500.*sample 0 \(850\)"):
        plan_packs(total, 1024, visual=visual, max_visual=500)
    plan = plan_packs(total, 1024, visual=visual, max_visual=500, overlong="drop")
    assert plan.dropped_ids.tolist() == [0]
    check_plan(plan, total, visual, 1024, 500)
    with pytest.raises(ValueError, match="needs visual="):
        plan_packs(total, 1024, max_visual=500)


def test_the_config_option_is_checked_and_keyed_only_when_set() -> None:
    assert "max_visual_tokens" not in checkpoint_key(NeatVLMConfig())
    assert checkpoint_key(NeatVLMConfig(max_visual_tokens=4096))["max_visual_tokens"] == 4096
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_visual_tokens"):
            NeatVLMConfig(max_visual_tokens=bad)  # type: ignore[arg-type]
