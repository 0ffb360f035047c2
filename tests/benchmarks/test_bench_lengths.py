"""Smoke test: the length benchmark runs with --quick and prints one JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_lengths.py"


@pytest.mark.timeout(240)
def test_bench_lengths_quick() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout)
    assert set(result) == {"benchmark", "params", "metrics", "env"}
    assert result["benchmark"] == "lengths"
    assert result["params"]["records"] == 5000
    assert result["params"]["reload_entries"] == 1_000_000
    for key in ("records_per_s", "build_s", "big_reload_s", "cached_reload_s"):
        assert result["metrics"][key] > 0
