"""Run a benchmark script against another checkout of neatpack (``--baseline DIR``), so two
versions are timed side by side in one run on the same machine.

    from _checkout import run_in_checkout   # benchmarks/ is the script's own folder on sys.path
    printed = run_in_checkout(DIR, __file__, [*argv, "--balance-only"])

The checkout's ``pipes`` and ``graphs`` folders are linked as ``neatpack.pipes`` /
``neatpack.graphs`` in a temporary folder put first on ``PYTHONPATH``, and the script runs in a
subprocess there; its printed JSON object is returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_in_checkout(checkout: str, script: str, argv: list[str]) -> dict[str, Any]:
    """``script`` with ``argv`` on the neatpack of ``checkout``: the JSON object it prints."""
    root = Path(checkout).resolve()
    with tempfile.TemporaryDirectory() as shim:
        (Path(shim) / "neatpack").mkdir()
        for sub in ("pipes", "graphs"):
            (Path(shim) / "neatpack" / sub).symlink_to(root / sub)
        env = {**os.environ, "PYTHONPATH": shim}
        cmd = [sys.executable, script, *argv]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    printed: dict[str, Any] = json.loads(out.stdout)
    return printed
