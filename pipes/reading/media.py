"""Image / video loading for tokenization: RGB conversion and bad-file errors naming the sample.

>>> to_rgb(Image.new("RGBA", (2, 2), (0, 0, 0, 0))).getpixel((0, 0))   # transparent -> white
(255, 255, 255)
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from neatpack.pipes.errors import REASONS, SampleError

__all__ = [
    "REASONS",
    "SampleError",
    "existing_media_file",
    "load_image",
    "load_video",
    "non_regular_file",
    "to_rgb",
]

_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})


def _to_uint8(arr: np.ndarray[Any, Any], mode: str) -> np.ndarray[Any, Any]:
    """16-bit ('I;16*', or 'I' above 255) scales by 1/257; float in [0, 1] scales by 255."""
    a = arr.astype(np.float64)
    if mode.startswith("I;16") or (mode == "I" and a.size and a.max() > 255):
        a = a / 257.0
    elif mode == "F" and a.size and a.max() <= 1.0:
        a = a * 255.0
    out: np.ndarray[Any, Any] = np.clip(np.rint(a), 0, 255).astype(np.uint8)
    return out


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB. Transparency (RGBA/LA/PA, or P/L/RGB with a transparency key) is
    composited on white; 16-bit and 32-bit grey is rescaled to 8 bits (PIL's own convert would
    clip a 16-bit image to mostly white); CMYK/YCbCr/LAB/HSV/L/1/P use PIL's conversion."""
    mode = img.mode
    keyed = "transparency" in img.info
    if mode == "RGB" and not keyed:
        return img
    if mode in _ALPHA_MODES or keyed:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode.startswith("I") or mode == "F":
        grey = Image.fromarray(_to_uint8(np.asarray(img), mode), mode="L")
        return grey.convert("RGB")
    return img.convert("RGB")


def _limit(max_image_pixels: int | None, default: bool) -> int | None:
    if default:
        pil = Image.MAX_IMAGE_PIXELS
        return None if pil is None else int(pil)
    return max_image_pixels


def _check_size(img: Image.Image, where: str, sample_id: Any, limit: int | None) -> None:
    w, h = img.size
    if w <= 0 or h <= 0:
        raise SampleError(sample_id, "empty_image", f"image {where} has size {w}x{h}; drop it")
    if limit is not None and w * h > limit:
        raise SampleError(
            sample_id,
            "decompression_bomb",
            f"image {where} has {w}x{h}={w * h} pixels, over the limit {limit} "
            "(PIL.Image.MAX_IMAGE_PIXELS or max_image_pixels=); downscale the file or raise the "
            "limit if you trust the source",
        )


_FILE_TYPES = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def non_regular_file(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is when it exists but is no regular file (``"a FIFO (named pipe)"``,
    ``"a directory"``, ...), else None (a regular file, or nothing there). Asked with ``stat``,
    which opens nothing: opening a FIFO blocks until some process writes to it, i.e. forever,
    so a media path must be refused before PIL, PyAV or ``wave`` touch it.

    >>> non_regular_file("/"), non_regular_file("/no/such/file")
    ('a directory', None)
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None  # missing or unreadable: the caller's missing-file path names it
    return _non_regular(mode)


def _non_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _FILE_TYPES if test(mode)), "not a regular file")


def existing_media_file(src: str | os.PathLike[str], kind: str, sample_id: Any) -> str:
    """``src`` as a path string if it names a non-empty regular file, else a ``SampleError``
    (``missing_file`` / ``bad_media`` for a FIFO, directory or device / ``empty_file``) naming
    the sample, the ``kind`` of media and the fix."""
    path = os.fspath(src)
    try:
        info = os.stat(path)  # once: the file's type and size (opens nothing)
    except (OSError, ValueError):
        raise SampleError(
            sample_id,
            "missing_file",
            f"{kind} file {path!r} does not exist; fix the path or the media root",
        ) from None
    if what := _non_regular(info.st_mode):
        raise SampleError(
            sample_id,
            "bad_media",
            f"{kind} file {path!r} is {what}, not a regular file (opening it could block "
            "forever); point the record at a regular file or drop it",
        )
    if info.st_size == 0:
        raise SampleError(
            sample_id, "empty_file", f"{kind} file {path!r} is 0 bytes; re-export or drop it"
        )
    return path


