"""Smoke test: benchmarks/bench_long_context.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_long_context_quick() -> None:
    out = run_bench("bench_long_context.py", timeout=280)
    m = out["metrics"]
    assert m["probe/qwen2"]["leaks"] is False
    assert m["probe/bamba"]["leaks"] is True
    for cp in ("cp2", "cp4", "cp8"):
        assert m[cp]["head_tail_max_over_mean_worst"] <= 1.05
        assert m[cp]["contiguous_max_over_mean_worst"] > m[cp]["head_tail_max_over_mean_worst"]
