"""One epoch's pack plan over a mixture, and its re-plan from a cursor after a blend change.

``plan_mixture`` lays the epoch's uses (``mixture.epoch_counts``) out as entries, a sample
used twice being two entries, and plans them with ``plan_packs`` (so packs may mix sources and
step groups stay balanced), or per source with ``single_source=True``. The serving order then
spreads every source evenly over the epoch: each step group joins the queue of the source it
carries most of, and the next group served is the queue head that keeps the tokens served so
far closest to every source's share, so any run of served groups holds every source near it::

    queues  a: a1 a2 a3 a4 a5 a6   b: b1 b2   c: c1 c2     (shares 60 / 20 / 20 %)
    served  a1 b1 c1 a2 a3 b2 a4 c2 a5 a6                   (never all c at the end)

Under ``balance="cost"`` (the graphs' default) a part's uses, every round of them, are one
``plan_packs`` (``mixture_uses``: a pack's second copy of a sample is traded for a use of
like cost in another pack), and the serving order keeps its made step groups whole: the other
packs of every part are ordered together (``balanced_order("cost")``) and the short last
group is drawn from them. Before, one plan a round (a sample's ``k``-th use in round ``k``)
and groups cut from the plans laid end to end: at 8 ranks, sources of 80k and 20k samples
(the second used 2.5 times), p95 vision max/mean 1.31 against 1.04 now, at 64 ranks 1.85
against 1.05, as one plan of the same uses (``benchmarks/bench_step_balance.py``,
``metrics["mixture"]``). The other balances plan by rounds as they did (their states load).

``replan_from_cursor`` keeps the packs already served (``order[:cursor]``) and plans the rest of
the epoch again for a new blend: the unconsumed uses are kept where the new blend still wants
them, dropped (listed in ``replan_dropped``) where it wants fewer, and topped up (least used
samples first) where it wants more.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from neatpack.pipes.mixtures.mixture import IntArray, fill_counts, source_rng
from neatpack.pipes.mixtures.mixture_uses import (
    TRADE_MAX,
    second_copies,
    separate_copies,
    use_index,
)
from neatpack.pipes.planning.balance import (
    COST_TERMS,
    BalancePolicy,
    balanced_order,
    pack_cost_terms,
)
from neatpack.pipes.planning.binpack import reorder_packs
from neatpack.pipes.planning.plan import plan_images, plan_packs

__all__ = ["MixturePlan", "mix_order", "pack_source_tokens", "plan_mixture", "replan_from_cursor"]


#: One plan part: CSR packs of global sample ids, the overlong ones left out, and how many of
#: its first packs are made step groups (``PackPlan.free_from``).
Packed = tuple[IntArray, IntArray, IntArray, int]


@dataclass(frozen=True, eq=False)
class MixturePlan:
    """One epoch's packs (CSR of global sample ids, ``ids[offsets[g]:offsets[g + 1]]``) and
    their serving ``order``. Global id ``i`` is sample ``i - bounds[s]`` of source ``s``,
    ``bounds[s] <= i < bounds[s + 1]``. ``replan_dropped`` lists the uses a re-plan dropped;
    ``dropped_ids`` the overlong samples the plan left out (``overlong="drop"``)."""

    offsets: IntArray
    ids: IntArray
    order: IntArray
    bounds: IntArray
    epoch: int
    group_size: int
    fingerprint: str
    dropped_ids: IntArray
    replan_dropped: IntArray

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    def pack(self, index: int) -> list[int]:
        """Global sample ids of pack ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"pack {index=} out of range for a plan of {len(self)} packs")
        return [int(i) for i in self.ids[self.offsets[index] : self.offsets[index + 1]]]

    def source_of(self, ids: npt.ArrayLike) -> IntArray:
        """Source index of each global id."""
        return np.searchsorted(self.bounds, np.asarray(ids), side="right").astype(np.int64) - 1

    def pack_sources(self, index: int) -> list[int]:
        """Source index of each sample of pack ``index`` (the pack's record of its sources)."""
        return [int(s) for s in self.source_of(self.pack(index))]

    def epoch_order(self, epoch: int) -> IntArray:
        """The serving order (this plan is one epoch's: another epoch is refused)."""
        if epoch != self.epoch:
            raise ValueError(f"this mixture plan is epoch {self.epoch}'s, asked for {epoch=}")
        return self.order


