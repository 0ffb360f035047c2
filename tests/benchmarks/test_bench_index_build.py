"""Smoke test: benchmarks/bench_index_build.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_index_build_quick() -> None:
    out = run_bench("bench_index_build.py")
    assert out["benchmark"] == "index_build"
    m, p = out["metrics"], out["params"]
    per = p["records"] // p["shards"]
    assert m["killed_exit_code"] == 3
    assert 0 < m["pieces_saved_before_kill"] < p["shards"]
    # only what the killed build had not saved, only the appended shards
    assert m["resume_estimated_records"] == (p["shards"] - m["pieces_saved_before_kill"]) * per
    assert m["append_estimated_records"] == p["appended_shards"] * per
    assert m["resume_same_as_cold"] is True
    assert m["append_same_as_rebuild"] is True
