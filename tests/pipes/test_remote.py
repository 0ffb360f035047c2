"""Tar and Parquet shards in a real S3-compatible object store (moto's standalone server,
started here on a free 127.0.0.1 port) read through s3fs: the same batches as the local
shards, exactly-once resume, retried reads, the index cached by ETag, poisoned media refused."""

from __future__ import annotations

import io
import json
import random
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from support.s3_server import free_port, moto_s3, s3_buckets, s3_options
from support.shard_records import (
    CFG,
    N,
    assert_resume_is_exactly_once,
    batch_ids,
    canonical,
    png_bytes,
    shard_samples,
    trl,
    without_meta,
    write_parquet,
    write_tars,
)

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes import shards as S
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.reading.media_policy import MediaRefusedError
from neatpack.pipes.reading.remote import RemoteReadError
from neatpack.pipes.reading.shards import ParquetSource, TarShardSource
from neatpack.pipes.testing.resume import same_item
from neatpack.pipes.testing.tiny import load_tiny_processor

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytestmark = pytest.mark.remote

BUCKET = "neat-data"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """moto's standalone S3 server in a subprocess; torn down after the module."""
    with moto_s3() as url:
        yield url


@pytest.fixture(scope="module")
def options(endpoint: str) -> dict[str, Any]:
    return s3_options(endpoint)


@pytest.fixture(scope="module")
def s3(options: dict[str, Any]) -> Any:
    return s3_buckets(options, BUCKET, "other-bucket", "my-bucket")


@pytest.fixture(scope="module")
def processor() -> Any:
    return load_tiny_processor()


@pytest.fixture(scope="module")
def samples() -> list[dict[str, Any]]:
    return shard_samples()


@pytest.fixture(scope="module")
def expected(samples: list[dict[str, Any]], processor: Any) -> list[dict[str, Any]]:
    return list(neat_vlm_graph([canonical(s) for s in samples], processor, config=CFG))


