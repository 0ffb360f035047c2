"""The tar offset index in flat arrays (pipes/reading/tar_index.py): same samples as ``index_tar``,
an ``.npz`` round trip without pickle, a torn cache file rebuilt; layout 3 (regular shards'
extensions once, offsets derived from checkpoints) for any listing, real tars and layout-2
files."""

from __future__ import annotations

import doctest
import io
import json
import pickle
import random
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.shard_records import CFG, WORDS, canonical, png_bytes, trl, without_meta, write_tars

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes import tar_index
from neatpack.pipes.reading.npz_files import MappedArray, checksum, write_npz
from neatpack.pipes.reading.shards import TarShardSource, index_tar
from neatpack.pipes.reading.tar_index import TarIndex
from neatpack.pipes.testing.resume import same_item
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    rng = random.Random(3)
    samples = [{"q": " ".join(rng.choices(WORDS, k=4)), "a": "ok",
                "images": [png_bytes(rng) for _ in range(i % 3)]} for i in range(7)]  # fmt: skip
    return write_tars(tmp_path, samples, per=4)


def test_index_holds_what_index_tar_lists(shards: list[Path], tmp_path: Path) -> None:
    listed = index_tar(str(shards[0]))
    index = TarIndex.from_samples(listed)
    assert list(index) == listed
    index.save(tmp_path / "i.npz", {"fingerprint": "f"})
    mapped, meta = TarIndex.load(tmp_path / "i.npz")
    assert isinstance(mapped.checkpoints, MappedArray)
    assert meta["fingerprint"] == "f"
    assert list(mapped) == listed
    assert mapped.unit == 512
    assert mapped.checkpoints.dtype == mapped.sizes.dtype == np.uint32
    both = TarIndex.concat([index, TarIndex.from_samples(index_tar(str(shards[1])))])
    assert list(both) == listed + index_tar(str(shards[1]))
    assert [both.shard_of(i) for i in range(len(both))] == [0] * 4 + [1] * 3


def test_an_index_of_the_earlier_layout_loads_the_same(shards: list[Path], tmp_path: Path) -> None:
    """The arrays the reader before the compact layout wrote (numpy strings, int64)."""
    listed = index_tar(str(shards[0]))
    members = [(e, o, s) for _, m in listed for e, (o, s) in m.items()]
    write_npz(
        tmp_path / "old.npz", keys=np.array([k for k, _ in listed], dtype=str),
        starts=np.cumsum([0, *(len(m) for _, m in listed)]).astype(np.int64),
        exts=np.array([e for e, _, _ in members], dtype=str),
        offsets=np.array([o for _, o, _ in members], np.int64),
        sizes=np.array([s for _, _, s in members], np.int64),
    )  # fmt: skip
    old, meta = TarIndex.load(tmp_path / "old.npz")
    assert meta == {}
    assert list(old) == listed


def test_bytes_a_sample() -> None:
    """10,000 samples of a .json and a .jpg member: 8.06 bytes a sample with consecutive
    numbered keys (two sizes, a 4-byte checkpoint every 64 samples; the extensions once a
    shard), 8.06 + 9 with keys that are not (position and tail of the key); layout 2 held 18
    (member position, first offset, two extension codes), the first layout 88."""
    samples = [(f"{i:06d}", {"json": (2048 * i + 512, 300), "jpg": (2048 * i + 1536, 500)})
               for i in range(10_000)]  # fmt: skip
    index = TarIndex.from_samples(samples)
    assert list(index) == samples
    assert index.members_each.tolist() == [2]
    assert index.moved_ids.tolist() == []
    assert index.nbytes / len(index) < 8.1
    named = [(f"k{i * 7:06d}", m) for i, (_, m) in enumerate(samples)]  # gaps: not a run
    index = TarIndex.from_samples(named)
    assert list(index) == named
    assert index.nbytes / len(index) < 17.1  # + its position (4) and 5-digit tail ("k0" kept once)


