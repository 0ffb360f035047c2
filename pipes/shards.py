"""Sharded local datasets: WebDataset-style tar shards and Parquet files, read by sample id.

Sample ids run over the shards in the order given (a glob is sorted): shard 0's samples, then
shard 1's, ... Random access goes through a per-shard offset index: a Parquet file's row groups
(from its footer, no data read), a tar shard's member offsets (headers only, grouped by key),
cached in ``cache_dir`` under the shard's fingerprint (size + sha256 of its first and last
64 KiB + path name) so a restart does not rescan. Both are ``RecordSource`` s: pass one to
``neat_vlm_graph`` and resume, exactly-once and elastic resume work as with JSONL (the ids are
stable).

A tar sample is the members sharing a key (``dir/000017.json``, ``dir/000017.jpg``; the key is
the name up to the first dot of its base name). Its ``.json`` member is the record, in any
format ``to_record`` reads (``pipes/formats.py``); a media value that names a member of the
sample (``"000017.jpg"`` or ``"jpg"``) becomes that member's bytes; a record with neither an
``images`` / ``videos`` key nor such a reference gets its image and video members, in member
order, as ``images`` / ``videos`` (for ``{"type": "image"}`` placeholders). Parquet rows are
records; an Image column's ``{"bytes", "path"}`` structs are read as ``pipes/formats.py`` says.

>>> ShardIndexError.__mro__[1].__name__
'RecordError'
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from ._record import RecordError, to_record
from .contracts import Record

__all__ = [
    "ParquetSource",
    "ShardIndexError",
    "TarShardSource",
    "shard_fingerprint",
    "shard_source",
]

IMAGE_EXTS: Final = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
VIDEO_EXTS: Final = ("mp4", "webm", "mkv", "avi", "mov")
_MEDIA_KEYS: Final = ("image", "video", "path", "url")


class ShardIndexError(RecordError):
    """A shard that cannot be indexed (missing, not a tar / Parquet file, no samples)."""


def _paths(
    shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], kind: str
) -> list[str]:
    if isinstance(shards, str | os.PathLike):
        text = os.fspath(shards)
        found = sorted(glob.glob(text)) if any(c in text for c in "*?[") else [text]
    else:
        found = [os.fspath(p) for p in shards]
    if not found:
        raise ShardIndexError(f"no {kind} shards match {shards!r}; check the path or glob")
    for p in found:
        if not os.path.isfile(p):
            raise ShardIndexError(f"{kind} shard {p!r} does not exist; fix the path")
    return found


def shard_fingerprint(path: str) -> str:
    """sha256 over the base name, size and the first and last 64 KiB (cheap on huge shards)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"{Path(path).name}\n{size}\n".encode())
    with open(path, "rb") as f:
        h.update(f.read(65536))
        if size > 65536:
            f.seek(max(65536, size - 65536))
            h.update(f.read())
    return h.hexdigest()


def _combined(fingerprints: list[str], kind: str) -> str:
    return hashlib.sha256(f"{kind}:{','.join(fingerprints)}".encode()).hexdigest()


def _locate(starts: Any, sample_id: int, n: int) -> tuple[int, int]:
    """(shard, index in shard) of ``sample_id``; ``starts``: a sorted list of shard starts."""
    if isinstance(sample_id, bool) or not isinstance(sample_id, int | np.integer):
        raise TypeError(f"sample_id must be an int, got {sample_id!r}")
    if not 0 <= sample_id < n:
        raise IndexError(f"{sample_id=} out of range for a source of {n} samples")
    shard = bisect.bisect_right(starts, int(sample_id)) - 1
    return shard, int(sample_id) - int(starts[shard])


# -- tar shards ----------------------------------------------------------------------------------

Members = dict[str, tuple[int, int]]  # ext -> (data offset, size)


def index_tar(path: str) -> list[tuple[str, Members]]:
    """``[(key, {ext: (offset, size)}), ...]`` in member order, reading headers only."""
    samples: list[tuple[str, Members]] = []
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                head, _, base = m.name.rpartition("/")
                stem, dot, ext = base.partition(".")
                if not dot:
                    continue
                key = f"{head}/{stem}" if head else stem
                if not samples or samples[-1][0] != key:
                    samples.append((key, {}))
                samples[-1][1][ext.lower()] = (m.offset_data, m.size)
    except (tarfile.TarError, OSError) as e:
        raise ShardIndexError(f"tar shard {path!r} is unreadable ({e}); re-create it") from e
    return samples


