"""What a training step waits for: the cost of every rank's packs in it, read from the plan.

A step ends when its slowest rank ends, and the ranks' packs differ in compute even when
their tokens are equal: attention grows with each document's length squared, the vision
encoder with each image's patches squared (``pipes/planning/balance.py``). The plan is the
same on every rank, so one rank knows every rank's packs of a step without asking: rank
``r``'s ``i``-th pack of the epoch sits at slot ``start + i * world_size + r`` of the
epoch's order (``PackSource``), so the step of a batch is its slots moved to each rank.

For each step handed to the trainer the loader records, per cost column, the slowest rank's
load and the mean rank's load; ``data_metrics()`` reports their sums' ratio over its window
(``data/step_imbalance/<column>``): 1.0 when the ranks were even, 1.25 when the window's steps
took a quarter longer than they would on even ranks.

>>> terms = np.array([[4.0, 16.0, 0.0, 0.0], [4.0, 4.0, 0.0, 0.0]])  # two packs, no images
>>> costs = StepCost(lambda plan, packs: terms[packs])
>>> order = np.array([0, 1])  # slot 0 -> pack 0 (rank 0), slot 1 -> pack 1 (rank 1)
>>> loads = costs.step_loads(None, order, slots=[1], rank=1, world_size=2)
>>> loads["attention"]  # (slowest rank, mean rank)
(16.0, 10.0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from neatpack.pipes.planning.balance import pack_costs
from neatpack.pipes.planning.cost import TERMS

__all__ = ["STEP_COLUMNS", "StepCost"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: What the loader reports per step: the language model's attention (sum of squared document
#: lengths), the vision encoder's cost, and the whole step (``BALANCE_COST``'s weights); and
#: ``supervised`` (label tokens) where the length index counts them (``StepCost(supervised=)``).
STEP_COLUMNS: Final = ("attention", "vision", "step")


class StepCost:
    """Each step's slowest and mean rank load, priced from that step's packs alone:
    ``terms_of(plan, packs)`` gives the cost terms (``[len(packs), 4]`` in ``cost.TERMS``
    order, e.g. ``balance.pack_cost_terms`` of those packs) of the pack indices ``packs``. A
    step reads a few dozen packs, so nothing of the size of the plan is made on any rank
    (a whole plan's terms at 100M samples are GBs of float64 temporaries). ``supervised``:
    label tokens per sample (``LengthIndex.supervised``): the column ``supervised`` too."""

    def __init__(
        self, terms_of: Callable[[Any, IntArray], FloatArray], supervised: Any = None
    ) -> None:
        self._terms_of = terms_of
        self._supervised = supervised

    def step_loads(
        self, plan: Any, order: npt.ArrayLike, *, slots: Sequence[int], rank: int, world_size: int
    ) -> dict[str, tuple[float, float]]:
        """``{column: (slowest rank's load, mean rank's load)}`` of the step whose packs on
        ``rank`` sit at ``slots`` of the epoch's ``order`` (slots past its end wrap, as the
        padded tail's do)."""
        order = np.asarray(order, dtype=np.int64)
        base = np.asarray(slots, dtype=np.int64) - rank  # this step's slots on rank 0
        every = base[:, None] + np.arange(world_size, dtype=np.int64)[None, :]
        return self.pack_loads(plan, order[every % order.size])

    def pack_loads(self, plan: Any, packs: npt.ArrayLike) -> dict[str, tuple[float, float]]:
        """``{column: (slowest rank's load, mean rank's load)}`` of one step given as its
        plan's pack indices, ``[packs per rank, ranks]`` (``report.step_rows``' rows)."""
        packs = np.asarray(packs, dtype=np.int64)
        terms = np.asarray(self._terms_of(plan, packs.reshape(-1)), dtype=np.float64)
        lm, vision = pack_costs(terms)
        cols = np.stack([terms[:, TERMS.index("attention")], vision, lm + vision], axis=1)
        names: tuple[str, ...] = STEP_COLUMNS
        if self._supervised is not None and plan is not None:
            flat = packs.reshape(-1)
            starts, ends = plan.offsets[flat], plan.offsets[flat + 1]
            labels = [
                float(np.asarray(self._supervised[plan.ids[a:b]], np.int64).sum())
                for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
            ]
            cols = np.concatenate([cols, np.asarray(labels)[:, None]], axis=1)
            names = (*STEP_COLUMNS, "supervised")
        loads = cols.reshape(*packs.shape, len(names)).sum(axis=0)  # [ranks, columns]
        peak, mean = loads.max(axis=0), loads.mean(axis=0)
        return {c: (float(peak[j]), float(mean[j])) for j, c in enumerate(names)}
