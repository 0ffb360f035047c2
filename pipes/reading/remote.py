"""Where shard bytes come from: local files or any fsspec URL (``s3://``, ``gs://``, ``hf://``...).

A ``ByteStore`` is what ``pipes/reading/shards.py`` reads through: list a glob, fingerprint a shard,
open it for the one-time index scan, and read byte ranges (tar members, Parquet row groups).
``LocalStore`` is plain files; ``FsspecStore`` is a remote filesystem:

* **ranged reads** (``fs.cat_file(path, start, end)``; a pack's ranges in one concurrent
  ``fs.cat_ranges`` call when the worker prefetches it),
* **retried**: a failed read is tried ``retries`` more times with a doubling back-off, then
  raised as a ``RemoteReadError`` naming the sample, the URL and the range, which the
  materializer's ``on_bad_sample`` policy counts like any other bad sample (a missing object
  or a refused permission is not retried: trying again cannot help),
* **fingerprinted** from ``fs.info`` (ETag, size, mtime) without reading the object,
* **fork-safe**: the filesystem object is made on first use in each process (a worker builds
  its own after the fork) and is never pickled: only the protocol and storage options are.

>>> is_url("s3://bucket/a.tar"), is_url("/data/a.tar"), is_url("file:///data/a.tar")
(True, False, False)
>>> split_url("s3://bucket/shards/a.tar")
('s3', 'bucket/shards/a.tar')
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol

from neatpack.pipes.reading._record import RecordError

__all__ = [
    "ByteStore",
    "FsspecStore",
    "LocalStore",
    "RemoteReadError",
    "WindowFile",
    "is_url",
    "split_url",
    "store_for",
]

_NOT_RETRIED: Final = (FileNotFoundError, PermissionError, IsADirectoryError)
_SCAN_BLOCK: Final = 256 << 10  # readahead of the tar header scan: several small members a read


class RemoteReadError(RecordError):
    """A ranged read that still failed after its retries; the message names the sample."""


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for ``protocol://...`` other than ``file://`` (read as a local path)."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def split_url(url: str) -> tuple[str, str]:
    """``(protocol, path without the protocol)``."""
    protocol, _, rest = url.partition("://")
    return protocol, rest


class ByteStore(Protocol):
    """The reads a shard source needs; ``where`` names the sample for errors."""

    def expand(self, pattern: str) -> list[str]: ...

    def fingerprint(self, path: str) -> str: ...

    def open(self, path: str) -> BinaryIO: ...

    def read(self, path: str, offset: int, size: int, where: str) -> bytes: ...

    def read_many(
        self, ranges: Sequence[tuple[str, int, int]], where: str
    ) -> list[bytes | BaseException]: ...


class LocalStore:
    """Local files: ``os.pread`` on a descriptor opened in the reading process."""

    remote = False

    def expand(self, pattern: str) -> list[str]:
        if any(c in pattern for c in "*?["):
            return sorted(glob.glob(pattern))
        return [pattern] if os.path.isfile(pattern) else []

    def fingerprint(self, path: str) -> str:
        """sha256 over the base name, size and the first and last 64 KiB (cheap on huge files)."""
        size = os.path.getsize(path)
        h = hashlib.sha256(f"{Path(path).name}\n{size}\n".encode())
        with open(path, "rb") as f:
            h.update(f.read(65536))
            if size > 65536:
                f.seek(max(65536, size - 65536))
                h.update(f.read())
        return h.hexdigest()

    def open(self, path: str) -> BinaryIO:
        return open(path, "rb")

    def read(self, path: str, offset: int, size: int, where: str) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(size)

    def read_many(
        self, ranges: Sequence[tuple[str, int, int]], where: str
    ) -> list[bytes | BaseException]:
        return [self.read(p, o, n, where) for p, o, n in ranges]


class FsspecStore:
    """An fsspec filesystem by protocol and storage options, made anew in each process.

    ``retries`` further tries of a failed read, ``backoff`` seconds before the first (doubled
    each time)."""

    remote = True

    def __init__(
        self,
        protocol: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retries: int = 3,
        backoff: float = 0.2,
    ) -> None:
        if retries < 0:
            raise ValueError(f"{retries=} must be >= 0")
        self.protocol = protocol
        self.storage_options = dict(storage_options or {})
        self.retries, self.backoff = retries, backoff
        self._fs: Any = None
        self._pid = -1

    @property
    def fs(self) -> Any:
        """This process's filesystem (a fresh instance after a fork: no inherited sockets)."""
        if self._fs is None or self._pid != os.getpid():
            try:
                import fsspec
            except ImportError as e:  # pragma: no cover - fsspec ships with torch / datasets
                raise ImportError("remote shards need fsspec: pip install fsspec") from e
            try:
                self._fs = fsspec.filesystem(
                    self.protocol, skip_instance_cache=True, **self.storage_options
                )
            except (ImportError, ValueError) as e:
                raise ImportError(
                    f"no fsspec filesystem for {self.protocol!r}:// ({e}); install its package "
                    "(s3fs for s3://, gcsfs for gs://, huggingface_hub for hf://)"
                ) from e
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_pid": -1}  # never pickle a live client

    def url(self, path: str) -> str:
        """A listed path of this filesystem as a URL again."""
        return path if is_url(path) else f"{self.protocol}://{path}"

    def _path(self, url: str) -> str:
        """The filesystem's own path of ``url`` (s3: ``bucket/key``; http keeps the URL)."""
        return str(self.fs._strip_protocol(url))

    def expand(self, pattern: str) -> list[str]:
        """The URLs a glob matches, or ``[pattern]`` if that object exists; a store that
        cannot answer (credentials, network) raises ``RemoteReadError`` saying why."""
        path = self._path(pattern)
        if any(c in path for c in "*?["):
            found = self._retry(lambda: self.fs.glob(path), f"listing {pattern!r}")
            return sorted(self.url(p) for p in found)
        try:
            self._retry(lambda: self.fs.info(path), f"{pattern!r}")
        except RemoteReadError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return []
            raise
        return [pattern]

    def fingerprint(self, path: str) -> str:
        """sha256 of the URL, size, ETag and modification time from ``fs.info`` (no data read)."""
        info = self._retry(lambda: self.fs.info(self._path(path)), f"info of {path!r}")
        keys = ("size", "ETag", "etag", "LastModified", "mtime", "last_modified", "md5Hash")
        parts = [f"{k}={info[k]}" for k in keys if info.get(k) is not None]
        return hashlib.sha256("\n".join([path, *parts]).encode()).hexdigest()

    def open(self, path: str) -> BinaryIO:
        f: BinaryIO = self.fs.open(
            self._path(path), "rb", block_size=_SCAN_BLOCK, cache_type="readahead"
        )
        return f

    def read(self, path: str, offset: int, size: int, where: str) -> bytes:
        data: bytes = self._retry(
            lambda: self.fs.cat_file(self._path(path), start=offset, end=offset + size),
            f"{where}: bytes {offset}..{offset + size} of {path!r}",
        )
        return data

    def read_many(
        self, ranges: Sequence[tuple[str, int, int]], where: str
    ) -> list[bytes | BaseException]:
        """All ``(path, offset, size)`` ranges in one concurrent call; a range that failed is
        returned as its exception (the sample's own read retries and reports it)."""
        if not ranges:
            return []
        try:
            got = self.fs.cat_ranges(
                [self._path(p) for p, _, _ in ranges],
                [o for _, o, _ in ranges],
                [o + n for _, o, n in ranges],
                on_error="return",
            )
        except Exception as e:  # the whole batch failed: each sample reads (and retries) alone
            return [e for _ in ranges]
        return [g if isinstance(g, bytes | BaseException) else bytes(g) for g in got]

    def _retry(self, call: Any, what: str) -> Any:
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return call()
            except _NOT_RETRIED as e:
                raise RemoteReadError(f"{what}: {type(e).__name__}: {e}; fix the URL") from e
            except Exception as e:  # network, throttling, 5xx: the client's own types vary
                if attempt == self.retries:
                    raise RemoteReadError(
                        f"{what}: failed {self.retries + 1} times, last {type(e).__name__}: "
                        f"{e}; check the store (or raise retries=)"
                    ) from e
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover


