"""Media metadata helpers of the estimator: validated ``images_meta`` / ``videos_meta``
entries, image header sizes (no decode) and per-video token plans."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neatpack.pipes.errors import EstimateError
from neatpack.pipes.indexing.media_tokens import VideoTokenConfig

__all__ = ["EstimateError"]


#: A record's ``_text_tokens`` must be an integer in ``[0, MAX_TEXT_TOKENS)``: far above any real
#: sample, and low enough that the index's int64 sums cannot overflow.
MAX_TEXT_TOKENS = 2**40


def positive_meta(sample_id: int, kind: str, meta: Any, n: int) -> list[float]:
    if not isinstance(meta, list | tuple) or len(meta) < n:
        raise EstimateError(f"sample_id={sample_id}: {kind}_meta entry {meta!r} needs {n} numbers")
    try:
        return [float(v) for v in meta[:n]]
    except (TypeError, ValueError) as e:
        raise EstimateError(f"sample_id={sample_id}: {kind}_meta entry {meta!r}: {e}") from e


def image_hw(value: Any, sample_id: int) -> tuple[int, int] | str:
    """(height, width) of a PIL image or an image file's header (EXIF rotation applied, as
    transformers' ``load_image`` does; the token count is symmetric in h and w, the size is
    not), or a fallback reason."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        w, h = value.size
        orientation = _orientation(value)
        return (w, h) if orientation in (5, 6, 7, 8) else (h, w)
    if value is None:
        return "image_no_meta"  # a placeholder block without images_meta: nothing to read
    if not isinstance(value, str):
        return "image_not_a_path"
    from neatpack.pipes.reading.media import non_regular_file

    if what := non_regular_file(value):  # before Image.open: a FIFO would block it forever
        raise EstimateError(
            f"sample_id={sample_id}: image {value!r} is {what}, not a regular file; point the "
            "record at a regular file or drop it"
        )
    try:
        with Image.open(value) as im:  # lazy: reads the header only, no decode
            w, h = im.size
            orientation = _orientation(im, value)
    except FileNotFoundError:
        return "image_missing"
    except Image.DecompressionBombError as e:  # not an OSError: it would escape unnamed
        raise EstimateError(
            f"sample_id={sample_id}: image {value!r}: {e} (PIL's hard limit, 2 x "
            "PIL.Image.MAX_IMAGE_PIXELS); downscale the file, or raise the limit or give "
            "images_meta if you trust the source"
        ) from e
    except (UnidentifiedImageError, OSError, SyntaxError):
        return "image_unreadable"
    return (w, h) if orientation in (5, 6, 7, 8) else (h, w)


def _png_late_exif(path: str) -> bool:
    """Whether a PNG file holds an ``eXIf`` chunk (PIL reads one placed before the pixel data
    into ``info`` at open; one after it is only found by decoding the whole image, which
    ``getexif()`` then does: ~12 ms a 0.5 MP PNG, so the chunk list is walked instead, with one
    8-byte read per chunk). A truncated or odd chunk list answers True: PIL then decides."""
    with open(path, "rb") as f:
        f.seek(8)  # the PNG signature
        while header := f.read(8):
            if len(header) < 8:
                return True
            kind = header[4:]
            if kind == b"eXIf":
                return True
            if kind == b"IEND":
                return False
            f.seek(int.from_bytes(header[:4], "big") + 4, 1)  # data and CRC
    return True


def _orientation(im: Any, path: str | None = None) -> int:
    """EXIF orientation read without decoding pixels. A PNG's ``getexif()`` decodes the whole
    image when no eXIf chunk came before the pixel data (PIL looks for one after it): for a file
    the chunk list is walked (:func:`_png_late_exif`); an in-memory PNG without an early eXIf
    chunk counts as unrotated."""
    early = "exif" in im.info or getattr(im, "_exif", None)
    if im.format == "PNG" and not early and (path is None or not _png_late_exif(path)):
        return 1
    return int(im.getexif().get(0x0112, 1))


def frames_fps(meta: Any) -> tuple[int, float | None]:
    """(frame count, fps or None) from a validated ``videos_meta`` entry."""
    frames, _, _, fps, duration = (float(v) for v in meta[:5])
    total = int(frames) or int(duration * fps)
    if fps == 0 and duration > 0:
        fps = total / duration
    return total, fps or None


def video_tokens(cfg: VideoTokenConfig, sid: int, value: Any, meta: Any) -> tuple[int, int]:
    """``(visual tokens, temporal patches)`` of one video from its metadata."""
    frames, h, w, fps, duration = positive_meta(sid, "videos", meta, 5)
    if h <= 0 or w <= 0 or frames < 0 or fps < 0 or duration < 0:
        raise EstimateError(
            f"sample_id={sid}: videos_meta {meta!r} needs [frames>=0, height>0, width>0, "
            "fps>=0, duration>=0]; fix the metadata"
        )
    total, rate = frames_fps(meta)
    if total <= 0:
        raise EstimateError(
            f"sample_id={sid}: videos_meta {meta!r} gives no frame count (frames=0 and "
            "fps*duration=0); fix the metadata"
        )
    try:
        return cfg.tokens(total, int(h), int(w), rate), cfg.grid_t(total, rate)
    except ValueError as e:
        raise EstimateError(f"sample_id={sid}: video {value!r} meta {meta!r}: {e}") from e


def raw_meta(raw: Any, key: str) -> Any:
    """``raw[key]``, or the peer's nesting ``raw["mm_inputs_meta"][key]`` (as ``to_record``)."""
    v = raw.get(key)
    if v is None:
        meta = raw.get("mm_inputs_meta")
        if isinstance(meta, Mapping):
            v = meta.get(key)
    return v


def record_media(record: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
    images, videos = [], []
    for msg in record["conversation"]:
        for block in msg["content"]:
            kind = block.get("type")
            if kind == "image":
                images.append(block.get("image"))
            elif kind == "video":
                videos.append(block.get("video"))
    return images, videos


def media_items(record: Mapping[str, Any]) -> int:
    """Media items of a Record: its image and video blocks (a video clip is one item)."""
    images, videos = record_media(record)
    return len(images) + len(videos)


def aligned_meta(record: Mapping[str, Any], key: str, n: int, sid: int) -> list[Any]:
    meta = record.get(key)
    if meta is None:
        return [None] * n
    if not isinstance(meta, list) or len(meta) != n:
        raise EstimateError(
            f"sample_id={sid}: {key} has {len(meta) if isinstance(meta, list) else meta!r} "
            f"entries but the conversation has {n} media blocks of that kind; one entry (or "
            "null) per block"
        )
    return meta
