"""Smoke test: benchmarks/bench_supervised_families.py --quick runs and prints its JSON object."""

from __future__ import annotations

import pytest
from support.bench import run_bench


@pytest.mark.slow  # ~35 s (15 index builds); the proof is tests/graphs/test_supervised_families
def test_bench_supervised_families_quick() -> None:
    out = run_bench("bench_supervised_families.py", timeout=600)
    assert out["benchmark"] == "supervised_families"
    m = out["metrics"]
    assert {"qwen2_vl", "gemma3", "idefics3", "phi4"} <= set(m)
    # the families whose templates trim or merge the answer count through their tokenize
    for family, row in m.items():
        trims = family in ("gemma3", "gemma4", "idefics3", "smolvlm")
        assert row["counts_through"] == ("family tokenize" if trims else "formula"), family
        assert row["label_marks"] == 1
        assert row["exact_supervised_us_per_record"] > 0
        assert 0 <= row["estimate_vs_exact"]["p50"] <= row["estimate_vs_exact"]["p95"]
