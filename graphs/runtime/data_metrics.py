"""The loader's data figures for a trainer's logger: the change in its running stats since the
previous read.

``NeatLoader.data_metrics()`` returns, as a flat dict of plain floats (the shape every logger
takes: ``Trainer.log``, Lightning's ``log_dict``, ``accelerator.log``, TensorBoard, W&B), the
figures of the batches handed out since its previous call:

* ``data/wait_s``: seconds the trainer's ``next(batch_iterator)`` blocked on the graph (a batch
  not built yet, an epoch's workers starting). The trainer's own step (forward, backward,
  logging) is not in it, so a high figure means the data is the bottleneck, not the step.
* ``data/wait_fraction``: ``wait_s`` over the wall time of the window (since the previous call,
  or the first ``iter()``): 0.0 when batches were always ready, near 1.0 when the trainer did
  little but wait.
* ``data/batches``: batches handed out in the window.
* ``data/fill``: real tokens / (packs x pack size) of the window's packs.
* ``data/estimate_error_p50``, ``data/estimate_error_p99``: |real / estimated - 1| per pack.
* ``data/step_imbalance/<column>`` (packed graphs): per cost column (``attention``,
  ``vision``, ``step``: ``graphs/runtime/step_cost.py``), the window's steps' summed load on
  their slowest rank over the same on the mean rank, read from the plan for every rank: 1.0
  when the ranks were even, 1.2 when the steps took a fifth longer than on even ranks.
* ``data/tokens/<source>``: real tokens of each mixture source (every source seen so far, 0
  when it had none in this window); their sum is the window's real tokens.

>>> from neatpack.graphs.runtime.loader import LoaderStats
>>> stats, window = LoaderStats(), DataWindow(started=10.0)
>>> stats.add_pack(real=900, capacity=1000, estimated=1000, sources={"ocr": 600, "chat": 300})
>>> stats.add_pack(real=800, capacity=1000, estimated=800, sources={"ocr": 800})
>>> stats.batches, stats.wait_s = 1, 0.5
>>> figures = window.take(stats, now=12.0)
>>> figures["data/wait_fraction"], figures["data/fill"], figures["data/tokens/chat"]
(0.25, 0.85, 300.0)
>>> again = window.take(stats, now=13.0)  # a new window: nothing since the last read
>>> again["data/tokens/chat"], again["data/batches"], again["data/wait_s"]
(0.0, 0.0, 0.0)
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from neatpack.graphs.runtime.loader import LoaderStats

__all__ = ["PREFIX", "DataWindow"]

PREFIX = "data/"


class DataWindow:
    """The loader's running stats at the last ``take()``; ``take`` returns the change since.

    No clock inside: the caller passes the times (``started``, ``now``), so the figures are a
    pure function of the two readings.
    """

    def __init__(self, started: float | None = None) -> None:
        self.started = started
        self.batches = self.real_tokens = self.pack_tokens = self.estimated_packs = 0
        self.wait_s = 0.0
        self.source_tokens: dict[str, int] = {}
        self.step_peak: dict[str, float] = {}
        self.step_mean: dict[str, float] = {}

    def take(self, stats: LoaderStats, now: float) -> dict[str, float]:
        """The figures since the last ``take`` (see the module docstring); the next window
        starts at ``now``."""
        wall = now - self.started if self.started is not None else 0.0
        wait = stats.wait_s - self.wait_s
        real, capacity = stats.real_tokens - self.real_tokens, stats.pack_tokens - self.pack_tokens
        # the window's packs with an estimate are the newest of stats.estimate_ratio (which
        # keeps the last ESTIMATE_WINDOW of the run)
        new = min(stats.estimated_packs - self.estimated_packs, len(stats.estimate_ratio))
        ratios = np.fromiter(islice(reversed(stats.estimate_ratio), new), np.float64, new)
        err = np.abs(ratios - 1.0)
        out = {
            f"{PREFIX}wait_s": float(wait),
            f"{PREFIX}wait_fraction": float(min(wait / wall, 1.0)) if wall > 0 else 0.0,
            f"{PREFIX}batches": float(stats.batches - self.batches),
            f"{PREFIX}fill": real / capacity if capacity else 0.0,
            f"{PREFIX}estimate_error_p50": float(np.percentile(err, 50)) if new else 0.0,
            f"{PREFIX}estimate_error_p99": float(np.percentile(err, 99)) if new else 0.0,
        }
        for name, total_mean in sorted(stats.step_mean.items()):
            mean = total_mean - self.step_mean.get(name, 0.0)
            peak = stats.step_peak[name] - self.step_peak.get(name, 0.0)
            out[f"{PREFIX}step_imbalance/{name}"] = peak / mean if mean > 0 else 1.0
        out.update({
            f"{PREFIX}tokens/{name}": float(n - self.source_tokens.get(name, 0))
            for name, n in sorted(stats.source_tokens.items())
        })  # fmt: skip
        self.started, self.wait_s, self.batches = now, stats.wait_s, stats.batches
        self.real_tokens, self.pack_tokens = stats.real_tokens, stats.pack_tokens
        self.estimated_packs, self.source_tokens = stats.estimated_packs, dict(stats.source_tokens)
        self.step_peak, self.step_mean = dict(stats.step_peak), dict(stats.step_mean)
        return out
