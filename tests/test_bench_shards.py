"""Smoke test: benchmarks/bench_shards.py --quick runs and prints its JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_shards.py"


def test_bench_shards_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    )
    out = json.loads(proc.stdout)
    assert set(out) == {"benchmark", "params", "metrics", "env"}
    assert out["benchmark"] == "shards"
    m = out["metrics"]
    assert m["same_lengths"] is True  # JSONL, tar and Parquet give the same length index
    assert m["tar_offset_index_records_per_s"] > 0
    assert set(m["length_index_records_per_s"]) == {"jsonl", "tar", "parquet"}
