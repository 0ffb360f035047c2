"""A cache file's checksum verified once per node, not once per process.

Every rank of a node maps the same cache files (the length index, the plan) and each used to
hash all of them at every start: eight ranks on a node hashed the 763 MB index of 100M
samples eight times (~0.5 CPU-s each), and again to resume. ``verify_once(path, arrays,
check)`` runs ``check()`` (which raises ``ValueError`` for a corrupt file) in one process of
the node and leaves a stamp beside the file, ``.<name>.<host>.verified``: the file's
identity (device, inode, size, mtime, ctime) when it was verified. A later process of the
node whose file still has that identity skips the check; the others wait on a lock
(``.<name>.verify.lock``) while one verifies, so eight ranks starting together hash it once.

Why the identity is enough: any write to the file (in place, truncation, a rename over it)
changes its ctime or inode, and no process can set a ctime back, so a file changed after
its check is checked again (``tests/pipes/test_verified.py`` corrupts one in place, with its
mtime restored). File systems set ctime from a coarse clock (one tick, 1-10 ms): two changes
within a tick can share a ctime, so a stamp is written only once the clock has passed the
file's ctime by ``_SETTLE_S`` (a fresh file waits that long, once). What it does not catch:
bytes that rot on the disk under an unchanged inode after the node verified them (a process
that mapped the file before would not either). A folder that cannot be written (no lock, no
stamp) checks in every process, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neatpack.pipes.reading.npz_files import locked

__all__ = ["verify_once"]

_SETTLE_S = 0.1  # > a file system's timestamp tick (1-10 ms): a later change gets a new ctime


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _mapped_identity(arrays: Mapping[str, Any]) -> tuple[int, ...] | None:
    """(inode, size, mtime) of the file the arrays were mapped from (``npz_files.map_npz``)."""
    for a in arrays.values():
        where = getattr(a, "_where", None)
        if where is not None:
            return tuple(where[-1])
    return None


def _stamp_of(stamp: Path) -> Any:
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None


def _stamped(path: Path, stamp: Path, mapped: tuple[int, ...]) -> bool:
    """Whether the stamp vouches for the file as it is now, and it is the file mapped."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    ident = _identity(st)
    return bool(ident[1:4] == list(mapped) and _stamp_of(stamp) == ident)


def verify_once(
    path: str | os.PathLike[str], arrays: Mapping[str, Any], check: Callable[[], None]
) -> None:
    """``check()`` the file at ``path``, whose members ``arrays`` are mapped, unless a process
    of this node checked it as it is now (module docstring). ``check`` raises ``ValueError``
    for a corrupt file; nothing is stamped then."""
    path = Path(path)
    mapped = _mapped_identity(arrays)
    stamp = path.with_name(f".{path.name}.{socket.gethostname()}.verified")
    if mapped is not None and _stamped(path, stamp, mapped):
        return  # no lock to wait for: eight ranks on two cores queued on it for seconds
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(locked(path.with_name(f".{path.name}.verify.lock")))
        except OSError:
            check()  # a folder we cannot write: every process checks
            return
        if mapped is not None and _stamped(path, stamp, mapped):
            return  # checked by the process we waited for
        st = os.stat(path)
        if mapped is None or (st.st_ino, st.st_size, st.st_mtime_ns) != mapped:
            check()  # replaced since it was mapped (or nothing mapped): check, stamp nothing
            return
        wait = (st.st_ctime_ns - time.time_ns()) / 1e9 + _SETTLE_S
        if wait > _SETTLE_S:  # a ctime in the future (clock skew): no stamp to trust
            check()
            return
        if wait > 0:
            time.sleep(wait)
        ident = _identity(os.stat(path))  # a change from here on gets a later ctime
        check()
        if ident[1:4] != list(mapped):
            return
        tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps(ident))
            os.replace(tmp, stamp)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
