"""The JSONL line index in ~4 bytes a line (``pipes/reading/line_index.py``): the same records,
line numbers and batches as the layout before it, from real files through ``JsonlSource`` and
the graph; re-based blocks (a tiny ``SPAN`` stands in for a file past 4 GiB); caches of the
earlier layouts loaded."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.reading import line_index
from neatpack.pipes.reading.line_index import LineIndex, block_bits
from neatpack.pipes.reading.npz_files import MappedArray, write_npz
from neatpack.pipes.reading.read import JsonlSource, _file_identity, _index_jsonl
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

BLANKS = (b"", b" ", b"\r", b"  \t", b"\t\r")


def reference(data: bytes) -> list[tuple[int, Any]]:
    """(1-based line number, parsed object) of every non-blank line, by plain splitting."""
    pieces = data.split(b"\n")
    if data.endswith(b"\n"):
        pieces.pop()
    return [(k + 1, json.loads(p)) for k, p in enumerate(pieces) if p.strip()]


def write_lines(path: Path, rnd: random.Random, n: int, *, crlf: bool, last_newline: bool) -> bytes:
    out = [rnd.choice(BLANKS) for _ in range(rnd.randint(0, 2))]  # leading blank lines
    for i in range(n):
        out.append(json.dumps({"id": i, "text": "é" * rnd.randint(0, 30)}).encode())
        out += [rnd.choice(BLANKS) for _ in range(rnd.choice([0, 0, 0, 1, 2]))]
    nl = b"\r\n" if crlf else b"\n"
    data = nl.join(out) + (nl if last_newline else b"")
    path.write_bytes(data)
    return data


def old_layout(path: Path, cache: Path) -> Path:
    """The cache file the reader before the compact index wrote (layout 2: int64 starts, uint32
    sizes, int64 line numbers), at the name it still looks under."""
    starts, ends, lines, blanks, digest = _index_jsonl(path)
    ident = _file_identity(path)
    out = cache / f"jsonl-index-{hashlib.sha256(ident.encode()).hexdigest()}.npz"
    write_npz(
        out, starts=starts, sizes=(ends - starts).astype(np.uint32),
        lines=np.zeros(0, np.int64) if lines is None else lines, blanks=np.asarray(blanks),
        digest=np.asarray(digest), identity=np.asarray(ident),
    )  # fmt: skip
    return out


def check_source(src: JsonlSource, want: list[tuple[int, Any]]) -> None:
    assert len(src) == len(want)
    assert [src.raw(i) for i in range(len(src))] == [obj for _, obj in want]
    assert [src.line_number(i) for i in range(len(src))] == [line for line, _ in want]
    assert list(src.iter_raw(0, len(src))) == [obj for _, obj in want]
    if len(src) > 3:
        assert list(src.iter_raw(2, len(src) - 1)) == [obj for _, obj in want[2:-1]]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000), n=st.integers(0, 40), crlf=st.booleans(),
    last_newline=st.booleans(), span=st.sampled_from([None, 64, 300]),
)  # fmt: skip
def test_records_and_line_numbers_as_a_plain_split_reads_them(
    tmp_path_factory: pytest.TempPathFactory, seed: int, n: int, crlf: bool,
    last_newline: bool, span: int | None,
) -> None:  # fmt: skip
    """CRLF, blank and whitespace lines (leading, between, trailing), a last line with or
    without its newline; blocks re-based every few lines (``span`` 64 / 300 bytes for 4 GiB)."""
    root = tmp_path_factory.mktemp("lines")
    path = root / "d.jsonl"
    data = write_lines(path, random.Random(seed), n, crlf=crlf, last_newline=last_newline)
    want = reference(data)
    saved = line_index.SPAN
    line_index.SPAN = span or saved
    try:
        plain = JsonlSource(path)
        cached = JsonlSource(path, cache_dir=root / "cache")
        mapped = JsonlSource(path, cache_dir=root / "cache")  # from the cache file
    finally:
        line_index.SPAN = saved
    if span is not None and n > 8:
        assert mapped.lines.bits < line_index.MAX_BITS  # the tiny span re-based blocks
    for src in (plain, cached, mapped):
        check_source(src, want)
    lines = data.split(b"\n")[: -1 if data.endswith(b"\n") or not data else None]
    assert plain.blank_lines == mapped.blank_lines == len(lines) - len(want)


def test_rebased_blocks_give_every_start_and_end() -> None:
    rnd = np.random.default_rng(3)
    sizes = rnd.integers(2, 200, 1_000)
    starts = np.concatenate([[0], np.cumsum(sizes + 1)[:-1]])
    ends = starts + sizes
    ends[[10, 500]] -= 1  # as if a blank line followed these two
    lines = np.arange(1, 1_001) + np.cumsum(np.isin(np.arange(1_000), [11, 501]))
    for bits in range(0, 6):
        idx = LineIndex.build(starts, ends, lines, bits=bits)
        assert len(idx.base) == -(-1_000 // (1 << bits))
        assert idx.starts(0, 1_000).tolist() == starts.tolist()
        assert idx.ends(0, 1_000).tolist() == ends.tolist()
        assert idx.ends(7, 12).tolist() == ends[7:12].tolist()
        assert [idx.end(i) for i in (0, 10, 11, 999)] == ends[[0, 10, 11, 999]].tolist()
        assert [idx.line_number(i) for i in range(1_000)] == lines.tolist()
        for off in [*rnd.integers(0, int(ends[-1]) + 50, 200).tolist(), 0, int(starts[-1])]:
            assert idx.first_at(off) == int(np.searchsorted(starts, off)), (bits, off)
        assert idx.over(150).tolist() == np.flatnonzero(ends - starts > 150).tolist()
    assert block_bits(starts, span=2**32) == line_index.MAX_BITS
    # a block must span less than `span` bytes: 1,000 lines of ~100 bytes in 4 KiB blocks
    bits = block_bits(starts, span=4096)
    assert bits == 5  # 32 lines of at most 201 bytes fit, 64 lines may not
    assert int(LineIndex.build(starts, ends, bits=bits).rel.max()) < 4096
    with pytest.raises(ValueError, match="skip a line"):
        LineIndex.build(starts, ends, lines + np.arange(1_000))


def test_about_four_bytes_a_line_mapped_from_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [json.dumps({"i": i}) for i in range(100_000)]
    path.write_text("\n".join(rows[:50_000]) + "\n\n" + "\n".join(rows[50_000:]) + "\n")
    src = JsonlSource(path, cache_dir=tmp_path / "c")
    again = JsonlSource(path, cache_dir=tmp_path / "c")
    assert isinstance(again.lines.rel, MappedArray)
    assert again.lines.nbytes / len(again) < 4.01  # was 12 (+8 for line numbers: a blank line)
    assert again.line_number(50_000) == 50_002
    assert again.raw(99_999) == {"i": 99_999} == src.raw(99_999)


def test_an_old_layout_cache_loads_identically_and_is_rewritten_once(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    data = write_lines(path, random.Random(5), 60, crlf=True, last_newline=False)
    cache = tmp_path / "cache"
    cache_file = old_layout(path, cache)
    src = JsonlSource(path, cache_dir=cache)  # converted from layout 2, not re-read
    check_source(src, reference(data))
    assert "meta" in np.load(cache_file).files  # rewritten as the compact layout
    st = os.stat(cache_file)
    again = JsonlSource(path, cache_dir=cache)
    assert isinstance(again.lines.rel, MappedArray)
    check_source(again, reference(data))
    assert os.stat(cache_file).st_ino == st.st_ino  # not rewritten a second time
    assert (
        src.content_fingerprint() == again.content_fingerprint() == hashlib.sha256(data).hexdigest()
    )  # the length index and saved states keep their key
    # layout 1 (``ends``, no ``sizes``) and a corrupt layout-3 file: rebuilt from the file
    starts, ends, _, blanks, digest = _index_jsonl(path)
    write_npz(cache_file, starts=starts, ends=ends, blanks=np.asarray(blanks),
              digest=np.asarray(digest), identity=np.asarray(_file_identity(path)))  # fmt: skip
    check_source(JsonlSource(path, cache_dir=cache), reference(data))
    body = bytearray(cache_file.read_bytes())
    at = body.index(b"rel.npy") + 200  # inside the rel member's data
    body[at] ^= 0xFF
    cache_file.write_bytes(bytes(body))
    check_source(JsonlSource(path, cache_dir=cache), reference(data))


def _batches(loader: Any, n: int) -> list[tuple[list[list[int]], list[int]]]:
    out = []
    for _, batch in zip(range(n), loader, strict=False):
        ids = [list(p["sample_ids"]) for p in batch["packs"]]
        out.append((ids, batch["input_ids"].reshape(-1).tolist()))
    return out


def test_the_graph_gives_the_same_batches_from_either_layout(tmp_path: Path) -> None:
    """A corpus rewritten with CRLF, blank lines and no final newline: the batches of the
    compact mapped index equal those of a layout-2 cache (the earlier reader's file) and of no
    cache at all."""
    write_corpus(tmp_path, num_samples=24, seed=11)
    rows = (tmp_path / "data.jsonl").read_bytes().splitlines()
    data = b"\r\n".join(r + (b"\r\n  " if i % 5 == 0 else b"") for i, r in enumerate(rows))
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(data)
    processor = load_tiny_processor()
    kw: dict[str, Any] = {"pack_size": 1024, "batch_size": 2, "media_root": str(tmp_path / "media")}
    want = _batches(neat_vlm_graph(path, processor, config=NeatVLMConfig(**kw)), 4)
    assert len(want) == 4
    old_layout(path, tmp_path / "old")
    for cache in ("old", "old", "new"):  # converted, then mapped; built fresh
        config = NeatVLMConfig(**kw, cache_dir=str(tmp_path / cache))
        assert _batches(neat_vlm_graph(path, processor, config=config), 4) == want


def test_doctests_pass() -> None:
    import doctest

    assert doctest.testmod(line_index).failed == 0


def _open_in_process(path: str, cache: str, q: Any) -> None:
    src = JsonlSource(path, cache_dir=cache)
    q.put((len(src), src.raw(len(src) - 1), isinstance(src.lines.rel, MappedArray)))


def test_one_process_of_a_node_reads_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three processes open the same file with one cache at once: one reads the file (the
    others wait on its lock), all map the same cache file and read the same records."""
    import multiprocessing as mp

    from neatpack.pipes.reading import read

    path = tmp_path / "d.jsonl"
    write_lines(path, random.Random(2), 3_000, crlf=False, last_newline=True)
    log = tmp_path / "reads.log"
    real = read._index_jsonl

    def logged(p: Path) -> Any:
        with log.open("a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # the others arrive while it reads
        return real(p)

    monkeypatch.setattr(read, "_index_jsonl", logged)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_open_in_process, args=(str(path), str(tmp_path / "c"), q))
             for _ in range(3)]  # fmt: skip
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(log.read_text().split()) == 1  # read once
    assert got == [(3_000, {"id": 2_999, "text": got[0][1]["text"]}, True)] * 3
    assert len(list((tmp_path / "c").glob("jsonl-index-*.npz"))) == 1


