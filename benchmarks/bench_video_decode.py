"""Video decoder choice for pipes/video.py: PyAV vs torchcodec on the same files.

Prints one JSON object. The script encodes its own videos with PyAV (h264 .mp4, vp8 .webm,
mpeg4 .mkv; a moving bar), then per decoder and file, in a fresh subprocess (so the peak RSS is
that decoder's alone), with one decoding thread: `frames_per_s` (every frame to an RGB uint8
array, best of `--repeats`), `first_frame_ms_cold` / `_warm` (open + first RGB frame, the
process's first open / a later one), `rss_after_import_mb` and `peak_rss_over_import_mb` (the
child's max RSS over its level after importing the decoder). A decoder that is not installed
or does not load (torchcodec needs the system's FFmpeg shared libraries) is reported as
`{"available": false, "reason": ...}`.
torchcodec can borrow the FFmpeg 8 that PyAV's wheel bundles: symlink `av.libs/libavcodec-*.so.62`
etc. to their plain sonames in a folder and put it and `av.libs` on `LD_LIBRARY_PATH`.

    python benchmarks/bench_video_decode.py            # 640x360, 240 frames per file
    python benchmarks/bench_video_decode.py --quick    # 160x120, 24 frames
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

CODECS = {"mp4": "libx264", "webm": "libvpx", "mkv": "mpeg4"}
DECODERS = ("pyav", "torchcodec")


def encode(path: str, n: int, w: int, h: int, fps: int = 24) -> None:
    import av
    import numpy as np

    with av.open(path, "w") as c:
        s = c.add_stream(CODECS[path.rsplit(".", 1)[1]], rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(n):
            a = np.full((h, w, 3), (i * 7) % 200, np.uint8)
            a[:, (i * 5) % w, :] = 250
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def _pyav(path: str) -> tuple[float, int]:
    """(seconds to first frame, frames) of one full decode with one thread."""
    import av

    t0 = time.perf_counter()
    first = 0.0
    n = 0
    with av.open(path) as c:
        stream = c.streams.video[0]
        stream.thread_count = 1
        for f in c.decode(stream):
            f.to_ndarray(format="rgb24")
            n += 1
            if n == 1:
                first = time.perf_counter() - t0
    return first, n


def _torchcodec(path: str) -> tuple[float, int]:
    from torchcodec.decoders import VideoDecoder

    t0 = time.perf_counter()
    d = VideoDecoder(path, num_ffmpeg_threads=1, device="cpu", dimension_order="NHWC")
    n = 0
    first = 0.0
    for _ in d:
        n += 1
        if n == 1:
            first = time.perf_counter() - t0
    return first, n


def child(decoder: str, path: str, repeats: int) -> dict[str, Any]:
    try:
        if decoder == "pyav":
            import av  # noqa: F401  (imports stay outside the timings)
        else:
            import torchcodec.decoders  # noqa: F401
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        fn = {"pyav": _pyav, "torchcodec": _torchcodec}[decoder]
        first, n = fn(path)  # warm-up, and the first-frame latency of a cold open
    except Exception as e:  # not installed, or its native libraries do not load
        return {"available": False, "reason": f"{type(e).__name__}: {str(e)[:200]}"}
    best, warm = float("inf"), float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        w, _n = fn(path)
        best, warm = min(best, time.perf_counter() - t0), min(warm, w)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"available": True, "frames": n, "frames_per_s": round(n / best, 1),
            "first_frame_ms_cold": round(first * 1000, 2),
            "first_frame_ms_warm": round(warm * 1000, 2),
            "rss_after_import_mb": round(base, 1),
            "peak_rss_over_import_mb": round(rss - base, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--frames", type=int, default=240)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=360)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("DECODER", "PATH"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.repeats)))
        return
    if args.quick:
        args.frames, args.width, args.height, args.repeats = 24, 160, 120, 1
    params = {k: getattr(args, k) for k in ("frames", "width", "height", "repeats")}
    metrics: dict[str, Any] = {}
    try:
        import av  # noqa: F401
    except ImportError:
        metrics["error"] = "PyAV is needed to encode the test videos: pip install 'neatpack[video]'"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for ext in CODECS:
                path = os.path.join(tmp, f"bench.{ext}")
                encode(path, args.frames, args.width, args.height)
                row = {}
                for dec in DECODERS:
                    cmd = [sys.executable, __file__, "--child", dec, path]
                    cmd += ["--repeats", str(args.repeats)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    row[dec] = json.loads(out.stdout)
                metrics[ext] = row
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "threads_per_decode": 1}
    print(json.dumps({"benchmark": "video_decode", "params": params, "metrics": metrics,
                      "env": env}))  # fmt: skip


if __name__ == "__main__":
    main()
