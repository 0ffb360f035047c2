"""Visual token counts without loading pixels: Qwen ``smart_resize`` (exact transformers 5.x
semantics) and frozen image / video token configs read from a real processor.

>>> smart_resize(1080, 1920)
(728, 1316)
>>> ImageTokenConfig(patch_size=14, merge_size=2).tokens(280, 560)
200

An aspect ratio over 200 raises ``ValueError`` exactly where transformers does (the peer
returned a size there); the estimator turns it into an error naming the sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "ImageTokenConfig",
    "VideoTokenConfig",
    "image_config_from_seed",
    "smart_resize",
    "smart_resize_video",
    "video_config_from_seed",
]

IntArray = npt.NDArray[np.int64]
VIDEO_SAMPLERS = ("qwen2_vl", "qwen3_vl")


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
) -> tuple[int, int]:
    """``transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize``, same float ops
    (banker's ``round``, then floor/ceil rescale into ``[min_pixels, max_pixels]``)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"  # noqa: E501
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int = 2,
    factor: int = 28,
    min_pixels: int = 112 * 112,
    max_pixels: int = 14 * 14 * 2 * 2 * 2 * 6144,
) -> tuple[int, int]:
    """``transformers.models.qwen3_vl.video_processing_qwen3_vl.smart_resize``: upscales sides
    below ``factor`` first, rounds ``t`` with ``round`` and raises when ``num_frames`` is below
    ``temporal_factor`` (the peer used ceil and skipped both checks)."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"  # noqa: E501
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _get(obj: Any, *names: str) -> Any:
    """First non-None of ``obj.size[name]`` / ``obj.size.name`` / ``obj.name`` over ``names``."""
    size = getattr(obj, "size", None)
    for name in names:
        for value in (
            size.get(name) if isinstance(size, dict) else getattr(size, name, None),
            getattr(obj, name, None),
        ):
            if value is not None:
                return value
    return None


def _positive(cls: str, **values: int | float) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise ValueError(f"{cls}: {name}={v!r} must be a positive number")


@dataclass(frozen=True, kw_only=True)
class ImageTokenConfig:
    """How an image processor turns ``[height, width]`` into tokens (defaults: Qwen2-VL's)."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def __post_init__(self) -> None:
        _positive(
            "ImageTokenConfig", patch_size=self.patch_size, merge_size=self.merge_size,
            min_pixels=self.min_pixels, max_pixels=self.max_pixels,
        )  # fmt: skip

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_processor(cls, processor: Any) -> ImageTokenConfig:
        """Read from a processor (or its ``image_processor``). In transformers 5.x the pixel
        bounds live in ``size`` as ``shortest_edge`` / ``longest_edge`` (pixel counts)."""
        ip = getattr(processor, "image_processor", processor)
        if getattr(ip, "do_resize", True) is False:
            raise ValueError("image processor has do_resize=False; token estimation needs resize")
        return cls(
            patch_size=int(_get(ip, "patch_size")),
            merge_size=int(_get(ip, "merge_size")),
            min_pixels=int(_get(ip, "shortest_edge", "min_pixels")),
            max_pixels=int(_get(ip, "longest_edge", "max_pixels")),
        )

    def tokens(self, height: int, width: int) -> int:
        """Visual tokens of one image: ``grid_h * grid_w // merge**2`` after smart_resize."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def tokens_array(self, height: IntArray, width: IntArray) -> IntArray:
        """Vectorized ``tokens`` (same IEEE ops: numpy rounds half to even like ``round``).
        Entries with aspect ratio over 200 come back as -1."""
        f = self.factor
        hf, wf = height.astype(np.float64), width.astype(np.float64)
        bad = np.maximum(hf, wf) / np.minimum(hf, wf) > 200
        h = np.round(hf / f) * f
        w = np.round(wf / f) * f
        big = h * w > self.max_pixels
        small = ~big & (h * w < self.min_pixels)
        with np.errstate(divide="ignore", invalid="ignore"):
            beta = np.sqrt((hf * wf) / self.max_pixels)
            h = np.where(big, np.maximum(f, np.floor(hf / beta / f) * f), h)
            w = np.where(big, np.maximum(f, np.floor(wf / beta / f) * f), w)
            beta = np.sqrt(self.min_pixels / (hf * wf))
            h = np.where(small, np.ceil(hf * beta / f) * f, h)
            w = np.where(small, np.ceil(wf * beta / f) * f, w)
        p = self.patch_size
        out = (h.astype(np.int64) // p) * (w.astype(np.int64) // p) // self.merge_size**2
        return np.where(bad, -1, out)


@dataclass(frozen=True, kw_only=True)
class VideoTokenConfig:
    """How a video processor turns ``[frames, height, width, fps, duration]`` into tokens.

    ``sampler`` picks the frame-sampling and resize rules of the processor family:
    ``"qwen3_vl"`` (``int(frames / fps * target_fps)`` clamped to ``[min_frames, max_frames]``
    then to the frame count, 3D smart_resize) or ``"qwen2_vl"`` (Qwen2/2.5-VL: floor to a
    multiple of ``temporal_patch_size``, 2D smart_resize). ``sample_frames=False`` means the
    processor uses every frame it is given. ``timestamps``: the processor writes
    ``<t seconds>`` plus vision start/end before each temporal patch (Qwen3-VL), text tokens
    that the estimator adds. Defaults: Qwen3-VL's.
    """

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    sample_frames: bool = True
    sampler: str = "qwen3_vl"
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768
    timestamps: bool = True

    def __post_init__(self) -> None:
        _positive(
            "VideoTokenConfig", patch_size=self.patch_size, merge_size=self.merge_size,
            temporal_patch_size=self.temporal_patch_size, min_pixels=self.min_pixels,
            max_pixels=self.max_pixels, max_frames=self.max_frames,
        )  # fmt: skip
        if self.sampler not in VIDEO_SAMPLERS:
            raise ValueError(f"{self.sampler=!r} is not one of {VIDEO_SAMPLERS}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_processor(cls, processor: Any) -> VideoTokenConfig:
        vp = getattr(processor, "video_processor", processor)
        name = type(vp).__name__.lower()
        fps = getattr(vp, "fps", None)
        return cls(
            patch_size=int(_get(vp, "patch_size")),
            merge_size=int(_get(vp, "merge_size")),
            temporal_patch_size=int(_get(vp, "temporal_patch_size")),
            min_pixels=int(_get(vp, "shortest_edge", "min_pixels")),
            max_pixels=int(_get(vp, "longest_edge", "max_pixels")),
            fps=None if fps is None else float(fps),
            num_frames=getattr(vp, "num_frames", None),
            min_frames=int(getattr(vp, "min_frames", 4)),
            max_frames=int(getattr(vp, "max_frames", 768)),
            sample_frames=bool(getattr(vp, "do_sample_frames", False)),
            sampler="qwen3_vl" if "qwen3" in name else "qwen2_vl",
            cap_pixels_per_frame=bool(getattr(vp, "cap_pixels_per_frame", None)),
            max_video_tokens=int(getattr(vp, "max_video_tokens", 768)),
            timestamps="qwen3" in name,
        )

    def frames(self, total: int, fps: float | None) -> int:
        """Frames the processor keeps from a ``total``-frame video at ``fps`` (None: unknown).
        Like transformers, the count is clamped to ``total`` last (the peer clamped to
        ``min_frames`` last and could exceed the video)."""
        if not self.sample_frames:
            return total
        tp = self.temporal_patch_size
        if self.sampler == "qwen3_vl":
            if self.num_frames is not None:
                return self.num_frames
            if self.fps is None:
                return min(max(total, self.min_frames), self.max_frames)
            n = int(total / (fps or 24) * self.fps)  # HF assumes 24 fps when unknown
            return min(max(n, self.min_frames), self.max_frames, total)
        if self.num_frames is not None:
            n = round(self.num_frames / tp) * tp
        elif self.fps is not None:
            if fps is None:
                raise ValueError("qwen2_vl frame sampling by fps needs the video's fps")
            cap = math.floor(min(self.max_frames, total) / tp) * tp
            x = min(max(total / fps * self.fps, self.min_frames), cap, total)
            n = math.floor(x / tp) * tp
        else:
            return total
        if n > total or n <= 0:
            raise ValueError(f"cannot sample {n} frames from a {total}-frame video")
        return math.ceil(total / (total / n))  # len(arange(0, total, total / n)), as HF

    def grid_t(self, frames: int, fps: float | None) -> int:
        """Temporal patches: ``ceil(kept frames / temporal_patch_size)``."""
        return -(-self.frames(frames, fps) // self.temporal_patch_size)

    def timestamp_texts(self, frames: int, fps: float | None) -> list[str]:
        """The ``<t seconds>`` strings Qwen3-VL's processor writes, one per temporal patch
        (the mean time of the patch's first and last sampled frame; unknown fps: 24)."""
        n = self.frames(frames, fps)
        if self.sample_frames:
            idx = np.linspace(0, frames - 1, n).round().astype(int).tolist()
        else:
            idx = list(range(frames))
        tp = self.temporal_patch_size
        idx += [idx[-1]] * (-len(idx) % tp)
        ts = [i / (fps or 24) for i in idx]
        return [f"<{(ts[i] + ts[i + tp - 1]) / 2:.1f} seconds>" for i in range(0, len(ts), tp)]

    def tokens(self, frames: int, height: int, width: int, fps: float | None) -> int:
        """Visual tokens of one video: ``ceil(n / tp) * grid_h * grid_w // merge**2``."""
        n = self.frames(frames, fps)
        tp, f = self.temporal_patch_size, self.factor
        if self.sampler == "qwen3_vl":
            max_pixels = self.max_pixels
            if self.cap_pixels_per_frame:
                cap = self.max_video_tokens * f * f
                per_frame = max(min(cap, self.max_pixels // n), int(self.min_pixels * 1.05))
                max_pixels = per_frame * n
            h, w = smart_resize_video(n, height, width, tp, f, self.min_pixels, max_pixels)
        else:
            max_pixels = self.max_pixels
            if self.cap_pixels_per_frame:
                total_px = int(self.max_video_tokens * f * f * 0.9)
                max_pixels = max(min(max_pixels, total_px * tp // n), int(self.min_pixels * 1.05))
            h, w = smart_resize(height, width, f, self.min_pixels, max_pixels)
        p = self.patch_size
        return -(-n // tp) * (h // p) * (w // p) // self.merge_size**2


def image_config_from_seed(cfg: dict[str, Any]) -> ImageTokenConfig:
    """An ``ImageTokenConfig`` from a seed-style config dict (``patch_size``, ``merge_size``,
    ``min_pixels``, ``max_pixels``; the seed's defaults for missing keys)."""
    p, m = int(cfg.get("patch_size", 14)), int(cfg.get("merge_size", 2))
    return ImageTokenConfig(
        patch_size=p, merge_size=m, min_pixels=int(cfg.get("min_pixels", 56 * 56)),
        max_pixels=int(cfg.get("max_pixels", 14 * 14 * 4 * 1280)),
    )  # fmt: skip


def video_config_from_seed(cfg: dict[str, Any]) -> VideoTokenConfig:
    """A ``VideoTokenConfig`` from a seed-style config dict (the seed's defaults for missing
    keys)."""
    return VideoTokenConfig(
        patch_size=int(cfg.get("patch_size", 16)), merge_size=int(cfg.get("merge_size", 2)),
        temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
        min_pixels=int(cfg.get("min_pixels", 128 * 128)),
        max_pixels=int(cfg.get("max_pixels", 16 * 16 * 2 * 2 * 2 * 6144)),
        fps=float(cfg.get("fps", 2.0)), min_frames=int(cfg.get("min_frames", 4)),
        max_frames=int(cfg.get("max_frames", 768)),
    )  # fmt: skip
