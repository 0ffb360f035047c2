"""A sample's uses in one epoch's plan: which round each use is in, and copies moved apart.

A mixture lists a sample once per use (``mixture_plan``). Planned one round at a time (a
sample's ``k``-th use in round ``k``), no pack can hold a sample twice, but the later rounds
are small plans on their own: 8 ranks, sources of 6,000 and 1,500 samples, the second used
~2.5 times, rounds 1 and 2 (1,500 and ~750 uses) stepped at p95 attention max/mean 1.37 and
1.49 against 1.005 for round 0. So under ``balance="cost"`` the uses are planned together
(one ``plan_packs``: step groups as even as one source's) and the few packs that took two
copies of a sample (78 of 9,716 uses there, 373 of 97,549 at 64 ranks) give one copy away:
``separate_copies`` trades it with the use nearest in attention and vision cost in another
pack that holds neither sample and keeps every budget. Tokens stay the same in all, so the
fill does not move; a trade of equal lengths moves no cost at all.

Worked by hand: packs ``[7, 7, 2]`` and ``[3, 4]`` of capacity 10, lengths ``7: 3, 2: 4,
3: 3, 4: 3`` (sample 7 used twice). The second 7 trades with the use nearest in cost that
the other pack can give: sample 3 (3 tokens, as 7). Packs ``[7, 3, 2]`` and ``[7, 4]``.

>>> ids, stuck = separate_copies(np.array([0, 3, 5]), np.array([7, 7, 2, 3, 4]),
...                              np.array([0, 0, 4, 3, 3, 0, 0, 3]), None, None, capacity=10)
>>> ids.tolist(), stuck.tolist()
([7, 3, 2, 7, 4], [])
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from neatpack.pipes.planning.balance import sample_vision_cost

__all__ = ["TRADE_MAX", "WINDOW", "WINDOW_MAX", "second_copies", "separate_copies", "use_index"]

IntArray = npt.NDArray[np.int64]

#: Uses nearest in attention first looked at for a trade (doubled until one is found, up to
#: ``WINDOW_MAX``: a copy that finds none there is left to the caller, in bounded time).
WINDOW = 64
WINDOW_MAX = 4096
#: Most second copies a caller trades among best fit's packs (``mixture_plan._apart``): more
#: are planned again by rounds (each trade costs ~40 us; a plan that large loses nothing
#: measurable to a few more packs).
TRADE_MAX = 4096


def use_index(entries: IntArray) -> IntArray:
    """For each entry, how many entries of the same sample come before it (0 for the first).

    >>> use_index(np.array([5, 3, 5, 5, 3])).tolist()
    [0, 0, 1, 2, 1]
    """
    order = np.argsort(entries, kind="stable")
    ordered = entries[order]
    first = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if entries.size else order
    run_start = np.repeat(first, np.diff(np.r_[first, entries.size]))
    out = np.empty(entries.size, dtype=np.int64)
    out[order] = np.arange(entries.size) - run_start
    return out


def second_copies(offsets: IntArray, ids: IntArray) -> IntArray:
    """Slots of CSR packs holding a sample already in their pack (every copy but the first).

    >>> second_copies(np.array([0, 3, 5]), np.array([4, 5, 4, 4, 6])).tolist()
    [2]
    """
    pack_of = np.repeat(np.arange(offsets.size - 1, dtype=np.int64), np.diff(offsets))
    return _second_copies(np.asarray(ids, dtype=np.int64), pack_of)


def _second_copies(ids: IntArray, pack_of: IntArray) -> IntArray:
    by_pack = np.lexsort((np.arange(ids.size), ids, pack_of))
    same = (pack_of[by_pack][1:] == pack_of[by_pack][:-1]) & (ids[by_pack][1:] == ids[by_pack][:-1])
    return np.sort(by_pack[1:][same])


def separate_copies(
    offsets: IntArray,
    ids: npt.ArrayLike,
    total: npt.ArrayLike,
    visual: npt.ArrayLike | None,
    images: npt.ArrayLike | None,
    *,
    capacity: int,
    max_visual: int | None = None,
    max_images: int | None = None,
) -> tuple[IntArray, IntArray]:
    """``ids`` (sample ids of CSR packs, repeats allowed) with every pack's second copies of a
    sample traded away (module doc), and the slots of the copies that found no trade (still
    in their packs: the caller takes them out). A pack stays
    within ``capacity`` tokens (``max_visual`` / ``max_images``: ``visual`` tokens and
    ``images`` items; both None: no such budget), or no fuller than it was (a sample longer
    than the headroom has a pack of its own)."""
    slots = np.asarray(ids, dtype=np.int64).copy()
    pack_of = np.repeat(np.arange(offsets.size - 1, dtype=np.int64), np.diff(offsets))
    todo = _second_copies(slots, pack_of)
    stuck: list[int] = []
    if not todo.size:
        return slots, np.zeros(0, np.int64)
    tot = np.asarray(total, dtype=np.int64)
    vis = None if visual is None else np.asarray(visual, dtype=np.int64)
    img = None if images is None else np.asarray(images, dtype=np.int64)
    # per slot: attention and vision cost over their means per pack (what a trade keeps
    # even), as ``balance.pack_costs`` prices them: length^2, and ``sample_vision_cost``
    n_packs = max(offsets.size - 1, 1)
    att = tot[slots].astype(np.float64) ** 2
    att /= max(float(att.sum()) / n_packs, 1.0)
    vcost = np.zeros_like(att)
    if vis is not None:
        vcost = sample_vision_cost(vis[slots], None if img is None else img[slots])
        vcost /= max(float(vcost.sum()) / n_packs, 1.0)
    # the budgets a trade keeps: tokens, and visual tokens / items where they are set
    budgets = [(tot, capacity), (vis, max_visual), (img, max_images)]
    cols = [a[slots] for a, limit in budgets if a is not None and limit is not None]
    limits = [int(limit) for a, limit in budgets if a is not None and limit is not None]
    used = [np.bincount(pack_of, weights=c, minlength=n_packs).astype(np.int64) for c in cols]
    by_cost = np.argsort(att, kind="stable")  # slots in attention order
    where = np.empty_like(by_cost)
    where[by_cost] = np.arange(by_cost.size)
    for i in todo.tolist():
        j = _trade(i, slots, pack_of, offsets, by_cost, where, att, vcost, cols, used, limits)
        if j is None:
            stuck.append(i)
            continue
        p, q = int(pack_of[i]), int(pack_of[j])
        for c, u in zip(cols, used, strict=True):
            d = int(c[j] - c[i])
            u[p] += d
            u[q] -= d
            c[i], c[j] = c[j], c[i]
        for a in (att, vcost):
            a[i], a[j] = a[j], a[i]
        slots[i], slots[j] = slots[j], slots[i]
        by_cost[where[i]], by_cost[where[j]] = j, i
        where[i], where[j] = where[j], where[i]
    return slots, np.asarray(stuck, dtype=np.int64)


def _trade(
    i: int,
    slots: IntArray,
    pack_of: IntArray,
    offsets: IntArray,
    by_cost: IntArray,
    where: IntArray,
    att: npt.NDArray[np.float64],
    vcost: npt.NDArray[np.float64],
    cols: list[IntArray],
    used: list[IntArray],
    limits: list[int],
) -> int | None:
    """The slot that slot ``i`` trades with: nearest in cost among the ``WINDOW`` (then twice
    as many, ... ``WINDOW_MAX``) slots nearest in attention, in another pack, within every
    budget, and neither pack then holding a sample twice; None where no slot does."""
    p, x = int(pack_of[i]), int(slots[i])
    in_p = slots[offsets[p] : offsets[p + 1]]
    half, seen = WINDOW // 2, 0
    while True:
        lo, hi = max(int(where[i]) - half, 0), min(int(where[i]) + half + 1, by_cost.size)
        cand = by_cost[lo:hi]
        q = pack_of[cand]
        # (x is in pack p: no copy of x either); a broadcast, not np.isin: 4x less time
        ok = (q != p) & ~(slots[cand][:, None] == in_p[None, :]).any(axis=1)
        for c, u, limit in zip(cols, used, limits, strict=True):
            d = c[cand] - c[i]  # what pack p gains, and pack q loses
            ok &= (u[p] + d <= max(limit, int(u[p]))) & (u[q] - d <= np.maximum(limit, u[q]))
        cand = cand[ok]
        score = np.abs(att[cand] - att[i]) + np.abs(vcost[cand] - vcost[i])
        for j in cand[np.argsort(score, kind="stable")].tolist():
            qj = int(pack_of[j])
            if x not in slots[offsets[qj] : offsets[qj + 1]]:
                return int(j)
        if hi - lo == by_cost.size or hi - lo == seen or half * 2 > WINDOW_MAX:
            return None
        seen, half = hi - lo, half * 2
