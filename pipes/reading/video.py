"""Video files (mp4, webm, mkv, ... or their encoded bytes): metadata for planning, frames for
the workers. Decoder: PyAV (``pip install 'neatpack[video]'``), chosen by measurement
(``benchmarks/bench_video_decode.py``): its wheels bundle FFmpeg, so it installs from PyPI
alone; torchcodec needs the system's FFmpeg shared libraries and does not load without them.

* ``probe_video(src)`` -> ``[frames, height, width, fps, duration]``, the ``videos_meta`` entry,
  from the container: stream headers, plus a demux-only packet count when the container stores
  no frame count (webm, mkv). No frame is decoded.
* ``decode_video(src, keep=None)`` -> a ``DecodedVideo``: the RGB frames (HxWx3 uint8 arrays),
  the stream's ``fps`` and the file's ``total_frames``. ``keep(total_frames, fps)`` names the
  frame indices wanted (the processor's own ``sample_frames``:
  ``pipes/materializing/tokenize.py``): every
  frame is still decoded in order (a P/B frame needs the ones before it, and the index of a
  frame is its place in the decoded sequence, as transformers counts it, variable frame rate
  included),
  but only the kept ones are converted to RGB and held (``to_ndarray`` is ~2/3 of the decode
  time; ``benchmarks/bench_video_decode.py``), and ``frames_indices`` lists them. The processor
  then gets exactly the frames it would have sampled from the full decode. Without ``keep``
  (or with ``DECODE_ONLY_KEPT = False``) every frame is returned. The container is opened per
  call, inside the worker: no decoder state exists before the fork.

>>> import av
>>> buf = io.BytesIO()
>>> with av.open(buf, "w", format="mp4") as c:   # 2 s at 30 fps: frame i is grey level 4*i
...     s = c.add_stream("libx264", rate=30)
...     s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
...     for i in range(60):
...         grey = np.full((32, 32, 3), 4 * i, np.uint8)
...         for p in s.encode(av.VideoFrame.from_ndarray(grey, format="rgb24")):
...             c.mux(p)
...     for p in s.encode():
...         c.mux(p)
>>> v = decode_video(buf.getvalue(), keep=lambda total, fps: [0, 15, 30, 45])   # 2 per s
>>> len(v), v.total_frames, v.fps, v.frames_indices
(4, 60, 30.0, [0, 15, 30, 45])
>>> [round(float(f.mean()) / 4) for f in v]   # the frames at those places
[0, 15, 30, 45]

Bad videos raise ``SampleError(reason="video_error")`` naming the sample: unreadable or corrupt
(``corrupt``), no video stream / zero frames (``empty``), fewer frames decoded than the
container lists (``truncated``), and kept frames' size over ``MAX_VIDEO_BYTES`` (``too
large``): each is counted by the loader's ``on_bad_sample`` policy like any bad sample.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, Final

import numpy as np

from neatpack.pipes.errors import SampleError

__all__ = [
    "DECODE_ONLY_KEPT",
    "MAX_VIDEO_BYTES",
    "DecodedVideo",
    "FramePicker",
    "decode_video",
    "probe_video",
    "require_av",
]

MAX_VIDEO_BYTES: Final = 8 * 2**30
"""Refuse a video whose kept RGB frames would exceed this (8 GiB: 1,000 frames of 1080p are
6.2 GiB). Raise it (``neatpack.pipes.reading.video.MAX_VIDEO_BYTES = ...``) if you have the RAM."""

DECODE_ONLY_KEPT = True
"""``decode_video`` converts and holds only the frames its ``keep`` names. Set
``neatpack.pipes.reading.video.DECODE_ONLY_KEPT = False`` to return every frame and let the
processor
sample them itself, as before: same outputs, slower (``benchmarks/bench_video_decode.py``
compares the two). It is read in the process that decodes: set it before the loader forks its
workers (the default context), or in each worker under spawn / forkserver."""

FramePicker = Callable[[int, float], Sequence[int]]
"""``keep(total_frames, fps) -> frame indices`` (0-based places in the decoded sequence, in the
order wanted; repeats allowed)."""


class DecodedVideo(list[Any]):
    """Frames (HxWx3 uint8) of a decoded file. ``fps``: the stream's average frame rate;
    ``total_frames``: frames in the file; ``frames_indices``: which of them these are, in order
    (``None``: every frame)."""

    fps: float | None = None
    total_frames: int | None = None
    frames_indices: list[int] | None = None


def require_av() -> Any:
    """The ``av`` module, or an ImportError that names the extra to install."""
    try:
        import av
    except ImportError as e:
        raise ImportError(
            "decoding video files needs PyAV: pip install 'neatpack[video]' (or pip install av); "
            "or give videos as lists of frames"
        ) from e
    return av


def _open(av: Any, src: str | bytes) -> Any:
    return av.open(io.BytesIO(src) if isinstance(src, bytes) else os.fspath(src))


def _where(src: str | bytes) -> str:
    return f"video file {src!r}" if isinstance(src, str) else f"video bytes ({len(src)} bytes)"


def _fps(stream: Any) -> float | None:
    rate = stream.average_rate or stream.guessed_rate
    return float(Fraction(rate)) if rate else None


def probe_video(src: str | bytes, sample_id: Any = None) -> list[float]:
    """``[frames, height, width, fps, duration]`` from the container, decoding nothing."""
    av = require_av()
    try:
        with _open(av, src) as container:
            if not container.streams.video:
                raise SampleError(sample_id, "video_error", f"{_where(src)} has no video stream")
            stream = container.streams.video[0]
            frames = int(stream.frames or 0)
            if frames <= 0:  # webm / mkv store no count: count packets (demux only, no decode)
                frames = sum(1 for p in container.demux(stream) if p.size)
            fps = _fps(stream)
            height, width = int(stream.height), int(stream.width)
    except SampleError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise SampleError(
            sample_id,
            "video_error",
            f"{_where(src)} is unreadable ({type(e).__name__}: {e}); re-encode or drop it",
        ) from e
    if frames <= 0 or height <= 0 or width <= 0:
        raise SampleError(
            sample_id,
            "video_error",
            f"{_where(src)} is empty ({frames} frames of {width}x{height}); drop it",
        )
    fps = fps or 24.0  # transformers' default for an unknown rate
    return [float(frames), float(height), float(width), fps, frames / fps]


def _kept(keep: FramePicker, frames: int, fps: float, src: str | bytes) -> list[int]:
    indices = [int(i) for i in keep(frames, fps)]
    bad = [i for i in indices if not 0 <= i < frames]
    if not indices or bad:
        raise ValueError(
            f"keep({frames}, {fps}) for {_where(src)} gave frame indices {indices[:8]!r} "
            f"(out of range: {bad[:8]!r}); a frame picker must name 1+ frames in [0, {frames})"
        )
    return indices


def decode_video(
    src: str | bytes, sample_id: Any = None, *, keep: FramePicker | None = None
) -> DecodedVideo:
    """The RGB frames of the first video stream, with its fps and frame count: every frame, or
    with ``keep`` (and ``DECODE_ONLY_KEPT``) only the frames ``keep(total_frames, fps)`` names,
    in that order. Every frame is still decoded and counted (a short file is ``truncated``)."""
    av = require_av()
    expected = probe_video(src, sample_id)
    frames, h, w = int(expected[0]), int(expected[1]), int(expected[2])
    indices = _kept(keep, frames, expected[3], src) if keep and DECODE_ONLY_KEPT else None
    wanted = None if indices is None else set(indices)
    held = frames if wanted is None else len(wanted)
    size = held * h * w * 3
    if size > MAX_VIDEO_BYTES:
        raise SampleError(
            sample_id,
            "video_error",
            f"{_where(src)} is too large: {held} frames of {w}x{h} decode to "
            f"{size / 2**30:.1f} GiB, over MAX_VIDEO_BYTES={MAX_VIDEO_BYTES / 2**30:.1f} GiB; "
            "cut or downscale it, or raise neatpack.pipes.reading.video.MAX_VIDEO_BYTES",
        )
    out = DecodedVideo()
    kept: dict[int, Any] = {}
    n = 0
    try:
        with _open(av, src) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            out.fps, out.total_frames = expected[3], frames
            for f in container.decode(stream):
                if wanted is None:
                    out.append(f.to_ndarray(format="rgb24"))
                elif n in wanted:  # the costly RGB conversion only for the kept frames
                    kept[n] = f.to_ndarray(format="rgb24")
                n += 1
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise SampleError(
            sample_id,
            "video_error",
            f"{_where(src)} is corrupt after {n} of {frames} frames "
            f"({type(e).__name__}: {e}); re-encode or drop it",
        ) from e
    if n != frames:
        raise SampleError(
            sample_id,
            "video_error",
            f"{_where(src)} is truncated: {n} frames decoded, the container lists "
            f"{frames}; re-encode or drop it",
        )
    if indices is not None:
        out.extend(kept[i] for i in indices)
        out.frames_indices = indices
    if out and not isinstance(out[0], np.ndarray):  # pragma: no cover - PyAV contract
        raise TypeError(f"PyAV returned {type(out[0]).__name__} frames")
    return out


def fill_video_meta(record: dict[str, Any]) -> dict[str, Any]:
    """Give each video file (path or bytes) of a Record without a ``videos_meta`` entry the
        entry ``probe_video`` reads from its container, so the length index plans it exactly
        without decoding. Frame-list videos and given entries are left as they are; without PyAV
        nothing is filled (the estimator then counts ``video_no_meta`` and the worker's decode
        names the extra to install). A missing or unreadable file gets no entry (a counted
    ``video_no_meta`` fallback, as an unreadable image); the worker's decode then refuses it,
    naming the sample."""
    videos = [b.get("video") for m in record["conversation"] for b in m["content"]
              if b.get("type") == "video"]  # fmt: skip
    meta = record.get("videos_meta")
    if not any(isinstance(v, str | bytes) for v in videos) or (
        isinstance(meta, list) and None not in meta
    ):
        return record
    if not isinstance(meta, list | type(None)) or (meta is not None and len(meta) != len(videos)):
        return record  # malformed: the estimator refuses it naming the sample
    try:
        require_av()
    except ImportError:
        return record
    filled = list(meta) if meta is not None else [None] * len(videos)
    for k, v in enumerate(videos):
        if filled[k] is None and (
            isinstance(v, bytes) or (isinstance(v, str) and os.path.isfile(v))
        ):
            # Unreadable: a counted fallback here (as an unreadable image); the decode refuses it.
            with contextlib.suppress(SampleError):
                filled[k] = probe_video(v, record["sample_id"])
    if any(m is not None for m in filled):
        record["videos_meta"] = filled
    return record
