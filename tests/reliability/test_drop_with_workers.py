"""Dropping a loader with worker processes mid-epoch prints no thread traceback.

The bug: a script that took a batch or two from ``neat_vlm_graph(..., num_workers=2)`` and then
dropped the loader (reassigned the variable, or built a new loader to resume from its
``state_dict()``) intermittently printed

    Exception in thread Thread-20 (_sort_worker):
    ... torch/multiprocessing/reductions.py rebuild_storage_fd: fd = df.detach()
    ... ConnectionResetError: [Errno 104] Connection reset by peer      (or EOFError, ...)

Stopping a graph set torchdata's thread stop event and the worker processes' stop event at
the same moment. A worker sees its event and exits while the in-order sort thread is still
receiving the last item that worker sent: the item's tensors travel as file descriptors, and
unpickling one connects to the sending worker's resource sharer, gone with the worker.

The race is narrow (about 1 run in 4 of 12 drops), so the child script here widens it through
the public ``batch_transform`` hook, the way a large item on a busy machine would: every
batch carries an object that takes ``DELAY`` seconds to unpickle in the trainer's process,
followed by a tensor. The sort thread is therefore inside that unpickling almost all the time,
and a drop lands there. On the old code every child run printed the traceback (measured:
10 of 10 runs, 2 loaders dropped each); the fix stops the threads first and the workers after
them (graphs/runtime/watchdog.py ``stop_graph``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json, sys, time

import torch

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes import load_tiny_processor, write_corpus

DELAY = float(sys.argv[2])


def _arrive(delay):
    time.sleep(delay)  # in the trainer's process: this item is slow to receive
    return SlowToReceive(delay)


class SlowToReceive:
    def __init__(self, delay):
        self.delay = delay

    def __reduce__(self):
        return (_arrive, (self.delay,))


def in_transit(batch):
    # the tensor after the slow object is received by file descriptor from the worker
    batch["in_transit"] = [SlowToReceive(DELAY), torch.arange(8)]
    return batch


root, modes = sys.argv[1], sys.argv[3].split(",")
data = write_corpus(root, num_samples=48, seed=3)
config = NeatVLMConfig(pack_size=2048, batch_size=2, media_root=f"{root}/media",
                       cache_dir=f"{root}/cache", num_workers=2)
build = lambda: neat_vlm_graph(data, load_tiny_processor(), config=config,
                               batch_transform=in_transit)


def started():
    # a loader two batches into its epoch: its sort thread is receiving the third
    loader = build()
    it = iter(loader)
    next(it)
    next(it)
    return loader, it


def check(batch):
    assert batch["in_transit"][1].tolist() == list(range(8))


drops = []
for mode in modes:
    loader, it = started()
    if mode == "drop":  # reassign the variables: the old loader and its iterator go now
        start = time.perf_counter()
        loader = it = None
        drops.append(time.perf_counter() - start)
    elif mode == "resume":  # a new loader from the state, then that one dropped too
        state = loader.state_dict()
        loader = it = None
        resumed = build()
        resumed.load_state_dict(state)
        check(next(iter(resumed)))
        start = time.perf_counter()
        resumed = None
        drops.append(time.perf_counter() - start)
    elif mode == "reload":  # load_state_dict on the running loader: iter() rebuilds the graph
        loader.load_state_dict(loader.state_dict())
        it = iter(loader)
        check(next(it))
    elif mode == "close":  # close() mid-epoch waits for the threads
        loader.close()
    else:
        raise ValueError(mode)
print("DROPS " + json.dumps(drops))
"""


MODES = "drop,resume,reload,close"


def test_dropping_loaders_with_workers_mid_epoch_prints_no_traceback(tmp_path: Path) -> None:
    script = tmp_path / "drop.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "data"), "0.3", MODES],
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = proc.stderr
    assert "Exception in thread" not in err, err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("DROPS ")]
    assert lines, proc.stdout[-2000:]
    assert len(json.loads(lines[-1][len("DROPS ") :])) == 2  # the script ran every mode
