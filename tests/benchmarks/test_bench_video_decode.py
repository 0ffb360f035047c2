"""Smoke test: benchmarks/bench_video_decode.py --quick runs and prints its JSON object."""

from __future__ import annotations

import importlib.util

from support.bench import run_bench


def test_bench_video_decode_quick() -> None:
    out = run_bench("bench_video_decode.py")
    assert out["benchmark"] == "video_decode"
    if importlib.util.find_spec("av") is None:
        assert "neatpack[video]" in out["metrics"]["error"]
        return
    assert set(out["metrics"]) == {"mp4", "webm", "mkv", "kept_frames"}
    kept = out["metrics"].pop("kept_frames")
    for ext in ("mp4", "webm", "mkv"):  # 24 frames at 24 fps, 2 fps sampling: 4 (min_frames)
        assert kept["decode_ms"][ext]["frames"] == 24
        assert kept["decode_ms"][ext]["kept"] == 4
    loader = kept["loader"]
    assert loader["identical"] is True  # the kept-frames batches equal the full decode's
    assert loader["all_frames"]["tokens"] == loader["kept_frames"]["tokens"] > 0
    for row in out["metrics"].values():
        pyav = row["pyav"]
        assert pyav["available"] is True
        assert pyav["frames"] == 24
        assert pyav["frames_per_s"] > 0
        assert row["torchcodec"]["available"] in (True, False)  # skipped when it does not load
