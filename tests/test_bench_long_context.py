"""Smoke test: benchmarks/bench_long_context.py --quick runs and prints its JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_long_context.py"


def test_bench_long_context_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True, text=True, check=True, timeout=280,
    )  # fmt: skip
    out = json.loads(proc.stdout)
    assert set(out) == {"benchmark", "params", "metrics", "env"}
    m = out["metrics"]
    assert m["probe/qwen2"]["leaks"] is False
    assert m["probe/bamba"]["leaks"] is True
    for cp in ("cp2", "cp4", "cp8"):
        assert m[cp]["head_tail_max_over_mean_worst"] <= 1.05
        assert m[cp]["contiguous_max_over_mean_worst"] > m[cp]["head_tail_max_over_mean_worst"]
