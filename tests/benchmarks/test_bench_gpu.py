"""Smoke test: benchmarks/bench_gpu.py --smoke (alias --quick) runs on CPU with a tiny model and
prints its JSON object, every row measured (the GPU figures come from a GPU run)."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_gpu_smoke() -> None:
    out = run_bench("bench_gpu.py", timeout=600)
    assert out["benchmark"] == "gpu"
    assert out["env"]["device"] == "cpu"
    assert out["params"]["formats"] == {"default": "sdpa", "default_model": "sdpa"}  # CPU
    m = out["metrics"]
    for row in ("default", "dense_sdpa", "varlen", "grouped"):
        assert m[row]["real_tokens_per_s"] > 0, row
        assert 0 < m[row]["real_fraction"] <= 1, row
    # the same packs through the dense mask and through varlen (CPU reference): one loss
    assert abs(m["dense_sdpa"]["loss_first"] - m["varlen"]["loss_first"]) < 1e-3
    for row in ("balance_tokens", "balance_cost"):
        assert m[row]["slowest_rank_step_s"] >= m[row]["mean_rank_step_s"] > 0, row
