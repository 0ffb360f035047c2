"""What a mixture delivered: token share per source (the epoch and windows of packs) next to
the target, and the ledger split per source (consumed, repeated, dropped, failed).

>>> import numpy as np
>>> from neatpack.pipes.mixtures.mixture_plan import MixturePlan
>>> z = np.zeros(0, np.int64)
>>> plan = MixturePlan(offsets=np.array([0, 2, 3]), ids=np.array([0, 2, 1]),
...                    order=np.array([1, 0]), bounds=np.array([0, 2, 3]), epoch=0,
...                    group_size=1, fingerprint="", dropped_ids=z, replan_dropped=z)
>>> r = realized_shares(plan, [30, 10, 60], ["a", "b"], [0.5, 0.5], window=1)
>>> r["epoch"], [w["shares"] for w in r["windows"]]
([0.4, 0.6], [[1.0, 0.0], [0.333333, 0.666667]])
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from neatpack.pipes.mixtures.mixture import Blend
from neatpack.pipes.mixtures.mixture_plan import MixturePlan, pack_source_tokens

__all__ = ["mixture_ledger", "realized_shares", "target_shares"]


def target_shares(blend: Blend, planned_tokens: Sequence[int]) -> list[float]:
    """Each source's target share of the epoch's tokens: a fixed-samples source's share is
    what its samples plan to; the weighted sources split the rest by weight.

    >>> target_shares({"epoch_tokens": None, "sources": [["a", 3, None], ["b", 1, None],
    ...                ["c", None, 10]]}, [500, 300, 200])
    [0.6, 0.2, 0.2]
    """
    total = max(sum(int(t) for t in planned_tokens), 1)
    fixed = sum(
        int(t) for t, e in zip(planned_tokens, blend["sources"], strict=True) if e[1] is None
    )
    weights = sum(float(e[1]) for e in blend["sources"] if e[1] is not None)
    rest = 1.0 - fixed / total
    return [
        round(int(t) / total if e[1] is None else rest * float(e[1]) / weights, 6)
        for t, e in zip(planned_tokens, blend["sources"], strict=True)
    ]


def _pack_tokens(plan: MixturePlan, total: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Tokens per source of each pack, in serving order: ``[packs, sources]``."""
    return pack_source_tokens(plan.offsets, plan.ids, total, plan.bounds)[plan.order]


def realized_shares(
    plan: MixturePlan,
    total: npt.ArrayLike,
    names: Sequence[str],
    target: Sequence[float],
    *,
    window: int = 1000,
    stride: int | None = None,
) -> dict[str, Any]:
    """Token share per source over the epoch and over each ``window`` packs of the serving
    order (starting every ``stride`` packs, default ``window``: consecutive windows), next to
    ``target``; ``worst`` is the largest |realized - target| over full windows."""
    if window < 1 or (stride is not None and stride < 1):
        raise ValueError(f"{window=} and {stride=} must be >= 1")
    per = _pack_tokens(plan, np.asarray(total, dtype=np.int64))
    want = np.asarray(target, dtype=np.float64)

    def shares(rows: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        s: npt.NDArray[np.float64] = rows.sum(axis=0).astype(np.float64)
        return s / max(float(s.sum()), 1.0)

    windows, worst = [], 0.0
    starts = range(0, max(len(plan) - window, 0) + 1, stride or window)
    for start in starts:
        got = shares(per[start : start + window])
        if start + window <= len(plan):
            worst = max(worst, float(np.abs(got - want).max()))
        windows.append({"start": start, "shares": [round(float(x), 6) for x in got]})
    return {
        "names": list(names),
        "target": [round(float(x), 6) for x in want],
        "epoch": [round(float(x), 6) for x in shares(per)],
        "window": window,
        "windows": windows,
        "worst": round(worst, 6),
    }


def mixture_ledger(
    ledgers: Iterable[Any],
    bounds: Sequence[int],
    names: Sequence[str],
    *,
    replan_dropped: Iterable[int] = (),
) -> dict[str, dict[str, int]]:
    """Per source, from one epoch's ``EpochLedger`` of every rank: ``consumed`` (uses),
    ``unique`` samples, ``repeated`` (uses beyond a sample's first: upsampling), ``dropped``
    (overflow policy, overlong, tail), ``replan_dropped`` (a blend change from the cursor),
    ``failed`` and ``padded``.

    >>> from neatpack.graphs.runtime.loader import EpochLedger
    >>> mixture_ledger([EpochLedger(consumed=[0, 0, 3]), EpochLedger(consumed=[1])], [0, 3, 5],
    ...                ["a", "b"])["a"]
    {'consumed': 3, 'unique': 2, 'repeated': 1, 'dropped': 0, 'replan_dropped': 0, 'failed': 0, \
'padded': 0}
    """
    edges = np.asarray(bounds, dtype=np.int64)
    kinds = ("consumed", "dropped", "failed", "padded", "replan_dropped")
    fields: dict[str, Counter[int]] = {k: Counter() for k in kinds}

    def source(i: int) -> int:
        return int(np.searchsorted(edges, i, side="right")) - 1

    uses: Counter[int] = Counter()
    for led in ledgers:
        for i in led.consumed:
            uses[int(i)] += 1
        for key, ids in (("dropped", [*led.dropped, *led.overlong, *led.tail_dropped]),
                         ("failed", led.failed), ("padded", led.padded)):  # fmt: skip
            for i in ids:
                fields[key][source(int(i))] += 1
    for i in replan_dropped:
        fields["replan_dropped"][source(int(i))] += 1
    out = {}
    for s, name in enumerate(names):
        mine = [c for i, c in uses.items() if source(i) == s]
        out[name] = {
            "consumed": sum(mine),
            "unique": len(mine),
            "repeated": sum(mine) - len(mine),
            "dropped": fields["dropped"][s],
            "replan_dropped": fields["replan_dropped"][s],
            "failed": fields["failed"][s],
            "padded": fields["padded"][s],
        }
    return out
