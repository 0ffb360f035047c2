"""Smoke test: benchmarks/bench_materialize.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_materialize_quick() -> None:
    out = run_bench("bench_materialize.py")
    assert out["benchmark"] == "materialize"
    tp = out["metrics"]["throughput"]
    assert tp["samples"] == 16
    assert tp["packs"] == 4
    assert tp["same_tokens"] is True  # both paths saw the same samples
    for key in ("materialize_packs_per_s", "materialize_tokens_per_s", "reference_tokens_per_s"):
        assert tp[key] > 0
    util = out["metrics"]["utilization"]
    assert "skipped" in util or 0 < util["real_utilization"] <= 1