class TarShardSource:
    """WebDataset-style tar shards (uncompressed ``.tar``), random access by sample id."""

    def __init__(
        self,
        shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        media_root: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        from .read import real_media_root

        self.paths = _paths(shards, "tar")
        self.media_root = real_media_root(media_root)
        fps = [shard_fingerprint(p) for p in self.paths]
        self._samples = [
            self._index(p, fp, cache_dir) for p, fp in zip(self.paths, fps, strict=True)
        ]
        counts = [len(s) for s in self._samples]
        self._starts: list[int] = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
        self._fingerprint = _combined(fps, "tar")

    @staticmethod
    def _index(path: str, fp: str, cache_dir: str | os.PathLike[str] | None) -> list[Any]:
        cache = Path(cache_dir) / f"tar-index-{fp}.json" if cache_dir is not None else None
        if cache is not None and cache.is_file():
            try:
                cached = json.loads(cache.read_text())  # [[key, {ext: [offset, size]}], ...]
                if isinstance(cached, list) and all(len(x) == 2 for x in cached[:1]):
                    return cached  # used as loaded: (key, members) unpack lists as tuples
            except (ValueError, TypeError):
                pass  # a corrupt cache file: rebuild it
        samples = index_tar(path)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(samples))
            os.replace(tmp, cache)
        return samples

    def __len__(self) -> int:
        return int(self._starts[-1])

    def raw(self, sample_id: int) -> dict[str, Any]:
        shard, local = _locate(self._starts, sample_id, len(self))
        with open(self.paths[shard], "rb") as f:
            return self._raw_at(f, shard, local, sample_id)

    def iter_raw(self, start: int, stop: int) -> Iterator[Any]:
        """Raw records ``start..stop-1``, one open file per shard (the length index reads
        these). A sample that cannot be read yields None: the index then takes it through
        ``source[id]``, which raises the named error (or its policy counts it)."""
        sid = start
        while sid < stop:
            shard, _ = _locate(self._starts, sid, len(self))
            first, end = int(self._starts[shard]), min(stop, int(self._starts[shard + 1]))
            with open(self.paths[shard], "rb") as f:
                for i in range(sid, end):
                    try:
                        yield self._raw_at(f, shard, i - first, i)
                    except RecordError:
                        yield None
            sid = end

    def _raw_at(self, f: Any, shard: int, local: int, sample_id: int) -> dict[str, Any]:
        key, members = self._samples[shard][local]
        path = self.paths[shard]
        where = f"sample_id={sample_id} ({path}: {key})"
        if "json" not in members:
            raise RecordError(f"{where}: no .json member (members {sorted(members)}); add one")

        def read(ext: str) -> Any:
            offset, size = members[ext]
            if ext.rsplit(".", 1)[-1] in IMAGE_EXTS:  # header now, pixels in the worker
                return _member_image(path, offset, size, f"{where} member .{ext}")
            f.seek(offset)
            return f.read(size)

        try:
            raw = json.loads(read("json"))
        except ValueError as e:
            raise RecordError(f"{where}: malformed .json member: {e}") from e
        if not isinstance(raw, dict):
            raise RecordError(f"{where}: .json member is a {type(raw).__name__}, not a dict")
        if len(members) == 1:
            return raw  # metadata only: nothing to attach
        names = {f"{Path(key).name}.{e}": e for e in members} | {e: e for e in members}
        used = _substitute(raw, names, read)
        if not used and not any(k in raw for k in ("images", "image", "videos", "video")):
            exts = [e for e in members if e != "json"]
            images = [read(e) for e in exts if e.rsplit(".", 1)[-1] in IMAGE_EXTS]
            videos = [read(e) for e in exts if e.rsplit(".", 1)[-1] in VIDEO_EXTS]
            if images:
                raw["images"] = images
            if videos:
                raw["videos"] = videos
        return raw

    def __getitem__(self, sample_id: int) -> Record:
        return to_record(self.raw(sample_id), int(sample_id), self.media_root)

    def content_fingerprint(self) -> str:
        return self._fingerprint


class MemberFile(io.RawIOBase):
    """A read-only window ``[offset, offset + size)`` of a file (a tar member), opened on the
    first read in the reading process (``os.pread``: no shared file position). ``bytes_read``
    counts what was read, so tests can check that planning reads headers only."""

    def __init__(self, path: str, offset: int, size: int) -> None:
        super().__init__()
        self.path, self.offset, self.size = path, offset, size
        self.pos = self.bytes_read = 0
        self._fd: int | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        data = os.pread(self._fd, n, self.offset + self.pos)
        buffer[: len(data)] = data
        self.pos += len(data)
        self.bytes_read += len(data)
        return len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        super().close()


