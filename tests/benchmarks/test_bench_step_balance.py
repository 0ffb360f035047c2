"""Smoke test: benchmarks/bench_step_balance.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench

METHODS = ("tokens", "cost_order", "cost", "kk", "lpt_swaps")


def test_bench_step_balance_quick() -> None:
    out = run_bench("bench_step_balance.py")
    assert out["benchmark"] == "step_balance"
    m = out["metrics"]
    assert {k.split("/")[0] for k in m} == {"generated", "ai2d", "chartqa", "docvqa", "real_mix"}
    for case in m.values():
        # balance="cost" makes its own packs where that wins (``made_groups``), within 0.2 points
        assert case["same_packs"] is (case["made_groups"] == 0)
        assert case["fill"]["cost"] >= case["fill"]["tokens"] - 0.002
        for method in METHODS:
            r = case[method]
            assert r["steps"] > 0
            for term in ("attention", "vision"):
                assert 1.0 <= r[term]["p50"] <= r[term]["p95"] <= r[term]["max"]
            assert r["epoch_time"] >= 1.0
