"""The media files a length index read, stamped (size, mtime), so a cached index is reused
only while they are the ones it measured.

An image without ``images_meta`` (a video without ``videos_meta``, an audio clip without
``audios_meta``) is sized from its file when the index is built. The index's cache key covers
the records and the estimator, not those files: with another ``media_root`` or images
re-exported at another size under the same names, the cached lengths were silently reused
(a 12-sample corpus then lost 7 samples per epoch to the overflow policy, 1 more truncated).
``MediaStamp`` records each such file; ``changes`` re-stats them at load (one ``stat`` per
file, no open), and the index is rebuilt when any differs. Paths under the media root are kept
relative to it, so the same files under a new root (copied with their mtimes, ``rsync -a``)
still match.

>>> import os, tempfile
>>> root = os.path.realpath(tempfile.mkdtemp())
>>> with open(f"{root}/a.png", "wb") as f:
...     _ = f.write(b"12345")
>>> stamp = MediaStamp.of([f"{root}/a.png"], root)
>>> stamp.paths, stamp.sizes.tolist(), stamp.changes(root)
(['a.png'], [5], [])
>>> with open(f"{root}/a.png", "wb") as f:
...     _ = f.write(b"1234567")
>>> stamp.changes(root)
['a.png: 5 -> 7 bytes']
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MEDIA_KINDS", "MediaStamp", "relative_to", "unsized_media_paths"]

#: Block types whose file a length estimate may read, and the metadata key that spares it.
MEDIA_KINDS = {"image": "images_meta", "video": "videos_meta", "audio": "audios_meta"}
IntArray = npt.NDArray[np.int64]


def unsized_media_paths(record: Mapping[str, Any]) -> list[str]:
    """The file paths of a Record's media blocks whose size no metadata entry gives: the files
    its length was (or may have been) read from."""
    seen = dict.fromkeys(MEDIA_KINDS, 0)
    out: list[str] = []
    for msg in record.get("conversation") or ():
        for block in msg.get("content") or ():
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind not in MEDIA_KINDS:
                continue
            k, seen[kind] = seen[kind], seen[kind] + 1
            meta = record.get(MEDIA_KINDS[kind])
            given = isinstance(meta, list) and k < len(meta) and meta[k] is not None
            value = block.get(kind)
            if isinstance(value, str) and not given:
                out.append(value)
    return out


def relative_to(paths: Iterable[str], root: str | None) -> list[str]:
    """``paths`` with the ``root/`` prefix taken off those under it (the others as given)."""
    if root is None:
        return list(paths)
    prefix = root.rstrip(os.sep) + os.sep
    return [p[len(prefix) :] if p.startswith(prefix) else p for p in paths]


def _under(path: str, root: str | None) -> str:
    return path if root is None or os.path.isabs(path) else os.path.join(root, path)


def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return -1, -1  # missing (or a URL): stamped as missing, compared as such
    return int(st.st_size), int(st.st_mtime_ns)


@dataclass(frozen=True)
class MediaStamp:
    """Media files (relative to ``root`` when under it) with their size and mtime (ns)."""

    root: str | None
    paths: list[str]
    sizes: IntArray
    mtimes: IntArray

    @classmethod
    def empty(cls) -> MediaStamp:
        return cls(None, [], np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def of(cls, paths: Iterable[str], root: str | None) -> MediaStamp:
        """Stamp the distinct ``paths`` (as the records give them, resolved under ``root``)."""
        rel = sorted(set(relative_to(paths, root)))
        stats = [_stat(_under(p, root)) for p in rel]
        return cls(
            root, rel,
            np.asarray([s for s, _ in stats], np.int64).reshape(-1),
            np.asarray([m for _, m in stats], np.int64).reshape(-1),
        )  # fmt: skip

    def changes(self, root: str | None, limit: int = 5) -> list[str]:
        """Up to ``limit`` files that differ now (size, mtime, missing) when the media root is
        ``root``; empty when every file is as stamped."""
        out: list[str] = []
        stamped = zip(self.paths, self.sizes.tolist(), self.mtimes.tolist(), strict=True)
        for path, size, mtime in stamped:
            now = _stat(_under(path, root))
            if now == (size, mtime):
                continue
            if now[0] != size:
                out.append(f"{path}: {size} -> {now[0]} bytes" if now[0] >= 0 and size >= 0
                           else f"{path}: {'missing' if now[0] < 0 else 'new'}")  # fmt: skip
            else:
                out.append(f"{path}: modified (mtime)")
            if len(out) >= limit:
                break
        return out

    def arrays(self) -> dict[str, Any]:
        """The ``.npz`` fields of the stamp (paths as one ``\\0``-joined UTF-8 byte array)."""
        joined = "\0".join(self.paths).encode("utf-8", "surrogateescape")
        return {
            "media_paths": np.frombuffer(joined, np.uint8),
            "media_sizes": self.sizes,
            "media_mtimes": self.mtimes,
        }

    @classmethod
    def from_arrays(cls, root: str | None, z: Mapping[str, Any]) -> MediaStamp:
        raw = z["media_paths"].tobytes().decode("utf-8", "surrogateescape")
        sizes = z["media_sizes"].astype(np.int64, copy=False)
        paths = raw.split("\0") if raw else []
        if len(paths) != sizes.shape[0]:
            raise ValueError(f"{len(paths)} media paths but {sizes.shape[0]} sizes")
        return cls(root, paths, sizes, z["media_mtimes"].astype(np.int64, copy=False))
