"""A mixture on real gloo process groups: 2 ranks checkpoint mid-epoch and are killed, 3 ranks
resume; the ledgers prove every use of every source in each epoch consumed exactly once."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.mixtures.mixture import Mixture, MixtureSource, epoch_counts
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

NAMES = ("caption", "ocr", "charts")
SIZES = (16, 10, 3)
EPOCHS = 2
_SHARED: dict[str, Any] = {}  # loaded once in the parent, inherited by the forked ranks


def _mixture(root: Path) -> Mixture:
    return Mixture(
        sources=[
            MixtureSource(
                name=n, data=root / n / "data.jsonl", media_root=str(root / n / "media"), weight=w
            )
            for n, w in zip(NAMES, (0.5, 0.25, 0.25), strict=True)
        ]
    )


def _config(root: Path) -> NeatVLMConfig:
    return NeatVLMConfig(pack_size=1024, cache_dir=str(root / "cache"), tail="drop", prefetch=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(phase: str, rank: int, world: int, port: int, root: Path, old_world: int) -> None:
    os.setpgrp()  # so the parent can kill this rank with anything it started
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        loader = neat_vlm_graph(_mixture(root), _SHARED["processor"], config=_config(root))
        if phase == "resume":
            loader.load_state_dict(
                torch.load(root / f"state_{rank % old_world}.pt", weights_only=True)
            )
        out: dict[str, Any] = {"ledgers": {}}
        for _ in range(EPOCHS - loader.epoch):
            for step, batch in enumerate(loader):
                assert batch["doc_sources"].shape[0] == 1
                if phase == "first" and step + 1 == 2:
                    torch.save(loader.state_dict(), root / f"state_{rank}.pt")
                    out["ledgers"] = {e: vars(x) for e, x in loader.ledgers.items()}
                    torch.save(out, root / f"{phase}_{rank}.pt")
                    dist.barrier()
                    time.sleep(600)  # the parent SIGKILLs us here: a crash
        out["ledgers"] = {e: vars(x) for e, x in loader.ledgers.items()}
        torch.save(out, root / f"{phase}_{rank}.pt")
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(phase: str, world: int, root: Path, old_world: int = 0) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(phase, r, world, port, root, old_world))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outputs = [root / f"{phase}_{r}.pt" for r in range(world)]
    deadline = time.time() + 300
    while time.time() < deadline:
        done = all(o.exists() for o in outputs)
        if done and (phase == "first" or all(not p.is_alive() for p in procs)):
            break
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    if phase == "first":
        time.sleep(0.5)
        for p in procs:
            if p.is_alive():
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(timeout=30)
    if phase != "first":
        assert [p.exitcode for p in procs] == [0] * world
    return [torch.load(o, weights_only=False) for o in outputs]


def test_mixture_kill_on_2_ranks_resume_on_3_is_exactly_once_per_use(tmp_path: Path) -> None:
    for name, n, seed in zip(NAMES, SIZES, (1, 2, 3), strict=True):
        write_corpus(tmp_path / name, num_samples=n, seed=seed)
    _SHARED["processor"] = load_tiny_processor()
    single = neat_vlm_graph(
        _mixture(tmp_path), _SHARED["processor"], config=_config(tmp_path)
    )  # the cache
    layout = single.source.layout
    bounds = np.concatenate([[0], np.cumsum(layout.sizes)])
    first = _run("first", 2, tmp_path)
    resumed = _run("resume", 3, tmp_path, old_world=2)
    for epoch in range(EPOCHS):
        counts = epoch_counts(
            layout.targets(single.source.blend), layout.sizes, NAMES, layout.seed, epoch
        )
        want = Counter({int(bounds[s]) + i: int(c) for s, cs in enumerate(counts)
                        for i, c in enumerate(cs) if c})  # fmt: skip

        def ids(outs: list[dict[str, Any]], key: str, epoch: int = epoch) -> Counter[int]:
            return Counter(i for o in outs for i in o["ledgers"].get(epoch, {}).get(key, []))

        consumed = ids(first, "consumed") + ids(resumed, "consumed")
        assert sum(ids(first, "consumed").values()) > 0 or epoch == 1
        assert consumed + ids(resumed, "tail_dropped") == want, f"epoch {epoch}"
        assert max(want.values()) >= 2  # charts is upsampled: repeats are counted, not lost
