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


def vlm_samples(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """35% text-only samples, the rest 1-4 images of 64..1280 visual tokens, within 8192:
    ``(total, visual, images)``."""
    rng = np.random.default_rng(seed)
    text_only = rng.random(n) < 0.35
    n_images = np.where(text_only, 0, rng.choice([1, 2, 3, 4], size=n, p=[0.5, 0.25, 0.15, 0.1]))
    visual = (rng.integers(64, 1281, size=(n, 4)) * (np.arange(4) < n_images[:, None])).sum(1)
    text = np.where(text_only, rng.lognormal(6.0, 0.9, n), rng.lognormal(5.0, 0.8, n))
    total = np.minimum(np.rint(text).astype(np.int64) + 1 + visual, 8192)
    return total, np.minimum(visual, total).astype(np.int64), n_images.astype(np.int64)


def vlm_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    total, visual, _ = vlm_samples(n, seed)
    return total, visual


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


# -- the third budget: media items per pack (max_images) ---------------------------------------


def check_images(plan: PackPlan, images: np.ndarray, budget: int) -> None:
    for pack in plan.packs():
        assert int(images[pack].sum()) <= budget


@given(
    st.lists(
        st.tuples(st.integers(1, 100), st.integers(0, 100), st.integers(0, 6)).map(
            lambda t: (t[0], min(t[:2]), t[2])
        ),
        max_size=60,
    ),
    st.integers(1, 100),
    st.integers(1, 6),
    st.booleans(),
    st.integers(1, 4),
)
def test_every_pack_keeps_all_three_budgets_and_every_sample_is_placed_once(
    samples: list[tuple[int, int, int]],
    budget: int,
    max_images: int,
    with_visual: bool,
    world_size: int,
) -> None:
    total = np.array([t for t, _, _ in samples], dtype=np.int64)
    visual = np.array([v for _, v, _ in samples], dtype=np.int64)
    images = np.array([m for _, _, m in samples], dtype=np.int64)
    max_visual = budget if with_visual else None
    plan = plan_packs(
        total, 100, visual=visual, max_visual=max_visual, images=images, max_images=max_images,
        overlong="drop", world_size=world_size,
    )  # fmt: skip
    check_plan(plan, total, visual, 100, budget if with_visual else 10**9)
    check_images(plan, images, max_images)
    over = (images > max_images) | ((visual > budget) if with_visual else False)
    assert plan.dropped_ids.tolist() == np.flatnonzero(over).tolist()


def test_the_images_budget_moves_samples_and_keeps_the_fill() -> None:
    total, visual, images = vlm_samples(5000, seed=1)
    plain = plan_packs(total, 8192, visual=visual)
    per_pack = [int(images[p].sum()) for p in plain.packs()]
    assert max(per_pack) > 8  # without the budget, packs hold more items than allowed
    # 8 binds: the token plan holds 8.6 items per pack on average, so at least
    # sum(images) / 8 = 762 packs are needed (706 without it). Measured: 776 packs with the
    # images budget alone, 812 with the visual one too (which alone needs none more).
    bound = images.sum() / 8
    for budgets, slack in (
        ({"max_images": 8}, 1.03),
        ({"max_images": 8, "max_visual": 6500}, 1.08),
    ):
        plan = plan_packs(total, 8192, visual=visual, images=images, world_size=8, seed=3,
                          **budgets)  # fmt: skip
        check_plan(plan, total, visual, 8192, budgets.get("max_visual", 10**9))
        check_images(plan, images, 8)
        assert plan.dropped_ids.size == 0
        assert len(plan) <= slack * bound
        assert plan.fingerprint != plain.fingerprint
    loose = plan_packs(total, 8192, visual=visual, images=images, max_images=12)
    assert loose.utilization() >= plain.utilization() - 0.002  # not binding: the same fill


def test_the_images_budget_keys_its_plan_and_leaves_other_plans_unchanged() -> None:
    from neatpack.pipes.planning.plan import plan_fingerprint

    total, visual, images = vlm_samples(2000, seed=2)
    plain = plan_packs(total, 8192, visual=visual, world_size=4)
    # counts given but not budgeted, token balance: the plan and its fingerprint as before
    given_counts = plan_packs(total, 8192, visual=visual, images=images, world_size=4)
    assert given_counts.fingerprint == plain.fingerprint
    assert given_counts.packs() == plain.packs()
    loose = plan_packs(total, 8192, visual=visual, images=images, world_size=4, max_images=10**4)
    assert loose.packs() == plain.packs()
    assert loose.fingerprint != plain.fingerprint  # another config: another key
    assert loose.fingerprint == plan_fingerprint(
        total, 8192, visual=visual, images=images, world_size=4, max_images=10**4
    )
    # a cost balance over one item per sample prices it as before the counts existed
    ones = np.minimum(images, 1)
    cost = plan_packs(total, 8192, visual=visual, world_size=4, balance="cost")
    assert plan_packs(total, 8192, visual=visual, images=ones, world_size=4,
                      balance="cost").fingerprint == cost.fingerprint  # fmt: skip
    multi = plan_packs(total, 8192, visual=visual, images=images, world_size=4, balance="cost")
    assert multi.fingerprint != cost.fingerprint  # the counts change the cost order


def test_a_sample_over_the_images_budget_alone_follows_the_overlong_policy() -> None:
    total = np.array([900, 300, 800, 50])
    visual = np.array([850, 200, 100, 0])
    images = np.array([1, 5, 2, 0])
    with pytest.raises(ValueError, match=r"max_images=3.*sample 1 \(5\)"):
        plan_packs(total, 1024, visual=visual, images=images, max_images=3)
    plan = plan_packs(total, 1024, visual=visual, images=images, max_images=3, overlong="drop")
    assert plan.dropped_ids.tolist() == [1]
    check_images(plan, images, 3)
    with pytest.raises(ValueError, match="needs images="):
        plan_packs(total, 1024, max_images=3)


def test_the_images_option_is_checked_and_keyed_only_when_set() -> None:
    assert "max_images" not in checkpoint_key(NeatVLMConfig())
    assert checkpoint_key(NeatVLMConfig(max_images=16))["max_images"] == 16
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_images"):
            NeatVLMConfig(max_images=bad)  # type: ignore[arg-type]
    from neatpack.graphs import NeatStreamConfig

    with pytest.raises(ValueError, match=r"max_images=4\) is not available for a stream"):
        NeatStreamConfig(max_images=4)
