"""Soak: real gloo ranks (forked processes) train for several epochs while the parent SIGKILLs
them at a random step and restarts them elastically (world size 2 -> 3 -> 1 -> 2, worker
count 0 / 1 / 2) from the last checkpoint every rank completed. The loader ledgers of the
checkpoint chain must show every sample consumed exactly once per epoch (``tail="drop"``:
the tail dropped by the layout that finished the epoch is excused).

Each rank saves ``{state, ledgers}`` atomically after every step, then joins a barrier (as a
data-parallel trainer steps in lock-step); a checkpoint step counts when all ranks saved it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.testing.resume import assert_exactly_once
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

pytestmark = [pytest.mark.faults, pytest.mark.distributed]
_SHARED: dict[str, Any] = {}  # the processor, loaded once in the parent, inherited by forks


@dataclass(frozen=True)
class Phase:
    world: int
    workers: int
    kill_after: int | None  # steps of this phase before the SIGKILL; None: run to the end


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(root: Path, workers: int) -> NeatVLMConfig:
    return NeatVLMConfig(
        pack_size=1024, media_root=str(root / "media"), cache_dir=str(root / "cache"),
        tail="drop", overlong="drop", num_workers=workers, prefetch=1, seed=7,
    )  # fmt: skip


def _rank(root: Path, p: int, rank: int, world: int, port: int, workers: int,
          resume: Path | None, epochs: int, kill_after: int | None) -> None:  # fmt: skip
    os.setpgrp()  # the parent kills this rank and its worker processes together
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    loader = neat_vlm_graph(root / "data.jsonl", _SHARED["processor"],
                            config=_config(root, workers), rank=rank, world_size=world)  # fmt: skip
    step = 0
    if resume is not None:
        saved = torch.load(resume / f"rank{rank % _ranks_in(resume)}.pt", weights_only=True)
        loader.load_state_dict(saved["state"])
        step = int(saved["step"])
    out = root / f"phase{p}"
    taken = 0  # steps of this phase
    while loader.epoch < epochs:
        for _batch in loader:
            step += 1
            taken += 1
            ckpt = out / f"step{step:05d}"
            ckpt.mkdir(parents=True, exist_ok=True)
            record = {"state": loader.state_dict(), "step": step,
                      "ledgers": {e: vars(x) for e, x in loader.ledgers.items()}}  # fmt: skip
            torch.save(record, ckpt / f".rank{rank}.tmp")
            os.replace(ckpt / f".rank{rank}.tmp", ckpt / f"rank{rank}.pt")
            dist.barrier()
            if taken == kill_after:  # wait for the SIGKILL here: a fast phase must not finish
                time.sleep(600)  # between two polls of the parent and dodge its kill
    final = {"ledgers": {e: vars(x) for e, x in loader.ledgers.items()}, "step": step}
    torch.save(final, out / f".done{rank}.tmp")
    os.replace(out / f".done{rank}.tmp", out / f"done{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _ranks_in(ckpt: Path) -> int:
    return len(list(ckpt.glob("rank*.pt")))


def _complete(phase_dir: Path, world: int) -> list[Path]:
    steps = sorted(phase_dir.glob("step*")) if phase_dir.exists() else []
    return [s for s in steps if all((s / f"rank{r}.pt").exists() for r in range(world))]


def _run_phase(root: Path, p: int, phase: Phase, resume: Path | None, epochs: int) -> bool:
    """Run one phase; True when it finished every epoch (not killed)."""
    ctx = mp.get_context("fork")
    port = _free_port()
    rest = (phase.workers, resume, epochs, phase.kill_after)
    procs = [
        ctx.Process(target=_rank, args=(root, p, r, phase.world, port, *rest))
        for r in range(phase.world)
    ]
    for proc in procs:
        proc.start()
    out = root / f"phase{p}"
    deadline = time.monotonic() + 300
    done = False
    while time.monotonic() < deadline:
        if all((out / f"done{r}.pt").exists() for r in range(phase.world)):
            done = True
            break
        if any(proc.exitcode not in (None, 0) for proc in procs):
            break
        if phase.kill_after is not None and len(_complete(out, phase.world)) >= phase.kill_after:
            break
        time.sleep(0.05)
    if not done:
        for proc in procs:
            if proc.is_alive():
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.join(30)
    codes = [proc.exitcode for proc in procs]
    if done:
        assert codes == [0] * phase.world, f"phase {p}: exit codes {codes}"
    else:
        assert all(c == -signal.SIGKILL for c in codes), f"phase {p} died on its own: {codes}"
    return done


def soak(root: Path, *, num_samples: int, epochs: int, phases: list[Phase]) -> dict[str, Any]:
    write_corpus(root, num_samples=num_samples, seed=11)
    _SHARED["processor"] = _SHARED.get("processor") or load_tiny_processor()
    neat_vlm_graph(root / "data.jsonl", _SHARED["processor"], config=_config(root, 0))  # cache
    chain: list[tuple[int, Path]] = []  # (phase, checkpoint or done folder) whose ledgers count
    resume: Path | None = None
    kills = 0
    for p, phase in enumerate(phases):
        finished = _run_phase(root, p, phase, resume, epochs)
        out = root / f"phase{p}"
        if finished:
            chain.append((phase.world, out))
            break
        kills += 1
        complete = _complete(out, phase.world)
        if complete:  # else: killed before its first checkpoint; resume where it resumed
            resume = complete[-1]
            chain.append((phase.world, resume))
    else:
        raise AssertionError("the last phase must run to the end (kill_after=None)")
    totals = {}
    for epoch in range(epochs):
        consumed: list[int] = []
        excused: list[int] = []
        for world, folder in chain:
            names = [f"done{r}.pt" if folder.name.startswith("phase") else f"rank{r}.pt"
                     for r in range(world)]  # fmt: skip
            ledgers = [torch.load(folder / n, weights_only=True)["ledgers"] for n in names]
            ep = [led[epoch] for led in ledgers if epoch in led]
            consumed += [i for led in ep for i in led["consumed"]]
            if ep:  # the layout that reached this epoch last decides its dropped tail
                excused = [i for led in ep for key in ("tail_dropped", "overlong")
                           for i in led[key]]  # fmt: skip
            assert not [i for led in ep for i in led["padded"] + led["failed"]]
        assert_exactly_once(consumed, range(num_samples), excused=excused)
        totals[epoch] = {"consumed": len(consumed), "excused": len(set(excused))}
    return {"kills": kills, "chain": [(w, f.parent.name, f.name) for w, f in chain],
            "epochs": totals}  # fmt: skip


@pytest.mark.timeout(300)
def test_soak_quick(tmp_path: Path) -> None:
    result = soak(tmp_path, num_samples=24, epochs=2, phases=[
        Phase(world=2, workers=0, kill_after=3),
        Phase(world=3, workers=1, kill_after=2),
        Phase(world=2, workers=2, kill_after=None),
    ])  # fmt: skip
    print(f"soak_quick: {result}")
    assert result["kills"] == 2


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_long(tmp_path: Path) -> None:
    rng = random.Random(2026)
    worlds = [2, 3, 1, 2] + [rng.choice([1, 2, 3]) for _ in range(10)]
    phases = [Phase(world=w, workers=rng.choice([0, 1, 2]), kill_after=rng.randint(1, 8))
              for w in worlds[:-1]]  # fmt: skip
    phases.append(Phase(world=worlds[-1], workers=rng.choice([0, 1, 2]), kill_after=None))
    started = time.monotonic()
    result = soak(tmp_path, num_samples=160, epochs=6, phases=phases)
    print(f"soak_long: {result} in {time.monotonic() - started:.0f} s")
    assert result["kills"] >= 10