class WindowFile(io.RawIOBase):
    """A read-only window ``[offset, offset + size)`` of some bytes; ``_read(at, n)`` fetches
    ``n`` bytes at absolute offset ``at``. ``bytes_read`` counts what was read, so tests can
    check that planning reads headers only."""

    def __init__(self, offset: int, size: int) -> None:
        super().__init__()
        self.offset, self.size = offset, size
        self.pos = self.bytes_read = 0

    def _read(self, at: int, n: int) -> bytes:
        raise NotImplementedError

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
        data = self._read(self.offset + self.pos, n)
        buffer[: len(data)] = data
        self.pos += len(data)
        self.bytes_read += len(data)
        return len(data)


class RangeFile(WindowFile):
    """A window of a store's object, each read a ranged read (wrapped in a ``BufferedReader``:
    an image header costs one or two requests)."""

    def __init__(self, store: ByteStore, path: str, offset: int, size: int, where: str) -> None:
        super().__init__(offset, size)
        self.store, self.path, self.where = store, path, where

    def _read(self, at: int, n: int) -> bytes:
        return self.store.read(self.path, at, n, self.where)


def store_for(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    storage_options: dict[str, Any] | None = None,
    retries: int = 3,
) -> LocalStore | FsspecStore:
    """The store of ``paths``: all local, or all URLs of one protocol (a mix is refused).

    >>> type(store_for(["a.tar", "b.tar"])).__name__, store_for("s3://b/*.tar").protocol
    ('LocalStore', 's3')
    """
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    protocols = {split_url(os.fspath(p))[0] if is_url(p) else "" for p in items}
    if len(protocols) > 1:
        raise RecordError(
            f"shards mix protocols {sorted(protocols)}; give shards of one store at a time"
        )
    protocol = protocols.pop() if protocols else ""
    if not protocol:
        if storage_options:
            raise ValueError(f"{storage_options=} given for local shards; drop it")
        return LocalStore()
    return FsspecStore(protocol, storage_options, retries=retries)
