"""The README keeps its promises: the quickstart runs, the two commands are there, the demo
and the training example work."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_quickstart_runs() -> None:
    section = README.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    lines = code.group(1).strip().splitlines()
    assert len(lines) < 15, "the quickstart must stay under 15 lines"
    exec(compile(code.group(1), "README-quickstart", "exec"), {})


def test_first_screen_has_the_two_commands() -> None:
    head = README.split("## Quickstart", 1)[0]
    assert "pip install . && neatpack demo" in head
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in head
    assert "test-command" in ci


def test_demo_command_succeeds(tmp_path: Path) -> None:
    from neatpack.graphs.cli import main

    code = main(
        [
            "demo",
            "--dir",
            str(tmp_path),
            "--samples",
            "24",
            "--pack-size",
            "1024",
            "--workers",
            "1",
            "--quiet",
        ]
    )
    assert code == 0


def test_demo_command_as_a_process(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "neatpack.graphs.cli",
            "demo",
            "--dir",
            str(tmp_path),
            "--samples",
            "16",
            "--pack-size",
            "1024",
            "--workers",
            "2",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Exception ignored" not in out.stderr, out.stderr[-2000:]  # no worker GC noise
    summary = json.loads(out.stdout[out.stdout.index("{") : out.stdout.rindex("}") + 1])
    assert summary["checks"] == {
        "every sample consumed once": True,
        "resume mid-epoch gives identical batches": True,
    }
    assert 0.5 < summary["utilization_real_tokens"] <= 1.0


@pytest.mark.parity
def test_training_example_reduces_the_loss() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_tiny.py"), "--steps", "6"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 6
    assert result["losses"][-1] < result["losses"][0]


def test_families_table_covers_every_handler_and_names_real_tests() -> None:
    """Issue #7's table: one row per registered handler, and every test it cites exists."""
    from neatpack.pipes.families import HANDLERS

    section = README.split("## Model families", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    handler_cells = " ".join(row.split("|")[2] for row in rows[1:])
    missing = [name for name in HANDLERS if f"`{name}`" not in handler_cells]
    assert not missing, f"README families table has no row for handlers {missing}"
    cited = set(re.findall(r"`(tests/[\w/]+\.py)(?:::[\w\[\]-]+)?`", section))
    assert cited, "the table cites no tests"
    absent = sorted(p for p in cited if not (ROOT / p).is_file())
    assert not absent, f"README families table cites missing test files {absent}"
    for ref in re.findall(r"`(tests/[\w/]+\.py)::(\w+)", section):
        assert f"def {ref[1]}(" in (ROOT / ref[0]).read_text(), f"{ref[0]} has no {ref[1]}"


def test_mixture_example_runs() -> None:
    section = README.split("## Mixtures of datasets", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    scope: dict[str, object] = {}
    exec(compile(code.group(1), "README-mixture", "exec"), scope)
    batch, state = scope["batch"], scope["state"]
    assert batch["source_names"] == ["ocr", "charts"]  # type: ignore[index]
    assert state["source"]["mixture"]["segments"][0][0] == 0  # type: ignore[index]
