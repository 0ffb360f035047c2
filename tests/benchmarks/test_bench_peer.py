"""bench_peer.py is kept out of CI (the peer framework lives in its own venv): without it the
script stops at once with status 2 and says how to install it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_peer.py"


def test_bench_peer_without_the_peer_says_how_to_install_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--peer-python", str(missing)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert "the peer framework is not installed" in out.stderr
    assert str(missing) in out.stderr
    assert "nemo-automodel==0.7.0" in out.stderr


def test_bench_peer_with_a_python_lacking_the_peer() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--peer-python", sys.executable],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "No module named 'nemo_automodel'" in out.stderr
