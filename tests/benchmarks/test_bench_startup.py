"""Smoke test: benchmarks/bench_startup.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_startup_quick() -> None:
    out = run_bench("bench_startup.py", "--repeats", "1")
    row = out["metrics"]["pack_2048"]
    assert 0 < row["graph_s"] <= row["first_batch_s"]
    assert 0 < row["first_pack_real_tokens"] <= 2048
