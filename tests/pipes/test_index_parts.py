"""The length index built in pieces (pipes/indexing/index_parts.py): a build killed mid-way
(the process, or one worker, ends with os._exit) resumes from its saved pieces; a torn piece
is estimated again; a Parquet dataset grown by new shard files (or with one shard re-written)
estimates only those shards and plans as a full rebuild; two real gloo ranks finish a killed
build together, split by records, each with its own progress line. Every estimated record is
counted through the estimator (a file appended to by every process)."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import socket
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from neatpack.pipes.indexing import index_parts
from neatpack.pipes.indexing.index_parts import Piece, assign_pieces, plan_pieces
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.indexing.media_tokens import ImageTokenConfig
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.reading.shards import ParquetSource
from neatpack.pipes.testing.counting import CountingEstimator, counted
from neatpack.pipes.testing.tiny import load_tiny_processor

pq = pytest.importorskip("pyarrow.parquet")
PER = 25  # rows per shard


def estimator(log: Path | str = "", die_after: int = -1, mode: str = "estimate") -> Any:
    if mode == "exact":  # the default mode: every record rendered and tokenized
        return CountingEstimator.from_processor(
            _processor(),
            mode="exact",
            log=str(log),
            die_after=die_after,
            on_missing_media="fallback",
        )
    return CountingEstimator(image=ImageTokenConfig(), on_missing_media="fallback",
                             log=str(log), die_after=die_after)  # fmt: skip


@functools.cache
def _processor() -> Any:
    return load_tiny_processor()


def rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = " ".join(["word"] * int(rng.integers(1, 80)))
        content = [{"type": "text", "text": text, "image": None}]
        meta = None
        if i % 3:  # an image; every 7th without a size (no file either: a counted fallback)
            content.insert(0, {"type": "image", "text": None, "image": f"img{seed}_{i}.jpg"})
            h, w = (int(x) for x in rng.integers(20, 900, 2))
            meta = None if i % 7 == 0 else [[h, w]]
        out.append({"messages": [{"role": "user", "content": content},
                                 {"role": "assistant", "content": [
                                     {"type": "text", "text": "ok", "image": None}]}],
                    "images_meta": meta})  # fmt: skip
    return out


def write_shard(root: Path, k: int, seed: int | None = None, per: int = PER) -> Path:
    import pyarrow as pa

    path = root / f"part-{k:03d}.parquet"
    pq.write_table(pa.Table.from_pylist(rows(per, k if seed is None else seed)), path,
                   row_group_size=10)  # fmt: skip
    return path


def dataset(root: Path, shards: int, per: int = PER) -> Path:
    data = root / "data"
    data.mkdir(exist_ok=True)
    for k in range(shards):
        write_shard(data, k, per=per)
    return data


def source(data: Path) -> ParquetSource:
    return ParquetSource(str(data / "*.parquet"), media_root=data)


def same(a: LengthIndex, b: LengthIndex) -> None:
    np.testing.assert_array_equal(a.total, b.total)
    np.testing.assert_array_equal(a.visual, b.visual)
    assert a.images is not None
    assert b.images is not None
    np.testing.assert_array_equal(a.images, b.images)
    assert a.images.dtype == np.uint16
    assert 0 < int(a.images.sum()) < len(a)  # rows(): one image in two of three records
    np.testing.assert_array_equal(a.fallback_ids, b.fallback_ids)
    assert a.fallback_counts == b.fallback_counts
    assert a.fallback_counts  # the corpus has fallbacks: they went through the pieces too


def piece_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("length-piece-*.npz"))


def _killed_build(data: str, cache: str, log: str, die_after: int, workers: int, mode: str) -> None:
    build_length_index(source(Path(data)), estimator(log, die_after, mode), cache_dir=cache,
                       progress=False, num_workers=workers)  # fmt: skip


def kill_mid_build(
    data: Path, cache: Path, die_after: int, workers: int = 0, mode: str = "estimate"
) -> int:
    """A build in a child process that ends (os._exit, no cleanup) after ``die_after``
    records; returns its exit code."""
    child = mp.get_context("fork").Process(
        target=_killed_build, args=(str(data), str(cache), str(cache.parent / "killed.log"),
                                    die_after, workers, mode))  # fmt: skip
    child.start()
    child.join(120)
    return int(child.exitcode or 0)


@pytest.mark.parametrize("mode", ["estimate", "exact"])
def test_a_killed_build_resumes_and_estimates_only_the_missing_shards(
    tmp_path: Path, mode: str
) -> None:
    data, cache = dataset(tmp_path, 8), tmp_path / "cache"
    clean = build_length_index(source(data), estimator(mode=mode), progress=False)
    assert kill_mid_build(data, cache, die_after=4 * PER + 10, mode=mode) == 3  # in shard 4
    assert len(piece_files(cache)) == 4  # shards 0-3 finished, each saved as it finished
    assert not list(cache.glob("[0-9a-f]*.npz"))  # no whole index
    log = tmp_path / "resume.log"
    resumed = build_length_index(source(data), estimator(log, mode=mode), cache_dir=cache,
                                 progress=False)  # fmt: skip
    assert counted(log) == [PER] * 4  # shards 4-7 only
    same(resumed, clean)
    assert LengthIndex.load(cache / f"{resumed.fingerprint}.npz").total.tolist() == (
        clean.total.tolist()
    )
    assert len(piece_files(cache)) == 8  # kept: a grown dataset reuses them


@pytest.mark.timeout(180)
def test_a_killed_worker_leaves_its_pool_s_finished_pieces(tmp_path: Path) -> None:
    """Two worker processes; one ends (os._exit) mid-way: the build fails in the parent, the
    pieces the workers finished are on disk, and the rerun estimates the others only."""
    per = 4096
    data, cache = dataset(tmp_path, 10, per=per), tmp_path / "cache"
    assert kill_mid_build(data, cache, die_after=5 * per, workers=2) != 0
    done = len(piece_files(cache))
    assert 1 <= done < 10
    log = tmp_path / "resume.log"
    resumed = build_length_index(source(data), estimator(log), cache_dir=cache, progress=False,
                                 num_workers=2)  # fmt: skip
    assert sum(counted(log)) == (10 - done) * per
    same(resumed, build_length_index(source(data), estimator(), progress=False))


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "other_piece"])
def test_a_torn_or_foreign_piece_is_estimated_again(tmp_path: Path, damage: str) -> None:
    data, cache = dataset(tmp_path, 6), tmp_path / "cache"
    first = build_length_index(source(data), estimator(), cache_dir=cache, progress=False)
    (cache / f"{first.fingerprint}.npz").unlink()  # the pieces are all that is left
    pieces = plan_pieces(source(data), estimator().config_key())
    path = index_parts.piece_path(cache, pieces[2])
    body = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(body[: len(body) // 2])
    elif damage == "flip":  # inside the total array: only the checksum sees it
        t = first.total[pieces[2].lo : pieces[2].hi].astype("<i4").tobytes()
        at = body.index(t) + 4
        path.write_bytes(body[:at] + bytes([body[at] ^ 0x01]) + body[at + 1 :])
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a whole, valid piece, of another shard
        path.write_bytes(index_parts.piece_path(cache, pieces[3]).read_bytes())
    assert index_parts.load_piece(cache, pieces[2], str(data)) is None
    log = tmp_path / "again.log"
    again = build_length_index(source(data), estimator(log), cache_dir=cache, progress=False)
    assert counted(log) == [PER]  # that shard only
    same(again, first)
    assert index_parts.load_piece(cache, pieces[2], str(data)) is not None  # rewritten whole


def plan_of(index: LengthIndex) -> Any:
    return plan_packs(index.total, 2048, visual=index.visual, seed=3)


def test_a_grown_dataset_estimates_only_its_new_shards_and_plans_as_a_rebuild(
    tmp_path: Path,
) -> None:
    data, cache = dataset(tmp_path, 8), tmp_path / "cache"
    build_length_index(source(data), estimator(), cache_dir=cache, progress=False)
    for k in (8, 9):  # appended: the glob now finds 10 shards
        write_shard(data, k)
    log = tmp_path / "grown.log"
    grown = build_length_index(source(data), estimator(log), cache_dir=cache, progress=False)
    assert counted(log) == [PER, PER]  # shards 8 and 9 only
    full = build_length_index(source(data), estimator(), progress=False)  # no cache: all of it
    same(grown, full)
    assert grown.fingerprint == full.fingerprint
    a, b = plan_of(grown), plan_of(full)
    for name in ("offsets", "ids", "totals", "visual"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.fingerprint == b.fingerprint
    # one shard re-written (other rows, one more of them): that shard only, ids after it move
    write_shard(data, 3, seed=99, per=PER + 1)
    log2 = tmp_path / "changed.log"
    changed = build_length_index(source(data), estimator(log2), cache_dir=cache, progress=False)
    assert counted(log2) == [PER + 1]
    same(changed, build_length_index(source(data), estimator(), progress=False))


def test_an_unsharded_source_resumes_and_removes_its_pieces(tmp_path: Path) -> None:
    """A JSONL file: pieces are runs of ids of the same file; they serve a restart only, so
    they are removed once the whole index is saved."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(3 * index_parts.PIECE_RECORDS
                                                               // 2, 0)))  # fmt: skip
    cache = tmp_path / "cache"
    src = JsonlSource(path, media_root=tmp_path)
    pieces = plan_pieces(src, estimator().config_key())
    assert [p.size for p in pieces] == [12288, 12288]
    clean = build_length_index(src, estimator(), progress=False)
    child = mp.get_context("fork").Process(target=_jsonl_killed, args=(path, cache, tmp_path))
    child.start()
    child.join(120)
    assert child.exitcode == 3
    assert len(piece_files(cache)) == 1
    log = tmp_path / "resume.log"
    resumed = build_length_index(src, estimator(log), cache_dir=cache, progress=False)
    assert sum(counted(log)) == 12288
    same(resumed, clean)
    assert [f.name for f in cache.iterdir()] == [f"{resumed.fingerprint}.npz"]


