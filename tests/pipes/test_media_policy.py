"""Media references of shard records confined to the dataset's location
(pipes/reading/media_policy.py):
the pure rule on each kind of poisoned reference, and local tar / Parquet shards refusing them
through ``source[id]`` and the graph's ``on_bad_sample`` policy."""

from __future__ import annotations

import io
import json
import os
import random
import tarfile
from pathlib import Path
from typing import Any

import pytest
from support.shard_records import png_bytes, trl

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes import media_policy
from neatpack.pipes.reading.media_policy import MediaRefusedError, confine_media_ref
from neatpack.pipes.reading.shards import ParquetSource, TarShardSource
from neatpack.pipes.testing.tiny import load_tiny_processor

BASE = "s3://bucket/set1"


@pytest.mark.parametrize(
    ("ref", "want"),
    [
        ("imgs/a.jpg", "s3://bucket/set1/imgs/a.jpg"),
        ("./imgs/../b.jpg", "s3://bucket/set1/b.jpg"),
        ("s3://bucket/set1/x/c.jpg", "s3://bucket/set1/x/c.jpg"),
        ("data:image/png;base64,AAAA", "data:image/png;base64,AAAA"),
    ],
)
def test_references_inside_the_dataset_are_kept(ref: str, want: str) -> None:
    assert confine_media_ref(ref, base=BASE, where="sample_id=1") == want


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("s3://other/a.jpg", "outside this dataset's location"),
        ("s3://bucket/set10/a.jpg", "outside this dataset's location"),  # a prefix, not a dir
        ("s3://bucket/set1/../set2/a.jpg", "outside this dataset's location"),
        ("../set2/a.jpg", "climbs out"),
        ("/etc/passwd", "a local path"),
        ("file:///etc/passwd", "outside this dataset's location"),
        ("gs://bucket/set1/a.jpg", "outside this dataset's location"),
        ("http://169.254.169.254/latest/meta-data/", "metadata / link-local"),
        ("http://[fe80::1]/a.jpg", "metadata / link-local"),
        ("http://metadata.google.internal/x", "metadata / link-local"),
        ("https://example.com/a.jpg", "not in allow_hosts=\\[\\]"),
    ],
)
def test_poisoned_references_are_refused_naming_the_sample(ref: str, why: str) -> None:
    with pytest.raises(MediaRefusedError, match=rf"^sample_id=7: .*{why}"):
        confine_media_ref(ref, base=BASE, where="sample_id=7")


def test_web_hosts_only_when_listed_and_never_metadata() -> None:
    ok = confine_media_ref("https://cdn.example.com/a.jpg", base=BASE, where="s",
                           allow_hosts=["CDN.example.com"])  # fmt: skip
    assert ok == "https://cdn.example.com/a.jpg"
    with pytest.raises(MediaRefusedError, match="not in allow_hosts"):
        confine_media_ref("https://evil.com/a.jpg", base=BASE, where="s", allow_hosts=["cdn.x"])
    with pytest.raises(MediaRefusedError, match="refused always"):
        confine_media_ref("http://169.254.169.254/a", base=BASE, where="s",
                          allow_hosts=["169.254.169.254"])  # fmt: skip


# Spellings of the metadata address that resolvers and HTTP clients accept (issue 25).
METADATA_ALIASES = [
    "2852039166",  # decimal
    "0xa9fea9fe",  # hex
    "0251.0376.0251.0376",  # octal parts
    "169.254.43518",  # inet_aton's short form
    "0xa9.0xfe.0xa9.0xfe",
    "[::ffff:169.254.169.254]",  # IPv4-mapped IPv6
    "[::ffff:a9fe:a9fe]",
    "[64:ff9b::a9fe:a9fe]",  # NAT64
    "metadata.google.internal.",  # trailing dot
    "METADATA.",
    "169.254.169.254.",
    "[fd00:ec2:0::254]",
    "1684301000",  # 100.100.100.200 (Alibaba Cloud) in decimal
]


