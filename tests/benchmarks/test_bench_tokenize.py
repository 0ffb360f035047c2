"""Smoke test: benchmarks/bench_tokenize.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_tokenize_quick() -> None:
    out = run_bench("bench_tokenize.py", "--repeats", "1")
    assert out["benchmark"] == "tokenize"
    row = out["metrics"]["qwen2_vl"]
    assert row["samples"] == 24
    assert row["tokens"] > 0
    for key in ("neatpack_ms", "reference_ms", "labels_ms"):
        assert set(row[key]) == {"mean", "p50", "p95"}