def mix_order(
    pack_tokens: npt.NDArray[np.int64],
    group_size: int,
    rng: np.random.Generator,
    free_from: int = 0,
) -> IntArray:
    """Serving order of packs (``pack_tokens[p, s]``: pack ``p``'s tokens of source ``s``, packs
    in load order): step groups of ``group_size`` neighbours, spread by class (module doc);
    ``len % group_size`` packs drawn among those from ``free_from`` on (the packs before it are
    made step groups, never split) form the tail, as in ``plan.step_group_order``.

    >>> tokens = np.array([[9, 0]] * 6 + [[0, 9]] * 2)
    >>> order = mix_order(tokens, 1, np.random.default_rng(0))
    >>> [slot for slot, pack in enumerate(order) if pack >= 6]  # the two c packs, spread
    [2, 6]
    """
    n = int(pack_tokens.shape[0])
    if free_from % group_size or not 0 <= free_from <= n:
        raise ValueError(f"{free_from=} must be a whole number of groups of {group_size} in "
                         f"[0, {n}]: the made step groups come first")  # fmt: skip
    tail_n = n % group_size
    tail = None
    if tail_n:
        tail = free_from + np.sort(rng.choice(n - free_from, size=tail_n, replace=False))
    body = np.arange(n, dtype=np.int64)
    if tail is not None:
        body = np.delete(body, tail)
    groups = body.reshape(-1, group_size)
    if groups.shape[0]:
        per_group = pack_tokens[groups].sum(axis=1)  # [G, S]
        groups = groups[_share_tracking_order(per_group, rng)]
        groups[1::2] = groups[1::2, ::-1]
    out = groups.reshape(-1)
    return out if tail is None else np.concatenate([out, tail.astype(np.int64)])


def _share_tracking_order(per_group: npt.NDArray[np.int64], rng: np.random.Generator) -> IntArray:
    """Order of step groups: each group joins the queue of the source it carries most of
    (relative to that source's total), queues are shuffled, and the next group served is the
    queue head that leaves the tokens served so far closest to every share (squared error
    over share), so every stretch of the epoch stays within about one group of every share.

    With ``e_s`` the current error of source ``s`` (tokens served minus share x all served),
    adding group ``g`` (tokens ``r_s``, ``R`` in all) gives ``sum_s (e_s + r_s - f_s R)^2 / f_s``
    ``= const + q_g + 2 sum_s (e_s / f_s) r_s`` (the cross term in ``R`` vanishes: the errors
    sum to 0), so each candidate costs one dot product with ``w_s = e_s / f_s``."""
    totals = per_group.sum(axis=0).astype(np.float64)
    share = totals / max(float(totals.sum()), 1.0)
    used = share > 0
    inv = np.where(used, 1.0 / np.where(used, share, 1.0), 0.0)
    size = per_group.sum(axis=1).astype(np.float64)
    q = ((per_group - share * size[:, None]) ** 2 * inv).sum(axis=1).tolist()
    cls = np.argmax(per_group / np.maximum(totals, 1.0), axis=1)
    queues = [rng.permutation(np.flatnonzero(cls == c)).tolist() for c in range(share.size)]
    heads = [0] * share.size
    rows, sizes, invs = per_group.tolist(), size.tolist(), inv.tolist()
    w = [0.0] * share.size  # e_s / f_s
    live = [c for c, queue in enumerate(queues) if queue]
    out: list[int] = []
    while live:
        pick, best = live[0], float("inf")
        for c in live:
            g = queues[c][heads[c]]
            cost = q[g] + 2.0 * sum(map(operator.mul, w, rows[g]))
            if cost < best:
                pick, best = c, cost
        group = queues[pick][heads[pick]]
        heads[pick] += 1
        if heads[pick] == len(queues[pick]):
            live.remove(pick)
        row, total = rows[group], sizes[group]
        for s, tokens in enumerate(row):
            if invs[s]:
                w[s] += tokens * invs[s] - total
        out.append(group)
    return np.asarray(out, dtype=np.int64)


def pack_source_tokens(
    offsets: IntArray, ids: IntArray, total: IntArray, bounds: IntArray
) -> npt.NDArray[np.int64]:
    """Tokens of each source in each pack: ``[packs, sources]``."""
    n_src, n_packs = int(bounds.size - 1), int(offsets.size - 1)
    if not ids.size:
        return np.zeros((n_packs, n_src), dtype=np.int64)
    src = np.searchsorted(bounds, ids, side="right") - 1
    pack = np.repeat(np.arange(n_packs, dtype=np.int64), np.diff(offsets))
    cells = np.bincount(pack * n_src + src, weights=total[ids], minlength=n_packs * n_src)
    return cells.astype(np.int64).reshape(n_packs, n_src)


