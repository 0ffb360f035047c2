"""Checkpoint folders a kill can tear: files written atomically, and the newest *complete*
folder of a run.

A run SIGKILLed while it saves leaves its last folder half written (weights, no optimizer, ...);
the framework's own loader then fails on the missing file, or loads a mix. A folder counts as
complete only once the file its writer writes last is there (``trainer_state.json`` for
``transformers.Trainer``, a marker after ``save_state`` for Accelerate); each caller says how
to tell with its ``problem`` function. ``newest_complete`` takes the newest folder whose
``problem`` is None and warns about every newer one it skips::

    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> for n in (2, 4, 10):
    ...     os.makedirs(os.path.join(out, f"step-{n}"))
    >>> torn = lambda path: "no marker" if path.endswith("-10") else None
    >>> os.path.basename(newest_complete(out, re.compile(r"^step-(\\d+)$"), torn, fix="-"))
    'step-4'
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

__all__ = ["atomic_file", "json_problem", "newest_complete"]

logger = logging.getLogger(__name__)


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Write ``path`` atomically: a temporary file beside it, synced, renamed over it. A kill
    mid-write leaves the old file or none, never half; the temporary file is removed whatever
    happens."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def json_problem(folder: str | os.PathLike[str], name: str) -> str | None:
    """Why the JSON file ``name`` that marks ``folder`` complete (written last) does not: it is
    missing or unreadable; None when it parses."""
    try:
        with open(os.path.join(os.fspath(folder), name)) as f:
            json.load(f)
    except FileNotFoundError:
        return f"no {name}"
    except (OSError, ValueError) as e:
        return f"unreadable {name} ({e})"
    return None


def newest_complete(
    output_dir: str | os.PathLike[str],
    pattern: re.Pattern[str],
    problem: Callable[[str], str | None],
    fix: str,
) -> str:
    """The newest folder of ``output_dir`` whose name matches ``pattern`` (group 1: its step
    number) and whose ``problem(path)`` is None. Newer ones are skipped with a warning naming
    each and its problem; ``ValueError`` naming what was found and ``fix`` when none is
    complete."""
    folder = os.fspath(output_dir)
    steps = sorted(
        (int(m.group(1)), name)
        for name in (os.listdir(folder) if os.path.isdir(folder) else [])
        if (m := pattern.match(name)) and os.path.isdir(os.path.join(folder, name))
    )
    torn: list[str] = []
    for _, name in reversed(steps):
        path = os.path.join(folder, name)
        why = problem(path)
        if why is None:
            if torn:
                logger.warning("resuming from %s; skipped incomplete %s", path, "; ".join(torn))
            return path
        torn.append(f"{name} ({why})")
    raise ValueError(
        f"no complete checkpoint in {folder!r} (found: {'; '.join(torn) or 'none'}); {fix}"
    )
