"""A stream on real gloo ranks: 2 ranks checkpoint and are killed, 3 ranks resume from every
rank's state and are killed in turn, 2 ranks finish the epoch and run the next: the union of
the ledgers holds every sample of each epoch exactly once, and the ranks of each run take the
same number of steps (a rank that runs dry repeats its last pack until all are dry)."""

from __future__ import annotations

import itertools
import json
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

from neatpack.graphs import NeatStreamConfig, neat_stream_graph
from neatpack.pipes.reading.stream import ListStream, sample_id
from neatpack.pipes.testing.resume import assert_exactly_once
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

NUM_SAMPLES = 40
CUTS = (0, 3, 9, 14, 22, 27, 33, 40)  # 7 shards of uneven sizes: ranks run dry apart
_SHARED: dict[str, Any] = {}  # made once in the parent, inherited by the forked ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(phase: str, rank: int, world: int, port: int, root: Path, workers: int,
               steps: int, resume_from: str | None, old_world: int) -> None:  # fmt: skip
    os.setpgrp()  # so the parent can kill this rank together with its worker processes
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        cfg = NeatStreamConfig(
            pack_size=1024, batch_size=1, buffer_size=5, media_root=str(root / "media"),
            num_workers=workers, prefetch=1,
        )  # fmt: skip
        loader = neat_stream_graph(_SHARED["stream"], _SHARED["processor"], config=cfg)
        if resume_from is not None:
            states = [
                torch.load(root / f"{resume_from}_state_{r}.pt", weights_only=True)
                for r in range(old_world)
            ]
            loader.load_state_dict(states)
        out: dict[str, Any] = {"steps": {}, "ledgers": {}}
        while loader.epoch < 2:
            epoch = loader.epoch
            for step, _batch in enumerate(loader, 1):
                out["steps"][epoch] = out["steps"].get(epoch, 0) + 1
                if step == steps and resume_from != "middle":
                    torch.save(loader.state_dict(), root / f"{phase}_state_{rank}.pt")
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


def _run(phase: str, world: int, root: Path, *, workers: int, steps: int = 0,
         resume_from: str | None = None, old_world: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    ctx = mp.get_context("fork")
    port = _free_port()
    args = (world, port, root, workers, steps, resume_from, old_world)
    procs = [ctx.Process(target=_rank_main, args=(phase, r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    killed = steps > 0
    outputs = [root / f"{phase}_{r}.pt" for r in range(world)]
    deadline = time.time() + 300
    while time.time() < deadline:
        done = all(o.exists() for o in outputs)
        if done and (killed or all(not p.is_alive() for p in procs)):
            break
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    if killed:
        time.sleep(0.5)
        for p in procs:
            if p.is_alive():
                os.killpg(p.pid, signal.SIGKILL)  # kill the ranks and their workers mid-run
    for p in procs:
        p.join(timeout=30)
    if not killed:
        assert [p.exitcode for p in procs] == [0] * world
    return [torch.load(o, weights_only=False) for o in outputs]


def _consumed(outputs: list[dict[str, Any]], epoch: int) -> list[int]:
    return [i for o in outputs for i in o["ledgers"].get(epoch, {}).get("consumed", [])]


def test_two_three_two_ranks_deliver_every_sample_once(tmp_path: Path) -> None:
    write_corpus(tmp_path, num_samples=NUM_SAMPLES, seed=11)
    rows = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    _SHARED["stream"] = ListStream([rows[a:b] for a, b in itertools.pairwise(CUTS)])
    _SHARED["processor"] = load_tiny_processor()
    everything = [sample_id(s, p) for s in range(len(CUTS) - 1)
                  for p in range(CUTS[s + 1] - CUTS[s])]  # fmt: skip

    first = _run("first", 2, tmp_path, workers=0, steps=3)
    middle = _run("middle", 3, tmp_path, workers=1, steps=3, resume_from="first", old_world=2)
    last = _run("last", 2, tmp_path, workers=0, resume_from="middle", old_world=3)

    assert_exactly_once(_consumed(first, 0) + _consumed(middle, 0) + _consumed(last, 0),
                        everything)  # fmt: skip
    assert_exactly_once(_consumed(last, 1), everything)
    for run in (first, middle, last):  # the ranks of a run step together
        per_epoch = {e: {o["steps"].get(e) for o in run} for e in (0, 1)}
        assert all(len(v) == 1 for v in per_epoch.values()), f"uneven steps: {per_epoch}"