def _plan_entries(
    entries: IntArray,
    total: IntArray,
    visual: IntArray,
    bounds: IntArray,
    *,
    capacity: int,
    packing_ratio: float,
    overlong: str,
    group_size: int,
    seed: int,
    single_source: bool,
    balance: BalancePolicy = "tokens",
    max_visual: int | None = None,
    images: IntArray | None = None,
    max_images: int | None = None,
    supervised: IntArray | None = None,
    per_rank: int | None = None,
) -> tuple[IntArray, IntArray, IntArray, npt.NDArray[np.bool_]]:
    """Packs of ``entries`` (global ids, repeats allowed) as CSR, the overlong ones left out,
    and which packs are made step groups (``PackPlan.free_from``: each part's first packs).
    Per source with ``single_source``. No pack holds a sample twice: under ``balance="cost"``
    a part's uses are planned together and copies moved apart (``_apart``), else one
    ``plan_packs`` per round (a sample's ``k``-th use is in round ``k``). ``balance``,
    ``max_visual`` (``images`` / ``max_images``) and ``per_rank`` (packs per rank per step,
    the step shape ``balance="cost"`` makes its groups for) are ``plan_packs``' own: each
    part's packs keep the budgets and come in its balance order."""
    src = np.searchsorted(bounds, entries, side="right") - 1
    sources = range(int(bounds.size - 1)) if single_source else [None]

    def plan(part: IntArray, how: BalancePolicy = balance) -> Packed:
        made = plan_packs(
            total[part], capacity, visual=visual[part], packing_ratio=packing_ratio,
            overlong=overlong, world_size=group_size, seed=seed, balance=how,
            max_visual=max_visual, images=None if images is None else images[part],
            max_images=max_images, supervised=None if supervised is None else supervised[part],
            per_rank=per_rank,
        )  # fmt: skip
        return made.offsets, part[made.ids], part[made.dropped_ids], made.free_from

    if balance != "cost":  # (rounds outer, sources inner: the plans as they were)
        rounds = use_index(entries)
        parts: Iterator[Packed] = (
            plan(part)  # one at a time: a 10M-entry epoch keeps one part in memory, not all
            for r in range(int(rounds.max()) + 1 if rounds.size else 0)
            for s in sources
            if (part := entries[(rounds == r) & (True if s is None else src == s)]).size
        )
    else:
        parts = (
            packed
            for s in sources
            if (part := entries if s is None else entries[src == s]).size
            for packed in _apart(
                plan(part),
                plan,
                total,
                visual,
                images,
                capacity=capacity,
                packing_ratio=packing_ratio,
                max_visual=max_visual,
                max_images=max_images,
            )
        )

    offs, ids, dropped, made, end = [np.zeros(1, np.int64)], [], [], [], 0
    for p_offsets, p_ids, p_dropped, free_from in parts:
        offs.append(p_offsets[1:] + end)
        end += int(p_offsets[-1])
        ids.append(p_ids)
        dropped.append(p_dropped)
        made.append(np.arange(p_offsets.size - 1) < free_from)
    out_offsets = np.concatenate(offs).astype(np.int64)
    made_mask = np.concatenate(made) if made else np.zeros(0, bool)
    return out_offsets, _cat(ids), np.unique(_cat(dropped)), made_mask