def _jsonl_killed(path: Path, cache: Path, tmp: Path) -> None:
    build_length_index(JsonlSource(path, media_root=tmp), estimator(tmp / "k.log", 13000),
                       cache_dir=cache, progress=False, num_workers=0)  # fmt: skip


def test_pieces_split_by_records_not_by_shard_count() -> None:
    """One shard of 50 records and ten of 5, over 2 ranks: 50 records each (an even count of
    shards would give one rank 75); a shard over PIECE_RECORDS is cut into pieces."""

    class Shards:
        shard_starts: ClassVar[list[int]] = [0, *range(50, 100, 5)]
        shard_fingerprints: ClassVar[list[str]] = [f"fp{k}" for k in range(11)]

        def __len__(self) -> int:
            return 100

    pieces = plan_pieces(Shards(), "cfg")
    assert [p.size for p in pieces] == [50, *[5] * 10]
    loads, estimates = assign_pieces(pieces, [np.zeros(11, bool)] * 2)
    assert loads == [[], []]
    assert [sum(pieces[i].size for i in e) for e in estimates] == [50, 50]

    class Big(Shards):
        shard_starts: ClassVar[list[int]] = [0]
        shard_fingerprints: ClassVar[list[str]] = ["big"]

        def __len__(self) -> int:
            return 40_000

    assert [p.size for p in plan_pieces(Big(), "cfg")] == [13333, 13333, 13334]
    other = plan_pieces(Big(), "another estimator config")
    assert {p.key for p in other}.isdisjoint(p.key for p in plan_pieces(Big(), "cfg"))
    # present pieces are read by a rank that has them; only the missing ones are split
    have = [np.array([True] * 5 + [False] * 6), np.array([True] * 3 + [False] * 8)]
    loads, estimates = assign_pieces(pieces, have)
    assert sorted(loads[0] + loads[1]) == [0, 1, 2, 3, 4]
    assert set(loads[1]) <= {0, 1, 2}  # rank 1 has only pieces 0-2
    assert sorted(estimates[0] + estimates[1]) == list(range(5, 11))
    assert [len(e) for e in estimates] == [3, 3]


