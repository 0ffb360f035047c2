"""The command line's inputs, checked: a processor by name or folder, a file to write, and the
``UsageError`` that ``neatpack`` turns into one line and exit code 2 (no traceback).

>>> writable_path("nodir/o.json")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
neatpack.graphs.command.cli_inputs.UsageError: cannot write 'nodir/o.json': folder 'nodir' does ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["UsageError", "load_processor", "writable_path"]


class UsageError(Exception):
    """A mistake in the command line or its inputs: one line, exit code 2."""


def load_processor(name: str) -> Any:
    from neatpack.pipes.testing.tiny import FAMILIES, load_tiny_processor

    if name in FAMILIES:
        return load_tiny_processor(name)
    path = Path(name)
    if not path.is_dir():
        raise UsageError(
            f"processor {name!r} is neither a directory saved with save_pretrained nor one of "
            f"the embedded tiny processors {list(FAMILIES)}: pass --processor DIR"
        )
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(path), local_files_only=True)  # type: ignore[no-untyped-call]
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load a processor from {name!r}: {exc}".splitlines()[0]) from exc


def writable_path(path: str) -> Path:
    out = Path(path)
    parent = out.parent if out.parent != Path("") else Path(".")
    if not parent.is_dir():
        raise UsageError(f"cannot write {path!r}: folder {str(parent)!r} does not exist")
    try:
        with out.open("ab"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write {path!r}: {exc.strerror}") from exc
    return out
