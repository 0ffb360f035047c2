"""The tar offset index shared per node (pipes/reading/shards.py, tar_index.py): written once
to ``cache_dir`` as ``tar-set-<fingerprint>.npz`` and mapped by every rank and worker (real
gloo ranks sharing one cache, and ranks whose caches differ as on two nodes); the same records
and batches as the in-memory index; the files of re-written or deleted shards pruned."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.gloo_ranks import gloo_group, run_ranks, save_report
from support.shard_records import CFG, shard_samples, write_tars
from support.spies import spy

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.reading.npz_files import MappedArray
from neatpack.pipes.reading.shards import TarShardSource, prune_tar_pieces
from neatpack.pipes.reading.tar_index import TarIndex
from neatpack.pipes.testing.resume import same_item
from neatpack.pipes.testing.tiny import load_tiny_processor


def records(source: TarShardSource) -> list[Any]:
    return [source.raw(i)["messages"] for i in range(len(source))]


def _rank(rank: int, world: int, port: int, root: str, shared: bool) -> None:
    from neatpack.pipes import shards

    with gloo_group(rank, world, port) as dist:
        gathers = spy(
            dist, "all_gather_object", lambda out, obj, group=None: len(pickle.dumps(obj))
        )
        scanned = spy(shards, "index_tar", lambda path, *a: Path(path).name)
        paths = sorted(Path(root).glob("*.tar"))
        cache = Path(root, "cache" if shared else f"cache{rank}")
        source = TarShardSource(paths, cache_dir=cache, rank=rank, world_size=world)
        first = (list(scanned), list(gathers))
        scanned.clear()
        gathers.clear()
        again = TarShardSource(paths, cache_dir=cache, rank=rank, world_size=world)
        report = {
            "records": records(source),
            "again": records(again),
            "mapped": [isinstance(s.index.checkpoints, MappedArray) for s in (source, again)],
            "file": [s.index.checkpoints._where[0] for s in (source, again)],
            "scanned": first[0],
            "gathers": first[1],
            "again_scanned": scanned,
            "again_gathers": gathers,
            "pieces": sorted(p.name for p in cache.glob("tar-index-*.npz")),
        }
        save_report(root, rank, report)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shared", [True, False], ids=["one-cache", "a-cache-per-rank"])
def test_two_gloo_ranks_map_one_offset_index_file(tmp_path: Path, shared: bool) -> None:
    """Each rank scans half the shards; with one cache (one node) only flags cross between
    the ranks and both map the one file; with a cache each (two nodes) the shards a rank's
    disk lacks come from the other rank, and each writes and maps its own copy."""
    write_tars(tmp_path, shard_samples(), per=3)  # 4 shards: 3, 3, 3, 1 samples
    want = records(TarShardSource(sorted(tmp_path.glob("*.tar"))))
    reports = run_ranks(_rank, 2, tmp_path, shared)
    for r, rep in enumerate(reports):
        assert rep["records"] == rep["again"] == want
        assert rep["mapped"] == [True, True]
        assert rep["scanned"] == [["shard-000.tar", "shard-001.tar"],
                                  ["shard-002.tar", "shard-003.tar"]][r]  # fmt: skip
        assert rep["again_scanned"] == []
        assert len(rep["again_gathers"]) == 1  # every rank has the file: one flag each
        assert len(rep["pieces"]) == 4  # every shard's index on every disk
        assert max(rep["gathers"][:3]) < 200  # flags, errors, bitmaps: no index crossed
        # one cache: 3 gathers of flags; a cache each: a 4th with the shards a disk lacked
        assert len(rep["gathers"]) == (3 if shared else 4)
    files = {f for rep in reports for f in rep["file"]}
    assert len(files) == (1 if shared else 2)
    assert all(Path(f).name.startswith("tar-set-") for f in files)


def _batches(loader: Any, n: int) -> list[Any]:
    return [batch for _, batch in zip(range(n), loader, strict=False)]


def test_the_mapped_index_gives_the_in_memory_batches_in_spawned_workers(tmp_path: Path) -> None:
    write_tars(tmp_path, shard_samples(), per=4)
    paths = sorted(tmp_path.glob("*.tar"))
    processor = load_tiny_processor()
    want = list(neat_vlm_graph(TarShardSource(paths), processor, config=CFG))
    mapped = TarShardSource(paths, cache_dir=tmp_path / "cache")
    assert isinstance(mapped.index.checkpoints, MappedArray)
    kw = {f: getattr(CFG, f) for f in ("pack_size", "batch_size", "shuffle", "estimate_mode")}
    spawned = NeatVLMConfig(**kw, num_workers=1, multiprocessing_context="spawn")
    assert same_item(list(neat_vlm_graph(mapped, processor, config=spawned)), want)
    # a source pickles its mapped index as the file's place, not its arrays
    assert len(__import__("pickle").dumps(mapped.index.checkpoints)) < 1_000
    # the path users call: a glob and the config's cache_dir (the graph makes the source)
    cached = NeatVLMConfig(**kw, cache_dir=str(tmp_path / "graph-cache"))
    got = list(neat_vlm_graph(str(tmp_path / "shard-*.tar"), processor, config=cached))
    assert same_item(got, want)
    assert len(list((tmp_path / "graph-cache").glob("tar-set-*.npz"))) == 1


def test_stale_offset_files_are_pruned_after_the_new_index_is_written(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    paths = write_tars(data, shard_samples(11), per=3)  # 4 shards
    cache = tmp_path / "cache"
    before = records(TarShardSource(paths, cache_dir=cache))
    pieces = {Path(TarIndex.read_meta(p)["path"]).name: p for p in cache.glob("tar-index-*.npz")}
    (old_set,) = cache.glob("tar-set-*.npz")
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    other = TarShardSource(write_tars(elsewhere, shard_samples(3, seed=1), per=3), cache_dir=cache)
    foreign = [cache / "tar-index-notours.npz", cache / "tar-set-x.npz", cache / "unrelated.npz"]
    for f in foreign:
        f.write_bytes(b"not an index")
    np.savez(cache / "tar-index-old.npz", keys=np.array(["a"]))  # an earlier layout's file
    write_tars(data, shard_samples(5, seed=99), per=5)  # shard-000.tar re-written (5 samples)
    paths[3].unlink()  # shard-003.tar deleted
    after = TarShardSource(paths[:3], cache_dir=cache)
    left = set(cache.iterdir())
    assert pieces["shard-000.tar"] not in left  # re-written
    assert pieces["shard-003.tar"] not in left  # deleted
    assert old_set not in left  # it held both
    assert {pieces["shard-001.tar"], pieces["shard-002.tar"]} <= left  # still this dataset's
    assert set(foreign) | {cache / "tar-index-old.npz"} <= left
    assert len(list(cache.glob("tar-set-*.npz"))) == 3  # this one, the other dataset's, "x"
    assert records(other) == records(TarShardSource(other.paths, cache_dir=cache))
    assert records(after) == records(TarShardSource(paths[:3]))
    assert len(after) == 5 + 3 + 3
    assert before[3:9] == records(after)[5:11]  # the shards that stayed
    # nothing is stale now: a second prune removes nothing
    assert prune_tar_pieces(cache, after.paths, after.shard_fingerprints) == []


def test_shard_indexes_of_the_earlier_layout_are_used_not_rescanned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache written before the compact layout (one ``tar-index-<fp>.npz`` a shard: numpy
    strings and int64): read and rewritten once, never rescanned; the same records."""
    from neatpack.pipes import shards
    from neatpack.pipes.reading.npz_files import write_npz

    paths = write_tars(tmp_path, shard_samples(), per=4)
    want = records(TarShardSource(paths))
    cache = tmp_path / "cache"
    cache.mkdir()
    for p in paths:
        listed = shards.index_tar(str(p))
        members = [(e, o, s) for _, m in listed for e, (o, s) in m.items()]
        write_npz(
            cache / f"tar-index-{shards.shard_fingerprint(str(p))}.npz",
            keys=np.array([k for k, _ in listed], dtype=str),
            starts=np.cumsum([0, *(len(m) for _, m in listed)]).astype(np.int64),
            exts=np.array([e for e, _, _ in members], dtype=str),
            offsets=np.array([o for _, o, _ in members], np.int64),
            sizes=np.array([s for _, _, s in members], np.int64),
        )  # fmt: skip

    def no_scan(path: str, *a: Any) -> Any:
        raise AssertionError(f"rescanned {path}")

    monkeypatch.setattr(shards, "index_tar", no_scan)
    source = TarShardSource(paths, cache_dir=cache)
    assert records(source) == want
    pieces = sorted(cache.glob("tar-index-*.npz"))
    assert len(pieces) == 3
    assert all(TarIndex.read_meta(p)["fingerprint"] in p.name for p in pieces)  # rewritten