def test_progress_is_quiet_when_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = dataset(tmp_path, 2)
    first = build_length_index(source(data), estimator(), cache_dir=tmp_path / "c",
                               progress=False)  # fmt: skip
    assert capsys.readouterr().err == ""
    (tmp_path / "c" / f"{first.fingerprint}.npz").unlink()  # from its pieces, with a line
    build_length_index(source(data), estimator(), cache_dir=tmp_path / "c", progress=True)
    assert "length index" in capsys.readouterr().err


def test_doctests_pass() -> None:
    import doctest

    result = doctest.testmod(index_parts)
    assert result.attempted >= 1
    assert result.failed == 0


# -- two gloo ranks finish a killed build --------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, data: str, cache: str, out: str) -> None:
    import io

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        err, sys.stderr = sys.stderr, io.StringIO()
        log = f"{out}.log"
        try:
            index = build_length_index(source(Path(data)), estimator(log), cache_dir=cache,
                                       progress=True, rank=rank, world_size=world,
                                       num_workers=0)  # fmt: skip
        finally:
            printed, sys.stderr = sys.stderr.getvalue(), err  # type: ignore[attr-defined]
        Path(out).write_text(json.dumps({
            "total": index.total.tolist(), "visual": index.visual.tolist(),
            "fallback_ids": index.fallback_ids.tolist(), "counted": counted(log),
            "progress": printed,
        }))  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shared", [True, False])
