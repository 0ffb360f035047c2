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

from neatpack.pipes.planning.balance import COST_TERMS, pack_cost_terms, pack_costs

__all__ = ["WINDOW", "WINDOW_MAX", "separate_copies", "use_index"]

IntArray = npt.NDArray[np.int64]

#: Uses nearest in cost first looked at for a trade (doubled until one is found, up to
#: ``WINDOW_MAX``: a copy that finds none there is left to the caller, in bounded time).
WINDOW = 64
WINDOW_MAX = 4096


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


def _second_copies(ids: IntArray, pack_of: IntArray) -> IntArray:
    """Slots holding a sample already in their pack (every copy but the first)."""
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
    vis = np.zeros_like(tot) if visual is None else np.asarray(visual, dtype=np.int64)
    img = None if images is None else np.asarray(images, dtype=np.int64)
    # per slot: tokens, visual, items, attention and vision cost (what the trade keeps even)
    terms = pack_cost_terms(np.arange(slots.size + 1), slots, tot, vis, images=img)
    att = terms[:, COST_TERMS.index("attention")]
    vcost = pack_costs(terms)[1]
    n_packs = max(offsets.size - 1, 1)
    att_scale = max(float(att.sum()) / n_packs, 1.0)
    vis_scale = max(float(vcost.sum()) / n_packs, 1.0)
    cols = [tot[slots], vis[slots], np.zeros_like(slots) if img is None else img[slots]]
    limits = [capacity, max_visual, max_images]
    used = [np.bincount(pack_of, weights=c, minlength=n_packs).astype(np.int64) for c in cols]
    by_len = np.lexsort((np.arange(slots.size), vcost, att))  # slots in cost order
    where = np.empty_like(by_len)
    where[by_len] = np.arange(by_len.size)
    for i in todo.tolist():
        j = _trade(i, slots, pack_of, offsets, by_len, where, att / att_scale,
                   vcost / vis_scale, cols, used, limits)  # fmt: skip
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
        by_len[where[i]], by_len[where[j]] = j, i
        where[i], where[j] = where[j], where[i]
    return slots, np.asarray(stuck, dtype=np.int64)


def _trade(
    i: int,
    slots: IntArray,
    pack_of: IntArray,
    offsets: IntArray,
    by_len: IntArray,
    where: IntArray,
    att: npt.NDArray[np.float64],
    vcost: npt.NDArray[np.float64],
    cols: list[IntArray],
    used: list[IntArray],
    limits: list[int | None],
) -> int | None:
    """The slot that slot ``i`` trades with: nearest in cost among the ``WINDOW`` (then twice as
    many, ... ``WINDOW_MAX``) slots nearest in cost order, in another pack, within every
    budget, and neither pack then holding a sample twice; None where no slot does."""
    p, x = int(pack_of[i]), int(slots[i])
    in_p = slots[offsets[p] : offsets[p + 1]]
    half, seen = WINDOW // 2, 0
    while True:
        lo, hi = max(int(where[i]) - half, 0), min(int(where[i]) + half + 1, by_len.size)
        cand = by_len[lo:hi]
        q = pack_of[cand]
        ok = (q != p) & (slots[cand] != x) & ~np.isin(slots[cand], in_p)
        for c, u, limit in zip(cols, used, limits, strict=True):
            if limit is None:
                continue
            d = c[cand] - c[i]  # what pack p gains, and pack q loses
            ok &= (u[p] + d <= max(limit, int(u[p]))) & (u[q] - d <= np.maximum(limit, u[q]))
        cand = cand[ok]
        score = np.abs(att[cand] - att[i]) + np.abs(vcost[cand] - vcost[i])
        for j in cand[np.argsort(score, kind="stable")].tolist():
            qj = int(pack_of[j])
            if x not in slots[offsets[qj] : offsets[qj + 1]]:
                return int(j)
        if hi - lo == by_len.size or hi - lo == seen or half * 2 > WINDOW_MAX:
            return None
        seen, half = hi - lo, half * 2