def _apart(
    packed: Packed,
    plan: Callable[[IntArray, BalancePolicy], Packed],
    total: IntArray,
    visual: IntArray,
    images: IntArray | None,
    *,
    capacity: int,
    packing_ratio: float,
    max_visual: int | None,
    max_images: int | None,
) -> Iterator[Packed]:
    """One plan of every use of a part (``packed``: CSR of sample ids, repeats allowed, and
    how many of its first packs are made groups, ``free_from``) with no pack holding a sample
    twice: second copies traded away (``separate_copies``). Best fit's packs after the made
    groups put a short sample's copies together (of 85,974 second copies at 3M uses, 85,727
    were there); where they hold more than ``TRADE_MAX`` (a large plan: trades cost ~40 us
    each, a few more packs nothing measurable) or some copy finds no trade, those packs are
    planned again by rounds, best fit, with the made groups' copies that found none."""
    offsets, ids, dropped, free_from = packed
    cut = int(offsets[free_from])
    copies = second_copies(offsets, ids)
    whole = int(np.count_nonzero(copies >= cut)) <= TRADE_MAX  # trade in every pack
    end = offsets.size if whole else free_from + 1
    traded, stuck = separate_copies(
        offsets[:end], ids[: int(offsets[end - 1])], total, visual, images,
        capacity=int(capacity * packing_ratio), max_visual=max_visual, max_images=max_images,
    )  # fmt: skip
    if whole and not stuck.size:
        yield offsets, traded, dropped, free_from
        return
    keep = np.ones(cut, dtype=bool)
    keep[stuck[stuck < cut]] = False
    pack_of = np.repeat(np.arange(free_from, dtype=np.int64), np.diff(offsets[: free_from + 1]))
    kept = np.bincount(pack_of[keep], minlength=free_from)
    made_offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    yield made_offsets, traded[:cut][keep], dropped, free_from
    rest = np.concatenate([traded[:cut][~keep], traded[cut:] if whole else ids[cut:]])
    rounds = use_index(rest)
    for r in range(int(rounds.max(initial=-1)) + 1):
        r_offsets, r_ids, _, _ = plan(rest[rounds == r], "tokens")  # best fit's packs
        yield r_offsets, r_ids, np.zeros(0, np.int64), 0


def _cat(parts: list[IntArray]) -> IntArray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _finish(
    prefix_offsets: IntArray,
    prefix_ids: IntArray,
    packed: tuple[IntArray, IntArray, npt.NDArray[np.bool_]],
    lengths: tuple[IntArray, IntArray, IntArray | None],
    bounds: IntArray,
    group_size: int,
    rng: np.random.Generator,
    balance: BalancePolicy,
) -> tuple[IntArray, IntArray, IntArray]:
    """Served prefix packs (kept in order) + new packs (``packed``: CSR and which packs are
    made step groups) in ``mix_order``: CSR and order. Under ``balance="cost"`` the made
    groups stay whole and the parts' other packs are ordered together
    (``balanced_order("cost")``), not cut where one part's packs end and the next's begin."""
    offsets, ids, made = packed
    tokens = pack_source_tokens(offsets, ids, lengths[0], bounds)
    if balance == "cost":
        load = _cost_load_order(offsets, ids, made, lengths, group_size)
        n_made = int(np.count_nonzero(made))
        order = load[mix_order(tokens[load], group_size, rng, free_from=n_made)]
    else:  # (the plans as they were: states saved under these balances still load)
        order = mix_order(tokens, group_size, rng)
    n_prefix = int(prefix_offsets.size - 1)
    all_offsets = np.concatenate([prefix_offsets, offsets[1:] + prefix_offsets[-1]])
    all_ids = np.concatenate([prefix_ids, ids])
    full = np.concatenate([np.arange(n_prefix, dtype=np.int64), order + n_prefix])
    return all_offsets.astype(np.int64), all_ids.astype(np.int64), full


def _cost_load_order(
    offsets: IntArray,
    ids: IntArray,
    made: npt.NDArray[np.bool_],
    lengths: tuple[IntArray, IntArray, IntArray | None],
    group_size: int,
) -> IntArray:
    """The made groups' packs (each part's, in order: whole groups), then every other pack
    in ``balanced_order("cost")``, as ``plan_packs`` orders one plan's free packs."""
    total, visual, images = lengths
    free = np.flatnonzero(~made)
    sub_offsets, sub_ids = reorder_packs(offsets, ids, free)
    terms = pack_cost_terms(sub_offsets, sub_ids, total, visual,
                            images=plan_images(images, "cost", None))  # fmt: skip
    tot_p = terms[:, COST_TERMS.index("tokens")].astype(np.int64)
    vis_p = terms[:, COST_TERMS.index("patches")].astype(np.int64)
    by_cost = balanced_order("cost", terms, vis_p, tot_p, group_size)
    return np.concatenate([np.flatnonzero(made), free[by_cost]]).astype(np.int64)


