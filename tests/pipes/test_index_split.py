"""The index build split over real gloo ranks (spawned, 127.0.0.1): each rank estimates whole
shards, the parts are all-gathered on a CPU gloo side group (never the default group), and
every rank ends with the single-process index."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.shard_records import WORDS, N, png_bytes, write_tars

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from neatpack.pipes import lengths, shards

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        groups: list[Any] = []
        real_gather = dist.all_gather_object

        def spy_gather(out: Any, obj: Any, group: Any = None) -> None:
            groups.append(group)
            real_gather(out, obj, group=group)

        sliced: list[list[tuple[int, int]]] = []
        real_parallel = lengths._estimate_parallel

        def spy_parallel(source: Any, est: Any, pieces: Any, *a: Any, **kw: Any) -> Any:
            sliced.append([(p.lo, p.hi) for p in pieces])
            return real_parallel(source, est, pieces, *a, **kw)

        scanned: list[str] = []
        real_scan = shards.index_tar

        def spy_scan(path: str, *a: Any) -> Any:
            scanned.append(Path(path).name)
            return real_scan(path, *a)

        dist.all_gather_object = spy_gather  # type: ignore[assignment]
        lengths._estimate_parallel = spy_parallel  # type: ignore[assignment]
        shards.index_tar = spy_scan  # type: ignore[assignment]
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
        Path(root, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_index_builds_split_whole_shards_over_gloo_ranks_on_a_side_group(tmp_path: Path) -> None:
    import random

    rng = random.Random(8)
    samples = [{"q": " ".join(rng.choices(WORDS, k=rng.randint(3, 8))),
                "a": " ".join(rng.choices(WORDS, k=rng.randint(2, 8))),
                "images": [png_bytes(rng) for _ in range(i % 3)]} for i in range(N)]  # fmt: skip
    write_tars(tmp_path, samples, per=3)  # shards start at 0, 3, 6, 9
    source = TarShardSource(sorted(tmp_path.glob("*.tar")))
    est = LengthEstimator.from_processor(load_tiny_processor(), mode="exact")
    single = build_length_index(source, est, progress=False).total.tolist()

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
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
