"""Shared by the benchmark smoke tests: run ``benchmarks/<script> --quick`` in a fresh process
and return its one JSON object, checked for the four keys every benchmark prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_bench(script: str, *args: str, timeout: int = 240) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *args],
        capture_output=True, text=True, check=True, timeout=timeout,
    )  # fmt: skip
    out: dict[str, Any] = json.loads(proc.stdout)
    assert set(out) == {"benchmark", "params", "metrics", "env"}
    return out
