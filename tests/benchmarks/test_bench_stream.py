"""Smoke test: benchmarks/bench_stream.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_stream_quick() -> None:
    out = run_bench("bench_stream.py", timeout=400)
    assert out["benchmark"] == "stream"
    m = out["metrics"]
    runs = ["planned", *(f"stream@{b}" for b in out["params"]["buffers"])]
    for run in runs:  # every run finished and delivered the whole corpus
        assert "error" not in m[run], m[run]
        assert m[run]["samples"] == out["params"]["samples"]
        assert 0 < m[run]["fill"] <= 1
    assert len({m[run]["real_tokens"] for run in runs}) == 1  # the same tokens, packed apart