def test_two_gloo_ranks_finish_a_killed_build(tmp_path: Path, shared: bool) -> None:
    """``shared``: one cache folder for both ranks; else one per rank (a node-local disk),
    rank 1's empty: rank 0 reads the pieces only it has, the ranks estimate the rest."""
    data, cache = dataset(tmp_path, 8), tmp_path / "cache"
    clean = build_length_index(source(data), estimator(), progress=False)
    assert kill_mid_build(data, cache, die_after=3 * PER + 1) == 3
    assert len(piece_files(cache)) == 3  # shards 0-2: most of what rank 0 would estimate
    caches = [cache, cache if shared else tmp_path / "cache-rank1"]
    ctx = mp.get_context("spawn")
    port = _free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(data), str(caches[r]),
                                             str(outs[r])))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("a rank hung in the length index build")
    assert [p.exitcode for p in procs] == [0, 0]
    reports = [json.loads(o.read_text()) for o in outs]
    for r, rep in enumerate(reports):
        assert rep["total"] == clean.total.tolist()
        assert rep["visual"] == clean.visual.tolist()
        assert rep["fallback_ids"] == clean.fallback_ids.tolist()
        assert f"length index [rank {r}/2]" in rep["progress"]  # each rank its own line
    # the 5 missing shards, split by records over the ranks (2 and 3), none twice
    assert sorted([reports[0]["counted"], reports[1]["counted"]]) == [[PER] * 2, [PER] * 3]
    if shared:
        assert len(piece_files(cache)) == 8
    else:  # each disk: the pieces its rank estimated (rank 0: the killed run's 3 too)
        assert sorted(len(piece_files(c)) for c in caches) == sorted([3 + 2, 3])
    for c in caches:
        assert (c / f"{clean.fingerprint}.npz").is_file()  # the whole index, on each disk


def test_piece_is_a_value() -> None:
    assert Piece(3, 7, "k").size == 4


