"""Smoke test: benchmarks/bench_plan.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_plan_quick() -> None:
    out = run_bench("bench_plan.py", "--repeats", "1", "--corpus", "40")
    assert out["benchmark"] == "plan"
    metrics = dict(out["metrics"])
    budget = metrics.pop("visual_budget")
    items = metrics.pop("images_budget")
    assert set(metrics) == {"lognormal/100000", "uniform/100000", "uniform_full/100000"}
    for row in metrics.values():
        assert row["lower_bound"] <= row["fast_packs"]
        assert row["lower_bound"] <= row["greedy_packs"]
        assert {"fast_csr_s", "fast_bin_ids_s", "greedy_s", "fast_gap_pp"} <= set(row)
        assert row["fast_half_full_packs"] <= 1
    assert set(budget) == {"vlm/100000", "corpus/40"}
    for rows in budget.values():
        assert set(rows) == {"none", "x1.25", "x1.1", "x1.0", "x0.8"}
        for name, row in rows.items():
            assert row["lower_bound"] <= row["packs"]
            if name != "none":  # the budget holds in every pack
                assert row["max_pack_visual"] <= row["max_visual"]
    assert set(items) == {"vlm/100000", "corpus/40"}
    for rows in items.values():
        assert set(rows) == {"none", "x1.25", "x1.0", "x0.8", "x1.0+visual"}
        for name, row in rows.items():
            assert row["lower_bound"] <= row["packs"]
            if name != "none":  # the budgets hold in every pack
                assert row["max_pack_images"] <= row["max_images"]
            if row["max_visual"] is not None:
                assert row["max_pack_visual"] <= row["max_visual"]
