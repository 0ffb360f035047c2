"""The loader's data figures for a trainer's logger: one window of batches, reset on each read.

``NeatLoader.data_metrics()`` returns the figures since its previous call as a flat dict of
plain floats, the shape every logger takes (``Trainer.log``, Lightning's ``log_dict``,
``accelerator.log``, TensorBoard, W&B):

* ``data/wait_s``: seconds the trainer's ``next(batch_iterator)`` blocked on the graph (a batch
  not built yet). Time the trainer spends between batches (forward, backward, logging) is not
  in it, so a high figure means the data is the bottleneck, not the step.
* ``data/wait_fraction``: ``wait_s`` over the wall time of the window (since the previous call,
  or the first ``iter()``): 0.0 when batches were always ready, near 1.0 when the trainer did
  little but wait.
* ``data/batches``: batches handed out in the window.
* ``data/fill``: real tokens / (packs x pack size) of the window's packs.
* ``data/estimate_error_p50``, ``data/estimate_error_p99``: |real / estimated - 1| per pack.
* ``data/tokens/<source>``: real tokens of each mixture source (every source seen so far, 0
  when it had none in this window); their sum is the window's real tokens.

>>> w = DataWindow(started=10.0)
>>> w.add_wait(0.5)
>>> w.add_pack(real=900, capacity=1000, estimated=1000, sources={"ocr": 600, "chat": 300})
>>> w.add_pack(real=800, capacity=1000, estimated=800, sources={"ocr": 800})
>>> w.batches += 1
>>> figures = w.take(now=12.0)
>>> figures["data/wait_fraction"], figures["data/fill"], figures["data/tokens/chat"]
(0.25, 0.85, 300.0)
>>> again = w.take(now=13.0)  # a new window: nothing since the last read
>>> again["data/tokens/chat"], again["data/batches"], again["data/wait_s"]
(0.0, 0.0, 0.0)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import numpy as np

__all__ = ["PREFIX", "DataWindow"]

PREFIX = "data/"
# Estimate ratios kept per window: a trainer that never reads the figures keeps at most this
# many floats (about 0.5 MB), not one per pack of the run.
WINDOW_PACKS = 65536


class DataWindow:
    """Counters of the batches since the last ``take()``; ``take`` returns them and resets.

    No clock inside: the caller passes the times (``started``, ``now``) and the waits it
    measured, so the figures are a pure function of what was added.
    """

    def __init__(self, started: float | None = None) -> None:
        self.started = started
        self.sources: dict[str, int] = {}  # every source seen, so each window logs each key
        self._reset()

    def _reset(self) -> None:
        self.wait_s = 0.0
        self.batches = 0
        self.real_tokens = 0
        self.pack_tokens = 0
        self.ratios: deque[float] = deque(maxlen=WINDOW_PACKS)
        self.sources = dict.fromkeys(self.sources, 0)

    def add_wait(self, seconds: float) -> None:
        self.wait_s += seconds

    def add_pack(
        self,
        *,
        real: int,
        capacity: int,
        estimated: float | None,
        sources: Mapping[str, int] | None = None,
    ) -> None:
        self.real_tokens += real
        self.pack_tokens += capacity
        if estimated:
            self.ratios.append(real / float(estimated))
        for name, tokens in (sources or {}).items():
            self.sources[name] = self.sources.get(name, 0) + int(tokens)

    def take(self, now: float) -> dict[str, float]:
        """The window's figures (see the module docstring); the next window starts at ``now``."""
        wall = now - self.started if self.started is not None else 0.0
        err = np.abs(np.asarray(self.ratios, dtype=np.float64) - 1.0)
        out = {
            f"{PREFIX}wait_s": float(self.wait_s),
            f"{PREFIX}wait_fraction": float(min(self.wait_s / wall, 1.0)) if wall > 0 else 0.0,
            f"{PREFIX}batches": float(self.batches),
            f"{PREFIX}fill": self.real_tokens / self.pack_tokens if self.pack_tokens else 0.0,
            f"{PREFIX}estimate_error_p50": float(np.percentile(err, 50)) if err.size else 0.0,
            f"{PREFIX}estimate_error_p99": float(np.percentile(err, 99)) if err.size else 0.0,
        }
        out.update({f"{PREFIX}tokens/{k}": float(v) for k, v in sorted(self.sources.items())})
        self.started = now
        self._reset()
        return out