def _member_image(path: str, offset: int, size: int, where: str) -> Any:
    """A PIL image opened lazily over a tar member: ``Image.open`` reads its header (the length
    index needs the size only); ``load_image`` in the worker reads and decodes the rest."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BufferedReader(MemberFile(path, offset, size), 16384))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise RecordError(
            f"{where}: no readable image header ({type(e).__name__}: {e}); re-encode it"
        ) from e


def _substitute(node: Any, names: dict[str, str], read: Any) -> bool:
    """Replace media values naming a member by its bytes, in place; True if any did."""
    used = False
    if isinstance(node, dict):
        for k, v in node.items():
            if k in _MEDIA_KEYS and isinstance(v, str) and v in names:
                node[k] = read(names[v])
                used = True
            elif k in ("images", "videos") and isinstance(v, list):
                for i, item in enumerate(v):
                    if isinstance(item, str) and item in names:
                        v[i] = read(names[item])
                        used = True
            else:
                used = _substitute(v, names, read) or used
    elif isinstance(node, list):
        for item in node:
            used = _substitute(item, names, read) or used
    return used


# -- Parquet -------------------------------------------------------------------------------------


class ParquetSource:
    """Parquet files, one record per row, random access by sample id through row groups. The
    last row group read is kept per process (sequential ids in a pack read it once)."""

    def __init__(
        self,
        shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        media_root: str | os.PathLike[str] | None = None,
    ) -> None:
        import pyarrow.parquet as pq

        from .read import real_media_root

        self.paths = _paths(shards, "Parquet")
        self.media_root = real_media_root(media_root)
        groups: list[list[int]] = []
        for p in self.paths:
            try:
                meta = pq.ParquetFile(p).metadata
            except Exception as e:  # pyarrow raises ArrowInvalid / OSError on a bad footer
                raise ShardIndexError(
                    f"Parquet shard {p!r} is unreadable ({e}); re-write it"
                ) from e
            groups.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        self._groups = [np.concatenate([[0], np.cumsum(g)]).astype(int).tolist() for g in groups]
        self._starts = (
            np.concatenate([[0], np.cumsum([g[-1] for g in self._groups])]).astype(int).tolist()
        )
        self._fingerprint = _combined([shard_fingerprint(p) for p in self.paths], "parquet")
        self._cache: tuple[tuple[int, int], list[dict[str, Any]]] | None = None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _rows(self, shard: int, group: int) -> list[dict[str, Any]]:
        if self._cache is None or self._cache[0] != (shard, group):
            import pyarrow.parquet as pq

            table = pq.ParquetFile(self.paths[shard]).read_row_group(group)
            self._cache = ((shard, group), table.to_pylist())
        return self._cache[1]

    def raw(self, sample_id: int) -> dict[str, Any]:
        shard, local = _locate(self._starts, sample_id, len(self))
        starts = self._groups[shard]
        group = bisect.bisect_right(starts, local) - 1
        return dict(self._rows(shard, group)[local - int(starts[group])])

    def __getitem__(self, sample_id: int) -> Record:
        return to_record(self.raw(sample_id), int(sample_id), self.media_root)

    def iter_raw(self, start: int, stop: int) -> Iterator[Any]:
        return (self.raw(i) for i in range(start, stop))

    def content_fingerprint(self) -> str:
        return self._fingerprint

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None}


_KINDS: Final[dict[str, type[TarShardSource] | type[ParquetSource]]] = {
    ".tar": TarShardSource,
    ".parquet": ParquetSource,
}


def shard_source(
    data: Any, media_root: str | os.PathLike[str] | None = None
) -> TarShardSource | ParquetSource | None:
    """A ``TarShardSource`` / ``ParquetSource`` when ``data`` is a path, glob or list of paths
    that all end ``.tar`` or all end ``.parquet``; else None (another reader's data).

    >>> shard_source([{"messages": []}]) is None
    True
    """
    items = [data] if isinstance(data, str | os.PathLike) else data
    if not isinstance(items, list | tuple) or not items:
        return None
    if not all(isinstance(p, str | os.PathLike) for p in items):
        return None
    suffixes = {Path(os.fspath(p)).suffix for p in items}
    if len(suffixes) != 1 or (suffix := suffixes.pop()) not in _KINDS:
        return None
    return _KINDS[suffix](data, media_root=media_root)