@pytest.fixture(scope="module")
def uploaded(s3: Any, samples: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tar and Parquet shards of test_shards.py under s3://neat-data/set1/."""
    root = tmp_path_factory.mktemp("shards")
    for p in write_tars(root, samples) + write_parquet(root, samples):
        s3.put_file(str(p), f"{BUCKET}/set1/{p.name}")
    return f"s3://{BUCKET}/set1"


@pytest.mark.parametrize("workers", [0, 2])
def test_s3_tar_shards_give_the_local_batches(
    uploaded: str, options: Any, processor: Any, expected: Any, workers: int
) -> None:
    source = TarShardSource(f"{uploaded}/shard-*.tar", storage_options=options)
    assert len(source) == N
    assert source.paths[0] == f"{uploaded}/shard-000.tar"
    cfg = NeatVLMConfig(**{**CFG.__dict__, "num_workers": workers})
    got = list(neat_vlm_graph(source, processor, config=cfg))
    assert same_item(without_meta(got), without_meta(expected))


def test_s3_parquet_gives_the_local_batches(
    uploaded: str, options: Any, processor: Any, expected: Any
) -> None:
    source = ParquetSource(
        [f"{uploaded}/part-0.parquet", f"{uploaded}/part-1.parquet"], storage_options=options
    )
    assert len(source) == N
    cfg = NeatVLMConfig(**{**CFG.__dict__, "num_workers": 2})
    got = list(neat_vlm_graph(source, processor, config=cfg))
    assert same_item(without_meta(got), without_meta(expected))


def test_graph_takes_an_s3_glob_with_the_endpoint_from_the_environment(
    uploaded: str, endpoint: str, processor: Any, expected: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    got = list(neat_vlm_graph(f"{uploaded}/shard-*.tar", processor, config=CFG))
    assert same_item(without_meta(got), without_meta(expected))


@pytest.mark.parametrize("kind", ["tar", "parquet"])
def test_resume_over_s3_shards_is_exactly_once(
    kind: str, uploaded: str, options: Any, processor: Any
) -> None:
    pattern = f"{uploaded}/shard-*.tar" if kind == "tar" else f"{uploaded}/part-*.parquet"
    source: Any = (TarShardSource if kind == "tar" else ParquetSource)(
        pattern, storage_options=options
    )
    assert_resume_is_exactly_once(source, processor)


def test_tar_index_is_cached_by_etag(
    s3: Any, samples: Any, options: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (path,) = write_tars(tmp_path, samples[:4], per=4)
    s3.put_file(str(path), f"{BUCKET}/cached/a.tar")
    url = f"s3://{BUCKET}/cached/a.tar"
    first = TarShardSource(url, cache_dir=tmp_path / "cache", storage_options=options)
    assert len(list((tmp_path / "cache").glob("tar-index-*.npz"))) == 1

    def no_scan(*a: Any) -> Any:
        raise AssertionError("rescanned")

    monkeypatch.setattr(S, "index_tar", no_scan)
    again = TarShardSource(url, cache_dir=tmp_path / "cache", storage_options=options)
    assert again.content_fingerprint() == first.content_fingerprint()
    assert again.raw(1)["messages"] == first.raw(1)["messages"]
    monkeypatch.undo()
    (path,) = write_tars(tmp_path, samples[:3], per=4)  # the object changes: new ETag
    s3.put_file(str(path), f"{BUCKET}/cached/a.tar")
    changed = TarShardSource(url, cache_dir=tmp_path / "cache", storage_options=options)
    assert len(changed) == 3
    assert changed.content_fingerprint() != first.content_fingerprint()


def test_a_failed_read_is_retried_then_reported_for_that_sample(
    uploaded: str, options: Any, processor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = TarShardSource(f"{uploaded}/shard-*.tar", storage_options={**options},
                            retries=2)  # fmt: skip
    source._store.backoff = 0.01
    fs = source._store.fs
    real = fs.cat_file
    calls: list[str] = []

    def flaky(path: str, *a: Any, **k: Any) -> Any:
        calls.append(path)
        if len(calls) <= 2:
            raise ConnectionResetError("connection reset by peer")
        return real(path, *a, **k)

    monkeypatch.setattr(fs, "cat_file", flaky)
    assert source[0]["conversation"][0]["role"] == "user"  # two failures, then read
    assert len(calls) >= 3

    def down(path: str, *a: Any, **k: Any) -> Any:
        raise TimeoutError("read timed out")

    monkeypatch.setattr(fs, "cat_file", down)
    with pytest.raises(RemoteReadError, match=r"sample_id=5 .*failed 3 times.*TimeoutError"):
        source[5]
    # Through the graph: the loader's policy counts the unreadable samples, named.
    monkeypatch.setattr(fs, "cat_file", real)
    index = build_length_index(  # planned while the store answered
        source, LengthEstimator.from_processor(processor, mode="exact"), progress=False
    )
    monkeypatch.setattr(fs, "cat_file", down)
    monkeypatch.setattr(fs, "cat_ranges", lambda *a, **k: [OSError("down")] * len(a[0]))
    cfg = NeatVLMConfig(**{**CFG.__dict__, "on_bad_sample": "skip"})
    loader = neat_vlm_graph(source, processor, config=cfg, lengths=index)
    batches = list(loader)
    assert batch_ids(batches) == []
    assert sorted(loader.ledgers[0].failed) == list(range(N))


def _tar(records: dict[str, dict[str, Any]], extra: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        members = {f"{k}.json": json.dumps(v).encode() for k, v in records.items()}
        for name, body in {**members, **(extra or {})}.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def test_poisoned_media_references_are_refused_naming_the_sample(
    s3: Any, samples: Any, options: Any, endpoint: str, processor: Any
) -> None:
    png = png_bytes(random.Random(1))
    s3.pipe_file(f"{BUCKET}/set2/imgs/a.png", png)
    s3.chmod(f"{BUCKET}/set2/imgs/a.png", "public-read")  # for the plain http GET below
    s3.pipe_file("other-bucket/a.png", png)

    def rec(ref: str) -> dict[str, Any]:
        return {**trl(samples[0] | {"images": [png]}), "images": [ref]}

    web = f"{endpoint}/{BUCKET}/set2/imgs/a.png"  # moto serves objects over plain http too
    refs = {
        "ok": "imgs/a.png",
        "ok-url": f"s3://{BUCKET}/set2/imgs/a.png",
        "other-bucket": "s3://other-bucket/a.png",
        "climbs-out": "../../other-bucket/a.png",
        "metadata": "http://169.254.169.254/latest/meta-data/iam/a.png",
        "local-file": "/etc/passwd",
        "web": web,
        "other-protocol": "gs://neat-data/a.png",
    }
    s3.pipe_file(f"{BUCKET}/set2/poison.tar", _tar({k: rec(v) for k, v in refs.items()}))
    source = TarShardSource(f"s3://{BUCKET}/set2/poison.tar", storage_options=options)
    keys = list(refs)
    for k in ("ok", "ok-url"):
        img = source[keys.index(k)]["conversation"][0]["content"][0]["image"]
        assert img.size == Image.open(io.BytesIO(png)).size
        assert img.load() is not None
    for k in ("other-bucket", "climbs-out", "metadata", "local-file", "web", "other-protocol"):
        with pytest.raises(MediaRefusedError, match=rf"sample_id={keys.index(k)} "):
            source[keys.index(k)]
    with pytest.raises(MediaRefusedError, match="not in allow_hosts"):
        source[keys.index("web")]
    allowed = TarShardSource(f"s3://{BUCKET}/set2/poison.tar", storage_options=options,
                             allow_hosts=["127.0.0.1", "169.254.169.254"])  # fmt: skip
    img = allowed[keys.index("web")]["conversation"][0]["content"][0]["image"]
    assert img.load() is not None  # fetched over http from the listed host
    with pytest.raises(MediaRefusedError, match="metadata / link-local"):
        allowed[keys.index("metadata")]
    # Through the graph with on_bad_sample="skip": the poisoned ones are counted, not read.
    cfg = NeatVLMConfig(pack_size=384, batch_size=1, shuffle=False, on_bad_sample="skip")
    loader = neat_vlm_graph(source, processor, config=cfg)
    got = batch_ids(list(loader))
    assert sorted(got) == [0, 1]
    assert sorted(loader.ledgers[0].failed) == list(range(2, len(refs)))


def test_readme_object_storage_example_runs(
    s3: Any, endpoint: str, samples: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Your data in object storage", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    for p in write_tars(tmp_path, samples):
        s3.put_file(str(p), f"my-bucket/set1/{p.name}")
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(compile(code.group(1), "README-object-storage", "exec"), scope)
    assert scope["batch"]["input_ids"].shape[0] == 1
    assert len(scope["source"]) == N
    assert len(list((tmp_path / "cache").glob("tar-index-*.npz"))) == 3


def test_an_allowed_web_host_cannot_redirect_the_read(s3: Any, options: Any, samples: Any) -> None:
    import http.server
    import threading

    hits: list[str] = []

    class Target(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *a: Any) -> None:
            pass

    target = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Target)
    where = f"http://localhost:{target.server_address[1]}/latest/meta-data.png"

    class Redirect(Target):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", where)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

    redirect = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    for server in (target, redirect):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ref = f"http://127.0.0.1:{redirect.server_address[1]}/a.png"
        rec = {**trl(samples[0] | {"images": [b""]}), "images": [ref]}
        s3.pipe_file(f"{BUCKET}/set3/r.tar", _tar({"r": rec}))
        source = TarShardSource(f"s3://{BUCKET}/set3/r.tar", storage_options=options,
                                allow_hosts=["127.0.0.1"])  # fmt: skip
        with pytest.raises(S.RecordError, match="sample_id=0"):
            source[0]
        assert hits == []  # the redirect was not followed
    finally:
        for server in (target, redirect):
            server.shutdown()


def test_sources_pickle_without_live_clients_or_handles(uploaded: str, options: Any) -> None:
    import pickle

    tar = TarShardSource(f"{uploaded}/shard-*.tar", storage_options=options)
    parquet = ParquetSource(f"{uploaded}/part-*.parquet", storage_options=options)
    tar.prefetch([0, 1])
    assert parquet[1]["conversation"]
    assert tar._store._fs is not None
    assert parquet._files  # open in this process
    for source in (tar, parquet):
        clone = pickle.loads(pickle.dumps(source))  # what a worker receives
        assert clone._store._fs is None  # the worker makes its own client
        assert getattr(clone, "_files", {}) == {}
        assert getattr(clone, "_prefetched", {}) == {}
        assert clone.raw(1)["messages"] == source.raw(1)["messages"]


def test_index_build_reads_the_json_members_in_batches(
    uploaded: str, options: Any, processor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = TarShardSource(f"{uploaded}/shard-*.tar", storage_options=options)
    fs = source._store.fs
    single: list[tuple[str, int, int]] = []
    batches: list[int] = []
    real_cat, real_ranges = fs.cat_file, fs.cat_ranges

    def cat_file(path: str, start: Any = None, end: Any = None, **k: Any) -> Any:
        single.append((path, start, end))
        return real_cat(path, start=start, end=end, **k)

    def cat_ranges(paths: list[str], starts: Any, ends: Any, **k: Any) -> Any:
        batches.append(len(paths))
        return real_ranges(paths, starts, ends, **k)

    monkeypatch.setattr(fs, "cat_file", cat_file)
    monkeypatch.setattr(fs, "cat_ranges", cat_ranges)
    est = LengthEstimator.from_processor(processor, mode="estimate")
    index = build_length_index(source, est, progress=False)
    assert batches == [4, 4, 2]  # one concurrent read per shard's .json members
    text_only = {  # the .json of samples without pictures: planned from the batch alone
        (source._store._path(source.paths[source.index.shard_of(i)]), *m["json"])
        for i, (_, m) in enumerate(source.index)
        if len(m) == 1
    }
    assert len(text_only) == 4
    assert not {(p, a, b - a) for p, a, b in single} & text_only  # none read alone
    assert single  # samples with pictures: their headers (and record) read by source[id]
    assert (index.total > 0).all()


def test_missing_and_unreachable_shards_are_named(uploaded: str, options: Any) -> None:
    with pytest.raises(S.ShardIndexError, match=r"tar shard 's3://neat-data/set1/nope.tar' does"):
        TarShardSource(f"{uploaded}/nope.tar", storage_options=options)
    with pytest.raises(S.ShardIndexError, match="no Parquet shards match"):
        ParquetSource(f"{uploaded}/nope-*.parquet", storage_options=options)
    closed = {**options, "endpoint_url": f"http://127.0.0.1:{free_port()}",
              "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}  # fmt: skip
    with pytest.raises(S.ShardIndexError, match=r"cannot be listed: .*failed 2 times"):
        TarShardSource(f"{uploaded}/shard-*.tar", storage_options=closed, retries=1)
