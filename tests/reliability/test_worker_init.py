"""Worker processes: one torch thread, freed memory kept, a quiet exit at interpreter teardown."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from neatpack.graphs.runtime.watchdog import init_worker


def _report_threads(owner: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    init_worker(owner)
    q.put(torch.get_num_threads())


def test_init_worker_sets_one_thread_in_workers_only() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_report_threads, args=(os.getpid(), q))
        p.start()
        assert q.get(timeout=30) == 1
        p.join(timeout=30)
        init_worker(os.getpid())  # the owner process keeps its own setting
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_script_with_live_worker_loader_exits_without_teardown_noise(tmp_path: Path) -> None:
    """torchdata 0.11's mapper iterator is garbage-collected during interpreter teardown and
    prints "Exception ignored ... 'NoneType' object has no attribute 'maxsize'" unless the
    loader stops its workers at exit."""
    script = textwrap.dedent(
        f"""
        from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
        from neatpack.pipes.testing.synth import write_corpus
        from neatpack.pipes.testing.tiny import load_tiny_processor
        root = {str(tmp_path)!r}
        data = write_corpus(root, num_samples=24, seed=0)
        cfg = NeatVLMConfig(pack_size=2048, batch_size=1, media_root=root + "/media",
                            cache_dir=root + "/cache", num_workers=2)
        loader = neat_vlm_graph(data, load_tiny_processor("qwen2_vl"), config=cfg)
        it = iter(loader)
        next(it)  # stop mid-epoch, workers alive
        full = neat_vlm_graph(data, load_tiny_processor("qwen2_vl"), config=cfg)
        n = sum(1 for _ in full)  # and one loader run to the end of its epoch
        print("batches", n)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "batches" in out.stdout
    assert "Exception ignored" not in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


_FAULTS = """
import resource, sys, torch
from neatpack.graphs.runtime.watchdog import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # warm: the first one always faults
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(16):
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # 64 MiB, freed at once
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_workers_keep_freed_memory_instead_of_faulting_it_in_again() -> None:
    """Sixteen 64 MiB tensors allocated and freed in turn (in a fresh interpreter, so no pages
    are shared copy-on-write with a parent): with glibc's defaults each one maps fresh pages
    (16k faults each); a process that keeps freed memory reuses them."""
    got = {}
    for mode in ("default", "keep"):
        out = subprocess.run(
            [sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120,
            check=True,
        )  # fmt: skip
        applied, faults = out.stdout.split()
        got[mode] = (applied == "True", int(faults))
    assert got["keep"][0]  # glibc: the settings applied
    assert got["default"][1] > 16 * 10_000  # default malloc: every allocation faults its pages in
    # observed: 16-49k (one to three allocations faulted in while the heap settles, then
    # reused) against 262k
    assert got["keep"][1] <= got["default"][1] / 4, got


def _count_faults(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch hook: in the worker, the page faults of sixteen 64 MiB allocations freed in turn
    (after one to warm the heap)."""
    import resource

    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(16):
        torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    batch["worker_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return batch


def test_the_retired_variable_warns_and_workers_still_keep_freed_memory(
    monkeypatch: Any,
) -> None:
    """``NEATPACK_WORKER_MALLOC=default`` turned the tuning off; it is no longer read (the
    tuning never lost in the measurements). A job that still sets it is warned when its graph
    with worker processes is built, and its workers keep freed memory as without it: sixteen
    64 MiB allocations fault a few times over, not 16 x 16k pages (262k with the variable
    honoured, as before)."""
    from neatpack.graphs import NeatLLMConfig, neat_llm_graph

    monkeypatch.setenv("NEATPACK_WORKER_MALLOC", "default")
    records = [{"input_ids": list(range(1, 20))} for _ in range(4)]
    cfg = NeatLLMConfig(pack_size=64, num_workers=1, prefetch=0, attn_implementation="doc_ids")
    with pytest.warns(UserWarning, match="NEATPACK_WORKER_MALLOC='default' is no longer read"):
        loader = neat_llm_graph(records, config=cfg, batch_transform=_count_faults)
    faults = [int(b["worker_faults"]) for b in loader]
    assert faults
    assert max(faults) < 16 * 10_000 / 2, faults