@pytest.mark.parametrize("host", METADATA_ALIASES)
def test_metadata_aliases_are_refused_even_when_listed(host: str) -> None:
    listed = [host, host.strip("[]"), host.rstrip(".")]
    with pytest.raises(MediaRefusedError, match="refused always"):
        confine_media_ref(f"http://{host}/latest/meta-data/", base=BASE, where="s",
                          allow_hosts=listed)  # fmt: skip


@pytest.mark.parametrize(
    "host", ["cdn.example.com", "93.184.216.34", "0x5db8d822", "[2001:db8::1]"]
)
def test_listed_ordinary_hosts_still_pass(host: str) -> None:
    url = f"https://{host}/a.jpg"
    assert confine_media_ref(url, base=BASE, where="s", allow_hosts=[host.strip("[]")]) == url


def _write_tar(path: Path, records: dict[str, dict[str, Any]]) -> None:
    with tarfile.open(path, "w") as tf:
        for key, rec in records.items():
            body = json.dumps(rec).encode()
            info = tarfile.TarInfo(f"{key}.json")
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))


@pytest.fixture
def poisoned(tmp_path: Path) -> tuple[Path, list[str]]:
    """A local tar shard in ``data/`` whose records name media inside and outside it."""
    data = tmp_path / "data"
    (data / "imgs").mkdir(parents=True)
    png = png_bytes(random.Random(2))
    (data / "imgs" / "a.png").write_bytes(png)
    (tmp_path / "secret.png").write_bytes(png)
    os.symlink(tmp_path / "secret.png", data / "imgs" / "link.png")
    refs = {"inside": "imgs/a.png", "absolute-inside": str(data / "imgs" / "a.png"),
            "outside": str(tmp_path / "secret.png"), "climbs": "../secret.png",
            "symlink-out": "imgs/link.png", "metadata": "http://169.254.169.254/a.png",
            "web": "https://example.com/a.png"}  # fmt: skip
    base = trl({"q": "what is it", "a": "a cat", "images": [png]})
    _write_tar(data / "s.tar", {k: {**base, "images": [v]} for k, v in refs.items()})
    return data / "s.tar", list(refs)


def test_local_shard_media_are_confined_to_the_shard_directory(poisoned: Any) -> None:
    path, keys = poisoned
    source = TarShardSource(path)
    for k in ("inside", "absolute-inside"):
        block = source[keys.index(k)]["conversation"][0]["content"][0]
        assert block["image"] == str(path.parent / "imgs" / "a.png")
    for k in ("outside", "climbs", "symlink-out", "metadata", "web"):
        with pytest.raises(MediaRefusedError, match=rf"^sample_id={keys.index(k)} \("):
            source[keys.index(k)]


def test_a_media_root_is_the_base_when_given(poisoned: Any) -> None:
    path, keys = poisoned
    source = TarShardSource(path, media_root=path.parent.parent)  # tmp_path: secret.png inside
    assert source[keys.index("outside")]["conversation"][0]["content"][0]["image"].endswith(
        "secret.png"
    )
    with pytest.raises(MediaRefusedError, match="metadata"):
        source[keys.index("metadata")]


@pytest.mark.timeout(60)
def test_tar_shard_refuses_listed_metadata_aliases(tmp_path: Path) -> None:
    """Through the user's source: every alias listed in ``allow_hosts`` is refused by name
    before any connection is tried."""
    png = png_bytes(random.Random(3))
    base = trl({"q": "what is it", "a": "a cat", "images": [png]})
    urls = [f"http://{h}/latest/meta-data/a.png" for h in METADATA_ALIASES]
    _write_tar(tmp_path / "s.tar", {f"k{i}": {**base, "images": [u]} for i, u in enumerate(urls)})
    hosts = [h.strip("[]") for h in METADATA_ALIASES]
    source = TarShardSource(tmp_path / "s.tar", allow_hosts=hosts)
    for i in range(len(urls)):
        with pytest.raises(MediaRefusedError, match=rf"^sample_id={i} .*refused always"):
            source[i]