def _long_lines(path: Path) -> bytes:
    """40 records, every 7th with a text of 1,500 bytes (the others under 100)."""
    rows = [json.dumps({"id": i, "text": "x" * (1_500 if i % 7 == 3 else i)}) for i in range(40)]
    data = ("\n".join(rows) + "\n").encode()
    path.write_bytes(data)
    return data


def _over(data: bytes, limit: int) -> list[int]:
    """Ids of the lines longer than ``limit`` bytes, by plain splitting."""
    return [i for i, line in enumerate(data.split(b"\n")[:-1]) if len(line) > limit]


def _open_and_count(path: str, cache: str, limits: list[int | None], q: Any) -> None:
    scans: list[Any] = []
    real = LineIndex.sizes

    def counted(self: LineIndex, i: int, j: int) -> Any:
        scans.append((i, j))
        return real(self, i, j)

    LineIndex.sizes = counted  # type: ignore[method-assign]  # this process only
    got = []
    for limit in limits:
        src = JsonlSource(path, cache_dir=cache, max_record_bytes=limit)
        got.append((src.too_large.tolist(), len(scans)))
    q.put(got)


def _in_a_process(path: Path, cache: Path, limits: list[int | None]) -> Any:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_open_and_count, args=(str(path), str(cache), limits, q))
    p.start()
    got = q.get(timeout=60)
    p.join(timeout=60)
    assert p.exitcode == 0
    return got


