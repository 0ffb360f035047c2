"""Smoke test: benchmarks/bench_plan.py --quick runs and prints its JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_plan.py"


def test_bench_plan_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeats", "1"],
        capture_output=True, text=True, check=True, timeout=240,
    )  # fmt: skip
    out = json.loads(proc.stdout)
    assert set(out) == {"benchmark", "params", "metrics", "env"}
    assert out["benchmark"] == "plan"
    assert set(out["metrics"]) == {"lognormal/100000", "uniform/100000", "uniform_full/100000"}
    for row in out["metrics"].values():
        assert row["lower_bound"] <= row["fast_packs"]
        assert row["lower_bound"] <= row["greedy_packs"]
        assert {"fast_csr_s", "fast_bin_ids_s", "greedy_s", "fast_gap_pp"} <= set(row)
        assert row["fast_half_full_packs"] <= 1
