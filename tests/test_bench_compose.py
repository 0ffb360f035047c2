"""Smoke test: bench_compose.py --quick runs and prints its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_compose_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_compose.py"), "--quick"],
        capture_output=True,
        text=True,
        check=True,
        timeout=400,
    )
    out = json.loads(proc.stdout)
    assert set(out) == {"benchmark", "params", "metrics", "env"}
    m = out["metrics"]
    for kind in ("prebuilt", "hand_chain", "hand_readme"):
        assert m[kind]["tokens_per_s"] > 0
        assert m[kind]["batches"] >= 2
    assert m["ratio_hand_chain_vs_prebuilt"] > 0
