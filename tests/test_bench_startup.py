"""Smoke test: benchmarks/bench_startup.py --quick runs and prints its JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_startup.py"


def test_bench_startup_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeats", "1"],
        capture_output=True, text=True, check=True, timeout=240,
    )  # fmt: skip
    out = json.loads(proc.stdout)
    assert set(out) == {"benchmark", "params", "metrics", "env"}
    row = out["metrics"]["pack_2048"]
    assert 0 < row["graph_s"] <= row["first_batch_s"]
    assert 0 < row["first_pack_real_tokens"] <= 2048
