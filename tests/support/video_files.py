"""Real video files for tests, written with PyAV (the test extra installs it)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

CODECS = {"mp4": "libx264", "webm": "libvpx", "mkv": "mpeg4"}


def encode(
    path: Path, n: int = 20, fps: int = 8, *, vfr: bool = False, w: int = 64, h: int = 56
) -> Path:
    """``n`` frames of a moving bar at ``fps`` (every frame differs), codec by suffix; ``vfr``:
    50 fps bursts of three frames with 100 ms gaps between them (millisecond timestamps), a
    variable frame rate."""
    with av.open(str(path), "w") as c:
        s = c.add_stream(CODECS[path.suffix[1:]], rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        if vfr:
            s.time_base = s.codec_context.time_base = Fraction(1, 1000)
        t = 0
        for i in range(n):
            a = np.full((h, w, 3), 30, np.uint8)
            a[:, (i * 3) % w, :] = 250
            a[: h // 2, :, 1] = (i * 9) % 256
            frame = av.VideoFrame.from_ndarray(a, format="rgb24")
            if vfr:
                frame.pts, frame.time_base = t, Fraction(1, 1000)
                t += 20 if i % 3 else 100
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def truncated_mp4(tmp: Path, frames: int = 30) -> Path:
    """An mp4 of ``frames`` noise frames with its index up front (faststart), cut at 60 % of its
    bytes: the container still lists every frame, the data of the last ones is gone."""
    whole = tmp / "fs.mp4"
    with av.open(str(whole), "w", options={"movflags": "faststart"}) as c:
        s = c.add_stream("libx264", rate=8)
        s.width, s.height, s.pix_fmt = 64, 56, "yuv420p"
        for i in range(frames):
            a = np.random.default_rng(i).integers(0, 255, (56, 64, 3), np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    data = whole.read_bytes()
    cut = tmp / "cut.mp4"
    cut.write_bytes(data[: len(data) * 6 // 10])
    return cut
