"""Real gloo process groups: checkpoint k steps, kill the ranks, resume on the same or another
world size (and worker count), and prove with the ledgers that every sample of every epoch is
consumed exactly once, and that same-size resume gives the uninterrupted run's batches."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.testing.resume import assert_exactly_once
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

NUM_SAMPLES = 40
EPOCHS = 2
_SHARED: dict[str, Any] = {}  # loaded once in the parent, inherited by the forked ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _digest(batch: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for key in ("input_ids", "labels", "position_ids"):
        h.update(batch[key].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _config(root: Path, workers: int) -> NeatVLMConfig:
    return NeatVLMConfig(
        pack_size=1024,
        batch_size=1,
        media_root=str(root / "media"),
        num_workers=workers,
        cache_dir=str(root / "cache"),
        tail="drop",
        prefetch=1,
    )


def _rank_main(
    phase: str,
    rank: int,
    world: int,
    port: int,
    root: Path,
    workers: int,
    steps: int,
    old_world: int,
) -> None:
    os.setpgrp()  # so the parent can kill this rank together with its worker processes
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        loader = neat_vlm_graph(
            root / "data.jsonl", _SHARED["processor"], config=_config(root, workers)
        )
        out: dict[str, Any] = {"batches": [], "ledgers": {}}
        if phase == "resume":
            state = torch.load(root / f"state_{rank % old_world}.pt", weights_only=True)
            loader.load_state_dict(state)
        epochs = EPOCHS - loader.epoch
        for _ in range(epochs):
            for step, batch in enumerate(loader):
                out["batches"].append(
                    (loader.epoch, [m["sample_ids"] for m in batch["packs"]], _digest(batch))
                )
                if phase == "first" and step + 1 == steps:
                    torch.save(loader.state_dict(), root / f"state_{rank}.pt.tmp")
                    os.replace(root / f"state_{rank}.pt.tmp", root / f"state_{rank}.pt")
                    out["ledgers"] = {e: vars(x) for e, x in loader.ledgers.items()}
                    torch.save(out, root / f"{phase}_{rank}.pt")
                    dist.barrier()
                    time.sleep(600)  # the parent SIGKILLs us here: a crash, not a clean exit
        out["ledgers"] = {e: vars(x) for e, x in loader.ledgers.items()}
        torch.save(out, root / f"{phase}_{rank}.pt")
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(
    phase: str, world: int, root: Path, *, workers: int = 0, steps: int = 0, old_world: int = 0
) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(phase, r, world, port, root, workers, steps, old_world)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.time() + 300
    outputs = [root / f"{phase}_{r}.pt" for r in range(world)]
    while time.time() < deadline:
        if all(o.exists() for o in outputs) and (
            phase == "first" or all(not p.is_alive() for p in procs)
        ):
            break
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            break
        time.sleep(0.2)
    if phase == "first":
        time.sleep(0.5)
        for p in procs:
            if p.is_alive():
                os.killpg(p.pid, signal.SIGKILL)  # kill the ranks and their workers mid-run
    for p in procs:
        p.join(timeout=30)
    codes = [p.exitcode for p in procs]
    if phase != "first":
        assert codes == [0] * world, f"{phase}: rank exit codes {codes}"
    return [torch.load(o, weights_only=False) for o in outputs]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    write_corpus(root, num_samples=NUM_SAMPLES, seed=3)
    _SHARED["processor"] = load_tiny_processor()
    # Build the length index once; every run below reuses the cache.
    neat_vlm_graph(root / "data.jsonl", _SHARED["processor"], config=_config(root, 0))
    return root


def _fresh(corpus: Path, tmp_path: Path) -> Path:
    root = tmp_path / "run"
    root.mkdir()
    (root / "media").symlink_to(corpus / "media")
    (root / "data.jsonl").symlink_to(corpus / "data.jsonl")
    (root / "cache").symlink_to(corpus / "cache")
    return root


def _consumed(outputs: list[dict[str, Any]], epoch: int, key: str = "consumed") -> list[int]:
    return [i for o in outputs for i in o["ledgers"].get(epoch, {}).get(key, [])]


@pytest.mark.parametrize(
    ("world", "new_world", "workers", "new_workers"),
    [(2, 2, 0, 1), (4, 4, 1, 2), (4, 2, 0, 0), (2, 3, 1, 0)],
)
def test_kill_and_resume_is_exactly_once(
    corpus: Path, tmp_path: Path, world: int, new_world: int, workers: int, new_workers: int
) -> None:
    root = _fresh(corpus, tmp_path)
    reference = _run("reference", world, root, workers=workers) if world == new_world else None
    first = _run("first", world, root, workers=workers, steps=2)
    resumed = _run("resume", new_world, root, workers=new_workers, old_world=world)
    counts = {len(o["batches"]) for o in resumed}
    assert len(counts) == 1, f"ranks yielded different numbers of batches: {counts}"
    for epoch in range(EPOCHS):
        consumed = _consumed(first, epoch) + _consumed(resumed, epoch)
        # the tail is cut by the layout that finishes the epoch: the resumed ranks'
        excused = _consumed(resumed, epoch, "tail_dropped")
        assert_exactly_once(consumed, range(NUM_SAMPLES), excused=excused)
    if reference is not None:
        for rank in range(world):
            ref = reference[rank]["batches"]
            got = first[rank]["batches"][:2] + resumed[rank]["batches"]
            assert got == ref, f"rank {rank}: resumed batches differ from the uninterrupted run"
