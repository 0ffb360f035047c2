"""Smoke test: benchmarks/bench_supervised_balance.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_supervised_balance_quick() -> None:
    out = run_bench("bench_supervised_balance.py")
    assert out["benchmark"] == "supervised_balance"
    m = out["metrics"]
    for world in ("8_ranks", "64_ranks"):
        tokens, supervised = m[world]["tokens"], m[world]["supervised"]
        assert tokens["packs"] == supervised["packs"] > 0  # the same packs, only reordered
        assert tokens["fill"] == supervised["fill"]
        for row in (tokens, supervised):
            for term in ("supervised", "total", "attention"):
                assert 1.0 <= row[term]["p50"] <= row[term]["p95"] <= row[term]["max"]
    assert set(m["estimate_vs_exact"]) == {"estimate", "calibrated"}
