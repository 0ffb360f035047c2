"""Cache files as ``.npz``: written atomically, read whole or refused.

The length index, a tar shard's offset index and a JSONL file's line index are all cached this
way. A writer never leaves half a file where a reader looks (a temporary file beside it, synced,
then renamed over it; removed if anything fails), and a reader gets every field it asks for or
a ``ValueError`` naming the file (torn, truncated, foreign or missing a field), never numpy's
open file handle left behind::

    >>> import tempfile, numpy as np
    >>> path = Path(tempfile.mkdtemp()) / "x.npz"
    >>> write_npz(path, a=np.arange(3), note=np.asarray("hi"))
    >>> got = read_npz(path, ("a", "note"), what="demo cache")
    >>> got["a"].tolist(), str(got["note"])
    ([0, 1, 2], 'hi')
"""

from __future__ import annotations

import os
import threading
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["read_npz", "write_npz"]


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
