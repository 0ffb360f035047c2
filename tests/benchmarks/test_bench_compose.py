"""Smoke test: bench_compose.py --quick runs and prints its JSON."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_compose_quick() -> None:
    out = run_bench("bench_compose.py", timeout=400)
    m = out["metrics"]
    for kind in ("prebuilt", "hand_chain", "hand_readme"):
        assert m[kind]["tokens_per_s"] > 0
        assert m[kind]["batches"] >= 2
    assert m["ratio_hand_chain_vs_prebuilt"] > 0
