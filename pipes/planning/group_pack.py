"""Packs made for their step groups (``balance="cost"``): the ranks of a step get alike packs.

Sorting finished packs (``balance.balanced_order``) can only pick neighbours among packs that
best fit made without knowing the ranks. Here the packs of a step group are made together:

1. fillers are kept back: a share of the tokens (the candidate's), text-only samples first
   (they add no vision to even), shortest first;
2. the other samples, text-only apart from those with images and by length inside each, are
   cut into *tuples* of ``group_size`` neighbours: alike in length, so in attention
   (``length ** 2``). Each class is cut into whole tuples (its shortest ``count % size``
   samples join the fillers): a tuple of both could not be evened (at 64 ranks the one
   mixed tuple made a group of vision max/mean 17). With a span above 1, windows of
   ``span`` tuples are sorted by vision cost first, so a tuple is alike in vision too, at
   some cost in length;
3. the tuples are packed by best fit on their longest member (``best_fit_decreasing``, or
   ``best_fit_two_budgets`` with ``max_visual``): one tuple-pack is one step group, and each
   of its ``group_size`` packs takes one member of every tuple in it. With the room rules
   (below), a group whose room no filler fits gives up its shortest tuple (``_tuple_packs``);
4. fillers go, best fit, into the room every pack of the group shares (``capacity`` minus
   the tuples' longest members); with the room rules, into rooms of at least ``WIDE_ROOM``
   of a pack as tuples of alike fillers first, dealt as members (``_filler_tuples``);
5. which member goes to which pack is dealt tuple by tuple, the widest spread first, the
   member of most cost to the pack with the least so far (LPT, the fillers counted), then up
   to ``SWAP_ROUNDS`` trades of one tuple's two members between the heaviest and the lightest
   pack. Dealt twice, on vision cost and on attention plus vision (each over its mean: the
   tuple of the longest samples is spread in length, 2,171 to 2,538 tokens in docvqa), and
   each group keeps the deal with the lower max/mean of the two terms;
6. fillers left over go, best fit, into each pack's own room (its longest members minus its
   own: 0.45 % of the tokens at 64 ranks, which left unfilled cost 0.5 fill points), and
   only those that fit nowhere make step groups of their own (steps 2-5 again). The groups
   whose fill would pull the plan's below best fit's by more than ``FILL_SLACK`` (the worst
   filled first; how many, estimated from their tokens, then checked by best fit and
   bisected) are packed by best fit after the groups (the *free* packs, in
   ``balanced_order("cost")``). With ``max_visual``, fillers that break the budget move out
   (``binpack.within_budget``; the members stay).

``group_packs`` builds one candidate per ``CANDIDATES`` (span, filler share), and
``ROOMS_CANDIDATE`` once more with the room rules where its fill left a step group of free
packs, and keeps the one whose step groups have the lowest p95 max/mean
(``balance.group_p95``), the worse of the two terms, with one pack per rank and with
``per_rank`` (a graph's ``batch_size``; else ``SCORE_PER_RANK``), or best fit's packs in
``balanced_order("cost")`` where those score lower: so the plan is never worse than sorting
finished packs on its own measure. ``images`` (media items per sample) price vision as
``balance.pack_cost_terms`` does, so the deal and the score agree.

Measured (``benchmarks/bench_step_balance.py``: p95 over steps of max/mean attention /
vision, shuffle on, two epochs; one / four packs per rank), against the sorted finished
packs (``cost_order``):

=========================  =====  ===============  ===============
lengths                    ranks  made groups      cost_order
=========================  =====  ===============  ===============
generated, 100k samples    8      1.007 / 1.034    1.083 / 1.073
                                  1.012 / 1.019    1.032 / 1.036
generated, 100k samples    64     1.014 / 1.046    1.206 / 1.242
                                  1.038 / 1.034    1.122 / 1.079
generated, 1M samples      8      1.003 / 1.012    1.022 / 1.023
                                  1.004 / 1.009    1.008 / 1.016
generated, 1M samples      64     1.008 / 1.036    1.086 / 1.067
                                  1.012 / 1.017    1.038 / 1.034
OmniBal docvqa (10,211)    64     1.030 / 1.045    1.094 / 1.123
                                  1.026 / 1.020    1.037 / 1.055
=========================  =====  ===============  ===============

Every other cell (ai2d, chartqa, docvqa and their mix, whole, at 8 and 64 ranks) <= 1.04;
fill within 0.18 points of best fit's. docvqa at 64 ranks has 160 samples per rank and 29
steps an epoch, so p95 over two epochs sits at the third-worst of 58 steps: one group above
1.05 (two steps) passes, two do not. Sorting best fit's packs by attention alone leaves p95
1.093 (the worst step at least 1.28: the heaviest pack over the mean of the 64 heaviest).

The room rules are for that case. Its samples are 821 tokens or more but 15 (all with
images), so a room under 821 stays empty: best fit put five tuples of ~1,490 into a group
(room ~700, fill .90) in six groups, and single fillers into rooms of ~1,800-2,100 took one
of 1,355 and left the rest (fill .90-.93). The plan kept (64, .20) then dropped two of its
30 groups for the fill (``ROOMS_CANDIDATE`` kept 19 groups without the rules), and the 84
free packs stepped at attention max/mean 1.11-1.13 once an epoch (p95 1.073 / 1.064). With
the rules all 29 groups are kept (fill .9786, above best fit's .9744), the free packs are
the short last step (``free_from``), and one group a term is over 1.05: on attention the one
holding the longest samples (2,171 to 2,538 tokens, 1.073: its four tuples fill its packs,
and the other three are too narrow to make up the longest's spread), on vision one of 1.062
(tuples of 3- and 5-tile samples). The gain depends on ``WIDE_ROOM``: 0.25 and 0.30 pass
(1.030 / 1.045 and 1.041 / 1.043); at 0.20 and 0.35-0.50 the build with the rules scores
worse and the one without is kept (1.073 / 1.064): which groups the fill keeps turns on a
few hundred tokens of room (``ROOM_WASTE`` 0.005-0.02 pass, 0 and 0.03 do not). The
generated lengths leave no free step group to ``ROOMS_CANDIDATE``, so their plans and times
are the same with the room rules; docvqa at 64 ranks plans in 0.13 s of CPU, 0.12 s without
them.

The candidates, and best fit's score, are built in threads (numpy lets go of the GIL in its
sorts, gathers and sums): as many as the cores and the free memory allow (``_threads``:
``SHARED_BYTES`` a sample, then ``CANDIDATE_BYTES`` a thread), and the pick is the first
candidate of the lowest score whatever order they end in, so the plan is the same with one
thread or six. Planning takes 2.2 s at 1M samples and 17-22 s at 10M (64 / 8 ranks; 138e5df
in the same run: 2.1 s and 30 s; best fit alone 0.08 s and 0.7 s) on a shared 2-core machine,
two threads at a time; one thread: 25 s of CPU at 10M, 64 ranks, against 29 s. At 100M
samples, 64 ranks: 372 s in one thread (the free memory held one: peak RSS 19.4 GB with the
lengths), of which 180 s in the kernel (the page faults of fresh full-size arrays): ``python
benchmarks/bench_plan.py --balance-only --balance cost,tokens --sizes 1000000,10000000 --ranks
8,64 --baseline <checkout>``.

Above ``CHUNK_SAMPLES`` (8M) samples they are planned in chunks (``chunk_count``: as few as
keep each at most that), sample ``i`` in chunk ``i % chunks``, so each is a fair share of a
file sorted by length or by source: every chunk is planned as above (all the candidates, its
own pick), one after another, and the plan is every chunk's made groups, whole, in chunk
order, then the free samples of all of them packed again together by best fit (in
``balanced_order("cost")``). The peak is then one chunk's, not the whole set's, and the time
grows with the samples, not faster: at 10M samples, 64 ranks, in two chunks, 29.8 s and
2.05 GB peak RSS against 31.7 s and 2.82 GB in one (made groups p95 attention / vision
1.006 / 1.007 against 1.003 / 1.008; fill 0.99881 against 0.99949, best fit's 0.99996).
At 100M samples, 64 ranks, in 13 chunks: 348 s (325 s of CPU, 116 s of it in the kernel) and
peak RSS 9.6 GB with the lengths (the process held 4.6 GB before planning: generating them),
against 372 s and 19.4 GB in one; made groups p95 1.004 / 1.007, fill 0.99926
(``/usr/bin/time -v`` around ``plan_packs`` of ``bench_plan.vlm_lengths``). Chunks of fewer
samples make less alike tuples: ``bench_step_balance``'s generated 1M samples in 4 chunks of
250k (``CHUNK_SAMPLES`` lowered) step at p95 1.004 / 1.032 and 1.009 / 1.047 (8 / 64 ranks,
one pack per rank) against 1.003 / 1.012 and 1.008 / 1.036 in one plan, as 250k samples
would; at 8M a chunk is past the 1M plan's evenness.
Plans of up to ``CHUNK_SAMPLES`` samples are the same as before (and so are their
fingerprints: ``plan._params`` names the chunks only where there are several).

The plan keeps the made groups as its first packs (``PackPlan.free_from``); the epoch shuffle
permutes whole groups and draws the short last group from the free packs, so every step of
the epoch is a made group or a group of free packs. Another world size is another plan
(elastic resume re-plans for it: a pure function of the lengths, the config and the size).

Worked by hand, ``group_size=2``, capacity 10, lengths ``[5, 5, 3, 3, 2, 2]`` with visual
``[4, 3, 0, 0, 0, 0]`` (too few tokens for fillers). Best fit makes ``[0, 1]`` (attention
``5^2 + 5^2 = 50``, all the vision) and ``[2, 3, 4, 5]`` (attention 26, no vision): one rank
would wait for the other on both. Here the tuples are (4, 5) and (2, 3) (text-only, by
length) and (1, 0) (images); their longest members, 2 + 3 + 5, fill one tuple-pack. The
tuple (1, 0) is dealt first (the widest vision spread): sample 0 (4 visual tokens) to pack
0, sample 1 (3) to pack 1, and the text-only tuples after it. Packs ``[0, 3, 5]`` and
``[1, 2, 4]``: 10 tokens and attention 38 each, vision 4 against 3.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from neatpack.pipes.planning.balance import (
    COST_TERMS,
    balanced_order,
    group_p95,
    imbalance,
    pack_cost_terms,
    pack_costs,
    sample_vision_cost,
)
from neatpack.pipes.planning.binpack import (
    IntArray,
    best_fit_decreasing,
    best_fit_two_budgets,
    radix_argsort,
    reorder_packs,
    within_budget,
)

__all__ = [
    "CANDIDATES",
    "CHUNK_SAMPLES",
    "FILL_SLACK",
    "GroupedPacks",
    "chunk_count",
    "group_packs",
    "grouped_order",
]

#: How far below best fit's fill (a fraction of capacity) the plan may go: 0.18 points.
FILL_SLACK: Final = 0.0018
#: The candidates built, the best kept: (span, filler share). The span is the window (in
#: tuples) of samples by length inside which tuples are cut by vision cost (1: by length
#: alone); the filler share, how much of the tokens (the shortest samples) is kept back to
#: fill each pack's room (more where tuples of many ranks leave more room).
CANDIDATES: Final = ((1, 0.05), (1, 0.10), (4, 0.05), (16, 0.20), (64, 0.20))
#: The candidate built again with the room rules (``_tuple_packs``, ``_filler_tuples``) where
#: its fill leaves a step group of free packs.
ROOMS_CANDIDATE: Final = (16, 0.20)
#: Groups whose attention max/mean is above ``1 +`` this after the vision deal (and above
#: their vision's) are dealt again on both terms: most groups are even in attention already.
REDEAL_ABOVE: Final = 0.01
#: How much lower (in max/mean) made groups must score than best fit's packs to be kept.
SCORE_MARGIN: Final = 0.01
#: Packs per rank of the second step shape candidates are scored on, where the caller does
#: not say (``group_packs(per_rank=)``).
SCORE_PER_RANK: Final = 4
#: Member trades per group after the deal, over its ``SWAP_TUPLES`` widest-spread tuples,
#: ``SWAP_BLOCK`` groups at a time (bounded memory at 100M samples).
SWAP_ROUNDS: Final = 16
SWAP_TUPLES: Final = 16
SWAP_BLOCK: Final = 1 << 15
#: The room rules: a group's shared room over ``ROOM_WASTE`` of a pack that no filler fits
#: costs it a tuple (``_tuple_packs``), at most ``ROOM_ROUNDS`` times over; rooms of at least
#: ``WIDE_ROOM`` of a pack take fillers as tuples first (``_filler_tuples``).
ROOM_WASTE: Final = 0.01
ROOM_ROUNDS: Final = 4
WIDE_ROOM: Final = 0.25
#: Memory per sample that ``group_packs`` holds for all its candidates (the samples' orders
#: and fillers per filler share) and that one candidate takes while it is built and scored
#: (tracemalloc at 2M samples, 64 ranks: 141 bytes a sample with one thread, +67 with a
#: second): it runs no more candidates at once than the free memory holds.
SHARED_BYTES: Final = 64
CANDIDATE_BYTES: Final = 96
#: Above this many samples ``group_packs`` plans them in chunks of at most this many (sample
#: ``i`` in chunk ``i % chunks``: each a fair share of a file sorted by length or source), one
#: chunk at a time: its memory and time stay those of this many samples.
CHUNK_SAMPLES: Final = 8_000_000

FloatArray = npt.NDArray[np.float64]
#: (offsets, ids, order, grouped): CSR packs and their storage order; its first ``grouped``
#: packs are the step groups as made (``group_size`` consecutive ones each), then the rest.
GroupedPacks = tuple[IntArray, IntArray, IntArray, int]


def _csr(sizes: npt.NDArray[Any]) -> IntArray:
    out = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


def _best_fit(lengths: IntArray, visual: IntArray, capacity: int, max_visual: int | None,
              sub: IntArray | None = None) -> tuple[IntArray, IntArray]:  # fmt: skip
    """Best fit's packs of the samples ``sub`` (all when None), CSR over positions in ``sub``:
    ``best_fit_decreasing``, or ``best_fit_two_budgets`` with ``max_visual`` (``visual`` is
    gathered only then)."""
    if max_visual is None:
        return best_fit_decreasing(lengths if sub is None else lengths[sub], capacity)
    if sub is not None:
        lengths, visual = lengths[sub], visual[sub]
    return best_fit_two_budgets(lengths, visual, capacity, max_visual)


def _into_rooms(
    used: IntArray, cand: IntArray, lengths: IntArray, capacity: int
) -> tuple[IntArray, IntArray, IntArray]:
    """Best fit of samples ``cand`` into packs already holding ``used`` tokens: (pack of each
    placed sample, placed ids, the ids that fit nowhere). Each pack is a unit of
    ``capacity + 1 + used`` at ``2 * capacity + 1`` (``best_fit_two_budgets``' trick: no two
    units share a pack, each leaves exactly its room)."""
    n_packs = used.size
    if cand.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    units = np.concatenate([capacity + 1 + used, lengths[cand]]).astype(np.int64, copy=False)
    b_off, items = best_fit_decreasing(units, 2 * capacity + 1)
    bin_of = np.repeat(np.arange(b_off.size - 1), np.diff(b_off))
    head = items[b_off[:-1]]
    unit_of_bin = np.where(head < n_packs, head, -1)
    is_sample = items >= n_packs
    pack = unit_of_bin[bin_of[is_sample]].astype(np.int64)
    ids = cand[items[is_sample] - n_packs].astype(np.int64)
    return pack[pack >= 0], ids[pack >= 0], ids[pack < 0]


def _tuples(visual: IntArray, vcost: FloatArray, order: IntArray, span: int) -> IntArray:
    """``order`` (text-only samples, then those with images, each by length) re-sorted for
    cutting into tuples: windows of ``span`` samples (a whole number of tuples, so no tuple
    straddles two) sorted by vision cost inside. The classes stay apart (a tuple of both
    could not be evened) but for the one tuple where they meet."""
    if span <= 1:
        return order
    window = np.arange(order.size) // span
    # one stable sort on (window, vision cost): below 2**30 while visual < 2**14
    key = (window << 30) | np.minimum(vcost[order], 2**30 - 1).astype(np.int64)
    return order[np.argsort(key, kind="stable")]


def _assign(members: IntArray, vcost: FloatArray, tp_of: IntArray, n_tp: int, size: int,
            start_v: FloatArray, vc: FloatArray | None = None) -> IntArray:  # fmt: skip
    """Pack (0..size-1 within its group) of every member: rounds of one tuple per group, LPT;
    then swaps of one tuple's members between the heaviest and the lightest pack. ``vc``:
    ``vcost[members]`` where the caller has it."""
    counts = np.bincount(tp_of, minlength=n_tp)
    starts = _csr(counts)[:-1]
    if vc is None:
        vc = vcost[members]
    n_rounds = int(counts.max(initial=0))
    # Each round as slices, not gathers and scatters by group: the groups by tuple count, most
    # first (those a round deals to are a prefix), members laid out round by round (round
    # i's are one block, in that group order). 1.6x faster at 10M samples.
    by_count = np.argsort(-counts, kind="stable")
    rank = np.empty(n_tp, dtype=np.int64)
    rank[by_count] = np.arange(n_tp)
    dealt = n_tp - np.cumsum(np.bincount(counts, minlength=n_rounds + 1))[:n_rounds]
    block = _csr(dealt)
    slot = block[np.arange(tp_of.size) - starts[tp_of]] + rank[tp_of]  # each row's place
    vc_r = np.empty_like(vc)
    vc_r[slot] = vc
    del vc  # (gathered back for the swaps: one [members, size] array less at the peak)
    heavy_r = np.argsort(-vc_r, axis=1, kind="stable").astype(np.min_scalar_type(-size))
    dest_r = np.empty_like(members)
    load_r = start_v[by_count].astype(np.float64)  # (a copy; bincount of nothing is int)
    for i in range(n_rounds):
        here, heavy = slice(block[i], block[i + 1]), heavy_r[block[i] : block[i + 1]]
        load = load_r[: dealt[i]]
        light = np.argsort(load, axis=1, kind="stable")
        np.put_along_axis(dest_r[here], heavy, light, axis=1)
        # each pack of a group takes one member: its load grows by that member's cost
        gain = np.empty((dealt[i], size))
        np.put_along_axis(gain, light, np.take_along_axis(vc_r[here], heavy, axis=1), axis=1)
        load += gain
    del heavy_r
    dest: IntArray = dest_r[slot]
    del dest_r
    vc = vc_r[slot]
    load = np.empty_like(load_r)
    load[by_count] = load_r
    for g0 in range(0, n_tp, SWAP_BLOCK):
        _swap(dest, vc, load, counts, starts, g0, min(n_tp, g0 + SWAP_BLOCK))
    return dest


def _swap(dest: IntArray, vc: FloatArray, load: FloatArray, counts: IntArray,
          starts: IntArray, g0: int, g1: int) -> None:  # fmt: skip
    """Groups ``g0:g1``: up to ``SWAP_ROUNDS`` times, trade one tuple's members between the
    heaviest and the lightest pack, the tuple whose trade leaves them closest (in place)."""
    size = dest.shape[1]
    k = min(SWAP_TUPLES, int(counts[g0:g1].max(initial=0)))
    if k == 0 or size < 2:
        return
    ng = g1 - g0
    kc = np.minimum(counts[g0:g1], k)  # the tuples of each group that may trade
    first = _csr(kc)  # group g's in by_pack: rows first[g]:first[g + 1]
    valid = np.arange(k)[None, :] < kc[:, None]  # [groups, k]
    # (group, i) -> its row of by_pack (clamped where there is no tuple i: masked below)
    tuple_i = np.minimum(np.arange(k)[None, :], np.maximum(kc, 1)[:, None] - 1)
    pair = np.minimum(first[:-1, None] + tuple_i, max(int(first[-1]) - 1, 0))
    row_of = np.repeat(starts[g0:g1] - first[:-1], kc) + np.arange(first[-1])  # in dest
    # by_pack[p, j]: vision of the member of p's tuple in pack j. Only the groups' own tuples
    # (5.9 a group on average at 10M samples, not 16 with padding): 5x less at 64 ranks
    by_pack = np.empty((row_of.size, size))
    np.put_along_axis(by_pack, dest[row_of], vc[row_of], axis=1)
    lo_all = load[g0:g1]
    live = np.arange(ng)  # a group no trade helps stays so (nothing in it changes): dropped
    for _ in range(SWAP_ROUNDS):
        at = np.arange(live.size)
        sub = lo_all[live]
        hi, lo = sub.argmax(axis=1), sub.argmin(axis=1)
        gap = sub[at, hi] - sub[at, lo]
        p = pair[live]
        delta = by_pack[p, hi[:, None]] - by_pack[p, lo[:, None]]  # [groups, k]: hi's - lo's
        after = np.abs(gap[:, None] - 2 * delta)
        after[(delta <= 0) | ~valid[live]] = np.inf
        best = after.argmin(axis=1)
        ok = after[at, best] < gap * (1 - 1e-9)
        if not ok.any():
            break
        g, q = live[ok], p[at, best][ok]
        h, low, d = hi[ok], lo[ok], delta[at, best][ok]
        by_pack[q, h], by_pack[q, low] = by_pack[q, low], by_pack[q, h]
        lo_all[g, h] -= d
        lo_all[g, low] += d
        r = row_of[q]
        in_h, in_l = dest[r] == h[:, None], dest[r] == low[:, None]
        dest[r] = np.where(in_h, low[:, None], np.where(in_l, h[:, None], dest[r]))
        live = g


def _split(
    lengths: IntArray, visual: IntArray, share: float = 0.05, images: IntArray | None = None
) -> tuple[FloatArray, IntArray, IntArray]:
    """(vision cost per sample, fillers, the other samples by (has images, length, visual)).
    Fillers: ``share`` of the tokens, text-only samples first (no vision to even), shortest
    first."""
    return _splits(lengths, visual, (share,), images)[share]


def _splits(
    lengths: IntArray, visual: IntArray, shares: tuple[float, ...], images: IntArray | None
) -> dict[float, tuple[FloatArray, IntArray, IntArray]]:
    """``_split`` for each share, from two stable radix sorts on packed keys (``has images,
    length`` and ``has images, length, visual``, each field in as few bits as its largest
    value needs: 2 passes of 16 bits at pack sizes to 16k, 2.5x faster than numpy's stable
    sort of int64 keys at 10M samples): the others keep the order of all samples by the key."""
    vcost = sample_vision_cost(visual, images)
    has = (visual > 0).astype(np.int64)
    lb = int(lengths.max(initial=0)).bit_length()
    vb = int(visual.max(initial=0)).bit_length()
    by_filler = radix_argsort((has << lb) | lengths, lb + 1)
    by_key = radix_argsort((has << (lb + vb)) | (lengths << vb) | visual, 1 + lb + vb)
    cum = np.cumsum(lengths[by_filler])
    out = {}
    for share in shares:
        k = int(np.searchsorted(cum, share * float(cum[-1] if cum.size else 0)))
        filler = np.zeros(lengths.size, dtype=bool)
        filler[by_filler[:k]] = True
        out[share] = (vcost, by_filler[:k], by_key[~filler[by_key]])
    return out


def _build(
    lengths: IntArray,
    visual: IntArray,
    capacity: int,
    size: int,
    max_visual: int | None,
    span: int,
    best_fit_packs: int,
    split: tuple[FloatArray, IntArray, IntArray],
    rooms: bool = False,
) -> tuple[IntArray, IntArray, int] | None:
    vcost, fillers, by_length = split
    made = _groups(lengths, visual, vcost, capacity, size, max_visual, span, by_length, fillers,
                   rooms)  # fmt: skip
    if made is None:
        return None
    pack, ids, n_members, f_pack, f_ids, rest = made
    n_packs = int(pack.max()) + 1
    if rest.size:  # 6. fillers left over, into each pack's own room (before they make groups)
        placed = np.concatenate([ids, f_ids])
        used = np.bincount(np.concatenate([pack, f_pack]), weights=lengths[placed],
                           minlength=n_packs).astype(np.int64)  # fmt: skip
        p2, i2, rest = _into_rooms(used, rest, lengths, capacity)
        f_pack, f_ids = np.concatenate([f_pack, p2]), np.concatenate([f_ids, i2])
    if rest.size >= size:  # fillers the rooms did not take: step groups of their own
        key = ((visual[rest] > 0).astype(np.int64) << 48) | (lengths[rest] << 24) | visual[rest]
        order = rest[np.argsort(key, kind="stable")]
        more = _groups(lengths, visual, vcost, capacity, size, max_visual, span, order, rest[:0],
                       rooms)  # fmt: skip
        if more is not None:
            pack2, ids2, n2, f_pack2, f_ids2, rest = more
            pack = np.concatenate([pack, n_packs + pack2])
            ids = np.concatenate([ids, ids2])
            n_members += n2
            f_pack = np.concatenate([f_pack, n_packs + f_pack2])  # (fillers after members)
            f_ids = np.concatenate([f_ids, f_ids2])
            n_packs += int(pack2.max()) + 1
    pack, ids = np.concatenate([pack, f_pack]), np.concatenate([ids, f_ids])
    if rest.size:  # 6. what is left, into each pack's own room
        used = np.bincount(pack, weights=lengths[ids], minlength=n_packs).astype(np.int64)
        p2, i2, rest = _into_rooms(used, rest, lengths, capacity)
        pack, ids = np.concatenate([pack, p2]), np.concatenate([ids, i2])
    return _finish(lengths, visual, capacity, size, max_visual, pack, ids, rest, n_members,
                   best_fit_packs)  # fmt: skip


def _groups(
    lengths: IntArray,
    visual: IntArray,
    vcost: FloatArray,
    capacity: int,
    size: int,
    max_visual: int | None,
    span: int,
    order: IntArray,
    fillers: IntArray,
    rooms: bool = False,
) -> tuple[IntArray, IntArray, int, IntArray, IntArray, IntArray] | None:
    """Steps 2-5 over ``order`` (ids by images or not, then length): (pack of each member,
    members, their count, pack of each placed filler, placed fillers, samples left over)."""
    # each class (text-only, then with images) cut into whole tuples: its shortest
    # ``count % size`` samples join the fillers (a tuple of both could not be evened)
    n_text = int(np.count_nonzero(visual[order] == 0))
    r_text, r_img = n_text % size, (order.size - n_text) % size
    fillers = np.concatenate([fillers, order[:r_text], order[n_text : n_text + r_img]])
    order = np.concatenate([order[r_text:n_text], order[n_text + r_img :]])
    if order.size == 0:
        return None
    tup = _tuples(visual, vcost, order, span * size).reshape(-1, size)
    longest = lengths[tup].max(axis=1)
    # the shortest room every pack of a group can fill: the ``size``-th shortest filler
    fit = 0
    if rooms and fillers.size >= size:
        fit = int(np.partition(lengths[fillers], size - 1)[size - 1])
    t_off, t_ids = _tuple_packs(longest, visual[tup].max(axis=1), capacity, max_visual, fit)
    # 4. fillers into the room every pack of a group shares: as tuples into wide rooms
    # (dealt as members), then one by one
    if rooms:
        tup, t_off, t_ids, fillers = _filler_tuples(lengths, visual, capacity, size, max_visual,
                                                    tup, t_off, t_ids, fillers)  # fmt: skip
        longest = lengths[tup].max(axis=1)
    n_tp = t_off.size - 1
    tp_of = np.repeat(np.arange(n_tp), np.diff(t_off))
    used = np.repeat(np.add.reduceat(longest[t_ids], t_off[:-1]), size)
    f_pack, f_ids, rest = _into_rooms(used, fillers, lengths, capacity)
    # 5. members to packs, dealt on vision cost; the groups where attention is then the
    # worse term are dealt again on attention plus vision, each over its mean (the tuple
    # of the longest samples is spread in length), and keep the deal with the lower max/mean
    rows = tup[t_ids]
    members, dest = _deal(rows, vcost, tp_of, n_tp, size, f_pack, f_ids)
    att, vis = _spreads(lengths, vcost, members, dest, tp_of, n_tp, f_pack, f_ids)
    again = np.flatnonzero((att > vis) & (att > 1 + REDEAL_ABOVE))
    if again.size:
        in_again = np.zeros(n_tp, dtype=bool)
        in_again[again] = True
        sub, f_sub = in_again[tp_of], in_again[f_pack // size]
        # the rows' squares and vision gathered once (the same means: same values, same
        # shape), and the cost of both terms only for the samples dealt again (zeros: pages
        # never written take no memory; the second call of a candidate has few samples)
        sq_rows = lengths[rows].astype(np.float64)
        sq_rows *= sq_rows
        v_rows = vcost[rows]
        dealt = np.concatenate([rows[sub].ravel(), f_ids[f_sub]])
        cost = lengths[dealt].astype(np.float64)
        cost *= cost
        cost /= max(float(sq_rows.mean()), 1.0)
        del sq_rows
        if (v_rows > 0).any():
            cost += vcost[dealt] / float(v_rows[v_rows > 0].mean())
        del v_rows
        both = np.zeros(lengths.size)
        both[dealt] = cost
        del dealt, cost
        local = np.searchsorted(again, tp_of[sub])
        f_local = np.searchsorted(again, f_pack[f_sub] // size) * size + f_pack[f_sub] % size
        m2, d2 = _deal(rows[sub], both, local, again.size, size, f_local, f_ids[f_sub])
        att2, vis2 = _spreads(lengths, vcost, m2, d2, local, again.size, f_local, f_ids[f_sub])
        better = (np.maximum(att2, vis2) < np.maximum(att, vis)[again])[local]
        members[sub] = np.where(better[:, None], m2, members[sub])
        dest[sub] = np.where(better[:, None], d2, dest[sub])
    pack = (tp_of[:, None] * size + dest).ravel()
    return pack, members.ravel(), members.size, f_pack, f_ids, rest


def _tuple_packs(longest: IntArray, top_visual: IntArray, capacity: int,
                 max_visual: int | None, fit: int) -> tuple[IntArray, IntArray]:  # fmt: skip
    """Step 3: tuples packed by best fit on their longest member (CSR over tuple indices).
    A group whose shared room is over ``ROOM_WASTE`` of a pack yet under ``fit`` (no filler
    fits it) gives up its shortest tuple, and the tuples given up are packed again, up to
    ``ROOM_ROUNDS`` times: best fit puts five docvqa tuples of ~1,490 tokens into 8,192 and
    leaves rooms of ~700 that none of its fillers (>= 821 tokens but 15) fits (fill .90)."""

    def packed(sub: IntArray) -> tuple[IntArray, IntArray]:
        off, ids = _best_fit(longest, top_visual, capacity, max_visual, sub)
        return off, sub[ids]

    off, ids = packed(np.arange(longest.size))
    if fit == 0:
        return off, ids
    done_off, done_ids = [np.zeros(1, dtype=np.int64)], []
    for _ in range(ROOM_ROUNDS):
        count = np.diff(off)
        room = capacity - np.add.reduceat(longest[ids], off[:-1])
        bad = (room > ROOM_WASTE * capacity) & (room < fit) & (count > 1)
        if not bad.any():
            break
        group = np.repeat(np.arange(count.size), count)
        shortest = np.lexsort((longest[ids], group))[off[:-1]]  # each group's shortest tuple
        out = np.zeros(ids.size, dtype=bool)
        out[shortest[bad]] = True
        done_off.append(np.diff(off) - np.bincount(group[out], minlength=count.size))
        done_ids.append(ids[~out])
        off, ids = packed(ids[out])
    done_off.append(np.diff(off))
    done_ids.append(ids)
    return _csr(np.concatenate(done_off[1:])), np.concatenate(done_ids).astype(np.int64)


def _filler_tuples(lengths: IntArray, visual: IntArray, capacity: int, size: int,
                   max_visual: int | None, tup: IntArray, t_off: IntArray, t_ids: IntArray,
                   fillers: IntArray) -> tuple[IntArray, IntArray, IntArray, IntArray]:  # fmt: skip
    """Fillers cut into tuples (by images or not, then length: alike) that go, best fit on
    their longest member, into the rooms of at least ``WIDE_ROOM`` of a pack: (tuples, the
    groups as CSR over them, the fillers left). Best fit of single fillers fills one pack
    after another: in a docvqa group of one tuple and 6,700 tokens of room some packs took
    five fillers of 1,337 tokens and 5 tiles, others seven of ~1,000 and 3 tiles (attention
    max/mean 1.12, vision 1.22); as tuples they are dealt like members."""
    if fillers.size < size or t_ids.size == 0:
        return tup, t_off, t_ids, fillers
    n_groups = t_off.size - 1
    used = np.add.reduceat(lengths[tup].max(axis=1)[t_ids], t_off[:-1])
    if not (used <= (1 - WIDE_ROOM) * capacity).any():
        return tup, t_off, t_ids, fillers
    used[used > (1 - WIDE_ROOM) * capacity] = capacity  # narrow rooms: fillers one by one
    has = visual[fillers] > 0
    by = fillers[np.lexsort((visual[fillers], lengths[fillers], has))]
    n_text = int(np.count_nonzero(~has))
    r_text, r_img = n_text % size, (by.size - n_text) % size  # each class cut whole
    left = [by[:r_text], by[n_text : n_text + r_img]]
    ftup = np.concatenate([by[r_text:n_text], by[n_text + r_img :]]).reshape(-1, size)
    group, placed, out = _into_rooms(used, np.arange(ftup.shape[0]), lengths[ftup].max(axis=1),
                                     capacity)  # fmt: skip
    t_group = np.repeat(np.arange(n_groups), np.diff(t_off))  # each tuple's group
    if max_visual is not None and placed.size:  # a group over the visual budget takes none
        top = visual[tup].max(axis=1)
        load = np.bincount(t_group, weights=top[t_ids], minlength=n_groups)
        load += np.bincount(group, weights=visual[ftup[placed]].max(axis=1), minlength=n_groups)
        ok = load[group] <= max_visual
        out = np.concatenate([out, placed[~ok]])
        group, placed = group[ok], placed[ok]
    if placed.size == 0:
        return tup, t_off, t_ids, fillers
    all_group = np.concatenate([t_group, group])
    all_ids = np.concatenate([t_ids, tup.shape[0] + placed])
    t_off = _csr(np.bincount(all_group, minlength=n_groups))
    left.append(ftup[out].ravel())
    return (np.concatenate([tup, ftup]), t_off, all_ids[np.argsort(all_group, kind="stable")],
            np.concatenate(left).astype(np.int64))  # fmt: skip


def _deal(rows: IntArray, cost: FloatArray, tp_of: IntArray, n_tp: int, size: int,
          f_pack: IntArray, f_ids: IntArray) -> tuple[IntArray, IntArray]:  # fmt: skip
    """Step 5 on ``cost``: (the tuples, widest spread first in each group, and the pack of
    each member), the fillers' cost counted."""
    start = np.bincount(f_pack, weights=cost[f_ids], minlength=n_tp * size).astype(np.float64)
    by_row = cost[rows]  # gathered once: the spread's, and (rows reordered) the deal's
    spread = by_row.max(axis=1)
    spread -= by_row.min(axis=1)
    order = np.lexsort((-spread, tp_of))
    members = rows[order]
    dest = _assign(members, cost, tp_of, n_tp, size, start.reshape(n_tp, size), by_row[order])
    return members, dest


