"""Smoke test: benchmarks/bench_tokenize.py --quick runs and prints its JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_tokenize.py"


def test_bench_tokenize_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeats", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    )
    out = json.loads(proc.stdout)
    assert set(out) == {"benchmark", "params", "metrics", "env"}
    assert out["benchmark"] == "tokenize"
    row = out["metrics"]["qwen2_vl"]
    assert row["samples"] == 24
    assert row["tokens"] > 0
    for key in ("neatpack_ms", "reference_ms", "labels_ms"):
        assert set(row[key]) == {"mean", "p50", "p95"}
