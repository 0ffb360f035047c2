"""Smoke test: benchmarks/bench_materialize.py --quick runs and prints its JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_materialize.py"


def test_bench_materialize_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    )
    out = json.loads(proc.stdout)
    assert set(out) == {"benchmark", "params", "metrics", "env"}
    assert out["benchmark"] == "materialize"
    tp = out["metrics"]["throughput"]
    assert tp["samples"] == 16
    assert tp["packs"] == 4
    assert tp["same_tokens"] is True  # both paths saw the same samples
    for key in ("materialize_packs_per_s", "materialize_tokens_per_s", "reference_tokens_per_s"):
        assert tp[key] > 0
    util = out["metrics"]["utilization"]
    assert "skipped" in util or 0 < util["real_utilization"] <= 1
