"""The tar offset index in flat arrays (pipes/reading/tar_index.py): same samples as ``index_tar``,
an ``.npz`` round trip without pickle, a torn cache file rebuilt."""

from __future__ import annotations

import doctest
import random
from pathlib import Path

import pytest
from support.shard_records import WORDS, png_bytes, write_tars

from neatpack.pipes import tar_index
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
    index.save(tmp_path / "i.npz")
    assert list(TarIndex.load(tmp_path / "i.npz")) == listed


def test_a_torn_cache_is_rebuilt(shards: list[Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = TarShardSource(shards, cache_dir=cache)
    files = sorted(cache.glob("tar-index-*.npz"))
    assert len(files) == 2
    files[0].write_bytes(files[0].read_bytes()[:100])  # torn
    with pytest.raises(ValueError, match="unreadable"):
        TarIndex.load(files[0])
    again = TarShardSource(shards, cache_dir=cache)
    assert [again.raw(i)["messages"] for i in range(7)] == [
        first.raw(i)["messages"] for i in range(7)
    ]
    rebuilt = TarIndex.load(files[0]).keys.tolist()  # the rebuild rewrote it
    assert rebuilt in ([f"{i:06d}" for i in range(4)], [f"{i:06d}" for i in range(4, 7)])


def test_inconsistent_arrays_are_refused() -> None:
    import numpy as np

    with pytest.raises(ValueError, match="inconsistent tar index"):
        TarIndex(np.array(["a"]), np.array([0]), np.array([]), np.array([]), np.array([]))


def test_doctests_pass() -> None:
    assert doctest.testmod(tar_index).failed == 0
