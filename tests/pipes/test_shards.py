"""Local tar shards and Parquet files (pipes/reading/shards.py) through ``neat_vlm_graph``: the same
batches as the records in canonical form, exactly-once resume mid-epoch, the offset index
cached by shard fingerprint."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from support.shard_records import (
    CFG,
    N,
    assert_resume_is_exactly_once,
    canonical,
    shard_samples,
    trl,
    without_meta,
    write_parquet,
    write_tars,
)

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes import shards as S
from neatpack.pipes.reading.shards import ParquetSource, ShardIndexError, TarShardSource
from neatpack.pipes.testing.resume import assert_exactly_once, same_item
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture(scope="module")
def processor() -> Any:
    return load_tiny_processor()


@pytest.fixture(scope="module")
def samples() -> list[dict[str, Any]]:
    return shard_samples()


@pytest.fixture(scope="module")
def expected(samples: list[dict[str, Any]], processor: Any) -> list[dict[str, Any]]:
    return list(neat_vlm_graph([canonical(s) for s in samples], processor, config=CFG))


def test_tar_shards_give_the_canonical_batches(
    samples: Any, processor: Any, expected: Any, tmp_path: Path
) -> None:
    write_tars(tmp_path, samples)
    source = TarShardSource(str(tmp_path / "shard-*.tar"))
    assert len(source) == N
    assert len(source.paths) == 3
    got = list(neat_vlm_graph(source, processor, config=CFG))
    assert same_item(without_meta(got), without_meta(expected))


def test_parquet_gives_the_canonical_batches(
    samples: Any, processor: Any, expected: Any, tmp_path: Path
) -> None:
    source = ParquetSource(write_parquet(tmp_path, samples))
    assert len(source) == N
    got = list(neat_vlm_graph(source, processor, config=CFG))
    assert same_item(without_meta(got), without_meta(expected))


@pytest.mark.parametrize("kind", ["tar", "parquet"])
def test_resume_mid_epoch_is_exactly_once(
    kind: str, samples: Any, processor: Any, tmp_path: Path
) -> None:
    if kind == "tar":
        write_tars(tmp_path, samples)
        source: Any = TarShardSource(sorted(tmp_path.glob("*.tar")))
    else:
        source = ParquetSource(write_parquet(tmp_path, samples))
    assert_resume_is_exactly_once(source, processor)


def test_tar_index_is_cached_by_shard_fingerprint(
    samples: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = write_tars(tmp_path, samples)
    cache = tmp_path / "cache"
    first = TarShardSource(paths, cache_dir=cache)
    assert len(list(cache.glob("tar-index-*.npz"))) == 3

    def no_scan(path: str) -> Any:
        raise AssertionError(f"rescanned {path}")

    monkeypatch.setattr(S, "index_tar", no_scan)
    again = TarShardSource(paths, cache_dir=cache)
    assert again.content_fingerprint() == first.content_fingerprint()
    sizes = [b["image"].size for b in again[5]["conversation"][0]["content"] if "image" in b]
    assert sizes == [
        b["image"].size for b in first[5]["conversation"][0]["content"] if "image" in b
    ]
    assert len(sizes) == 2
    monkeypatch.undo()
    with tarfile.open(paths[0], "a") as tf:  # the shard changes: new fingerprint, rescanned
        info = tarfile.TarInfo("000099.json")
        body = json.dumps(trl(samples[0])).encode()
        info.size = len(body)
        tf.addfile(info, io.BytesIO(body))
    changed = TarShardSource(paths, cache_dir=cache)
    assert len(changed) == N + 1
    assert changed.content_fingerprint() != first.content_fingerprint()


def test_bad_shards_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar" * 100)
    with pytest.raises(ShardIndexError, match=r"bad.tar.*unreadable"):
        TarShardSource(bad)
    with pytest.raises(ShardIndexError, match="no tar shards match"):
        TarShardSource(str(tmp_path / "none-*.tar"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 nope")
    with pytest.raises(ShardIndexError, match=r"bad.parquet.*unreadable"):
        ParquetSource(tmp_path / "bad.parquet")


def test_elastic_resume_two_to_three_ranks_over_tar_shards(
    samples: Any, processor: Any, tmp_path: Path
) -> None:
    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.indexing.lengths import build_length_index

    write_tars(tmp_path, samples, per=3)
    source = TarShardSource(sorted(tmp_path.glob("*.tar")))
    index = build_length_index(
        source, LengthEstimator.from_processor(processor, mode="exact"), progress=False
    )
    cfg = NeatVLMConfig(pack_size=160, batch_size=1, seed=1)

    def loader(rank: int, world: int) -> Any:
        return neat_vlm_graph(source, processor, config=cfg, rank=rank, world_size=world,
                              lengths=index)  # fmt: skip

    old = [loader(r, 2) for r in range(2)]
    for x in old:
        next(iter(x))
    states = [x.state_dict() for x in old]
    new = [loader(r, 3) for r in range(3)]
    for r, x in enumerate(new):
        x.load_state_dict(states[r % 2])
    assert len({len(list(x)) for x in new}) == 1  # every rank the same number of steps
    consumed = [i for x in old + new for i in x.ledgers[0].consumed]
    dropped = [i for x in new for i in x.ledgers[0].tail_dropped]
    assert_exactly_once(consumed, range(N), excused=dropped)
    assert len(consumed) >= N - 2


def test_tar_planning_reads_image_headers_only(
    samples: Any, processor: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PIL import ImageFile

    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.indexing.lengths import build_length_index

    big = [
        dict(s, images=[_noise(200 + 10 * i) for _ in s["images"]]) for i, s in enumerate(samples)
    ]
    write_tars(tmp_path, big)
    opened: list[Any] = []
    real_open = S.MemberFile.__init__

    def spy(self: Any, *a: Any) -> None:
        real_open(self, *a)
        opened.append(self)

    monkeypatch.setattr(S.MemberFile, "__init__", spy)
    loads: list[int] = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda im: loads.append(1) or real_load(im))
    source = TarShardSource(sorted(tmp_path.glob("*.tar")))
    est = LengthEstimator.from_processor(processor, mode="estimate")
    build_length_index(source, est, progress=False)
    assert loads == []  # nothing decoded
    assert len(opened) >= sum(len(s["images"]) for s in big)  # each image at least once
    assert sum(m.bytes_read for m in opened) < sum(m.size for m in opened) / 4  # headers only
    img = source[2]["conversation"][0]["content"][0]["image"]
    assert img.load() is not None  # the worker's decode reads the rest
    assert img.size == Image.open(io.BytesIO(big[2]["images"][0])).size


def _noise(side: int) -> bytes:
    rng = random.Random(side)
    buf = io.BytesIO()
    Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3)).save(buf, "PNG")
    return buf.getvalue()


def test_graph_takes_shard_paths_and_globs(
    samples: Any, processor: Any, expected: Any, tmp_path: Path
) -> None:
    tars = write_tars(tmp_path, samples)
    parquet = write_parquet(tmp_path, samples)
    for data in (str(tmp_path / "shard-*.tar"), [str(p) for p in tars], parquet):
        got = list(neat_vlm_graph(data, processor, config=CFG))
        assert same_item(without_meta(got), without_meta(expected)), data


def test_doctests_pass() -> None:
    import doctest

    result = doctest.testmod(S)
    assert result.attempted >= 2
    assert result.failed == 0


def test_bad_tar_sample_is_named_and_iter_raw_defers_it(samples: Any, tmp_path: Path) -> None:
    path = tmp_path / "mixed.tar"
    with tarfile.open(path, "w") as tf:
        for name, body in (("a.json", json.dumps(trl(samples[0])).encode()),
                           ("b.json", b"{not json"), ("c.txt", b"no json member")):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    source = TarShardSource(path)
    assert len(source) == 3
    raws = list(source.iter_raw(0, 3))
    assert raws[0] == trl(samples[0])
    assert raws[1:] == [None, None]  # the index takes these through source[id]: named errors
    with pytest.raises(S.RecordError, match=r"sample_id=1 \(.*mixed.tar: b\): malformed"):
        source[1]
    with pytest.raises(S.RecordError, match=r"sample_id=2 .*no .json member"):
        source[2]
