"""The tar offset index in flat arrays (pipes/reading/tar_index.py): same samples as ``index_tar``,
an ``.npz`` round trip without pickle, a torn cache file rebuilt."""

from __future__ import annotations

import doctest
import random
from pathlib import Path

import numpy as np
import pytest
from support.shard_records import WORDS, png_bytes, write_tars

from neatpack.pipes import tar_index
from neatpack.pipes.reading.npz_files import MappedArray, write_npz
from neatpack.pipes.reading.shards import TarShardSource, index_tar
from neatpack.pipes.reading.tar_index import TarIndex


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
    assert isinstance(mapped.first_offsets, MappedArray)
    assert meta["fingerprint"] == "f"
    assert list(mapped) == listed
    assert mapped.unit == 512
    assert mapped.first_offsets.dtype == mapped.sizes.dtype == np.uint32
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
    """10,000 samples of a .json and a .jpg member: 18 bytes a sample with consecutive numbered
    keys (member position, first offset, two sizes and two extension codes), 18 + 9 with keys
    that are not (position and tail of the key), was 88."""
    samples = [(f"{i:06d}", {"json": (2048 * i + 512, 300), "jpg": (2048 * i + 1536, 500)})
               for i in range(10_000)]  # fmt: skip
    index = TarIndex.from_samples(samples)
    assert list(index) == samples
    assert index.nbytes / len(index) < 18.1
    named = [(f"k{i * 7:06d}", m) for i, (_, m) in enumerate(samples)]  # gaps: not a run
    index = TarIndex.from_samples(named)
    assert list(index) == named
    assert index.nbytes / len(index) < 27.1  # + its position (4) and 5-digit tail ("k0" kept once)


def test_members_not_where_the_previous_one_ends_are_listed() -> None:
    """A member after a long name's extra header (or a skipped entry) is not 512 bytes after
    the previous one's padded data: its offset is kept apart, and read back exactly."""
    samples = [("000000", {"json": (512, 10), "jpg": (1536, 600)}),  # follows: 512 + 512 + 512
               ("000001", {"json": (3584, 10), "jpg": (5120, 5)}),  # a 1024-byte header
               ("000002", {"jpg": (6144, 5), "json": (7168, 3)})]  # fmt: skip
    index = TarIndex.from_samples(samples)
    assert list(index) == samples
    assert index.moved_ids.tolist() == [3]
    parts = TarIndex.concat([index, TarIndex.from_samples(samples)])
    assert list(parts) == samples + samples
    assert parts.moved_ids.tolist() == [3, 9]


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
    assert isinstance(first.index.first_offsets, MappedArray)  # the whole index, mapped
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
