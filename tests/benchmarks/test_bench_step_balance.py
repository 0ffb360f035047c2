"""Smoke test: benchmarks/bench_step_balance.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench

METHODS = ("tokens", "cost_order", "cost", "kk", "lpt_swaps")


def test_bench_step_balance_quick() -> None:
    out = run_bench("bench_step_balance.py")
    assert out["benchmark"] == "step_balance"
    m = dict(out["metrics"])
    mixture = m.pop("mixture")
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
    # mixtures with repeated sources (as the graphs plan them): every use once, as even as
    # one plan of the same uses where packs may mix sources, fill within 0.2 points
    assert {k.split("/")[0] for k in mixture} == {"generated", "real"}
    for key, case in mixture.items():
        mix, one = case["mixture"], case["one_plan"]
        assert mix["steps"] > 0
        assert mix["fill"] >= case["best_fit_fill"] - 0.002
        assert max(case["uses_per_sample"]) > 2  # a source used more than twice
        for term in ("attention", "vision"):
            assert 1.0 <= mix[term]["p50"] <= mix[term]["p95"] <= mix[term]["max"]
            if "single_source=False" in key:
                assert mix[term]["p95"] <= one[term]["p95"] + 0.02, (key, term)
