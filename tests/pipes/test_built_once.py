"""``built_once`` (pipes/reading/built_once.py): processes of a node that ask together build a
cache file once (real processes, a real ``flock``), a torn file is built again, and a folder
that cannot be written gives the in-memory value, at the three places that use it (the JSONL
line index, the tar set, the plan file)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from support.shard_records import WORDS, png_bytes, write_tars

from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.planning.plan_file import shared_plan
from neatpack.pipes.reading import built_once as built_once_module
from neatpack.pipes.reading.built_once import built_once
from neatpack.pipes.reading.npz_files import MappedArray
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.reading.shards import TarShardSource


def _read(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):  # absent or torn
        return None


def _write(path: Path, log: Path, value: int) -> int:
    with log.open("a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # the others arrive while it builds
    path.write_text(str(value))
    got = _read(path)
    assert got is not None
    return got


def _ask(path: str, log: str, q: Any) -> None:
    p, lg = Path(path), Path(log)
    q.put(built_once(p, lambda: _read(p), lambda: _write(p, lg, 7), in_memory=lambda: -1))


def test_processes_of_a_node_that_ask_together_build_once(tmp_path: Path) -> None:
    path, log = tmp_path / "cache" / "value.txt", tmp_path / "builds.log"
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(str(path), str(log), q)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert got == [7] * 4
    assert len(log.read_text().split()) == 1  # one process built; three waited, then loaded
    assert (tmp_path / "cache" / "value.lock").is_file()


def test_a_torn_file_is_built_again(tmp_path: Path) -> None:
    path, log = tmp_path / "value.txt", tmp_path / "builds.log"
    path.write_text("4")
    assert built_once(path, lambda: _read(path), lambda: _write(path, log, 5), lambda: -1) == 4
    assert not log.exists()  # found: nothing built
    path.write_text("not a number")
    assert built_once(path, lambda: _read(path), lambda: _write(path, log, 5), lambda: -1) == 5
    assert len(log.read_text().split()) == 1


def test_a_folder_that_cannot_be_written_gives_the_in_memory_value(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = blocker / "cache" / "value.txt"  # its folder cannot be made: an OSError
    built: list[int] = []

    def build() -> int:
        built.append(1)
        return 5

    assert built_once(path, lambda: _read(path), build, in_memory=lambda: -1) == -1
    assert built == []


def test_each_site_gives_the_same_values_without_a_writable_cache(tmp_path: Path) -> None:
    """The JSONL line index, the tar set and the plan file built in memory under a folder that
    cannot be made, equal to those built in (and mapped from) a writable cache."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    unwritable, cache = blocked / "cache", tmp_path / "cache"
    rng = random.Random(3)

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(f'{{"id": {i}, "text": "{rng.choice(WORDS)}"}}\n' for i in range(50)))
    mapped, in_memory = (
        JsonlSource(jsonl, cache_dir=cache),
        JsonlSource(jsonl, cache_dir=unwritable),
    )
    assert isinstance(mapped.lines.rel, MappedArray)
    assert not isinstance(in_memory.lines.rel, MappedArray)
    assert [in_memory.raw(i) for i in range(50)] == [mapped.raw(i) for i in range(50)]

    samples = [{"q": rng.choice(WORDS), "a": rng.choice(WORDS),
                "images": [png_bytes(rng) for _ in range(i % 2)]} for i in range(7)]  # fmt: skip
    tars = write_tars(tmp_path, samples, per=3)
    a, b = TarShardSource(tars, cache_dir=cache), TarShardSource(tars, cache_dir=unwritable)
    assert isinstance(a.index.checkpoints, MappedArray)
    assert not isinstance(b.index.checkpoints, MappedArray)
    assert [b.raw(i)["messages"] for i in range(7)] == [a.raw(i)["messages"] for i in range(7)]

    lengths = np.random.default_rng(0).integers(1, 9, size=40)
    want = plan_packs(lengths, 16)
    for plan in (shared_plan(cache, lengths, 16), shared_plan(unwritable, lengths, 16)):
        assert plan.packs() == want.packs()
        assert plan.fingerprint == want.fingerprint
    assert not blocked.is_dir()


def test_doctests_pass() -> None:
    import doctest

    assert doctest.testmod(built_once_module).failed == 0
