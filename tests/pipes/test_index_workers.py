"""The length index on several processes: forked (a script needs no ``__main__`` guard), the
same index as one process, and the graph's ``index_workers`` option."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from neatpack.pipes.indexing.index_workers import (
    MIN_RECORDS_PER_WORKER,
    index_start_method,
    index_workers,
)


def _corpus(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            text = "word " * (5 + i % 50)
            turns = [{"role": "user", "content": text}, {"role": "assistant", "content": text}]
            f.write(json.dumps({"id": i, "messages": turns}) + "\n")
    return path


@pytest.mark.timeout(300)
def test_a_script_without_main_guard_builds_the_index_on_worker_processes(
    tmp_path: Path,
) -> None:
    """A plain script (no ``if __name__ == "__main__"``) that asks for index workers. With
    spawned workers every child re-ran the script and the build died ("An attempt has been
    made to start a new process before the current process has finished its bootstrapping
    phase", then BrokenProcessPool); forked workers just run the slices."""
    data = _corpus(tmp_path / "d.jsonl", 2 * MIN_RECORDS_PER_WORKER + 100)
    script = tmp_path / "build.py"
    script.write_text(textwrap.dedent(f"""
        from neatpack.pipes.indexing.estimate import LengthEstimator
        from neatpack.pipes.indexing.lengths import build_length_index
        from neatpack.pipes.reading.read import JsonlSource
        from neatpack.pipes.testing.tiny import load_tiny_processor
        src = JsonlSource({str(data)!r})
        est = LengthEstimator.from_processor(load_tiny_processor("qwen2_vl"), mode="estimate")
        one = build_length_index(src, est, progress=False)
        two = build_length_index(src, est, progress=False, num_workers=2)
        same = bool((one.total == two.total).all()), one.fingerprint == two.fingerprint
        print(len(two.total), *same)
        """))  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=280, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(2 * MIN_RECORDS_PER_WORKER + 100), "True", "True"]


def test_start_method_and_worker_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEATPACK_INDEX_START", raising=False)
    assert index_start_method() == "fork"  # Linux
    assert index_workers(2 * MIN_RECORDS_PER_WORKER - 1, cpus=8) == 0  # too few to pay
    assert index_workers(10**6, cpus=8) == 8
    assert index_workers(10**6, cpus=1) == 0
    assert index_start_method("spawn") == "spawn"
    # spawned workers re-import torch: not worth it by default
    assert index_workers(10**6, cpus=8, start_method="spawn") == 0
    with pytest.raises(ValueError, match=r"index_start_method='telepathy' is not one of \('fork'"):
        index_start_method("telepathy")


def test_a_bad_start_method_is_refused_at_construction_listing_the_choices() -> None:
    from neatpack.graphs import GroupedConfig, NeatVLMConfig

    for config in (NeatVLMConfig, GroupedConfig):
        with pytest.raises(ValueError, match=r"index_start_method='telepathy'\): not one of"):
            config(index_start_method="telepathy")  # type: ignore[arg-type]


