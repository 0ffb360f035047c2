"""The stream sources (``pipes/reading/stream_files.py``, ``stream_hf.py``,
``stream_generator.py``) keep the ``StreamSource`` promise on real data: tar and Parquet files on
disk and in moto's S3 server, a ``datasets`` streaming dataset over local JSONL and Parquet
files, a seeded generator. For each: the shards are stable, ``open(shard, start)`` is the tail
of ``open(shard, 0)`` for every start, three re-opens in a row stay right, the fingerprint
follows the content, a bad start or a missing file is refused by name, and the records are the
raw shapes ``to_record`` reads."""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.s3_server import moto_s3, s3_buckets, s3_options
from support.shard_records import WORDS, shard_samples, write_parquet, write_tars

from neatpack.pipes import GeneratorStream, HFStream, ShardStream, StreamOrderError, to_record
from neatpack.pipes.reading.shards import ShardIndexError
from neatpack.pipes.reading.stream import StreamSource
from neatpack.pipes.reading.stream_hf import seek_state

N = 10


def norm(x: Any) -> Any:
    """A record as comparable plain data: an image as its size, mode and pixel hash."""
    if isinstance(x, dict):
        return {k: norm(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [norm(v) for v in x]
    if isinstance(x, bytes):
        return hashlib.sha256(x).hexdigest()[:16]
    if hasattr(x, "tobytes") and hasattr(x, "size"):  # a PIL image
        return [x.size, x.mode, hashlib.sha256(x.convert("RGB").tobytes()).hexdigest()[:16]]
    return x


def read(src: Any, shard: int, start: int = 0) -> list[Any]:
    return [norm(r) for r in src.open(shard, start)]


def check_stream(src: Any, sizes: list[int]) -> None:
    """The promise of ``StreamSource`` on ``src`` whose shards hold ``sizes`` records."""
    assert isinstance(src, StreamSource)
    assert src.shards() == src.shards()
    assert len(src.shards()) == len(sizes)
    assert len(set(src.shards())) == len(sizes)
    for shard, n in enumerate(sizes):
        whole = read(src, shard)
        assert len(whole) == n
        assert len({json.dumps(r, sort_keys=True) for r in whole}) == n  # distinct records
        for start in sorted({0, 1, n // 2, n - 1, n}):
            for _ in range(3):  # re-opened three times in a row: the same tail each time
                assert read(src, shard, start) == whole[start:], (shard, start)
    fp = src.fingerprint()
    assert isinstance(fp, str)
    assert fp == src.fingerprint()


def check_records(src: Any) -> None:
    """Every record is a raw shape the readers take: ``to_record`` gives a conversation."""
    for shard in range(len(src.shards())):
        for pos, raw in enumerate(src.open(shard)):
            rec = to_record(raw, pos, None)
            assert rec["conversation"]
            assert rec["conversation"][0]["role"] == "user"


def check_bad_starts(src: Any, n_last: int) -> None:
    last = len(src.shards()) - 1
    with pytest.raises(ValueError, match=r"start=-1 is not a position"):
        src.open(0, -1)
    with pytest.raises(IndexError, match=r"shard=99 is not a shard"):
        src.open(99, 0)
    with pytest.raises(ValueError, match=rf"shard {last}.*start={n_last + 5} is past its end"):
        list(src.open(last, n_last + 5))


@pytest.fixture(scope="module")
def samples() -> list[dict[str, Any]]:
    return shard_samples()


# -- tar and Parquet files, local ---------------------------------------------------------------


def test_local_tar_shards(samples: Any, tmp_path: Path) -> None:
    write_tars(tmp_path, samples, per=4)  # 4 + 4 + 2
    src = ShardStream(str(tmp_path / "*.tar"), cache_dir=tmp_path / "cache")
    assert [Path(s).name for s in src.shards()] == [f"shard-00{k}.tar" for k in range(3)]
    check_stream(src, [4, 4, 2])
    check_records(src)
    check_bad_starts(src, 2)
    first = read(src, 0)[0]  # images from the tar's own members, in member order
    assert "images" not in first
    assert len(read(src, 0)[2]["images"]) == 2


def test_local_parquet_shards_and_fingerprint(samples: Any, tmp_path: Path) -> None:
    paths = write_parquet(tmp_path, samples)  # 6 + 4 rows, row groups of 3
    src = ShardStream([str(p) for p in paths])
    check_stream(src, [6, 4])
    check_records(src)
    check_bad_starts(src, 4)
    before = src.fingerprint()
    write_parquet(tmp_path, list(reversed(samples)))  # same files, other content
    assert ShardStream([str(p) for p in paths]).fingerprint() != before


def test_missing_files_are_named(samples: Any, tmp_path: Path) -> None:
    with pytest.raises(ShardIndexError, match=r"nope\.tar.*no files exist; fix the path"):
        ShardStream([str(tmp_path / "nope.tar")])
    with pytest.raises(ShardIndexError, match=r"no files match"):
        ShardStream(str(tmp_path / "*.tar"))
    write_tars(tmp_path, samples, per=5)
    src = ShardStream(str(tmp_path / "*.tar"))
    os.remove(src.paths[1])  # deleted under a running stream: named when it is opened
    with pytest.raises(ShardIndexError, match=r"shard-001\.tar"):
        list(src.open(1, 2))
    with pytest.raises(ShardIndexError, match=r"one kind"):
        ShardStream([src.paths[0], str(write_parquet(tmp_path, samples)[0])])


# -- S3 (moto's server) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_set(samples: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    with moto_s3() as endpoint:
        options = s3_options(endpoint)
        fs = s3_buckets(options, "stream")
        root = tmp_path_factory.mktemp("s3-stream")
        for p in write_tars(root, samples, per=4) + write_parquet(root, samples):
            fs.put_file(str(p), f"stream/set/{p.name}")
        yield "s3://stream/set", options


@pytest.mark.remote
def test_s3_tar_and_parquet_shards(samples: Any, s3_set: Any, tmp_path: Path) -> None:
    url, options = s3_set
    tars = ShardStream(f"{url}/*.tar", storage_options=options, cache_dir=tmp_path)
    assert tars.shards() == [f"{url}/shard-00{k}.tar" for k in range(3)]
    check_stream(tars, [4, 4, 2])
    check_records(tars)
    check_bad_starts(tars, 2)
    local = ShardStream(str(Path(write_tars(tmp_path, samples, per=4)[0]).parent / "*.tar"))
    assert [read(tars, k) for k in range(3)] == [read(local, k) for k in range(3)]
    parquet = ShardStream(f"{url}/*.parquet", storage_options=options)
    check_stream(parquet, [6, 4])
    with pytest.raises(ShardIndexError, match=r"s3://stream/set/none\.tar"):
        ShardStream(f"{url}/none.tar", storage_options=options)


# -- datasets streaming -------------------------------------------------------------------------


def write_jsonl(root: Path, samples: list[dict[str, Any]], per: int = 4) -> list[str]:
    paths = []
    for k in range(0, len(samples), per):
        path = root / f"part-{k // per}.jsonl"
        with open(path, "w") as f:
            for s in samples[k : k + per]:
                row = {"messages": [{"role": "user", "content": s["q"]},
                                    {"role": "assistant", "content": s["a"]}]}  # fmt: skip
                print(json.dumps(row), file=f)
        paths.append(str(path))
    return paths


def hf_stream(files: list[str], kind: str = "json") -> HFStream:
    datasets = pytest.importorskip("datasets")
    return HFStream(datasets.load_dataset(kind, data_files=files, split="train", streaming=True))


def test_hf_streaming_jsonl(samples: Any, tmp_path: Path) -> None:
    files = write_jsonl(tmp_path, samples)
    src = hf_stream(files)
    assert src.shards() == files
    check_stream(src, [4, 4, 2])
    check_records(src)
    check_bad_starts(src, 2)
    assert src.seeks_by_state > 0
    assert src.seeks_by_reading == 0
    before = src.fingerprint()
    with open(files[1], "a") as f:  # one more record in the middle shard
        f.write(json.dumps({"messages": [{"role": "user", "content": "new"}]}) + "\n")
    assert hf_stream(files).fingerprint() != before


def test_hf_streaming_parquet_with_images(samples: Any, tmp_path: Path) -> None:
    files = [str(p) for p in write_parquet(tmp_path, samples)]
    src = hf_stream(files, "parquet")
    check_stream(src, [6, 4])
    check_records(src)
    assert read(src, 0)[2]["images"][0]["bytes"]  # images as bytes, decoded in the workers


def test_hf_state_keeps_advancing_after_resumes(samples: Any, tmp_path: Path) -> None:
    """What datasets issue 8308 broke (5.0): after ``load_state_dict`` the dataset's state
    froze, so a second resume restarted the stream. The adapter never reads positions from
    it: re-opened at the positions it counted, it gives the right records whatever the
    version. The dataset's own second resume is checked where it is fixed (5.1 on)."""
    src = hf_stream(write_jsonl(tmp_path, samples, per=N))
    texts = [s["q"] for s in samples]
    for start in (3, 5, 7):  # three resumes in a row, each from the adapter's own count
        it = src.open(0, start)
        assert [next(it)["messages"][0]["content"] for _ in range(2)] == texts[start : start + 2]
    import datasets

    if tuple(int(p) for p in datasets.__version__.split(".")[:2]) < (5, 1):
        pytest.skip(f"datasets {datasets.__version__}: its own state may freeze (issue 8308)")
    sub = src.shard_dataset(0)
    sub.load_state_dict(seek_state(sub.state_dict(), 3))
    it = iter(sub)
    assert next(it)["messages"][0]["content"] == samples[3]["q"]
    next(it)
    state = sub.state_dict()
    again = src.shard_dataset(0)
    again.load_state_dict(state)  # the second resume continues at 5
    assert next(iter(again))["messages"][0]["content"] == samples[5]["q"]


def test_hf_layouts_it_cannot_seek_are_read(samples: Any, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    files = write_jsonl(tmp_path, samples)
    ds = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    mapped = HFStream(ds.map(lambda r: {"n": len(r["messages"])}))
    check_stream(mapped, [4, 4, 2])
    assert mapped.seeks_by_reading > 0  # a .map: seek by reading, still right
    with pytest.raises(ValueError, match=r"shuffled.*before \.shuffle\(\)"):
        HFStream(ds.shuffle(seed=0))
    with pytest.raises(TypeError, match=r"HFDatasetSource"):
        HFStream(datasets.Dataset.from_list([{"a": 1}]))
    no_files = HFStream(datasets.Dataset.from_list(samples).to_iterable_dataset(num_shards=2))
    with pytest.raises(ValueError, match=r"fingerprint="):
        no_files.fingerprint()
    os.remove(files[1])
    with pytest.raises(ShardIndexError, match=r"HFStream shard 1 .*part-1\.jsonl.*restore"):
        list(HFStream(ds).open(1, 1))


# -- a user generator ---------------------------------------------------------------------------


def make_shard(shard: int, start: int) -> Iterator[dict[str, Any]]:
    rng = random.Random(shard)
    for i in range(5 + shard):
        rec = {"id": f"{shard}/{i}", "conversation": [
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=4))},
            {"role": "assistant", "content": "ok"}]}  # fmt: skip
        if i >= start:
            yield rec


def test_generator_stream() -> None:
    src = GeneratorStream(make_shard, 3, key=lambda r: r["id"], version="v1")
    check_stream(src, [5, 6, 7])
    check_records(src)
    other = GeneratorStream(make_shard, 3, key=lambda r: r["id"], version="v2")
    assert other.fingerprint() != src.fingerprint()
    with pytest.raises(ValueError, match=r"start=-1 is not a position"):
        src.open(0, -1)
    with pytest.raises(ValueError, match=r"version="):
        GeneratorStream(make_shard, 3, version="")


def test_generator_that_is_not_deterministic_is_named() -> None:
    calls = [0]

    def make(shard: int, start: int) -> Iterator[dict[str, Any]]:
        calls[0] += 1  # another run, other records: what an unseeded generator does
        for i in range(start, 4):
            yield {"id": f"{calls[0]}-{i}", "messages": [{"role": "user", "content": "x"}]}

    src = GeneratorStream(make, 2, key=lambda r: r["id"], version="v")
    assert len(list(src.open(1))) == 4
    with pytest.raises(StreamOrderError, match=r"shard 1 \(1\) position 2: key '2-2'.*seed"):
        list(src.open(1, 2))
