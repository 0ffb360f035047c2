"""Smoke test: benchmarks/bench_shards.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_shards_quick() -> None:
    out = run_bench("bench_shards.py")
    assert out["benchmark"] == "shards"
    m = out["metrics"]
    assert m["same_lengths"] is True  # JSONL, tar and Parquet give the same length index
    assert m["tar_offset_index_records_per_s"] > 0
    assert set(m["length_index_records_per_s"]) == {"jsonl", "tar", "parquet"}
