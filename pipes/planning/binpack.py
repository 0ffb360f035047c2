"""Bin packing of sample lengths into packs: the seed's ``greedy_knapsack`` and a fast planner.

Both take integer lengths (tokens, after the shift) and a capacity, and return packs of sample
ids. ``greedy_knapsack`` is the seed's algorithm, bit for bit (a Python heap: ~1 s per 1M
samples). ``best_fit_decreasing`` packs 1M samples in well under a second and never uses more
packs than it on the benchmark distributions (``benchmarks/bench_plan.py``).

>>> greedy_knapsack([5, 4, 3, 3, 9, 2], 8, overlong="drop")
[[0, 3], [1, 2], [5]]
>>> overlong_ids([5, 4, 3, 3, 9, 2], 8)
[4]
>>> offsets, ids = best_fit_decreasing([5, 4, 3, 3, 2], 8)
>>> [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
[[0, 2], [1, 3], [4]]
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

from neatpack.pipes.compat.renamed import renamed_keywords

__all__ = [
    "OVERLONG_POLICIES",
    "OverlongPolicy",
    "add_arange",
    "best_fit_decreasing",
    "best_fit_two_budgets",
    "bfd_bin_ids",
    "check_budget",
    "greedy_knapsack",
    "id_dtype",
    "lower_bound",
    "overlong_ids",
    "packed_csr",
    "radix_argsort",
    "reorder_packs",
    "within_budget",
]

#: A sample longer than a pack: raise naming it, or drop it (counted).
OverlongPolicy = Literal["raise", "drop"]
OVERLONG_POLICIES: tuple[str, ...] = get_args(OverlongPolicy)
IntArray = npt.NDArray[np.int64]


def overlong_ids(lengths: Sequence[int] | npt.ArrayLike, max_length: int) -> list[int]:
    """Ids of the samples longer than ``max_length`` (those a packer cannot place)."""
    return np.flatnonzero(np.asarray(lengths) > max_length).tolist()


def check_lengths(
    lengths: npt.ArrayLike, capacity: int, overlong: str, who: str, kw: str = "overlong"
) -> IntArray:
    """Validate lengths and capacity; raise on overlong samples unless ``overlong="drop"``."""
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"{who}: {kw}={overlong!r} is not one of {OVERLONG_POLICIES}")
    if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 1:
        raise ValueError(f"{who}: capacity must be a positive int, got {capacity=!r}")
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(
            f"{who}: lengths must be 1-D ints, got dtype {arr.dtype} shape {arr.shape}"
        )
    if arr.dtype not in (np.int32, np.int64):  # int32 (a LengthIndex's) is kept: no copy
        arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        bad = np.flatnonzero(arr < 0)[:5].tolist()
        raise ValueError(f"{who}: negative lengths at sample ids {bad}: {arr[bad].tolist()}")
    if overlong == "raise" and arr.size and arr.max() > capacity:
        bad = np.flatnonzero(arr > capacity)
        shown = ", ".join(f"sample {i} (length {arr[i]})" for i in bad[:5].tolist())
        raise ValueError(
            f"{who}: {bad.size} sample(s) longer than the capacity {capacity}: {shown}"
            f"{' ...' if bad.size > 5 else ''}. Fix: raise the capacity, filter them out, or "
            f"pass {kw}='drop' to leave them out (listed by overlong_ids / dropped_ids)."
        )
    return arr


@renamed_keywords(on_overlong="overlong")
def greedy_knapsack(
    lengths: Sequence[int], max_length: int, *, overlong: str = "raise"
) -> list[list[int]]:
    """The seed's greedy knapsack: worst-fit decreasing with a min-heap of bin fills.

    Samples are visited longest first (stable: equal lengths keep id order). Only the
    least-filled bin is tried; if the sample does not fit there it opens a new bin. Bins come
    back in creation order, ids inside a bin longest first.

    The seed silently drops samples longer than ``max_length``. Here that raises a
    ``ValueError`` naming them, unless ``overlong="drop"``, which gives the seed's exact
    result; the dropped ids are ``overlong_ids(lengths, max_length)``.

    Worked by hand, ``([5, 4, 3, 3, 9, 2], 8, overlong="drop")``: visit order 9 (id 4,
    dropped), 5 -> new bin A, 4 -> A would be 9: new bin B, 3 (id 2) -> B (least filled, 7),
    3 (id 3) -> A (5 < 7: now 8), 2 -> B would be 9: new bin C. Result ``[[0, 3], [1, 2], [5]]``.
    """
    arr = check_lengths(lengths, max_length, overlong, "greedy_knapsack")
    values: list[int] = arr.tolist()
    order = sorted(range(len(values)), key=lambda i: -values[i])
    bins: list[list[int]] = []
    heap: list[tuple[int, int]] = []
    for idx in order:
        n = values[idx]
        if n > max_length:
            continue
        if heap and heap[0][0] + n <= max_length:
            fill, b = heapq.heappop(heap)
            bins[b].append(idx)
            heapq.heappush(heap, (fill + n, b))
        else:
            bins.append([idx])
            heapq.heappush(heap, (n, len(bins) - 1))
    return bins


def lower_bound(lengths: npt.ArrayLike, capacity: int) -> int:
    """max(ceil(sum / capacity), Martello-Toth L2): no packing can use fewer packs.

    >>> lower_bound([6, 6, 6, 1, 1], 10), -(-20 // 10)
    (3, 2)
    """
    arr = check_lengths(lengths, capacity, "raise", "lower_bound")
    if arr.size == 0:
        return 0
    c = int(capacity)
    cnt = np.bincount(arr, minlength=c + 1).astype(np.int64)
    tok = cnt * np.arange(c + 1, dtype=np.int64)
    ccum = np.concatenate([[0], np.cumsum(cnt)])  # ccum[v] = #items with length < v
    scum = np.concatenate([[0], np.cumsum(tok)])
    half = c // 2
    alpha = np.arange(half + 1)
    n1 = ccum[c + 1] - ccum[c - alpha + 1]  # length > c - alpha
    n2 = ccum[c - alpha + 1] - ccum[half + 1]  # c/2 < length <= c - alpha
    s2 = scum[c - alpha + 1] - scum[half + 1]
    s3 = scum[half + 1] - scum[alpha]  # alpha <= length <= c/2
    extra = np.maximum(0, -(-(s3 - (n2 * c - s2)) // c))
    l2 = int((n1 + n2 + extra).max())
    return max(l2, -(-int(arr.sum()) // c))


class _Nodes:
    """Classes of bins with identical contents so far (a split tree; leaves are final bins)."""

    def __init__(self) -> None:
        self.count: list[int] = []  # bins in the class
        self.items: list[int] = []  # items per bin so far
        self.children: list[list[int]] = []
        self.roots: list[int] = []
        self.rec_node: list[int] = []  # record: every bin of rec_node gets rec_k items
        self.rec_k: list[int] = []
        self.rec_prior: list[int] = []  # items each of those bins held before

    def new(self, count: int, parent: int) -> int:
        self.count.append(count)
        self.items.append(self.items[parent] if parent >= 0 else 0)
        self.children.append([])
        node = len(self.count) - 1
        (self.roots if parent < 0 else self.children[parent]).append(node)
        return node

    def record(self, node: int, k: int) -> None:
        self.rec_node.append(node)
        self.rec_k.append(k)
        self.rec_prior.append(self.items[node])
        self.items[node] += k

    def leaf_of(self, node: int) -> int:
        while self.children[node]:
            node = self.children[node][0]
        return node


def _bfd_records(cnt: list[int], capacity: int) -> _Nodes:
    """Best-fit decreasing on counts: the Python loop runs over distinct lengths, not samples.

    Bins with equal remaining room ``r`` are interchangeable, so they are kept as classes in
    ``groups[r]``. ``k`` samples of length ``L`` go, best fit, into the bin with the least room
    ``r >= L``; that bin then takes ``r // L`` of them. Equal-content bins move as one class.
    """
    nodes = _Nodes()
    groups: dict[int, deque[tuple[int, int]]] = {}
    keys: list[int] = []  # sorted rooms with a non-empty group
    present = [v for v in range(capacity, 0, -1) if cnt[v]]
    lmin = present[-1] if present else 1
    for length in present:
        need = cnt[length]
        moves: list[tuple[int, int, int]] = []  # (new room, class, bins)
        i = bisect_left(keys, length)
        while need and i < len(keys):
            room = keys[i]
            k = room // length
            dq = groups[room]
            while need and dq:
                node, nb = dq[0]
                if nb * k <= need:
                    dq.popleft()
                    nodes.record(node, k)
                    moves.append((room - k * length, node, nb))
                    need -= nb * k
                    continue
                full, part = divmod(need, k)
                if full:
                    a = nodes.new(full, node)
                    nodes.record(a, k)
                    moves.append((room - k * length, a, full))
                if part:
                    p = nodes.new(1, node)
                    nodes.record(p, part)
                    moves.append((room - part * length, p, 1))
                rest = nb - full - (1 if part else 0)
                dq[0] = (nodes.new(rest, node), rest)
                need = 0
            if dq:
                i += 1
            else:
                del groups[room]
                keys.pop(i)
        if need:  # nothing open fits: open bins holding capacity // length samples each
            q = capacity // length
            nb, extra = divmod(need, q)
            if nb:
                a = nodes.new(nb, -1)
                nodes.record(a, q)
                moves.append((capacity - q * length, a, nb))
            if extra:
                p = nodes.new(1, -1)
                nodes.record(p, extra)
                moves.append((capacity - extra * length, p, 1))
        for room, node, nb in moves:
            if room < lmin:  # no remaining sample fits: the bin is closed
                continue
            if room not in groups:
                groups[room] = deque()
                insort(keys, room)
            groups[room].append((node, nb))
    if cnt[0]:  # zero-length samples join the first bin (they take no room)
        if nodes.roots:
            leaf = nodes.leaf_of(nodes.roots[0])
            one = nodes.new(1, leaf)
            if nodes.count[leaf] > 1:
                nodes.new(nodes.count[leaf] - 1, leaf)
        else:
            one = nodes.new(1, -1)
        nodes.record(one, cnt[0])
    return nodes


_COUNT_BLOCK = 1 << 22


def _counts(arr: IntArray, capacity: int, may_overlong: bool = True) -> IntArray:
    """Samples of each length ``0..capacity`` (overlong ones, dropped, not counted), a block
    at a time: ``bincount`` casts its input to intp first, a whole int64 copy of int32
    lengths (800 MB and 1.8 s at 100M samples, against 0.2 s in blocks)."""
    clip = may_overlong and arr.shape[0] > 0 and int(arr.max()) > capacity
    out = np.zeros(capacity + 2, dtype=np.int64)
    for i in range(0, arr.shape[0], _COUNT_BLOCK):
        block = arr[i : i + _COUNT_BLOCK]
        if clip:
            block = np.minimum(block, capacity + 1)
        out += np.bincount(block, minlength=capacity + 2)
    return out[: capacity + 1]


def _layout(
    cnt: IntArray, capacity: int, sizes_too: bool = True
) -> tuple[npt.NDArray[np.signedinteger[Any]], IntArray, IntArray, IntArray, int]:
    """Run the planner on the length counts; per (bin, record) pair: bin id, items, prior
    items; and bin sizes (the last two empty unless ``sizes_too``; bin ids do not need them).
    Bin ids are int32 when they fit.
    Pairs come in slot order (see ``_slot_chunks``): a record's ``k`` items per bin are the
    next ``k`` slots of its length."""
    nodes = _bfd_records(cnt.tolist(), capacity)
    n_nodes = len(nodes.count)
    lo = [0] * n_nodes
    sizes: list[int] = []
    counts: list[int] = []
    stack = list(reversed(nodes.roots))
    nxt = 0
    while stack:  # depth first, so every class owns a contiguous range of bin ids
        v = stack.pop()
        lo[v] = nxt
        if nodes.children[v]:
            stack.extend(reversed(nodes.children[v]))
        else:
            nxt += nodes.count[v]
            sizes.append(nodes.items[v])
            counts.append(nodes.count[v])
    rn = np.asarray(nodes.rec_node, dtype=np.int64)
    rcount = np.asarray(nodes.count, dtype=np.int64)[rn]
    start = np.cumsum(rcount) - rcount
    n_pairs = int(rcount.sum())
    small = np.int32 if n_pairs < 2**31 else np.int64  # bins <= pairs; int32 halves the traffic
    pair_bin = np.repeat((np.asarray(lo, dtype=np.int64)[rn] - start).astype(small), rcount)
    pair_bin += np.arange(n_pairs, dtype=small)
    pair_k = np.repeat(np.asarray(nodes.rec_k, dtype=np.int64), rcount)
    if not sizes_too:
        empty = np.zeros(0, dtype=np.int64)
        return pair_bin, pair_k, empty, empty, nxt
    pair_prior = np.repeat(np.asarray(nodes.rec_prior, dtype=np.int64), rcount)
    bin_size = np.repeat(np.asarray(sizes, dtype=np.int64), np.asarray(counts, dtype=np.int64))
    return pair_bin, pair_k, pair_prior, bin_size, nxt


_CHUNK_BITS = 18  # 256k ids per chunk: the chunk's arrays (~6 MiB) stay in L2/L3 cache


def _slot_chunks(
    arr: IntArray, capacity: int, cnt: IntArray
) -> Iterator[tuple[int, npt.NDArray[np.intp], IntArray]]:
    """Per chunk of ids, ``(first, local, slots)``: sample ``first + local[j]`` takes slot
    ``slots[j]``. Slots number the kept samples longest first and, within a length, by id:
    exactly the positions a stable argsort of ``-length`` gives. Overlong samples take the
    slots from ``cnt.sum()`` on, by id.

    Why not that argsort: at 10M samples it alone took ~0.35 s, and scattering through its
    permutation another ~0.2 s. Here each chunk of ``2**_CHUNK_BITS`` ids is put in order
    by itself: below 65,536 tokens a pack, a stable argsort of the lengths as uint16 (numpy
    sorts 16-bit keys by radix: ~5 ns a sample with the cast, against ~26 ns for the sort
    below on this machine); wider lengths sort one packed key ``length << bits | local id``
    (the keys are unique, so numpy's unstable sort is stable in effect). A running count per
    length across chunks turns a chunk's sorted order into global slots, and the caller
    scatters results back inside the chunk, which is in cache.
    """
    n = arr.shape[0]
    cap1 = capacity + 1  # the one class of all overlong samples
    if cap1 < 1 << 16:
        yield from _radix_chunks(arr, cap1, _slot_bases(cnt, cap1))
        return
    bits = _CHUNK_BITS
    # 14 bits of length (capacity < 16383) + 18 of local id fit a uint32; larger use uint64
    wide = cap1.bit_length() + bits > 32
    dtype: type[np.unsignedinteger[Any]] = np.uint64 if wide else np.uint32
    base = _slot_bases(cnt, cap1)
    clip = n > 0 and int(arr.max()) > capacity
    size = max(1, min(n, 1 << bits))
    local = np.arange(size, dtype=dtype)
    step = np.arange(size, dtype=np.int64)
    key_buf = np.empty(size, dtype=dtype)  # buffers reused by every chunk (no page faults)
    cls_buf = np.empty(size, dtype=dtype)
    new_buf = np.empty(size, dtype=np.bool_)
    ids_buf = np.empty(size, dtype=np.intp)
    clip_buf = np.empty(size if clip else 0, dtype=np.int64)
    mask = dtype((1 << bits) - 1)
    first = np.zeros(1, dtype=np.intp)
    for c0 in range(0, n, size):
        a = arr[c0 : c0 + size]
        m = a.shape[0]
        if clip:
            a = np.minimum(a, cap1, out=clip_buf[:m])
        key = key_buf[:m]
        np.left_shift(a, bits, out=key, casting="unsafe")
        key |= local[:m]
        key.sort()
        cls = np.right_shift(key, bits, out=cls_buf[:m])
        slots = _run_slots(cls, first, new_buf, base, step)
        # the caller uses (ids, slots) before asking for the next chunk: ids is a buffer
        yield c0, np.bitwise_and(key, mask, out=ids_buf[:m], casting="unsafe"), slots


def _run_slots(
    cls: npt.NDArray[Any],
    first: npt.NDArray[np.intp],
    new_buf: npt.NDArray[np.bool_],
    base: IntArray,
    step: IntArray,
) -> IntArray:
    """The slot of each of a chunk's sorted lengths ``cls``: each run of one length takes the
    next free slots of that length (``base``, advanced in place)."""
    m = cls.shape[0]
    starts = np.flatnonzero(np.not_equal(cls[1:], cls[:-1], out=new_buf[: m - 1]))
    starts += 1
    starts = np.concatenate((first, starts))  # first position of each length in the chunk
    runs = np.diff(starts, append=m)
    lens = cls[starts]
    delta = base[lens] - starts
    base[lens] += runs
    slots = np.repeat(delta, runs)
    slots += step[:m]
    return slots


def _slot_bases(cnt: IntArray, cap1: int) -> IntArray:
    """The first slot of each length ``0..cap1`` (longest first; ``cap1``: the overlong)."""
    base = np.empty(cap1 + 1, dtype=np.int64)  # the next free slot of each length
    rev = cnt[::-1]
    base[:cap1] = (np.cumsum(rev) - rev)[::-1]
    base[cap1] = int(cnt.sum())
    return base


def _radix_chunks(
    arr: IntArray, cap1: int, base: IntArray
) -> Iterator[tuple[int, npt.NDArray[np.intp], IntArray]]:
    """``_slot_chunks`` for lengths below 65,536 (``cap1``: the class of the overlong)."""
    n = arr.shape[0]
    size = max(1, min(n, 1 << _CHUNK_BITS))
    step = np.arange(size, dtype=np.int64)
    key_buf = np.empty(size, dtype=np.uint16)
    cls_buf = np.empty(size, dtype=np.uint16)
    new_buf = np.empty(size, dtype=np.bool_)
    first = np.zeros(1, dtype=np.intp)
    for c0 in range(0, n, size):
        a = arr[c0 : c0 + size]
        m = a.shape[0]
        key = key_buf[:m]
        np.minimum(a, cap1, out=key, casting="unsafe")  # every overlong length is cap1
        local = np.argsort(key, kind="stable")  # radix: equal lengths keep id order
        cls = np.take(key, local, out=cls_buf[:m])
        slots = _run_slots(cls, first, new_buf, base, step)
        yield c0, local, slots


@renamed_keywords(on_overlong="overlong")
def bfd_bin_ids(lengths: npt.ArrayLike, capacity: int, *, overlong: str = "raise") -> IntArray:
    """Pack index of every sample under ``best_fit_decreasing`` (-1 for dropped overlong ones).

    >>> bfd_bin_ids([6, 6, 6, 1, 1, 4], 10).tolist()
    [0, 1, 2, 1, 1, 0]
    """
    arr = check_lengths(lengths, capacity, overlong, "bfd_bin_ids")
    n = arr.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    cnt = _counts(arr, capacity, overlong == "drop")
    n_kept = int(cnt.sum())
    if n_kept == 0:
        return np.full(n, -1, dtype=np.int64)
    pair_bin, pair_k, _, _, n_bins = _layout(cnt, capacity, sizes_too=False)
    small = np.int32 if n_bins < 2**31 else np.int64  # half the memory traffic of int64
    slot_bin = np.repeat(pair_bin.astype(small, copy=False), pair_k)  # the pack of each slot
    if n_kept < n:  # overlong samples take the slots after the kept ones
        slot_bin = np.concatenate((slot_bin, np.full(n - n_kept, -1, dtype=small)))
    out = np.empty(n, dtype=small)  # scattering 4-byte values: ~0.07 s less at 10M
    for c0, local, slots in _slot_chunks(arr, capacity, cnt):
        out[c0 : c0 + local.shape[0]][local] = slot_bin[slots]
    return out.astype(np.int64, copy=False)


@renamed_keywords(on_overlong="overlong")
def best_fit_decreasing(
    lengths: npt.ArrayLike, capacity: int, *, overlong: str = "raise"
) -> tuple[IntArray, IntArray]:
    """Best-fit decreasing packs as CSR: pack ``g`` is ``ids[offsets[g] : offsets[g + 1]]``.

    Longest sample first, each into the open pack with the least room that still fits it, so
    (like first fit) at most one pack ends up at most half full. Ids inside a pack are longest
    first. Overlong samples raise, or with ``overlong="drop"`` are left out (see
    ``overlong_ids``). The work is O(N) numpy plus a Python loop over the distinct lengths.

    >>> offsets, ids = best_fit_decreasing([6, 6, 6, 1, 1, 4], 10)
    >>> offsets.tolist(), ids.tolist()
    ([0, 2, 5, 6], [0, 5, 1, 3, 4, 2])
    """
    arr = check_lengths(lengths, capacity, overlong, "best_fit_decreasing")
    offsets, ids, _, _ = packed_csr(arr, capacity, may_overlong=overlong == "drop")
    return offsets, ids


def packed_csr(
    arr: npt.NDArray[Any],
    capacity: int,
    *,
    may_overlong: bool = True,
    carry: Sequence[npt.NDArray[Any]] = (),
) -> tuple[IntArray, npt.NDArray[Any], list[npt.NDArray[Any]], IntArray]:
    """``best_fit_decreasing`` of checked lengths (``check_lengths``), with what a planner
    needs of its packs without gathering by sample id: ``(offsets, ids, carried, tokens)``.

    ``carried[j]`` is ``carry[j][ids]`` (one value per placed sample, in CSR order), written
    while the ids are (a chunk of samples at a time, in id order: the reads are sequential
    and the writes land in runs, where ``carry[j][ids]`` reads at random: 3.4 s against
    ~0.4 s for 100M int32 visual counts). Below 65,536 tokens a pack it is uint16: every
    placed sample's value must fit it (visual tokens <= length <= capacity do). ``tokens``
    is each pack's sum of ``arr``, from the packer's layout (no pass over the samples).
    """
    n = arr.shape[0]
    cnt = _counts(arr, capacity, may_overlong) if n else np.zeros(capacity + 1, np.int64)
    n_kept = int(cnt.sum())
    small = id_dtype(n)  # ids and CSR positions: 4 bytes a sample below 2**31 samples
    if n_kept == 0:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=small), [empty for _ in carry], empty
    pair_bin, pair_k, pair_prior, bin_size, n_bins = _layout(cnt, capacity)
    offsets = np.zeros(bin_size.size + 1, dtype=np.int64)
    np.cumsum(bin_size, out=offsets[1:])
    run_start = np.cumsum(pair_k) - pair_k
    # the length of each pair's samples: slots number the samples longest first
    by_length = np.arange(capacity, -1, -1)
    first_slot = np.cumsum(cnt[::-1])
    pair_len = by_length[np.searchsorted(first_slot, run_start, side="right")]
    tokens = np.bincount(pair_bin, weights=pair_k * pair_len, minlength=n_bins).astype(np.int64)
    del pair_len
    slot_pos = np.repeat((offsets[pair_bin] + pair_prior - run_start).astype(small), pair_k)
    del pair_bin, pair_prior, run_start
    add_arange(slot_pos)  # the CSR position of each slot
    if n_kept < n:  # overlong samples: positions past the kept ids, cut off below
        slot_pos = np.concatenate((slot_pos, np.arange(n_kept, n, dtype=small)))
    ids = np.empty(n, dtype=small)
    narrow = capacity < 1 << 16
    out = [np.empty(n, dtype=np.uint16 if narrow else c.dtype) for c in carry]
    for c0, local, slots in _slot_chunks(arr, capacity, cnt):
        pos = slot_pos[slots]
        ids[pos] = local + c0
        for src, dst in zip(carry, out, strict=True):
            dst[pos] = src[c0 : c0 + local.shape[0]][local]  # (overlong ones wrap: cut off)
    return offsets, ids[:n_kept], [c[:n_kept] for c in out], tokens


def radix_argsort(key: npt.NDArray[np.integer[Any]], bits: int) -> npt.NDArray[np.intp]:
    """``np.argsort(key, kind="stable")`` of non-negative ints below ``2**bits``, 16 bits at a
    time from the lowest digit: numpy sorts 16-bit keys by radix (~5 ns a sample), where its
    stable sort of wider keys is a timsort (~100 ns at 10M random keys); each further digit
    costs two gathers.

    >>> radix_argsort(np.array([70000, 3, 70000, 1, 3]), 17).tolist()
    [3, 1, 4, 0, 2]
    """
    order = np.argsort((key & 0xFFFF).astype(np.uint16), kind="stable")
    for shift in range(16, bits, 16):
        digit = ((key[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digit, kind="stable")]
    return order


def id_dtype(n: int) -> type[np.signedinteger[Any]]:
    """The dtype of sample ids and positions among ``n`` samples: int32 while it holds them."""
    return np.int32 if n < 2**31 else np.int64


def add_arange(a: npt.NDArray[Any], first: int = 0) -> None:
    """``a += arange(first, first + len(a))`` in place, a cache-sized block at a time (a whole
    ``arange`` would be one more array of ``len(a)``: 400 MB at 100M int32 samples)."""
    step = 1 << _CHUNK_BITS
    block = np.arange(min(step, a.shape[0]), dtype=a.dtype)
    for c0 in range(0, a.shape[0], step):
        seg = a[c0 : c0 + step]
        seg += block[: seg.shape[0]]
        seg += first + c0


#: Packs ``reorder_packs`` gathers at a time (tens of samples each: 4M samples a block).
_REORDER_PACKS = 1 << 16


def reorder_packs(
    offsets: IntArray, ids: npt.NDArray[Any], order: IntArray
) -> tuple[IntArray, npt.NDArray[Any]]:
    """The CSR ``(offsets, ids)`` with its packs in ``order`` (a subset of them, in that
    order), a block of packs at a time: the only O(samples) array made is the new ids.

    >>> offsets, ids = np.array([0, 2, 3, 6]), np.array([7, 8, 9, 4, 5, 6])
    >>> off, ids = reorder_packs(offsets, ids, np.array([2, 0]))  # pack 2, then pack 0
    >>> off.tolist(), ids.tolist()
    ([0, 3, 5], [4, 5, 6, 7, 8])
    """
    sizes = np.diff(offsets)[order]
    new_offsets = np.zeros(order.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=new_offsets[1:])
    out = np.empty(int(new_offsets[-1]), dtype=ids.dtype)
    starts = offsets[order]
    for p0 in range(0, order.size, _REORDER_PACKS):
        p1 = min(p0 + _REORDER_PACKS, order.size)
        a, b = int(new_offsets[p0]), int(new_offsets[p1])
        take = np.repeat((starts[p0:p1] - new_offsets[p0:p1]).astype(ids.dtype), sizes[p0:p1])
        add_arange(take, a)
        out[a:b] = ids[take]
    return new_offsets, out


def check_budget(
    lengths: IntArray,
    values: npt.ArrayLike,
    budget: int,
    overlong: str,
    who: str,
    kw: str,
    fix: str = "shrink their media (the image processor's max_pixels)",
) -> IntArray:
    """Validate a second per-sample load (``values``, e.g. visual tokens) against its per-pack
    ``budget``: ids of the samples whose load alone exceeds it, or a ``ValueError`` naming them
    under ``overlong="raise"`` (``fix``: what else than raising the budget helps)."""
    if isinstance(budget, bool) or not isinstance(budget, int | np.integer) or budget < 1:
        raise ValueError(f"{who}: {kw} must be a positive int or None, got {budget=!r}")
    arr = np.asarray(values).astype(np.int64, copy=False)
    if arr.shape != lengths.shape:
        raise ValueError(f"{who}: {kw} needs one value per sample: {arr.shape} vs {lengths.shape}")
    bad = np.flatnonzero(arr > budget)
    if overlong == "raise" and bad.size:
        shown = ", ".join(f"sample {i} ({arr[i]})" for i in bad[:5].tolist())
        raise ValueError(
            f"{who}: {bad.size} sample(s) over the per-pack budget {kw}={budget} on their own: "
            f"{shown}{' ...' if bad.size > 5 else ''}. Fix: raise {kw}, {fix}, or pass "
            "overlong='drop' to leave them out."
        )
    return bad.astype(np.int64)


def within_budget(
    offsets: IntArray,
    ids: IntArray,
    lengths: IntArray,
    values: IntArray,
    capacity: int,
    budget: int,
    *,
    more: Sequence[tuple[IntArray, int]] = (),
) -> tuple[IntArray, IntArray]:
    """Packs (CSR from ``best_fit_decreasing``) whose ``values`` (a second load: visual tokens)
    sum to at most ``budget`` each, with every sample kept exactly once. ``more``: further
    ``(values, budget)`` loads (media items per pack) kept the same way, all at once.

    In a pack over a budget, a sample stays while, for every load, it has none of it or the
    running load (pack order, longest first) is within that budget; the rest move out. Moved
    samples are packed again by ``best_fit_decreasing`` among themselves, and so on until none
    move: each round every pack over a budget keeps at least its first sample (no sample alone
    exceeds a budget: ``check_budget`` first), so the rounds end. Packs within the budget
    are untouched, so without a binding budget the plan is ``best_fit_decreasing``'s.

    >>> offsets, ids = best_fit_decreasing([4, 4, 2], 10)
    >>> offsets, ids = within_budget(offsets, ids, np.array([4, 4, 2]), np.array([3, 3, 0]), 10, 4)
    >>> [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    [[0, 2], [1]]
    """
    done_sizes: list[IntArray] = []
    done_ids: list[IntArray] = []
    loads = [(values, budget), *more]
    while ids.size:
        starts = offsets[:-1]
        sizes = np.diff(offsets)
        over = np.zeros(sizes.size, dtype=bool)
        keep = np.ones(ids.size, dtype=bool)
        for vals, cap in loads:
            load = vals[ids]
            over |= np.add.reduceat(load, starts) > cap
            running = np.cumsum(load)
            running -= np.repeat(running[starts] - load[starts], sizes)  # within each pack
            keep &= (load == 0) | (running <= cap)
        if not over.any():
            done_sizes.append(sizes)
            done_ids.append(ids)
            break
        pack_of = np.repeat(np.arange(sizes.size), sizes)
        kept_sizes = np.bincount(pack_of[keep], minlength=sizes.size)
        done_sizes.append(kept_sizes[kept_sizes > 0])
        done_ids.append(ids[keep])
        moved = ids[~keep]  # longest first within each pack; repacked below
        sub_offsets, sub = best_fit_decreasing(lengths[moved], capacity, overlong="raise")
        offsets, ids = sub_offsets, moved[sub]
    sizes_all = np.concatenate(done_sizes) if done_sizes else np.zeros(0, np.int64)
    out_offsets = np.zeros(sizes_all.size + 1, dtype=np.int64)
    np.cumsum(sizes_all, out=out_offsets[1:])
    out_ids = np.concatenate(done_ids) if done_ids else np.zeros(0, np.int64)
    return out_offsets, out_ids.astype(np.int64, copy=False)


def best_fit_two_budgets(
    lengths: npt.ArrayLike,
    values: npt.ArrayLike,
    capacity: int,
    budget: int,
    *,
    more: Sequence[tuple[npt.ArrayLike, int]] = (),
) -> tuple[IntArray, IntArray]:
    """Packs within ``capacity`` tokens and ``budget`` of a second load each (``values``:
    visual tokens), as CSR like ``best_fit_decreasing``; every sample exactly once. Every
    sample must fit both alone (``check_lengths``, ``check_budget``). ``more``: further
    ``(values, budget)`` loads (media items per pack), kept by every pack too.

    When ``best_fit_decreasing``'s packs already keep the budget they are the answer (the plan
    does not change). Otherwise two phases, both on the fast packer:

    1. the loaded samples (any load), packed by load (``budget`` per pack) and made to fit the
       tokens (``within_budget`` with the roles swapped) and the ``more`` loads: each such pack
       is close to the budget. With ``more``, the load packed by is the one whose total is the
       most budgets (the binding one: many small images under an images budget);
    2. their packs as units of ``capacity + 1 + tokens``, plus empty units of ``capacity + 1``
       (fresh packs), plus the samples with no load, packed at ``2 * capacity + 1``: no two
       units share a pack (each is over half of it), a unit leaves exactly its real room, and
       best fit puts the load-free samples into the fullest rooms first. Load-free samples
       that open a pack of their own anyway are packed again at ``capacity``.

    On the generated VLM lengths of ``bench_plan.py`` the token fill stays within a point of
    the unbudgeted plan while the budget is above the mean load per pack.

    >>> offsets, ids = best_fit_two_budgets([4, 4, 2, 3], [3, 3, 0, 0], 10, 4)
    >>> [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    [[0, 3, 2], [1]]
    """
    tok = np.asarray(lengths).astype(np.int64, copy=False)
    loads = [(np.asarray(v).astype(np.int64, copy=False), int(b)) for v, b in [(values, budget),
                                                                             *more]]  # fmt: skip
    offsets, ids = best_fit_decreasing(tok, capacity)
    if ids.size == 0 or all(np.add.reduceat(v[ids], offsets[:-1]).max() <= b for v, b in loads):
        return offsets, ids
    has_load = loads[0][0] > 0
    for v, _ in loads[1:]:
        has_load |= v > 0
    loaded = np.flatnonzero(has_load)
    free = np.flatnonzero(~has_load)
    # 1. loaded samples: by the binding load, then within the tokens and the other loads
    p = int(np.argmax([int(v.sum()) / b for v, b in loads])) if more else 0
    load, budget = loads[p]
    others = [(v[loaded], b) for k, (v, b) in enumerate(loads) if k != p]
    v_off, v_sub = best_fit_decreasing(load[loaded], budget)
    v_off, v_sub = within_budget(
        v_off, v_sub, load[loaded], tok[loaded], budget, capacity, more=others
    )
    v_ids = loaded[v_sub]
    v_fill = np.add.reduceat(tok[v_ids], v_off[:-1])
    # 2. units (loaded packs, fresh packs) and load-free samples, best fit at 2 * capacity + 1
    n_fresh = -(-int(tok[free].sum()) // capacity) + 1
    unit_len = np.concatenate(
        [tok[free], capacity + 1 + v_fill, np.full(n_fresh, capacity + 1, np.int64)]
    )
    unit_count = np.concatenate(
        [np.ones(free.size, np.int64), np.diff(v_off), np.zeros(n_fresh, np.int64)]
    )
    unit_ids = np.concatenate([free, v_ids])
    unit_start = np.concatenate([np.arange(free.size), free.size + v_off[:-1], np.zeros(n_fresh)])
    b_off, items = best_fit_decreasing(unit_len, 2 * capacity + 1)
    b_sizes = np.diff(b_off)
    headed = unit_len[items[b_off[:-1]]] > capacity  # a unit opens the pack (longest first)
    counts = unit_count[items]
    n_out = int(counts.sum())
    run0 = np.cumsum(counts) - counts
    take = np.repeat(unit_start[items].astype(np.int64) - run0, counts)
    take += np.arange(n_out, dtype=np.int64)
    flat = unit_ids[take]
    pack_sizes = np.add.reduceat(counts, b_off[:-1])
    pack_of = np.repeat(np.repeat(np.arange(b_sizes.size), b_sizes), counts)
    keep_pack = headed & (pack_sizes > 0)
    in_kept = keep_pack[pack_of]
    sizes = [pack_sizes[keep_pack]]
    out = [flat[in_kept]]
    stray = flat[~in_kept]  # load-free samples that opened a pack of their own
    if stray.size:
        s_off, s_sub = best_fit_decreasing(tok[stray], capacity)
        sizes.append(np.diff(s_off))
        out.append(stray[s_sub])
    all_sizes = np.concatenate(sizes)
    out_offsets = np.zeros(all_sizes.size + 1, dtype=np.int64)
    np.cumsum(all_sizes, out=out_offsets[1:])
    return out_offsets, np.concatenate(out)
