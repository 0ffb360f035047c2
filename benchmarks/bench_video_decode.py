"""Video decoder choice for pipes/reading/video.py: PyAV vs torchcodec on the same files.

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

`kept_frames`: decoding only the frames the processor keeps (`pipes/reading/video.py` `keep=`, the
default) against every frame (`DECODE_ONLY_KEPT = False`, the old path), side by side in this
run, with the tiny Qwen3-VL processor (2 fps sampling):

* `decode_ms` per file above: `decode_video` all frames vs the kept ones (best of `--repeats`);
* `loader`: `--clips` mp4 clips (30 fps, `--clip-size`, 60-120 frames) through
  `neat_vlm_graph` with 0 workers, the length index built beforehand; per mode (alternating,
  after one warm-up round, best of `--repeats`): `decode_s` (time in `decode_video`),
  `iter_s`, `tokens_per_s` (real tokens / `iter_s`); `identical`: both modes' batches are
  `torch.equal`.

    python benchmarks/bench_video_decode.py            # 640x360, 240 frames per file; 64 clips
    python benchmarks/bench_video_decode.py --quick    # 160x120, 24 frames; 4 clips
    python benchmarks/bench_video_decode.py --kept-only    # the kept_frames section alone
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

from _machine import machine  # benchmarks/ is on sys.path as the script's folder

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


def _keep_qwen3(processor: Any) -> Any:
    from transformers.video_utils import VideoMetadata

    def keep(total: int, fps: float) -> list[int]:
        md = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=list(range(total)))
        return [int(i) for i in processor.video_processor.sample_frames(metadata=md)]

    return keep


def _best_ms(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1000, 2)


def kept_frames(
    files: dict[str, str], clips: int, size: tuple[int, int], repeats: int, tmp: str
) -> dict[str, Any]:
    import random

    import torch

    from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
    from neatpack.pipes import video
    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.indexing.lengths import build_length_index
    from neatpack.pipes.reading.read import SequenceSource
    from neatpack.pipes.testing.tiny import load_tiny_processor

    proc = load_tiny_processor("qwen3_vl")
    keep = _keep_qwen3(proc)
    out: dict[str, Any] = {"decode_ms": {}}
    for ext, path in files.items():
        video.decode_video(path)  # warm-up: first open, imports
        kept = video.decode_video(path, keep=keep)
        out["decode_ms"][ext] = {
            "frames": kept.total_frames, "kept": len(kept),
            "all_frames": _best_ms(lambda p=path: video.decode_video(p), repeats),
            "kept_frames": _best_ms(lambda p=path: video.decode_video(p, keep=keep), repeats),
        }  # fmt: skip
    rnd = random.Random(1)
    records = []
    for i in range(clips):
        path = os.path.join(tmp, f"clip{i}.mp4")
        encode(path, rnd.randint(60, 120), size[0], size[1], fps=30)
        user = [{"type": "video", "video": path}, {"type": "text", "text": "what moves?"}]
        records.append({"messages": [{"role": "user", "content": user},
                                     {"role": "assistant", "content": "a bar"}]})  # fmt: skip
    est = LengthEstimator.from_processor(proc, mode="exact")
    index = build_length_index(SequenceSource(records), est, progress=False)
    real_decode = video.decode_video
    decode_s = [0.0]

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_decode(*a, **k)
        finally:
            decode_s[0] += time.perf_counter() - t0

    cfg = NeatVLMConfig(pack_size=4096, batch_size=1, num_workers=0, seed=0)
    rows: dict[str, dict[str, Any]] = {"all_frames": {}, "kept_frames": {}}
    batches: dict[str, list[Any]] = {}
    try:
        video.decode_video = timed  # type: ignore[assignment]  # 0 workers: this process
        for rep in range(repeats + 1):  # round 0 warms up (imports, first opens): not kept
            for mode in rows:
                video.DECODE_ONLY_KEPT = mode == "kept_frames"
                decode_s[0] = 0.0
                t0 = time.perf_counter()
                got = list(neat_vlm_graph(records, proc, config=cfg, lengths=index))
                took = time.perf_counter() - t0
                row = rows[mode]
                if rep and took < row.get("iter_s", float("inf")):
                    tokens = sum(int((b["doc_ids"] > 0).sum()) for b in got)
                    row.update(iter_s=round(took, 3), decode_s=round(decode_s[0], 3),
                               decode_share=round(decode_s[0] / took, 3),
                               tokens=tokens, tokens_per_s=round(tokens / took))  # fmt: skip
                batches[mode] = got
    finally:
        video.decode_video = real_decode  # type: ignore[assignment]
        video.DECODE_ONLY_KEPT = True
    keys = ("input_ids", "labels", "pixel_values_videos", "video_grid_thw")
    a, b = batches["all_frames"], batches["kept_frames"]
    same = len(a) == len(b) and all(
        x["sample_ids"] == y["sample_ids"] and all(torch.equal(x[k], y[k]) for k in keys)
        for x, y in zip(a, b, strict=True)
    )
    out["loader"] = {**rows, "identical": same, "clips": clips, "clip_size": list(size)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--frames", type=int, default=240)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=360)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("DECODER", "PATH"))
    ap.add_argument("--clips", type=int, default=64)
    ap.add_argument("--clip-size", type=int, nargs=2, default=(320, 240), metavar=("W", "H"))
    ap.add_argument("--kept-only", action="store_true", help="only the kept_frames section")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.repeats)))
        return
    if args.quick:
        args.frames, args.width, args.height, args.repeats, args.clips = 24, 160, 120, 1, 4
        args.clip_size = (160, 120)
    params = {k: getattr(args, k) for k in ("frames", "width", "height", "repeats", "clips")}
    metrics: dict[str, Any] = {}
    try:
        import av  # noqa: F401
    except ImportError:
        metrics["error"] = "PyAV is needed to encode the test videos: pip install 'neatpack[video]'"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            files = {}
            for ext in CODECS:
                path = files[ext] = os.path.join(tmp, f"bench.{ext}")
                encode(path, args.frames, args.width, args.height)
                if args.kept_only:
                    continue
                row = {}
                for dec in DECODERS:
                    cmd = [sys.executable, __file__, "--child", dec, path]
                    cmd += ["--repeats", str(args.repeats)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    row[dec] = json.loads(out.stdout)
                metrics[ext] = row
            size = (args.clip_size[0], args.clip_size[1])
            metrics["kept_frames"] = kept_frames(files, args.clips, size, args.repeats, tmp)
    env = machine(threads_per_decode=1)
    print(json.dumps({"benchmark": "video_decode", "params": params, "metrics": metrics,
                      "env": env}))  # fmt: skip


if __name__ == "__main__":
    main()