def _set_options(
    balance: str,
    max_visual: int | None,
    max_images: int | None = None,
    per_rank: int | None = None,
) -> list[object]:
    """The plan options set away from their defaults (plans without them keep their
    fingerprints, so states saved before them still load); ``per_rank`` only where it plans
    (``balance="cost"``), as in ``plan_packs``' fingerprint."""
    out: list[object] = []
    if balance != "tokens":
        out.append(f"balance={balance}")
    if balance == "cost" and per_rank is not None:
        out.append(f"per_rank={int(per_rank)}")
    if max_visual is not None:
        out.append(f"max_visual={int(max_visual)}")
    if max_images is not None:
        out.append(f"max_images={int(max_images)}")
    return out


def _fingerprint(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.astype("<i8").tobytes() if isinstance(p, np.ndarray) else repr(p).encode())
        h.update(b"|")
    return h.hexdigest()


def plan_mixture(
    counts: Sequence[IntArray],
    total: npt.ArrayLike,
    visual: npt.ArrayLike,
    *,
    capacity: int,
    epoch: int,
    packing_ratio: float = 1.0,
    overlong: str = "raise",
    group_size: int = 1,
    seed: int = 0,
    single_source: bool = False,
    balance: BalancePolicy = "tokens",
    max_visual: int | None = None,
    images: npt.ArrayLike | None = None,
    max_images: int | None = None,
    supervised: npt.ArrayLike | None = None,
    per_rank: int | None = None,
) -> MixturePlan:
    """Epoch ``epoch``'s plan: ``counts[s][i]`` uses of sample ``i`` of source ``s``
    (``mixture.epoch_counts``); ``total`` / ``visual`` are the concatenated length indexes.
    ``per_rank``: packs per rank per step (the graph's ``batch_size``), which
    ``balance="cost"`` makes its step groups for (``plan_packs``); the other balances ignore it.

    >>> from neatpack.pipes.mixtures.mixture import epoch_counts
    >>> counts = epoch_counts([4, 3], [2, 3], ["a", "b"], seed=0, epoch=0)
    >>> plan = plan_mixture(counts, [3, 3, 2, 2, 2], [0] * 5, capacity=6, epoch=0)
    >>> sorted(sorted(plan.pack(int(p))) for p in plan.order)  # a's 2nd uses: another pack
    [[0, 1], [0, 1], [2, 3, 4]]
    """
    tot = np.asarray(total, dtype=np.int64)
    vis = np.asarray(visual, dtype=np.int64)
    imgs = None if images is None else np.asarray(images, dtype=np.int64)
    sup = None if supervised is None else np.asarray(supervised, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum([c.size for c in counts])]).astype(np.int64)
    if int(bounds[-1]) != tot.size or vis.shape != tot.shape:
        raise ValueError(
            f"counts cover {int(bounds[-1])} samples, lengths {tot.size} and visual {vis.size}: "
            "one count per sample of each source, in the order of the concatenated index"
        )
    entries = np.concatenate(
        [np.repeat(np.arange(c.size, dtype=np.int64) + bounds[s], c) for s, c in enumerate(counts)]
    )
    offsets, ids, dropped, made = _plan_entries(
        entries, tot, vis, bounds, capacity=capacity, packing_ratio=packing_ratio,
        overlong=overlong, group_size=group_size, seed=seed, single_source=single_source,
        balance=balance, max_visual=max_visual, images=imgs, max_images=max_images,
        supervised=sup, per_rank=per_rank,
    )  # fmt: skip
    rng = np.random.default_rng([seed, epoch, 1])
    empty = np.zeros(1, np.int64)
    offsets, ids, order = _finish(
        empty, np.zeros(0, np.int64), (offsets, ids, made), (tot, vis, imgs), bounds,
        group_size, rng, balance,
    )  # fmt: skip
    fp = _fingerprint(
        "mixture-plan/1", epoch, group_size, capacity, packing_ratio, overlong, seed,
        single_source, offsets, ids, order,
        *_set_options(balance, max_visual, max_images, per_rank),
    )  # fmt: skip
    return MixturePlan(
        offsets=offsets, ids=ids, order=order, bounds=bounds, epoch=epoch,
        group_size=group_size, fingerprint=fp, dropped_ids=dropped,
        replan_dropped=np.zeros(0, np.int64),
    )  # fmt: skip


