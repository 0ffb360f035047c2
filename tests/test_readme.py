"""The README keeps its promises: every python block runs as written, the two commands are
there, the demo and the training example work."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from support.shard_records import png_bytes, write_tars

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# A block that only makes sense after the one before it (it uses its names) says so on the line
# above its fence; it runs after that block, in the same process. Nothing else is exempt.
CONTINUES = "<!-- continues the block above -->"


class Block(NamedTuple):
    section: str
    line: int
    code: str
    continues: bool


def python_blocks(text: str = README) -> list[Block]:
    """Every ```python block of ``text`` with its ``##`` section and first line."""
    blocks, section = [], ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            continues = i > 0 and lines[i - 1].strip() == CONTINUES
            blocks.append(Block(section, i + 2, "\n".join(lines[i + 1 : end]) + "\n", continues))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks()


def _script(k: int) -> str:
    """Block ``k`` as it runs: after the blocks it continues, in one process."""
    start = k
    while BLOCKS[start].continues:
        start -= 1
    return "".join(b.code for b in BLOCKS[start : k + 1])


def test_every_block_is_found_and_continuations_have_a_block_before_them() -> None:
    assert README.count("```python") == len(BLOCKS) >= 9
    for k, block in enumerate(BLOCKS):
        if block.continues:  # a continuation needs a block before it in its own section
            assert k > 0, block
            assert BLOCKS[k - 1].section == block.section, block
    sections = {b.section for b in BLOCKS}
    assert "Context parallel" in sections
    assert all(any(not b.continues for b in BLOCKS if b.section == s) for s in sections)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each block runs: a user's folder with tar shards under ``data/`` (the sharded
    datasets example reads ``data/shard-*.tar``)."""
    root = tmp_path_factory.mktemp("readme")
    (root / "data").mkdir()
    rng = random.Random(4)
    samples = [{"q": f"what is picture {i}?", "a": f"a drawing, number {i}",
                "images": [png_bytes(rng)] if i % 2 else []} for i in range(8)]  # fmt: skip
    write_tars(root / "data", samples)
    return root


@pytest.fixture(scope="module")
def s3_env(workdir: Path) -> Iterator[dict[str, str]]:
    """The object-storage example's bucket (``s3://my-bucket/set1/``, the same shards) in
    moto's S3 server, and the environment that points the block at it."""
    pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    from support.s3_server import S3_ENV, moto_s3

    with moto_s3() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, **{
            "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
            "region_name": "us-east-1"})  # fmt: skip
        client.create_bucket(Bucket="my-bucket")
        for shard in sorted((workdir / "data").glob("shard-*.tar")):
            client.upload_file(str(shard), "my-bucket", f"set1/{shard.name}")
        yield {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k", range(len(BLOCKS)), ids=[f"{b.section}-line{b.line}" for b in BLOCKS])
def test_readme_block_runs_as_written(k: int, workdir: Path, request: Any, tmp_path: Path) -> None:
    """Each block in a fresh interpreter, in a folder of its own that holds ``data/``; a
    continuation runs after the block it continues. Exit code 0 or the block's traceback."""
    code = _script(k)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if "s3://" in code:
        env.update(request.getfixturevalue("s3_env"))
    (tmp_path / "data").symlink_to(workdir / "data")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=280, check=False,
    )  # fmt: skip
    assert out.returncode == 0, f"README line {BLOCKS[k].line}:\n{out.stderr[-3000:]}"


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
    from neatpack.graphs.command.cli import main

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
            "neatpack.graphs.command.cli",
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
    balance = summary["step_balance_2_ranks"]  # slowest rank over mean, per step cost column
    assert set(balance) == {"attention", "vision", "step"}
    assert all(1.0 <= v < 1.5 for v in balance.values()), balance


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