def test_the_longest_line_is_kept_so_a_later_process_does_not_scan(tmp_path: Path) -> None:
    """The over-long check (``max_record_bytes``) reads the longest line's size from the cache
    file: a second process scans no line unless the limit is under it, and refuses the same
    lines either way."""
    path, cache = tmp_path / "d.jsonl", tmp_path / "cache"
    data = _long_lines(path)
    longest = max(len(line) for line in data.split(b"\n"))
    first = JsonlSource(path, cache_dir=cache)  # reads the file, writes the cache
    assert first.lines.longest == longest
    limits: list[int | None] = [None, 8 << 20, longest, longest - 1, 200]
    got = _in_a_process(path, cache, limits)
    want_ids = [[] if limit is None else _over(data, limit) for limit in limits]
    assert [ids for ids, _ in got] == want_ids
    assert want_ids[-1] == [3, 10, 17, 24, 31, 38]  # the test can tell a scan from none
    # counted since the process started: no pass while the limit is at or over the longest
    # line, one (a chunk of lines) for each limit under it
    assert [n for _, n in got] == [0, 0, 0, 1, 2]
    check_source(JsonlSource(path, cache_dir=cache), reference(data))


def test_a_cache_without_the_longest_line_is_scanned_once_and_rewritten(tmp_path: Path) -> None:
    """A layout-3 file written before the longest line's size was kept loads identically: one
    process of the node scans it once and rewrites it; later processes scan nothing."""
    from neatpack.pipes.reading.read import _save_jsonl_index

    path, cache = tmp_path / "d.jsonl", tmp_path / "cache"
    data = _long_lines(path)
    built = JsonlSource(path, cache_dir=cache)
    (cache_file,) = cache.glob("jsonl-index-*.npz")
    lines = LineIndex.from_arrays(
        {f: np.array(a) for f, a in built.lines.arrays().items()}, built.lines.meta()
    )
    lines.longest = None  # what the reader before it wrote
    _save_jsonl_index(cache_file, _file_identity(path), lines, built.blank_lines,
                      built.content_fingerprint())  # fmt: skip
    assert "longest" not in json.loads(np.load(cache_file)["meta"].tobytes())
    before = os.stat(cache_file).st_ino
    converted, again = _in_a_process(path, cache, [None]), _in_a_process(path, cache, [None])
    assert converted == [([], 1)]  # one pass (one chunk of lines), in the first process
    assert again == [([], 0)]  # read from the rewritten file
    assert os.stat(cache_file).st_ino != before
    meta = json.loads(np.load(cache_file)["meta"].tobytes())
    assert meta["longest"] == max(len(line) for line in data.split(b"\n"))
    src = JsonlSource(path, cache_dir=cache)
    check_source(src, reference(data))
    assert src.content_fingerprint() == built.content_fingerprint()
    assert JsonlSource(path, cache_dir=cache, max_record_bytes=200).too_large.tolist() == _over(
        data, 200
    )