def test_a_grown_tar_dataset_estimates_only_its_new_shard(tmp_path: Path) -> None:
    import random

    from support.shard_records import WORDS, png_bytes, write_tars

    from neatpack.pipes.reading.shards import TarShardSource

    rng = random.Random(4)
    samples = [{"q": " ".join(rng.choices(WORDS, k=rng.randint(3, 8))), "a": "ok",
                "images": [png_bytes(rng) for _ in range(i % 3)]} for i in range(11)]  # fmt: skip
    paths = write_tars(tmp_path, samples, per=3)  # 3, 3, 3, 2 samples
    cache = tmp_path / "cache"
    build_length_index(TarShardSource(paths[:3]), estimator(), cache_dir=cache, progress=False)
    log = tmp_path / "grown.log"
    grown = build_length_index(TarShardSource(paths), estimator(log), cache_dir=cache,
                               progress=False)  # fmt: skip
    assert counted(log) == [2]  # the appended shard only
    full = build_length_index(TarShardSource(paths), estimator(), progress=False)
    np.testing.assert_array_equal(grown.total, full.total)
    np.testing.assert_array_equal(grown.visual, full.visual)
    assert grown.visual.sum() > 0  # the images' headers were read (from the tar members)


def test_stale_pieces_are_pruned_and_a_fresh_build_plans_the_same(tmp_path: Path) -> None:
    """A shard re-written and a shard deleted: once the grown index is saved, their old
    pieces are removed; pieces of another estimator config (another model's index), pieces of
    the earlier format (no shard named) and foreign files stay; the cached build then equals,
    and plans as, a build from nothing."""
    data, cache = dataset(tmp_path, 5), tmp_path / "cache"
    build_length_index(source(data), estimator(), cache_dir=cache, progress=False)
    other = CountingEstimator(image=ImageTokenConfig(), on_missing_media="fallback",
                              chars_per_token=2.0)  # fmt: skip
    assert other.config_key() != estimator().config_key()
    build_length_index(source(data), other, cache_dir=cache, progress=False)
    first = set(piece_files(cache))
    assert len(first) == 10  # 5 shards, two configs
    mine = {p: json.loads(np.load(p)["meta"].tobytes()) for p in first}
    ours = {p for p, m in mine.items() if m["config"] == estimator().config_key()}
    by_shard = {Path(mine[p]["shard"]).name: p for p in ours}
    old_format = cache / "length-piece-0000.npz"  # a piece saved before pieces named their shard
    meta = {k: v for k, v in mine[by_shard["part-001.parquet"]].items()
            if k not in ("kind", "config", "shard", "fingerprint")}  # fmt: skip
    z = dict(np.load(by_shard["part-001.parquet"]))
    z["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(old_format, **z)
    foreign = cache / "length-piece-foreign.npz"
    foreign.write_bytes(b"not ours")
    write_shard(data, 3, seed=99, per=PER + 1)  # re-written
    (data / "part-004.parquet").unlink()  # deleted
    log = tmp_path / "after.log"
    cached = build_length_index(source(data), estimator(log), cache_dir=cache, progress=False)
    assert counted(log) == [PER + 1]  # the re-written shard only
    now = set(piece_files(cache))
    gone = first - now
    assert gone == {by_shard["part-003.parquet"], by_shard["part-004.parquet"]}
    assert {old_format, foreign} <= now  # not ours to judge
    assert first - ours <= now  # the other config's pieces stay, its shards' too
    fresh = build_length_index(source(data), estimator(), progress=False)
    same(cached, fresh)
    a, b = plan_of(cached), plan_of(fresh)
    assert a.fingerprint == b.fingerprint
    np.testing.assert_array_equal(a.ids, b.ids)
    # and a build from the pruned cache alone (the index file removed) is the same again
    (cache / f"{cached.fingerprint}.npz").unlink()
    log2 = tmp_path / "again.log"
    again = build_length_index(source(data), estimator(log2), cache_dir=cache, progress=False)
    assert counted(log2) == []  # every piece still there
    same(again, fresh)