def test_members_not_where_the_previous_one_ends_are_listed() -> None:
    """A member after a long name's extra header (or a skipped entry) is not 512 bytes after
    the previous one's padded data (of its sample or, for a first member, of the sample
    before): its offset is kept apart, and read back exactly."""
    samples = [("000000", {"json": (512, 10), "jpg": (1536, 600)}),  # follows: 512 + 512 + 512
               ("000001", {"json": (3584, 10), "jpg": (5120, 5)}),  # a 1024-byte header
               ("000002", {"jpg": (6144, 5), "json": (7168, 3)})]  # fmt: skip
    index = TarIndex.from_samples(samples)
    assert list(index) == samples
    assert index.moved_ids.tolist() == [2, 3]  # 3584 is not 1536 + 1024 + 512; 5120 ...
    parts = TarIndex.concat([index, TarIndex.from_samples(samples)])
    assert list(parts) == samples + samples
    assert parts.moved_ids.tolist() == [2, 3, 8, 9]


def test_a_corrupt_index_file_is_refused(shards: list[Path], tmp_path: Path) -> None:
    TarIndex.from_samples(index_tar(str(shards[0]))).save(tmp_path / "i.npz")
    body = bytearray((tmp_path / "i.npz").read_bytes())
    body[body.index(b"\n", body.index(b"sizes.npy")) + 2] ^= 0x01  # a size, past its header
    (tmp_path / "i.npz").write_bytes(bytes(body))
    with pytest.raises(ValueError, match="checksum"):
        TarIndex.load(tmp_path / "i.npz")


