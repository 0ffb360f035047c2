"""Worker processes run torch on one thread, and a script that keeps a loader alive exits quietly."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from neatpack.graphs.watchdog import init_worker


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
        from neatpack.pipes.synth import write_corpus
        from neatpack.pipes.tiny import load_tiny_processor
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
