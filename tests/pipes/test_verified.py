"""A cache file verified once per node (``pipes/reading/verified.py``): later processes skip
the checksum while the file is unchanged, and a file changed in any way is checked again, so
a corrupt one is still refused (and rebuilt by its owner), never used silently."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neatpack.pipes.indexing.lengths import LengthIndex
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.planning.plan_file import load_plan, shared_plan
from neatpack.pipes.reading.npz_files import map_npz
from neatpack.pipes.reading.verified import verify_once


def _index(path: Path, n: int = 5_000) -> LengthIndex:
    rng = np.random.default_rng(0)
    total = rng.integers(1, 900, n).astype(np.int32)
    index = LengthIndex(total=total, visual=total // 4, fingerprint="f" * 64)
    index.save(path)
    return index


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the index checksums computed (the real method, called through)."""
    calls: list[int] = []
    real = LengthIndex._checksum

    def counted(self: LengthIndex, layout: int = 2) -> str:
        calls.append(layout)
        return real(self, layout)

    monkeypatch.setattr(LengthIndex, "_checksum", counted)
    return calls


def _flip_in_place(path: Path, needle: bytes) -> None:
    """Corrupt one byte of ``path`` in place (same inode and size) and put its mtime back."""
    st = path.stat()
    data = path.read_bytes()
    at = data.index(needle)
    with path.open("r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns


def test_an_index_is_verified_once_and_checked_again_after_a_change_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "i.npz"
    index = _index(path)
    calls = _counting(monkeypatch)
    assert LengthIndex.load(path).total.tolist() == index.total.tolist()
    assert len(calls) == 1
    assert list(tmp_path.glob(".i.npz.*.verified"))  # the node's stamp
    LengthIndex.load(path)
    LengthIndex.load(path)
    assert len(calls) == 1  # unchanged since: not hashed again
    _flip_in_place(path, np.asarray(index.total[1000:1004]).tobytes())
    with pytest.raises(ValueError, match="checksum"):
        LengthIndex.load(path)  # the ctime moved: checked, and refused
    assert len(calls) == 2
    with pytest.raises(ValueError, match="checksum"):
        LengthIndex.load(path)  # a failed check stamps nothing
    assert len(calls) == 3
    index.save(path)  # rebuilt (a new inode; save computes the checksum it writes)
    assert len(calls) == 4
    assert LengthIndex.load(path).total.tolist() == index.total.tolist()  # checked once more
    LengthIndex.load(path)  # then trusted
    assert len(calls) == 5


def test_a_stamp_of_another_file_is_not_trusted(tmp_path: Path) -> None:
    """A stamp copied over from a good file does not vouch for a corrupt one."""
    good, bad = tmp_path / "good.npz", tmp_path / "bad.npz"
    index = _index(good)
    LengthIndex.load(good)
    index.save(bad)
    _flip_in_place(bad, np.asarray(index.total[2000:2004]).tobytes())
    for stamp in tmp_path.glob(".good.npz.*.verified"):
        (tmp_path / stamp.name.replace("good", "bad")).write_text(stamp.read_text())
    with pytest.raises(ValueError, match="checksum"):
        LengthIndex.load(bad)


def test_a_verified_plan_file_corrupted_in_place_is_planned_again(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    total = rng.integers(1, 900, 8_000).astype(np.int32)
    want = plan_packs(total, 2048, world_size=2)
    shared_plan(tmp_path, total, 2048, world_size=2)  # planned, written, verified, stamped
    path = tmp_path / f"plan-{want.fingerprint}.npz"
    assert list(tmp_path.glob(f".{path.name}.*.verified"))
    assert load_plan(path, want.fingerprint).ids.tolist() == want.ids.tolist()
    _flip_in_place(path, np.asarray(want.ids[500:504]).tobytes())
    with pytest.raises(ValueError, match="checksum"):
        load_plan(path, want.fingerprint)
    again = shared_plan(tmp_path, total, 2048, world_size=2)
    assert np.array_equal(again.ids, want.ids)


def _load_and_count(path: str, log: str, q: Any) -> None:
    def check() -> None:
        with open(log, "a") as f:  # one line per check, whichever process ran it
            f.write(f"{os.getpid()}\n")

    verify_once(path, map_npz(path, ("total",), what="t"), check)
    q.put(os.getpid())


def test_the_processes_of_a_node_check_a_file_once(tmp_path: Path) -> None:
    path = tmp_path / "i.npz"
    _index(path)
    log = tmp_path / "checks.log"
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_load_and_count, args=(str(path), str(log), q)) for _ in range(4)]
    for p in procs:
        p.start()
    done = {q.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
    assert len(done) == 4
    assert len(log.read_text().splitlines()) == 1  # one process checked; three waited, skipped


def test_a_jsonl_line_index_is_hashed_once_and_a_corrupt_one_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JSONL line index is verified like the length index: later opens skip the hash, and
    one corrupted in place (mtime restored) is refused and rebuilt, never read from."""
    import json

    from neatpack.pipes.reading import read
    from neatpack.pipes.reading.read import JsonlSource

    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(json.dumps({"i": i, "pad": "x" * (i % 37)}) + "\n" for i in range(5_000))
    )
    cache = tmp_path / "c"
    first = JsonlSource(path, cache_dir=cache)
    hashes: list[int] = []
    real = read.checksum
    monkeypatch.setattr(read, "checksum", lambda *a, **k: hashes.append(1) or real(*a, **k))
    for _ in range(3):
        assert JsonlSource(path, cache_dir=cache).raw(4_321) == first.raw(4_321)
    assert hashes == []  # the node's stamp vouches for the unchanged file
    (cache_file,) = cache.glob("jsonl-index-*.npz")
    rel = np.asarray(first.lines.rel[100:104]).tobytes()
    _flip_in_place(cache_file, rel)
    again = JsonlSource(path, cache_dir=cache)  # checked (ctime moved), refused, rebuilt
    assert hashes  # the check ran
    assert [again.raw(i) for i in range(0, 5_000, 97)] == [
        first.raw(i) for i in range(0, 5_000, 97)
    ]
