"""Cache files as ``.npz``: written atomically, read whole or memory-mapped, or refused.

The length index, a tar shard's offset index and a JSONL file's line index are all cached this
way. ``np.savez`` stores its members uncompressed, so ``map_npz`` maps each member's bytes
straight from the file (no copy): the ranks and workers of a node that map one cache file
share one copy in the page cache, counted once by the kernel (PSS), instead of one private
copy each. A mapped array pickles as its place in the file (``MappedArray``), so a spawned
worker maps the same pages again instead of receiving the array's bytes.

A writer never leaves half a file where a reader looks (a temporary file beside it, synced,
then renamed over it; removed if anything fails), and a reader gets every field it asks for or
a ``ValueError`` naming the file (torn, truncated, foreign or missing a field), never numpy's
open file handle left behind::

    >>> import tempfile, numpy as np
    >>> path = Path(tempfile.mkdtemp()) / "x.npz"
    >>> write_npz(path, a=np.arange(3), note=np.asarray("hi"))
    >>> got = read_npz(path, ("a", "note"), what="demo cache")
    >>> got["a"].tolist(), str(got["note"])
    ([0, 1, 2], 'hi')
    >>> mapped = map_npz(path, ("a",), what="demo cache")["a"]
    >>> type(mapped).__name__, mapped.tolist(), mapped.flags.writeable
    ('MappedArray', [0, 1, 2], False)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import struct
import threading
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MappedArray", "checksum", "locked", "map_npz", "read_npz", "write_npz"]


@contextlib.contextmanager
def locked(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created) while the block runs: one process of a node
    writes a shared cache file, the others wait and then read what it wrote."""
    with Path(path).open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def checksum(arrays: Mapping[str, Any], meta: Mapping[str, Any], head: str = "") -> str:
    """sha256 over ``head``, the JSON ``meta`` and every array by name (its dtype, shape and
    bytes as stored): what a cache file records to tell a torn or corrupt copy from a good one.

    >>> a = {"ids": np.arange(3, dtype=np.int32)}
    >>> checksum(a, {"k": 1}) == checksum({"ids": np.arange(3, dtype=np.int64)}, {"k": 1})
    False
    """
    h = hashlib.sha256(head.encode())
    h.update(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.data)
    return h.hexdigest()


def write_npz(path: str | os.PathLike[str], *, fsync: bool = True, **arrays: Any) -> None:
    """``np.savez`` to ``path`` atomically: a temporary file in the same folder, flushed to
    disk, then ``os.replace``; the temporary file is removed whatever happens. ``fsync=False``
    skips the flush to disk (~5 ms a file here): for files whose reader checks a checksum and
    rebuilds a bad one (the length index's pieces), a crash of the machine costs a rebuild."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("wb") as f:
            np.savez(f, **arrays)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_npz(path: str | os.PathLike[str], fields: Sequence[str], what: str) -> dict[str, Any]:
    """The arrays ``fields`` of the ``.npz`` at ``path``, read into memory. ``ValueError``
    "``what`` PATH is unreadable: ..." for a file that is absent, torn, foreign or lacks a
    field (the caller rebuilds it). The file is opened here: ``np.load`` leaves its own handle
    open when the zip is torn."""
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            return {k: z[k] for k in fields}
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{what} {os.fspath(path)} is unreadable: {e!r}") from e


class MappedArray(np.ndarray):  # any dtype and shape
    """A read-only array whose bytes are mapped from a cache file (``map_npz``).

    Pickles as ``(path, offset, dtype, shape, file identity)``: the receiving process (a
    spawned worker) maps the same file again, so its pages stay shared; a file replaced since
    (another inode, size or mtime) raises ``ValueError`` there rather than mapping other bytes.
    Slices and results of arithmetic are plain arrays (pickled by value, like any array).
    """

    _where: tuple[Any, ...] | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self._where = None  # only the array map_npz made knows its place in the file

    def __array_wrap__(self, arr: Any, context: Any = None, return_scalar: bool = False) -> Any:
        arr = super().__array_wrap__(arr, context, return_scalar)
        if arr is self or type(arr) is not MappedArray:
            return arr
        return arr[()] if arr.shape == () else arr.view(np.ndarray)

    def __getitem__(self, index: Any) -> Any:
        out = super().__getitem__(index)
        return out.view(np.ndarray) if type(out) is MappedArray else out

    def __reduce__(self) -> Any:
        if self._where is None:
            return np.asarray(self).copy().__reduce__()
        return (_remap, self._where)


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (int(st.st_ino), int(st.st_size), int(st.st_mtime_ns))


def _remap(
    path: str, offset: int, dtype: str, shape: tuple[int, ...], order: str,
    ident: tuple[int, int, int],
) -> np.ndarray[Any, Any]:  # fmt: skip
    if _identity(os.stat(path)) != tuple(ident):  # (a list, after some pickle round trips)
        raise ValueError(
            f"cache file {path} was replaced after it was mapped (rebuilt by another process?): "
            "a worker cannot map the same bytes; restart the loader so every process maps the "
            "current file"
        )
    return _map(path, offset, np.dtype(dtype), shape, order, ident)


def _map(
    path: str, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...], order: str,
    ident: tuple[int, int, int],
) -> np.ndarray[Any, Any]:  # fmt: skip
    if int(np.prod(shape)) == 0:  # mmap cannot map zero bytes
        empty = np.zeros(shape, dtype)
        empty.flags.writeable = False
        return empty
    mm = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape,
                   order="F" if order == "F" else "C")  # fmt: skip
    out: MappedArray = mm.view(MappedArray)
    out._where = (path, offset, dtype.str, tuple(shape), order, ident)
    return out


def _member_offset(f: Any, info: zipfile.ZipInfo) -> int:
    """Where a stored member's bytes start: after its local header (whose name and extra
    field lengths can differ from the central directory's)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"member {info.filename} is compressed: it cannot be mapped")
    f.seek(info.header_offset)
    head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise ValueError(f"member {info.filename}: no local header at {info.header_offset}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return int(info.header_offset + 30 + name_len + extra_len)


def map_npz(path: str | os.PathLike[str], fields: Sequence[str], what: str) -> dict[str, Any]:
    """The arrays ``fields`` of the (uncompressed) ``.npz`` at ``path``, memory-mapped read-only
    (``MappedArray``); the same ``ValueError`` as ``read_npz`` for a file that is absent, torn,
    foreign, compressed or lacks a field. Nothing is read but the headers: a member cut short
    (its bytes past the file's end) is refused here, a member whose bytes changed is the
    caller's checksum to find."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as z:
            ident = _identity(os.fstat(f.fileno()))
            out: dict[str, Any] = {}
            for k in fields:
                info = z.getinfo(f"{k}.npy")
                start = _member_offset(f, info)
                f.seek(start)
                version = np.lib.format.read_magic(f)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)  # fmt: skip
                shape, fortran, dtype = read(f)
                if dtype.hasobject:
                    raise ValueError(f"member {k} holds Python objects: it cannot be mapped")
                offset = f.tell()
                if offset - start + int(np.prod(shape)) * dtype.itemsize > info.file_size:
                    raise ValueError(f"member {k} is shorter than its header says")
                out[k] = _map(path, offset, dtype, tuple(shape), "F" if fortran else "C", ident)
            return out
    except (OSError, KeyError, ValueError, EOFError, struct.error, zipfile.BadZipFile) as e:
        raise ValueError(f"{what} {path} is unreadable: {e!r}") from e
