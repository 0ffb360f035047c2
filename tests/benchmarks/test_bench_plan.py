"""Smoke test: benchmarks/bench_plan.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_plan_quick() -> None:
    out = run_bench("bench_plan.py", "--repeats", "1")
    assert out["benchmark"] == "plan"
    assert set(out["metrics"]) == {"lognormal/100000", "uniform/100000", "uniform_full/100000"}
    for row in out["metrics"].values():
        assert row["lower_bound"] <= row["fast_packs"]
        assert row["lower_bound"] <= row["greedy_packs"]
        assert {"fast_csr_s", "fast_bin_ids_s", "greedy_s", "fast_gap_pp"} <= set(row)
        assert row["fast_half_full_packs"] <= 1