def test_a_torn_cache_is_rebuilt(shards: list[Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = TarShardSource(shards, cache_dir=cache)
    files = sorted(cache.glob("tar-index-*.npz"))
    assert len(files) == 2
    (whole,) = cache.glob("tar-set-*.npz")
    assert isinstance(first.index.checkpoints, MappedArray)  # the whole index, mapped
    want = [first.raw(i)["messages"] for i in range(7)]
    listed = list(first.index)
    torn = whole.with_name("torn")  # a new file over the name: ``first`` keeps its pages
    torn.write_bytes(whole.read_bytes()[:300])
    torn.replace(whole)  # torn: assembled again from the shards' files
    again = TarShardSource(shards, cache_dir=cache)
    assert [again.raw(i)["messages"] for i in range(7)] == want
    assert list(TarIndex.load(whole)[0]) == listed == list(first.index)
    files[0].write_bytes(files[0].read_bytes()[:100])  # torn
    with pytest.raises(ValueError, match="unreadable"):
        TarIndex.load(files[0])
    whole.unlink()
    again = TarShardSource(shards, cache_dir=cache)
    assert [again.raw(i)["messages"] for i in range(7)] == want
    rebuilt = [k for k, _ in TarIndex.load(files[0])[0]]  # the rebuild rewrote it
    assert rebuilt in ([f"{i:06d}" for i in range(4)], [f"{i:06d}" for i in range(4, 7)])


def test_inconsistent_arrays_are_refused() -> None:
    good = TarIndex.from_samples([("a", {"json": (512, 3)})]).arrays
    with pytest.raises(ValueError, match="inconsistent tar index"):
        TarIndex({**good, "sizes": np.zeros(2, np.uint32)}, 512)
    with pytest.raises(ValueError, match="inconsistent tar index"):
        TarIndex(good, 7)


def test_doctests_pass() -> None:
    assert doctest.testmod(tar_index).failed == 0


# -- layout 3: regular shards, derived offsets, layout 2 converted -------------------------------

Listing = list[tuple[str, dict[str, tuple[int, int]]]]


def write_layout2(path: Path, shards: list[Listing], meta: dict[str, Any]) -> None:
    """A cache file as layout 2 wrote it (a member position and first offset a sample, an
    extension code a member, later members' moved offsets), keys kept as bytes."""
    samples = [s for shard in shards for s in shard]
    members = [(e, o, n) for _, m in samples for e, (o, n) in m.items()]
    vocab = sorted({e for e, _, _ in members})
    starts = np.cumsum([0, *(len(m) for _, m in samples)])
    firsts = np.asarray([next(iter(m.values()))[0] if m else 0 for _, m in samples], np.int64)
    unit = 512 if not (firsts % 512).any() else 1
    later = [j for i in range(len(samples)) for j in range(starts[i] + 1, starts[i + 1])]
    moved = [j for j in later if members[j][1] != members[j - 1][1]
             + -(-members[j - 1][2] // 512) * 512 + 512]  # fmt: skip
    tails = [k.encode() for k, _ in samples]
    arrays = {
        "shard_starts": np.cumsum([0, *(len(s) for s in shards)]).astype(np.int64),
        "prefixes": np.asarray([""] * len(shards), dtype=str),
        "key_first": np.full(len(shards), -1, np.int64),
        "key_width": np.zeros(len(shards), np.int64),
        "key_at": np.cumsum([0, *(len(s) for s in shards)])[:-1].astype(np.int64),
        "key_starts": np.cumsum([0, *(len(t) for t in tails)]).astype(np.uint32),
        "keys": np.frombuffer(b"".join(tails), np.uint8),
        "member_starts": starts.astype(np.uint32),
        "first_offsets": (firsts // unit).astype(np.uint32),
        "exts": np.asarray(vocab, dtype=str),
        "ext_codes": np.asarray([vocab.index(e) for e, _, _ in members], np.uint8),
        "sizes": np.asarray([n for _, _, n in members], np.uint32),
        "moved_ids": np.asarray(moved, np.int64),
        "moved_offsets": np.asarray([members[j][1] for j in moved], np.int64),
    }
    info = {"layout": 2, "unit": unit, **meta}
    body = json.dumps({**info, "checksum": checksum(arrays, info)}).encode()
    write_npz(path, meta=np.frombuffer(body, np.uint8), **arrays)


@st.composite
def shard_listings(draw: Any) -> Listing:
    """One shard's ``index_tar`` list: numbered or free keys; every sample with the same
    extensions (regular) or each its own (some none); members one 512-byte header after the
    previous one's padded data, or moved (a long name's extra headers, a skipped entry), the
    offsets block-aligned or not (unit 512 or 1)."""
    n = draw(st.integers(0, 150))
    numbered = draw(st.booleans())
    keys = [f"p/{draw(st.integers(0, 99)) + i:05d}" for i in range(n)] if numbered else [
        draw(st.text("ab/0é", min_size=1, max_size=6)) for _ in range(n)]  # fmt: skip
    exts = st.lists(st.sampled_from(["json", "jpg", "0.png", "txt", "cls"]), unique=True,
                    max_size=3)  # fmt: skip
    pattern = draw(exts) if draw(st.booleans()) else None
    aligned = draw(st.booleans())
    cursor, out = 0, []
    for key in keys:
        members = {}
        for ext in pattern if pattern is not None else draw(exts):
            size = draw(st.integers(0, 3000))
            header = 512 * draw(st.sampled_from([1, 1, 1, 1, 3]))  # 3: a PAX/GNU long name
            cursor += header if aligned else header + draw(st.integers(0, 7))
            members[ext] = (cursor, size)
            cursor += -(-size // 512) * 512
        out.append((key, members))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(st.lists(shard_listings(), max_size=4))
def test_any_listing_round_trips(tmp_path: Path, shards: list[Listing]) -> None:
    """from_samples, concat (flat and nested), save/load (mapped) and layout 2 converted all
    give every sample's ``(key, members)`` back, members in their order."""
    want = [s for shard in shards for s in shard]
    parts = [TarIndex.from_samples(shard) for shard in shards]
    for shard, part in zip(shards, parts, strict=True):
        assert [(k, list(m.items())) for k, m in part] == [(k, list(m.items())) for k, m in shard]
    whole = TarIndex.concat(parts)
    assert [(k, list(m.items())) for k, m in whole] == [(k, list(m.items())) for k, m in want]
    half = len(parts) // 2
    nested = TarIndex.concat([TarIndex.concat(parts[:half]), TarIndex.concat(parts[half:])])
    assert list(nested) == want
    whole.save(tmp_path / "w.npz", {"fingerprint": "f"})
    mapped, meta = TarIndex.load(tmp_path / "w.npz")
    assert meta["layout"] == 3
    assert list(mapped) == want
    assert list(TarIndex.concat([mapped, whole])) == want + want
    write_layout2(tmp_path / "l2.npz", shards, {"fingerprint": "f"})
    converted, meta = TarIndex.load(tmp_path / "l2.npz")
    assert meta["layout"] == 2
    assert [(k, list(m.items())) for k, m in converted] == [
        (k, list(m.items())) for k, m in want]  # fmt: skip


def _tar(path: Path, entries: list[tuple[str, bytes]], fmt: int) -> None:
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, body in entries:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))


def test_real_tars_read_the_same_through_the_source_and_the_graph(tmp_path: Path) -> None:
    """Two shards written by ``tarfile``: a regular one (a .json and a .0.png a sample, over
    64 samples, one key a path of 110 characters: a GNU long-name header before it) and one
    in PAX format whose sample 66 lacks its image (irregular, a long name too). The index
    gives what ``index_tar`` lists, the source the records written, the graph the batches
    of the same records in memory; layout 3 holds the regular shard's extensions once."""
    rng = random.Random(5)
    samples = [{"q": " ".join(rng.choices(WORDS, k=3)), "a": "ok",
                "images": [] if i == 166 else [png_bytes(rng)]} for i in range(170)]  # fmt: skip
    paths = []
    for k, (lo, hi, fmt) in enumerate([(0, 100, tarfile.GNU_FORMAT),
                                       (100, 170, tarfile.PAX_FORMAT)]):  # fmt: skip
        entries = []
        for i in range(lo, hi):
            key = f"{'d' * 110}/{i:06d}" if i in (40, 130) else f"{i:06d}"
            entries.append((f"{key}.json", json.dumps(trl(samples[i])).encode()))
            entries += [(f"{key}.0.png", b) for b in samples[i]["images"]]
        paths.append(tmp_path / f"shard-{k:03d}.tar")
        _tar(paths[-1], entries, fmt)
    listed = [index_tar(str(p)) for p in paths]
    assert len(listed[0][40][0]) > 100
    source = TarShardSource(paths, cache_dir=tmp_path / "cache")
    assert isinstance(source.index.checkpoints, MappedArray)
    assert source.index.members_each.tolist() == [2, -1]
    assert len(source.index.moved_ids) >= 2  # the long names' first members
    assert list(source.index) == listed[0] + listed[1]
    sent = pickle.dumps(source.index)  # to a spawned worker: the file's place, not its arrays
    assert len(sent) < 8_000
    assert list(pickle.loads(sent)) == listed[0] + listed[1]
    assert [source.raw(i)["messages"] for i in range(170)] == [
        trl(s)["messages"] for s in samples]  # fmt: skip
    processor = load_tiny_processor()
    want = list(neat_vlm_graph([canonical(s) for s in samples], processor, config=CFG))
    cached = NeatVLMConfig(**{f: getattr(CFG, f) for f in ("pack_size", "batch_size", "shuffle",
                              "estimate_mode")}, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    got = list(neat_vlm_graph(str(tmp_path / "shard-*.tar"), processor, config=cached))
    assert same_item(without_meta(got), without_meta(want))


def test_layout2_files_load_and_are_rewritten_once(
    shards: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache of layout 2 (each shard's file and the whole set's): read, never rescanned,
    rewritten in layout 3 (the set mapped again), the same records."""
    from neatpack.pipes.reading import shards as shards_module

    cache = tmp_path / "cache"
    first = TarShardSource(shards, cache_dir=cache)
    want = [first.raw(i)["messages"] for i in range(len(first))]
    listed = [index_tar(str(p)) for p in shards]
    files = sorted(cache.glob("tar-*.npz"))
    assert len(files) == 3
    for f in files:
        meta = {k: v for k, v in TarIndex.read_meta(f).items()
                if k not in ("layout", "unit", "checksum")}  # fmt: skip
        whole = f.name.startswith("tar-set-")
        mine = listed if whole else [index_tar(meta["path"])]
        write_layout2(f, mine, meta)
        assert TarIndex.read_meta(f)["layout"] == 2

    def no_scan(path: str, *a: Any) -> Any:
        raise AssertionError(f"rescanned {path}")

    monkeypatch.setattr(shards_module, "index_tar", no_scan)
    again = TarShardSource(shards, cache_dir=cache)
    assert [again.raw(i)["messages"] for i in range(len(again))] == want
    assert list(again.index) == listed[0] + listed[1]
    assert isinstance(again.index.checkpoints, MappedArray)
    assert sorted(cache.glob("tar-*.npz")) == files
    assert all(TarIndex.read_meta(f)["layout"] == 3 for f in files)