def replan_from_cursor(
    plan: MixturePlan,
    cursor: int,
    targets: Sequence[int] | IntArray,
    names: Sequence[str],
    total: npt.ArrayLike,
    visual: npt.ArrayLike,
    *,
    capacity: int,
    packing_ratio: float = 1.0,
    overlong: str = "raise",
    seed: int = 0,
    single_source: bool = False,
    balance: BalancePolicy = "tokens",
    max_visual: int | None = None,
    images: npt.ArrayLike | None = None,
    max_images: int | None = None,
    supervised: npt.ArrayLike | None = None,
    per_rank: int | None = None,
) -> MixturePlan:
    """``plan`` with ``order[:cursor]`` kept (served) and the rest planned for ``targets``
    (uses per source in the whole epoch, e.g. ``source_targets`` of the new blend), with the
    plan options ``plan_mixture`` takes.

    >>> from neatpack.pipes.mixtures.mixture import epoch_counts
    >>> counts = epoch_counts([2, 3], [2, 3], ["a", "b"], seed=0, epoch=0)
    >>> old = plan_mixture(counts, [3, 3, 2, 2, 2], [0] * 5, capacity=3, epoch=0)
    >>> new = replan_from_cursor(old, 1, [2, 1], ["a", "b"], [3, 3, 2, 2, 2], [0] * 5,
    ...                          capacity=3)
    >>> len(new), new.replan_dropped.size  # b wanted 1 use instead of 3: 2 uses listed
    (3, 2)
    """
    tot = np.asarray(total, dtype=np.int64)
    vis = np.asarray(visual, dtype=np.int64)
    imgs = None if images is None else np.asarray(images, dtype=np.int64)
    sup = None if supervised is None else np.asarray(supervised, dtype=np.int64)
    if not 0 <= cursor <= len(plan):
        raise ValueError(f"{cursor=} must lie in [0, {len(plan)}] (the plan's packs)")
    served = plan.order[:cursor]
    prefix_sizes = np.diff(plan.offsets)[served]
    prefix_offsets = np.concatenate([[0], np.cumsum(prefix_sizes)]).astype(np.int64)
    prefix_ids = (
        np.concatenate([plan.ids[plan.offsets[p] : plan.offsets[p + 1]] for p in served])
        if cursor
        else np.zeros(0, np.int64)
    )
    rest = plan.order[cursor:]
    rest_ids = (
        np.concatenate([plan.ids[plan.offsets[p] : plan.offsets[p + 1]] for p in rest])
        if rest.size
        else np.zeros(0, np.int64)
    )
    bounds = plan.bounds
    entries, dropped = [], [plan.replan_dropped]
    for s, name in enumerate(names):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        used = np.bincount(
            prefix_ids[(prefix_ids >= lo) & (prefix_ids < hi)] - lo, minlength=hi - lo
        )
        left = np.bincount(rest_ids[(rest_ids >= lo) & (rest_ids < hi)] - lo, minlength=hi - lo)
        want = max(int(targets[s]) - int(used.sum()), 0)
        rng = source_rng(seed, plan.epoch, name, cursor)
        if want <= int(left.sum()):
            keep = fill_counts(used, want, rng, cap=left)
            dropped.append(np.repeat(np.arange(hi - lo, dtype=np.int64) + lo, left - keep))
        else:
            keep = left + fill_counts(used + left, want - int(left.sum()), rng)
        entries.append(np.repeat(np.arange(hi - lo, dtype=np.int64) + lo, keep))
    offsets, ids, overlong_out, made = _plan_entries(
        np.concatenate(entries), tot, vis, bounds, capacity=capacity,
        packing_ratio=packing_ratio, overlong=overlong, group_size=plan.group_size, seed=seed,
        single_source=single_source, balance=balance, max_visual=max_visual, images=imgs,
        max_images=max_images, supervised=sup, per_rank=per_rank,
    )  # fmt: skip
    rng = np.random.default_rng([seed, plan.epoch, 2, cursor])
    offsets, ids, order = _finish(
        prefix_offsets, prefix_ids, (offsets, ids, made), (tot, vis, imgs), bounds,
        plan.group_size, rng, balance,
    )  # fmt: skip
    fp = _fingerprint("mixture-replan/1", plan.fingerprint, cursor, list(targets), offsets, ids)
    return MixturePlan(
        offsets=offsets, ids=ids, order=order, bounds=bounds, epoch=plan.epoch,
        group_size=plan.group_size, fingerprint=fp,
        dropped_ids=np.union1d(plan.dropped_ids, overlong_out).astype(np.int64),
        replan_dropped=np.sort(np.concatenate(dropped)).astype(np.int64),
    )  # fmt: skip
