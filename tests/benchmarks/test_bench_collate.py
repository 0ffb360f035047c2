"""Smoke test: benchmarks/bench_collate.py --quick runs and prints its JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_collate.py"


def test_bench_collate_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--seq", "512", "--repeats", "2",
         "--heavy-repeats", "1"],
        capture_output=True, text=True, check=True, timeout=240,
    )  # fmt: skip
    out = json.loads(proc.stdout)
    assert set(out) == {"benchmark", "params", "metrics", "env"}
    assert out["benchmark"] == "collate"
    assert out["params"]["seq"] == 512
    assert set(out["metrics"]) == {
        "doc_ids", "position_ids", "flash_attention_2", "thd", "flex_attention", "sdpa", "eager",
    }  # fmt: skip
    timing = {"collate_ms_median", "collate_ms_best", "collate_ms_p90",
              "collate_ms_median_unpreempted", "preempted_calls", "page_faults_per_call_median",
              "gc_runs"}  # fmt: skip
    for fmt, row in out["metrics"].items():
        assert timing | {"mask_ms_best", "output_bytes", "mask_bytes",
                         "rss_peak_delta_bytes"} <= set(row)  # fmt: skip
        assert row["collate_ms_best"] <= row["collate_ms_median"] <= row["collate_ms_p90"]
        # the general-path baseline is timed for the compact formats only
        compact = fmt not in ("flex_attention", "sdpa", "eager")
        assert ("general_path" in row) == compact
        if compact:
            assert timing == set(row["general_path"])
    # the 4D masks hold B*S*S entries: bool 1 byte, additive float32 4 bytes
    assert out["metrics"]["sdpa"]["mask_bytes"] == 4 * 512 * 512
    assert out["metrics"]["eager"]["mask_bytes"] == 4 * 4 * 512 * 512
