"""Smoke test: benchmarks/bench_mixture.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_mixture_quick() -> None:
    out = run_bench("bench_mixture.py", "--repeats", "1")
    assert out["benchmark"] == "mixture"
    assert out["params"]["samples"] == 1_000_000
    single, mixture = out["metrics"]["single"], out["metrics"]["mixture"]
    assert {"s", "cpu_s", "peak_mb", "packs"} <= set(single) & set(mixture)
    assert mixture["repeat_per_source"][-1] > 1 > mixture["repeat_per_source"][2]
    assert abs(sum(mixture["epoch_shares"]) - 1) < 1e-4
