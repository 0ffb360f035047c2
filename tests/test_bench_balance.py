"""Smoke test: benchmarks/bench_balance.py --quick runs and prints its JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_balance.py"


def test_bench_balance_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--epochs", "2"],
        capture_output=True, text=True, check=True, timeout=240,
    )  # fmt: skip
    out = json.loads(proc.stdout)
    assert set(out) == {"benchmark", "params", "metrics", "env"}
    assert out["benchmark"] == "balance"
    m = out["metrics"]
    for order in ("plan_order", "random_shuffle"):
        for load in ("visual", "text", "total"):
            assert set(m[order][load]) == {"mean", "p95", "max", "sum_max_over_sum_mean"}
            assert m[order][load]["mean"] >= 1.0
    assert m["packs"] > 0