def test_parquet_rows_are_confined_too(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rec = trl({"q": "q", "a": "a", "images": [b""]})
    rows = [{"messages": json.dumps(rec["messages"]), "image": ref}
            for ref in ("a.png", "/etc/passwd")]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    source = ParquetSource(tmp_path / "p.parquet")
    assert source.raw(0)["image"] == str(tmp_path / "a.png")
    with pytest.raises(MediaRefusedError, match=r"sample_id=1 .*'/etc/passwd'"):
        source.raw(1)


def test_graph_counts_poisoned_records_under_skip(poisoned: Any) -> None:
    path, keys = poisoned
    cfg = NeatVLMConfig(pack_size=384, batch_size=1, shuffle=False, on_bad_sample="skip")
    loader = neat_vlm_graph(TarShardSource(path), load_tiny_processor(), config=cfg)
    got = [i for b in loader for row in b["sample_ids"] for i in row]
    assert sorted(got) == [0, 1]
    assert sorted(loader.ledgers[0].failed) == list(range(2, len(keys)))


def test_doctests_pass() -> None:
    import doctest

    assert doctest.testmod(media_policy).failed == 0


def test_only_media_references_are_confined() -> None:
    from neatpack.pipes.reading.media_policy import confine_record_media

    block = {"type": "image_url", "image_url": {"url": "https://evil.example/x.png"}}
    row: dict[str, Any] = {
        "url": "https://origin.example/page",  # provenance columns: neither read nor refused
        "meta": {"path": "/orig/x.jpg"},
        "messages": [{"role": "user", "content": [block, {"type": "text", "text": "/etc/x"}]}],
    }
    kw: dict[str, Any] = {"base": BASE, "where": "sample_id=2", "allow_hosts": (), "load": str}
    with pytest.raises(MediaRefusedError, match=r"sample_id=2: .*evil.example"):
        confine_record_media(row, **kw)
    block["image_url"]["url"] = "imgs/x.png"
    out = confine_record_media(row, **kw)
    assert out["messages"][0]["content"][0]["image_url"]["url"] == f"{BASE}/imgs/x.png"
    assert block["image_url"]["url"] == "imgs/x.png"  # copy on write: the input is unchanged
    assert out["meta"] is row["meta"]
    row["messages"] = []
    assert confine_record_media(row, **kw) is row  # nothing to confine: the same object


@pytest.mark.parametrize("kind", ["tar", "parquet"])
def test_reading_records_leaves_no_reference_cycles(kind: str, tmp_path: Path) -> None:
    """The length index reads every record with the collector paused: a cycle per record
    (a self-recursive closure, say) is memory that grows with the corpus (13 GB at 10M)."""
    import gc
    import types

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rec = {**trl({"q": "q", "a": "a", "images": [b""]}), "images": ["imgs/a.png"]}
    if kind == "tar":
        _write_tar(tmp_path / "s.tar", {"a": rec})
        source: Any = TarShardSource(tmp_path / "s.tar")
    else:
        row = {"messages": json.dumps(rec["messages"]), "images": rec["images"]}
        pq.write_table(pa.Table.from_pylist([row]), tmp_path / "p.parquet")
        source = ParquetSource(tmp_path / "p.parquet")
    assert str(tmp_path / "imgs" / "a.png") in json.dumps(source.raw(0))
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the collector finds, to see whose it is
    gc.disable()
    try:
        for _ in range(200):
            source.raw(0)
        gc.collect()
        # neatpack's own functions in cycles (a self-recursive closure leaves one per read);
        # other threads of the test process (an s3fs/botocore event loop left by an earlier
        # test) make garbage of their own meanwhile, which is not counted
        ours = [
            o for o in gc.garbage
            if isinstance(o, types.FunctionType) and o.__module__.startswith("neatpack")
        ]  # fmt: skip
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not ours, ours[:3]
