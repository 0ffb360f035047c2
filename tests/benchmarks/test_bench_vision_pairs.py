"""Smoke test: benchmarks/bench_vision_pairs.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_vision_pairs_quick() -> None:
    out = run_bench("bench_vision_pairs.py")
    assert out["benchmark"] == "vision_pairs"
    for case in out["metrics"].values():
        assert case["multi_image_samples"] > 0
        assert case["packs_with_images"] > 0
        # one image per sample never understates; equal images never overstate (sum p^2 >= P^2/n)
        assert case["one_image_per_sample_over_exact"]["min"] >= 1.0
        assert case["equal_images_over_exact"]["max"] <= 1.0 + 1e-9
        assert case["one_image_per_sample_over_exact"]["max"] > 1.0
