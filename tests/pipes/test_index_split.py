"""The index build split over real gloo ranks (spawned, 127.0.0.1): each rank estimates whole
shards, the parts are all-gathered on a CPU gloo side group (never the default group), and
every rank ends with the single-process index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.gloo_ranks import gloo_group, run_ranks, save_report
from support.shard_records import N, shard_samples, write_tars
from support.spies import spy

from neatpack.pipes import index_split
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.index_split import split_points
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.reading.shards import TarShardSource
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.mark.parametrize(
    ("n", "parts", "bounds", "want"),
    [
        (10, 2, [0, 4, 8], [0, 4, 10]),
        (10, 2, [0, 3, 6, 9], [0, 6, 10]),
        (10, 3, None, [0, 3, 6, 10]),
        (10, 4, [0, 8], [0, 0, 8, 8, 10]),  # fewer shards than parts: empty parts
        (0, 2, [], [0, 0, 0]),
    ],
)
def test_split_points_cut_at_the_nearest_shard_start(
    n: int, parts: int, bounds: Any, want: list[int]
) -> None:
    assert split_points(n, parts, bounds) == want


def test_split_points_always_partition() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, parts = int(rng.integers(0, 50)), int(rng.integers(1, 6))
        bounds = sorted(set(rng.integers(0, n + 1, size=int(rng.integers(0, 8))).tolist()))
        cuts = split_points(n, parts, bounds)
        assert len(cuts) == parts + 1
        assert (cuts[0], cuts[-1]) == (0, n)
        assert cuts == sorted(cuts)
        assert all(c in {0, n, *bounds} for c in cuts) or not bounds


def _rank(rank: int, world: int, port: int, root: str) -> None:
    from neatpack.pipes import lengths, shards

    with gloo_group(rank, world, port) as dist:
        groups = spy(dist, "all_gather_object", lambda out, obj, group=None: group)
        sliced = spy(
            lengths,
            "_estimate_parallel",
            lambda src, est, parts, *a, **kw: [(p.lo, p.hi) for p in parts],
        )
        scanned = spy(shards, "index_tar", lambda path, *a: Path(path).name)
        paths = sorted(Path(root).glob("*.tar"))
        source = TarShardSource(paths, rank=rank, world_size=world)
        est = LengthEstimator.from_processor(load_tiny_processor(), mode="exact")
        index = build_length_index(source, est, progress=False, rank=rank, world_size=world)
        again = build_length_index(source, est, progress=False, rank=rank, world_size=world)
        report = {
            "total": index.total.tolist(),
            "again": again.total.tolist(),
            "slices": sliced,
            "scanned": scanned,
            "samples": [source.raw(i)["messages"] for i in range(len(source))],
            "gathers": len(groups),
            "default_group_used": any(g is None or g is dist.group.WORLD for g in groups),
            "backends": sorted({dist.get_backend(g) for g in groups if g is not None}),
            "one_side_group": len({id(g) for g in groups}) == 1,
        }
        save_report(root, rank, report)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_index_builds_split_whole_shards_over_gloo_ranks_on_a_side_group(tmp_path: Path) -> None:
    write_tars(tmp_path, shard_samples(), per=3)  # shards start at 0, 3, 6, 9
    source = TarShardSource(sorted(tmp_path.glob("*.tar")))
    est = LengthEstimator.from_processor(load_tiny_processor(), mode="exact")
    single = build_length_index(source, est, progress=False).total.tolist()

    reports = run_ranks(_rank, 2, tmp_path)
    for r, rep in enumerate(reports):
        assert rep["total"] == single  # the whole index on each rank
        assert rep["again"] == single
        # whole shards, split by records: 5 moved to 6
        assert rep["slices"] == [[[[0, 3], [3, 6]], [[6, 9], [9, 10]]][r]] * 2
        assert (
            rep["scanned"]
            == [["shard-000.tar", "shard-001.tar"], ["shard-002.tar", "shard-003.tar"]][r]
        )
        assert rep["samples"] == [source.raw(i)["messages"] for i in range(N)]
        assert rep["gathers"] == 5  # the offset index once, the length index twice two
        assert not rep["default_group_used"]
        assert rep["backends"] == ["gloo"]
        assert rep["one_side_group"]


def test_a_non_gloo_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="backend 'nccl'; pass a gloo group"):
        index_split.side_group(object())


def test_doctests_pass() -> None:
    import doctest

    assert doctest.testmod(index_split).attempted >= 2
    assert doctest.testmod(index_split).failed == 0