def load_image(
    src: Any, *, sample_id: Any, max_image_pixels: int | str | None = "pil"
) -> Image.Image:
    """Open ``src`` (a path or a PIL image), check it, and return an RGB image.

    ``max_image_pixels``: ``"pil"`` (default) uses ``PIL.Image.MAX_IMAGE_PIXELS`` at call time,
    ``None`` disables this check, an int sets the limit. PIL's own hard stop at
    2 x ``PIL.Image.MAX_IMAGE_PIXELS`` still applies when opening files (it is process-global;
    set ``PIL.Image.MAX_IMAGE_PIXELS = None`` yourself to lift it). Errors are ``SampleError``.
    """
    limit = _limit(
        None if isinstance(max_image_pixels, str) else max_image_pixels, max_image_pixels == "pil"
    )
    if isinstance(src, Image.Image):
        where = f"<PIL {src.format or src.mode} {src.size}>"
        _check_size(src, where, sample_id, limit)
        try:  # a lazily opened image (encoded bytes, pipes/reading/formats.py) decodes here
            src.load()
            return to_rgb(src)
        except (SyntaxError, OSError, ValueError) as exc:
            raise _decode_error(sample_id, f"image {where}", exc) from exc
    if not isinstance(src, str | os.PathLike):
        raise SampleError(
            sample_id,
            "bad_media",
            f"image value {src!r} is a {type(src).__name__}; expected a file path or a PIL.Image",
        )
    path = existing_media_file(src, "image", sample_id)
    try:
        with Image.open(path) as im:
            _check_size(im, repr(path), sample_id, limit)
            im.load()  # pixels now live in memory; leaving the block only closes the file
            return to_rgb(im)
    except SampleError:
        raise
    except Image.DecompressionBombError as exc:
        raise SampleError(
            sample_id,
            "decompression_bomb",
            f"image file {path!r}: {exc} (PIL's own hard limit, 2 x PIL.Image.MAX_IMAGE_PIXELS); "
            "downscale the file or raise PIL.Image.MAX_IMAGE_PIXELS if you trust the source",
        ) from exc
    except (UnidentifiedImageError, SyntaxError, OSError, ValueError) as exc:
        raise _decode_error(sample_id, f"image file {path!r}", exc) from exc


def _decode_error(sample_id: Any, where: str, exc: BaseException) -> SampleError:
    truncated = "truncated" in str(exc).lower() or "broken data stream" in str(exc).lower()
    return SampleError(
        sample_id,
        "truncated_image" if truncated else "corrupt_image",
        f"{where} cannot be decoded ({type(exc).__name__}: {exc}); re-export or drop it",
    )


def load_video(
    src: Any, *, sample_id: Any, keep: Callable[[int, float], Sequence[int]] | None = None
) -> Any:
    """A video is a list of frames (PIL images -> RGB, arrays as given), an existing file path
    or encoded bytes (both decoded here by ``pipes/reading/video.py``, PyAV: ``neatpack[video]``;
    with
    ``keep(total_frames, fps) -> indices`` only those frames, see ``decode_video``)."""
    if isinstance(src, str | os.PathLike | bytes):
        from neatpack.pipes.reading.video import decode_video

        if not isinstance(src, bytes):
            src = existing_media_file(src, "video", sample_id)
        return decode_video(src, sample_id, keep=keep)
    if isinstance(src, Sequence) and len(src) > 0:
        frames: list[Any] = []
        for k, f in enumerate(src):
            if isinstance(f, Image.Image):
                _check_size(f, f"video frame {k}", sample_id, None)
                frames.append(to_rgb(f))
            elif isinstance(f, np.ndarray) and f.ndim == 3:
                frames.append(f)
            else:
                raise SampleError(
                    sample_id,
                    "bad_media",
                    f"video frame {k} is {type(f).__name__}; "
                    "expected a PIL.Image or an HxWxC array",
                )
        return frames
    raise SampleError(
        sample_id, "bad_media", f"video value {src!r:.80} is not a path or a non-empty frame list"
    )
