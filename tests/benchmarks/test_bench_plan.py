"""Smoke test: benchmarks/bench_plan.py --quick runs and prints its JSON object."""

from __future__ import annotations

from pathlib import Path

from support.bench import run_bench

ROOT = Path(__file__).resolve().parents[2]


def test_bench_plan_quick() -> None:
    out = run_bench("bench_plan.py", "--repeats", "1", "--corpus", "40")
    assert out["benchmark"] == "plan"
    metrics = dict(out["metrics"])
    budget = metrics.pop("visual_budget")
    items = metrics.pop("images_budget")
    plans = metrics.pop("balance_plan")
    assert set(plans) == {"vlm/100000/8", "vlm/100000/64"}
    for row in plans.values():
        assert set(row) == {"tokens", "cost"}
        assert row["tokens"]["free_from"] == 0  # only "cost" makes step groups
        for cell in row.values():
            assert 0.9 < cell["utilization"] <= 1.0
            assert cell["free_from"] <= cell["packs"]
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


def test_bench_plan_baseline_same_checkout() -> None:
    """--baseline times another checkout's planner in a subprocess: this one against itself
    gives the same plans (the hashes), from the same files."""
    out = run_bench("bench_plan.py", "--balance-only", "--sizes", "20000", "--ranks", "8",
                    "--repeats", "1", "--baseline", str(ROOT))  # fmt: skip
    assert set(out["metrics"]) == {"balance_plan", "balance_plan_baseline"}
    base = out["metrics"]["balance_plan_baseline"]
    assert base["planner"] == out["params"]["planner"]
    for cell in out["metrics"]["balance_plan"]["vlm/20000/8"].values():
        assert cell["same_plan"] is True
        assert cell["baseline_plan_s"] > 0