def _spreads(lengths: IntArray, vcost: FloatArray, members: IntArray, dest: IntArray,
             tp_of: IntArray, n_tp: int, f_pack: IntArray,
             f_ids: IntArray) -> tuple[FloatArray, FloatArray]:  # fmt: skip
    """Per group: max/mean over its packs of attention and of vision cost, fillers counted."""
    size = dest.shape[1]
    pack = (tp_of[:, None] * size + dest).ravel()
    out = []
    for squared, cost in ((True, lengths), (False, vcost)):
        # squared after the gather: the same values, without a float copy of every sample
        weights = [cost[m].astype(np.float64, copy=False) for m in (members.ravel(), f_ids)]
        if squared:
            for w in weights:
                w *= w
        load = np.bincount(pack, weights=weights[0], minlength=n_tp * size)
        load += np.bincount(f_pack, weights=weights[1], minlength=n_tp * size)
        out.append(imbalance(load.reshape(n_tp, size)))
    return out[0], out[1]


def _finish(
    lengths: IntArray,
    visual: IntArray,
    capacity: int,
    size: int,
    max_visual: int | None,
    pack: IntArray,
    ids: IntArray,
    rest: IntArray,
    n_members: int,
    best_fit_packs: int,
) -> tuple[IntArray, IntArray, int] | None:
    """Keep the groups the fill allows (worst filled go first), pack the rest by best fit."""
    n_groups = int(pack.max(initial=-1)) // size + 1
    total = float(lengths.sum())
    floor_fill = total / (best_fit_packs * capacity) - FILL_SLACK
    group = pack // size  # (once: free_packs below asks for it on every try)
    g_tok = np.bincount(group, weights=lengths[ids], minlength=n_groups)
    worst = np.argsort(g_tok, kind="stable")

    def free_packs(drop: int) -> tuple[npt.NDArray[np.bool_], IntArray, IntArray, IntArray, bool]:
        keep = np.ones(n_groups, dtype=bool)
        keep[worst[:drop]] = False
        free = np.concatenate([rest, ids[~keep[group]]])
        f_off, f_sub = _best_fit(lengths, visual, capacity, max_visual, free)
        fill = total / ((int(keep.sum()) * size + f_off.size - 1) * capacity)
        return keep, free, f_off, f_sub, fill >= floor_fill

    # the fewest worst-filled groups to drop: estimated from the free tokens (a prefix sum)
    # packed at a fill ``eff`` (first best fit's own, then what best fit of the free samples
    # measured), checked by best fit; then doubling and bisection between a count that fell
    # short and one that did not, to within 2 % (a few rounds of best fit; the fill is
    # nearly monotone in the count)
    free_tok = float(lengths[rest].sum()) + np.concatenate([[0.0], np.cumsum(g_tok[worst])])
    counts = size * (n_groups - np.arange(n_groups + 1))

    def estimate(eff: float) -> int:
        fill = total / ((counts + np.ceil(free_tok / (capacity * eff))) * capacity)
        return int(np.argmax(fill >= floor_fill)) if (fill >= floor_fill).any() else n_groups

    short, hi, found = -1, n_groups + 1, None  # short: fell short; hi: the fewest that did not
    drop, eff = estimate(floor_fill + FILL_SLACK), floor_fill + FILL_SLACK
    for _ in range(3):
        trial = free_packs(drop)
        if trial[4]:
            hi, found = drop, trial
        else:
            short = drop
        if trial[2].size > 1 and free_tok[drop] > 0:
            eff = free_tok[drop] / ((trial[2].size - 1) * capacity)
        drop = min(max(estimate(eff), short + 1), hi - 1)
        if drop <= short or drop >= hi:
            break
    step = 1
    while found is None and short < n_groups:
        drop = min(n_groups, short + step)
        trial = free_packs(drop)
        hi, found, short = (drop, trial, short) if trial[4] else (hi, None, drop)
        step *= 2
    if found is None:
        return None
    while hi - short > max(1, hi // 50):
        mid = (short + hi) // 2
        trial = free_packs(mid)
        short, hi, found = (short, mid, trial) if trial[4] else (mid, hi, found)
    keep, free, f_off, f_sub, _ = found
    kept = int(keep.sum())
    if kept == 0:
        return None
    renumber = np.cumsum(keep) - 1
    in_kept = keep[group]
    n_members = int(in_kept[:n_members].sum())
    pack = pack[in_kept]  # renumbered: each kept group moves down by the groups dropped before it
    pack += ((renumber - np.arange(n_groups)) * size)[group[in_kept]]
    ids = ids[in_kept]
    g_off = _csr(np.bincount(pack, minlength=kept * size))
    if max_visual is None:
        g_ids = ids[_longest_first(pack, lengths[ids])]
    else:  # fillers may break the budget: members first, so fillers move out (new packs)
        g_ids = ids[np.lexsort((np.arange(ids.size) >= n_members, pack))]
        g_off, g_ids = within_budget(g_off, g_ids, lengths, visual, capacity, max_visual)
        pack_of = np.repeat(np.arange(g_off.size - 1), np.diff(g_off))
        g_ids = g_ids[_longest_first(pack_of, lengths[g_ids])]
    offsets = _csr(np.concatenate([np.diff(g_off), np.diff(f_off)]))
    return offsets, np.concatenate([g_ids, free[f_sub]]).astype(np.int64), kept * size


def _longest_first(pack: IntArray, length: IntArray) -> IntArray:
    """The order by pack, longest sample first inside each (one stable sort, packed key)."""
    return np.argsort((pack.astype(np.int64) << 32) - length, kind="stable")


def group_packs(
    lengths: npt.ArrayLike,
    visual: npt.ArrayLike,
    capacity: int,
    group_size: int,
    *,
    max_visual: int | None = None,
    images: npt.ArrayLike | None = None,
    per_rank: int | None = None,
    chunks: int | None = None,
) -> GroupedPacks | None:
    """Packs made ``group_size`` at a time (module docstring), every sample exactly once, each
    within ``capacity`` tokens (and ``max_visual`` visual tokens when set; every sample must
    fit both alone): ``GroupedPacks``. Where made groups do not beat them (or lose more
    than ``FILL_SLACK`` of fill), best fit's packs in ``balanced_order("cost")`` with
    ``grouped=0``. None for ``group_size < 2`` or fewer samples than that. ``images``: media
    items per sample (``LengthIndex.images``), which price the vision encoder as
    ``balance.pack_cost_terms`` does (None: one image per sample). ``per_rank``: packs per
    rank per step, when known: candidates are scored on that step shape as well as on one
    pack per rank (None: ``SCORE_PER_RANK``). ``chunks``: how many chunks the samples are
    planned in (sample ``i`` in chunk ``i % chunks``; None: ``chunk_count`` of the samples).

    >>> offsets, ids, order, grouped = group_packs([5, 5, 3, 3, 2, 2], [4, 3, 0, 0, 0, 0], 10, 2)
    >>> [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])], order.tolist(), grouped
    ([[0, 3, 5], [1, 2, 4]], [0, 1], 2)
    """
    tok = np.asarray(lengths).astype(np.int64, copy=False)
    vis = np.asarray(visual).astype(np.int64, copy=False)
    imgs = None if images is None else np.asarray(images).astype(np.int64, copy=False)
    if group_size < 2 or tok.size < group_size:
        return None
    shape = (group_size, SCORE_PER_RANK if per_rank is None else per_rank)
    k = chunk_count(tok.size) if chunks is None else chunks
    k = max(1, min(k, tok.size // group_size))  # every chunk holds a step group's samples
    if k == 1:
        return _one_set(tok, vis, capacity, group_size, max_visual, imgs, shape)
    made: list[tuple[IntArray, IntArray]] = []  # (offsets, ids) of each chunk's made groups
    free: list[IntArray] = []  # the samples of each chunk's free packs
    for c in range(k):  # one after another: the peak is one chunk's (its candidates threaded)
        sub = np.arange(c, tok.size, k, dtype=np.int64)
        part = _one_set(tok[sub], vis[sub], capacity, group_size, max_visual,
                        None if imgs is None else imgs[sub], shape)  # fmt: skip
        off, ids, order, grouped = part
        made.append(reorder_packs(off, sub[ids], order[:grouped]))
        free.append(reorder_packs(off, sub[ids], order[grouped:])[1])
        del part, off, ids, order
    # the free samples of every chunk packed again together, by best fit: one part-filled
    # last pack, not one a chunk (at 4 chunks of 10,000 samples, 0.0006 of fill)
    rest = np.concatenate(free)
    f_off, f_sub = _best_fit(tok, vis, capacity, max_visual, rest)
    sizes = [np.diff(off) for off, _ in made] + [np.diff(f_off)]
    offsets = _csr(np.concatenate(sizes))
    ids = np.concatenate([i for _, i in made] + [rest[f_sub]]).astype(np.int64, copy=False)
    grouped = sum(off.size - 1 for off, _ in made)
    terms = pack_cost_terms(offsets, ids, tok, vis, imgs)
    return offsets, ids, grouped_order(terms, grouped, group_size), grouped


def chunk_count(n: int) -> int:
    """How many chunks ``group_packs`` plans ``n`` samples in: one up to ``CHUNK_SAMPLES``,
    then as many as keep each at most that (sample ``i`` in chunk ``i % chunks``)."""
    return max(1, -(-n // CHUNK_SAMPLES))


def _one_set(tok: IntArray, vis: IntArray, capacity: int, group_size: int,
             max_visual: int | None, imgs: IntArray | None,
             shape: tuple[int, int]) -> GroupedPacks:  # fmt: skip
    """``group_packs`` of one set of samples (the whole, or one chunk): every candidate and
    best fit's packs, the best kept."""
    with ThreadPoolExecutor(_threads(tok.size), thread_name_prefix="group-packs") as pool:
        shares = tuple(sorted({share for _, share in CANDIDATES}))
        splitting = pool.submit(_splits, tok, vis, shares, imgs)
        bf_off, bf_ids = _best_fit(tok, vis, capacity, max_visual)
        today = pool.submit(_scored, bf_off, bf_ids, 0, tok, vis, *shape, images=imgs)
        splits = splitting.result()
        made = {pool.submit(_candidate, tok, vis, capacity, group_size, max_visual, span,
                            share, bf_off.size - 1, splits[share], shape, imgs): i
                for i, (span, share) in enumerate(CANDIDATES)}  # fmt: skip
        del splits
        score, packs = today.result()
        # the first candidate of the lowest score, best fit's packs before them all (made
        # groups must win clearly): the same pick whatever order the threads end in, and
        # only the best so far is held
        best, best_i = (score - SCORE_MARGIN, packs), -1
        for done in as_completed(made):
            i, scored = made.pop(done), done.result()
            if scored is not None and (scored[0], i) < (best[0], best_i):
                best, best_i = scored, i
    return best[1]


def _candidate(tok: IntArray, vis: IntArray, capacity: int, group_size: int,
               max_visual: int | None, span: int, share: float, best_fit_packs: int,
               split: tuple[FloatArray, IntArray, IntArray], shape: tuple[int, int],
               imgs: IntArray | None) -> tuple[float, GroupedPacks] | None:  # fmt: skip
    """One of ``CANDIDATES`` built and scored (a pure function: candidates run in threads).
    ``share`` is the candidate's filler share: ``ROOMS_CANDIDATE``, where its build leaves a
    whole step group of free packs, is built again with the room rules, and the rules' build
    is kept only where it scores lower."""
    built = _build(tok, vis, capacity, group_size, max_visual, span, best_fit_packs, split)
    if built is None:
        return None
    scored = _scored(*built, tok, vis, *shape, images=imgs)
    if (span, share) != ROOMS_CANDIDATE or built[0].size - 1 - built[2] < group_size:
        return scored
    del built
    rooms = _build(tok, vis, capacity, group_size, max_visual, span, best_fit_packs, split, True)
    if rooms is None:
        return scored
    with_rules = _scored(*rooms, tok, vis, *shape, images=imgs)
    return with_rules if with_rules[0] < scored[0] else scored


def _threads(n: int) -> int:
    """Threads for ``group_packs``: its candidates and best fit's score at once (numpy lets
    go of the GIL in its sorts, gathers and sums), as many as the cores, and as the free
    memory holds (``SHARED_BYTES`` and ``CANDIDATE_BYTES`` a sample each); at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    threads = min(len(CANDIDATES) + 1, cores)
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))  # fmt: skip
    except (OSError, StopIteration, ValueError):  # not Linux: the cores alone
        return threads
    return max(1, min(threads, (free - SHARED_BYTES * n) // max(CANDIDATE_BYTES * n, 1)))


def grouped_order(terms: FloatArray, grouped: int, group_size: int) -> IntArray:
    """Storage order of packs from ``group_packs``: the step groups as made, then the free
    packs in ``balanced_order("cost")`` among themselves."""
    n = terms.shape[0]
    free = terms[grouped:]
    tokens = free[:, 0].astype(np.int64)
    rest = balanced_order("cost", free, np.zeros(n - grouped, np.int64), tokens, group_size)
    return np.concatenate([np.arange(grouped, dtype=np.int64), grouped + rest])


def _scored(offsets: IntArray, ids: IntArray, grouped: int, lengths: IntArray,
            visual: IntArray, group_size: int, per_rank: int = SCORE_PER_RANK, *,
            images: IntArray | None = None) -> tuple[float, GroupedPacks]:  # fmt: skip
    """The packs in storage order, and what the candidates are chosen on: the worst p95 over
    steps of max/mean attention or vision cost, with one pack per rank (a step group) and
    with ``per_rank`` (that many groups, drawn as an epoch's shuffle would: a few bad groups
    then touch more steps). ``images`` prices vision as ``balance.pack_cost_terms`` does."""
    terms = pack_cost_terms(offsets, ids, lengths, visual, images)
    _, vision = pack_costs(terms)
    order = grouped_order(terms, grouped, group_size)
    n = order.size // group_size * group_size
    groups = np.random.default_rng(0).permutation(n // group_size)  # fixed: a pure function
    n4 = groups.size // per_rank * per_rank if per_rank > 1 else 0
    score = 1.0
    for col in (terms[order, COST_TERMS.index("attention")], vision[order]):
        score = max(score, group_p95((col,), group_size))
        if n4:
            by_rank = col[:n].reshape(-1, group_size)[groups[:n4]]
            steps = by_rank.reshape(-1, per_rank, group_size).sum(axis=1)
            score = max(score, float(np.percentile(imbalance(steps), 95)))
    return score, (offsets, ids, order, grouped)