def test_the_retired_variable_is_an_error_naming_the_config_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``NEATPACK_INDEX_START`` is no longer read: a job that still sets it (to start the index
    build without fork) is told the field that replaced it, instead of silently forking."""
    from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
    from neatpack.pipes.testing.tiny import load_tiny_processor

    data = _corpus(tmp_path / "d.jsonl", 40)
    proc = load_tiny_processor("qwen2_vl")
    cfg = NeatVLMConfig(pack_size=1024, prefetch=0)
    monkeypatch.setenv("NEATPACK_INDEX_START", "spawn")
    with pytest.raises(RuntimeError, match="NEATPACK_INDEX_START='spawn' is no longer read") as e:
        neat_vlm_graph(data, proc, config=cfg)
    assert "index_start_method (NeatVLMConfig, GroupedConfig" in str(e.value)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mixture", [False, True])
def test_a_spawn_started_index_build_through_the_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mixture: bool
) -> None:
    """``index_start_method="spawn"`` reaches the index build's pool (of the data, or of each
    source of a mixture): 2 spawned processes build the index (a process that must not fork),
    and the graph plans the same packs as with the index built in this process."""
    import concurrent.futures

    from neatpack.graphs import NeatVLMConfig, neat_vlm_parts
    from neatpack.pipes import Mixture, MixtureSource
    from neatpack.pipes.testing.tiny import load_tiny_processor

    started: list[tuple[int, str]] = []
    real_pool = concurrent.futures.ProcessPoolExecutor

    def spy(workers: int, **kw: Any) -> concurrent.futures.ProcessPoolExecutor:
        started.append((workers, kw["mp_context"].get_start_method()))
        return real_pool(workers, **kw)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", spy)
    data: Any = _corpus(tmp_path / "d.jsonl", 2 * MIN_RECORDS_PER_WORKER + 100)
    proc = load_tiny_processor("qwen2_vl")
    kw: dict[str, Any] = {"pack_size": 1024, "estimate_mode": "estimate", "prefetch": 0}
    if mixture:
        kw["mixture"] = Mixture(sources=[MixtureSource(name="a", data=str(data), weight=1.0)])
        data = None
    spawned = neat_vlm_parts(
        data, proc, config=NeatVLMConfig(**kw, index_workers=2, index_start_method="spawn")
    )
    assert started == [(2, "spawn")]
    here = neat_vlm_parts(data, proc, config=NeatVLMConfig(**kw, index_workers=0))
    assert started == [(2, "spawn")]  # no pool
    assert spawned.config == here.config  # same index fingerprint, same checkpoint key
    a, b = spawned.source.plan_for(1), here.source.plan_for(1)
    assert len(a) == len(b) > 0
    assert [a.pack(k) for k in range(len(a))] == [b.pack(k) for k in range(len(b))]


def test_a_grouped_graph_that_must_not_fork_builds_its_index_without_fork(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grouped graph sizes its index pool itself (one per core once the slice pays); with
    ``index_start_method="spawn"`` it starts none (spawned ones cost more than they save), so
    nothing forks, where the default forks two here (2 cores)."""
    import concurrent.futures

    from neatpack.graphs import GroupedConfig, grouped_vlm_graph
    from neatpack.pipes import index_workers as mod
    from neatpack.pipes.testing.tiny import load_tiny_processor

    pools: list[str] = []
    real_pool = concurrent.futures.ProcessPoolExecutor

    def spy(workers: int, **kw: Any) -> concurrent.futures.ProcessPoolExecutor:
        pools.append(kw["mp_context"].get_start_method())
        return real_pool(workers, **kw)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", spy)
    monkeypatch.setattr(mod, "_cpus", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    data = _corpus(tmp_path / "d.jsonl", 2 * MIN_RECORDS_PER_WORKER + 100)
    proc = load_tiny_processor("qwen2_vl")
    spawned = grouped_vlm_graph(data, proc, config=GroupedConfig(index_start_method="spawn"))
    assert pools == []
    forked = grouped_vlm_graph(data, proc, config=GroupedConfig())
    assert pools == ["fork"]
    assert len(spawned) == len(forked)


def test_cores_are_shared_among_the_ranks_of_a_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun starts LOCAL_WORLD_SIZE ranks per machine, each building its own slice: each
    takes its share of the cores, not all of them (8 ranks x 16 workers on 16 cores)."""
    from neatpack.pipes import index_workers as mod

    monkeypatch.setattr(mod, "_cpus", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert index_workers(10**6) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert index_workers(10**6) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert index_workers(10**6) == 0  # one core per rank: the rank's own process
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert index_workers(10**6) == 16


def test_the_default_build_uses_a_pool_once_the_slice_pays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``num_workers=None`` (the graphs' default) sizes the pool from this rank's records:
    a pool for a large slice, none for a small one; the same index either way."""
    import concurrent.futures

    from neatpack.pipes import index_workers as mod
    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.indexing.lengths import build_length_index
    from neatpack.pipes.reading.read import JsonlSource
    from neatpack.pipes.testing.tiny import load_tiny_processor

    pools: list[int] = []
    real_pool = concurrent.futures.ProcessPoolExecutor

    def spy(workers: int, **kw: object) -> concurrent.futures.ProcessPoolExecutor:
        pools.append(workers)
        return real_pool(workers, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", spy)
    monkeypatch.setattr(mod, "_cpus", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    src = JsonlSource(_corpus(tmp_path / "d.jsonl", 2 * MIN_RECORDS_PER_WORKER + 10))
    est = LengthEstimator.from_processor(load_tiny_processor("qwen2_vl"), mode="estimate")
    auto = build_length_index(src, est, progress=False, num_workers=None)
    assert pools == [2]
    one = build_length_index(src, est, progress=False, num_workers=0)
    assert pools == [2]
    assert (auto.total == one.total).all()
    assert auto.fingerprint == one.fingerprint
    small = JsonlSource(_corpus(tmp_path / "s.jsonl", 500))
    build_length_index(small, est, progress=False, num_workers=None)
    assert pools == [2]  # 500 records: this process


def test_graph_index_workers_option(tmp_path: Path) -> None:
    from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
    from neatpack.pipes.testing.tiny import load_tiny_processor

    with pytest.raises(ValueError, match="index_workers=-1"):
        NeatVLMConfig(pack_size=1024, index_workers=-1)
    data = _corpus(tmp_path / "d.jsonl", 40)
    proc = load_tiny_processor("qwen2_vl")
    got = []
    for workers in (0, None, 2):  # 40 records: None and 2 both run in this process
        cfg = NeatVLMConfig(pack_size=1024, index_workers=workers, prefetch=0)
        loader = neat_vlm_graph(data, proc, config=cfg)
        got.append([p["sample_ids"] for b in loader for p in b["packs"]])
    assert got[0] == got[1] == got[2]


def test_the_worked_examples_run_as_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    import doctest

    from neatpack.pipes.compat import retired_env
    from neatpack.pipes.indexing import index_workers as mod
    from neatpack.pipes.materializing import transfer

    for name in retired_env.RETIRED_ENV:
        monkeypatch.delenv(name, raising=False)
    results = [doctest.testmod(m) for m in (retired_env, mod, transfer)]
    assert all(r.failed == 0 for r in results), results
    assert sum(r.attempted for r in results) >= 10
