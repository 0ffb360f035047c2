"""Smoke test: benchmarks/bench_cost_model.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_cost_model_quick() -> None:
    out = run_bench("bench_cost_model.py")
    assert out["benchmark"] == "cost_model"
    m = out["metrics"]
    for fmt in ("sdpa", "flash_attention_2"):
        assert m[fmt]["packs"] == 12
        assert -1.0 <= m[fmt]["spearman_flops"] <= 1.0
        assert -1.0 <= m[fmt]["spearman_calibrated_held_out"] <= 1.0
        assert abs(sum(m[fmt]["flops_share"].values()) - 1.0) < 1e-3
        assert all(v >= 0 for v in m[fmt]["calibrated"].values())
    assert m["goal_met"] is False  # --quick times 12 packs, the goal needs >= 50
