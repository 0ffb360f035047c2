"""Real gloo process groups on 127.0.0.1: a free port, ranks spawned to run a test's function
(``run_ranks``), the group each joins (``gloo_group``) and the report each writes to
``rank<r>.json`` under the test's folder (``save_report``)."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[Any]:
    """``torch.distributed`` with this rank in a gloo group on 127.0.0.1:``port`` while the
    block runs; a barrier when it ends cleanly (no rank leaves while another still gathers)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        yield dist
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_report(root: str | Path, rank: int, report: dict[str, Any]) -> None:
    """What a rank found, as JSON, for ``run_ranks`` to return to the test."""
    Path(root, f"rank{rank}.json").write_text(json.dumps(report))


def run_ranks(
    target: Callable[..., None], world: int, root: Path, *args: Any, timeout: float = 240
) -> list[dict[str, Any]]:
    """Spawn ``target(rank, world, port, str(root), *args)`` for every rank, wait for all of
    them to exit cleanly and return the reports they wrote (``root / f"rank{rank}.json"``)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, str(root), *args))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    assert [p.exitcode for p in procs] == [0] * world
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]
