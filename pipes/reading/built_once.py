"""A cache file built once per node: one process builds it under an ``flock``, the others map it.

The JSONL line index, the tar shards' whole offset index and the plan are each shared this way
by the ranks and workers of a node: eight ranks starting together would otherwise each read the
100M-line file (or plan 100M samples) and each hold their own copy. ``built_once(path, load,
build, in_memory)`` is the one protocol they follow:

1. ``load()`` without a lock: a file built before (the common start) is mapped at once.
2. Else take ``<path>.lock`` (``npz_files.locked``; its folder is created), ``load()`` again:
   the process this one waited for has built it; else ``build()`` (which writes ``path`` and
   returns what it wrote, mapped) while the others wait.
3. A folder that cannot be written or locked (any ``OSError`` from step 2): ``in_memory()``,
   the value built in this process and kept in memory, as if there were no cache.

``load`` returns None for a file that is absent, torn, corrupt or of another input (the caller's
checks); ``build`` handles a failed write of its own file by returning what it built.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "answer.txt"
    >>> builds = []
    >>> def load():
    ...     return int(path.read_text()) if path.exists() else None
    >>> def build():
    ...     builds.append(1)
    ...     path.write_text("42")
    ...     return load()
    >>> [built_once(path, load, build, in_memory=lambda: 42) for _ in range(2)]
    [42, 42]
    >>> len(builds)  # the second call mapped what the first wrote
    1
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from neatpack.pipes.reading.npz_files import locked

__all__ = ["built_once"]

T = TypeVar("T")


def built_once(
    path: str | os.PathLike[str],
    load: Callable[[], T | None],
    build: Callable[[], T],
    in_memory: Callable[[], T],
) -> T:
    """What ``load()`` finds at ``path``, else what ``build()`` writes there, run by one process
    of a node under ``<path>.lock`` while the others wait and then ``load()``; ``in_memory()``
    where the folder cannot be written (module docstring)."""
    path = Path(path)
    found = load()
    if found is not None:
        return found
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.with_suffix(".lock")):
            found = load()  # built by the process we waited for
            return build() if found is None else found
    except OSError:  # a folder we cannot write: no lock, no file
        return in_memory()
