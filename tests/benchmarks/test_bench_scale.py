"""Smoke test: benchmarks/bench_scale.py --quick runs and prints its JSON object."""

from __future__ import annotations

from support.bench import run_bench


def test_bench_scale_quick() -> None:
    out = run_bench("bench_scale.py", timeout=400)
    assert out["benchmark"] == "scale"
    meta, video = out["metrics"]["metadata"], out["metrics"]["video"]
    assert meta["same_index"] is True  # 1 and 2 processes build the same index
    assert set(meta["index_records_per_s"]) == {"1_process", "2_process"}
    assert meta["first_batch_tokens"] > 0
    assert set(video["loader_tokens_per_s"]) == {"0_workers", "2_workers"}
    assert 0 < video["decode_share"] < 1


def test_bench_scale_simulated_ranks() -> None:
    out = run_bench("bench_scale.py", "--samples", "20000", "--ranks", "2", timeout=400)
    metrics = out["metrics"]
    assert [r["rank"] for r in metrics["per_rank"]] == [0, 1]
    assert metrics["node"]["resume_exact"] is True  # the resumed loader's batch is the next one
    assert metrics["plan_files_mb"] > 0  # planned once, into the shared cache
    assert all(r["first_batch_tokens"] > 0 for r in metrics["per_rank"])
    offsets = metrics["reader_offsets"]  # built by the real readers from real files
    assert offsets["jsonl"]["bytes_per_sample"] < offsets["jsonl"]["before_bytes_per_sample"]
    assert offsets["jsonl"]["overlong_pass_per_open"] is False  # the longest line is cached
    assert offsets["tar"]["bytes_per_sample"] < offsets["tar"]["before_bytes_per_sample"]
    files = metrics["node_files_bytes_per_sample"]
    assert files["parquet"] < files["jsonl"] < files["tar"]
