"""Smoke test: benchmarks/bench_balance.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_balance_quick() -> None:
    out = run_bench("bench_balance.py", "--epochs", "2")
    assert out["benchmark"] == "balance"
    m = out["metrics"]
    for order in ("plan_order", "random_shuffle"):
        for load in ("visual", "text", "total"):
            assert set(m[order][load]) == {"mean", "p95", "max", "sum_max_over_sum_mean"}
            assert m[order][load]["mean"] >= 1.0
    assert m["packs"] > 0
