"""The pack plan: which samples go in which pack, and the order packs are served in each epoch.

``plan_packs(total, capacity, visual=...)`` is pure: the same lengths and config give the same
plan on every rank. Packs are made by best-fit decreasing (``binpack.best_fit_decreasing``),
then arranged for ``group_size`` ranks: sorted by visual load (then total tokens) and cut into
step groups of ``group_size`` consecutive packs, so the ranks of one training step carry
nearly equal vision and text work. Each epoch permutes whole step groups, seeded by
``(seed, epoch)``, so the balance survives shuffling and no curriculum by visual load appears
(the seed sorted all packs by visual load, and ``max_packs`` then kept the lowest: bug B2).

Example, three ranks::

    packs sorted by visual load   v=0 v=0 v=10 | v=120 v=130 v=140 | v=900 v=950 v=990
    step groups                   g0           | g1                | g2
    epoch order (seeded)          g2 g0 g1 -> every step: three packs of like load

Why neighbours and not a snake deal (low, high, high, low, ...)? A snake gives every step the
same *sum*, but the ranks inside a step then differ widely, and a step waits for its slowest
rank. Neighbours in load order make the ranks of a step alike (``bench_balance.py``: per-step
max/mean visual tokens 1.0007 at 8 ranks, against 1.34 for a per-pack random shuffle). With
several packs per rank per step, each rank takes one pack from each of several groups, so
the ranks stay alike.

``len(plan) % group_size`` packs (chosen per epoch, seeded) form a short last group at the
end of ``epoch_order``; the pack source drops or pads that tail so every rank gets the same
number of packs. The plan itself only orders.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from neatpack.pipes.compat.renamed import renamed_keywords
from neatpack.pipes.planning.balance import BalancePolicy, balanced_order, pack_cost_terms
from neatpack.pipes.planning.binpack import (
    IntArray,
    best_fit_two_budgets,
    check_budget,
    check_lengths,
    greedy_knapsack,
    id_dtype,
    packed_csr,
    reorder_packs,
)
from neatpack.pipes.planning.group_pack import chunk_count, group_packs

__all__ = [
    "PLAN_VERSION",
    "PackPlan",
    "greedy_knapsack_vt_balanced",
    "plan_fingerprint",
    "plan_images",
    "plan_packs",
    "plan_supervised",
    "step_group_order",
]

PLAN_VERSION = "neatpack.plan/1"


def _sorted_by_load(visual: IntArray, totals: IntArray) -> IntArray:
    """Pack indices by ascending visual load, then total tokens, then index (stable)."""
    return np.lexsort((totals, visual)).astype(np.int64)


def step_group_order(
    n_packs: int, group_size: int, rng: np.random.Generator, tail_from: int = 0
) -> IntArray:
    """Permutation of ``range(n_packs)`` (already sorted by load) into shuffled step groups.

    ``n_packs % group_size`` positions, drawn from ``rng`` among ``tail_from..n_packs - 1``
    (packs made as step groups, ``group_pack.py``, come first and are never split), form the
    tail. The rest are cut
    into consecutive groups of ``group_size`` (neighbours in load order), the groups are
    permuted, and every second group is reversed so no rank always takes the lighter pack.
    """
    tail_n = n_packs % group_size
    tail = None
    if tail_n:
        tail_from = min(tail_from, n_packs - tail_n)  # (0 for every plan but group_pack's)
        tail = tail_from + np.sort(rng.choice(n_packs - tail_from, size=tail_n, replace=False))
    body = np.arange(n_packs, dtype=np.int64)
    if tail is not None:
        body = np.delete(body, tail)
    groups = body.reshape(-1, group_size)[rng.permutation(body.size // group_size)]
    groups[1::2] = groups[1::2, ::-1]
    out = groups.reshape(-1)
    return out if tail is None else np.concatenate([out, tail.astype(np.int64)])


@renamed_keywords(on_overlong="overlong")
def greedy_knapsack_vt_balanced(
    lengths: Sequence[int],
    max_length: int,
    visual_tokens: Sequence[int],
    *,
    overlong: str = "raise",
    group_size: int = 2,
    seed: int = 0,
) -> list[list[int]]:
    """The seed's ``greedy_knapsack`` bins, ordered so each run of ``group_size`` is balanced.

    The seed only sorted the bins by visual-token sum (no interleaving, despite its
    docstring): shuffling then undid it, and without shuffling training saw text-only packs
    first and image-heavy packs last. Here the bins are sorted by (visual, total) tokens, cut
    into groups of ``group_size`` consecutive bins, and the groups are permuted with
    ``np.random.default_rng([seed, 0])``. With ``DistributedSampler(shuffle=False)`` on
    ``group_size`` ranks, one step takes one such group. The bins themselves are the seed's.
    """
    bins = greedy_knapsack(lengths, max_length, overlong=overlong)
    if len(visual_tokens) != len(lengths):
        raise ValueError(f"{len(visual_tokens)=} must equal {len(lengths)=}")
    if group_size < 1:
        raise ValueError(f"{group_size=} must be >= 1")
    vis = np.asarray(visual_tokens, dtype=np.int64)
    tot = np.asarray(lengths, dtype=np.int64)
    v = np.array([int(vis[b].sum()) for b in bins], dtype=np.int64)
    t = np.array([int(tot[b].sum()) for b in bins], dtype=np.int64)
    by_load = _sorted_by_load(v, t)
    order = by_load[step_group_order(len(bins), group_size, np.random.default_rng([seed, 0]))]
    return [bins[i] for i in order.tolist()]


@dataclass(frozen=True, eq=False)
class PackPlan:
    """Packs as CSR (``ids[offsets[g]:offsets[g + 1]]`` are pack ``g``'s sample ids).

    Packs are stored in ``balance`` order (``balance.balanced_order``: by default sorted by
    visual, then total tokens), so consecutive packs are alike; ``epoch_order(epoch)`` is the
    serving order. ``dropped_ids`` are the overlong samples left out (``overlong="drop"``),
    ``truncated_ids`` the samples of packs cut by ``max_packs``. ``group_size`` is the world
    size the plan was grouped for; ``fingerprint`` covers the lengths and every parameter.
    ``free_from``: packs before it were made as step groups (``balance="cost"``,
    ``group_pack.py``); the short last group of an epoch is drawn from the packs after it.
    """

    offsets: IntArray
    ids: IntArray
    totals: IntArray
    visual: IntArray
    dropped_ids: IntArray
    truncated_ids: IntArray
    capacity: int
    packing_ratio: float
    group_size: int
    seed: int
    shuffle: bool
    fingerprint: str
    balance: BalancePolicy = "tokens"
    free_from: int = 0

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def n_planned(self) -> int:
        """Samples placed in packs."""
        return int(self.ids.size)

    def pack(self, index: int) -> list[int]:
        """Sample ids of pack ``index`` (storage order), longest first."""
        if not 0 <= index < len(self):
            raise IndexError(f"pack {index=} out of range for a plan of {len(self)} packs")
        return [int(i) for i in self.ids[self.offsets[index] : self.offsets[index + 1]]]

    def packs(self) -> list[list[int]]:
        """Every pack's sample ids, in storage order."""
        if len(self) == 0:
            return []
        return [a.tolist() for a in np.split(self.ids, self.offsets[1:-1])]

    def epoch_order(self, epoch: int) -> IntArray:
        """Pack indices in this epoch's serving order (step groups shuffled by (seed, epoch)).

        With ``shuffle=False`` every epoch gets epoch 0's order: fixed, but still spread over
        loads rather than sorted by them.
        """
        if epoch < 0:
            raise ValueError(f"{epoch=} must be >= 0")
        rng = np.random.default_rng([self.seed, epoch if self.shuffle else 0])
        return step_group_order(len(self), self.group_size, rng, self.free_from)

    def utilization(self) -> float:
        """Planned tokens / (packs x capacity)."""
        return float(self.totals.sum()) / max(len(self) * self.capacity, 1)


_BLOCK = 1 << 22  # samples per block where a whole-array temporary would cost O(samples)


def _hash_int64(h: Any, a: npt.NDArray[Any]) -> None:
    """``h.update(a.astype("<i8").tobytes())`` a block at a time: the same digest, without an
    int64 copy of the whole array (800 MB at 100M samples)."""
    for i in range(0, a.shape[0], _BLOCK):
        h.update(np.ascontiguousarray(a[i : i + _BLOCK], dtype="<i8").data)


def _fingerprint(
    total: npt.NDArray[Any],
    visual: npt.NDArray[Any] | None,
    params: Mapping[str, object],
    images: npt.NDArray[Any] | None = None,
    supervised: npt.NDArray[Any] | None = None,
) -> str:
    h = hashlib.sha256(PLAN_VERSION.encode())
    _hash_int64(h, total)
    if visual is None:
        h.update(b"|")
    else:
        _hash_int64(h, visual)
    if images is not None:  # only when they change the plan: see plan_images
        h.update(b"|images|")
        _hash_int64(h, images)
    if supervised is not None:  # only under balance="supervised": see plan_supervised
        h.update(b"|supervised|")
        _hash_int64(h, supervised)
    h.update(json.dumps(params, sort_keys=True).encode())
    return h.hexdigest()


def plan_images(
    images: npt.NDArray[Any] | None, balance: str, max_images: int | None
) -> npt.NDArray[Any] | None:
    """The media-item counts the plan depends on (so its fingerprint covers them), or None:
    under ``max_images``, or when a vision cost is balanced and some sample has several items
    (one item each prices a sample as before the counts existed: saved states keep matching)."""
    if images is None:
        return None
    if max_images is not None:
        return images
    if balance in ("cost", "vision") and images.size and int(images.max()) > 1:
        return images
    return None


def plan_supervised(supervised: npt.NDArray[Any] | None, balance: str) -> npt.NDArray[Any] | None:
    """The supervised-token counts the plan depends on (only ``balance="supervised"`` reads
    them), or None; that policy without them is a ``ValueError`` naming the fix."""
    if balance != "supervised":
        return None
    if supervised is None:
        raise ValueError(
            "balance='supervised' needs supervised= (supervised tokens per sample: "
            "LengthIndex.supervised, which the graphs count when this balance is chosen)"
        )
    return supervised


def _check_images(images: npt.ArrayLike, total: npt.NDArray[Any]) -> npt.NDArray[Any]:
    arr = np.asarray(images)
    if arr.dtype not in (np.uint16, np.int32, np.int64):  # a LengthIndex's uint16 as it is
        arr = arr.astype(np.int64)
    if arr.shape != total.shape:
        raise ValueError(f"images has shape {arr.shape}, lengths {total.shape}: one per sample")
    if arr.size and int(arr.min()) < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"images (media items per sample) must be >= 0: sample {i} has {arr[i]}")
    return arr


def _pack_sums(values: npt.NDArray[Any], offsets: IntArray, ids: npt.NDArray[Any]) -> IntArray:
    """``values`` summed per pack (CSR), a block of packs at a time (no gather of all ids)."""
    n = offsets.size - 1
    out = np.zeros(n, dtype=np.int64)
    step = max(1, _BLOCK // 64)  # packs per block (tens of samples each)
    for p0 in range(0, n, step):
        p1 = min(p0 + step, n)
        a, b = int(offsets[p0]), int(offsets[p1])
        if b > a:
            out[p0:p1] = np.add.reduceat(values[ids[a:b]], offsets[p0:p1] - a, dtype=np.int64)
    return out


def _csr_sums(values: npt.NDArray[Any], offsets: IntArray) -> IntArray:
    """Per pack sums of ``values`` already in CSR order, a block of packs at a time."""
    n = offsets.size - 1
    out = np.zeros(n, dtype=np.int64)
    step = max(1, _BLOCK // 64)
    for p0 in range(0, n, step):
        p1 = min(p0 + step, n)
        a, b = int(offsets[p0]), int(offsets[p1])
        out[p0:p1] = np.add.reduceat(values[a:b], offsets[p0:p1] - a, dtype=np.int64)
    return out


def _check_visual(vis: npt.NDArray[Any], total: npt.NDArray[Any]) -> None:
    for i0 in range(0, total.shape[0], _BLOCK):
        v, t = vis[i0 : i0 + _BLOCK], total[i0 : i0 + _BLOCK]
        bad = np.flatnonzero((v < 0) | (v > t))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"visual tokens must lie in [0, length]: sample {i0 + i} has visual={v[i]}, "
                f"length={t[i]}. Recompute the length index."
            )


def _params(
    capacity: int, packing_ratio: float, max_packs: int | None, overlong: str, world_size: int,
    seed: int, shuffle: bool, balance: str, max_visual: int | None, max_images: int | None = None,
    per_rank: int | None = None, n_samples: int = 0,
) -> dict[str, object]:  # fmt: skip
    params: dict[str, object] = {
        "capacity": int(capacity),
        "packing_ratio": float(packing_ratio),
        "max_packs": max_packs,
        "overlong": overlong,
        "group_size": int(world_size),
        "seed": int(seed),
        "shuffle": bool(shuffle),
    }
    if balance != "tokens":  # so the default plan keeps its fingerprint (saved states load)
        params["balance"] = balance
    if balance == "cost":  # its packs are made for the step groups now (group_pack.py): a
        # state or plan file from the sorted-packs plan, or from group_pack's first version
        # (its tuples could mix text-only and image samples) or second (no room rules:
        # other packs where its fill left a group of free packs), is refused
        params["packs"] = "grouped/3"
        if per_rank is not None:  # the step shape its candidates are scored on
            params["per_rank"] = int(per_rank)
        chunks = chunk_count(n_samples)
        if chunks > 1 and max_images is None:  # planned in chunks (other packs): only then,
            params["chunks"] = chunks  # so smaller plans keep their fingerprint
    if max_visual is not None:  # only when set: plans without it keep their fingerprint
        params["max_visual"] = int(max_visual)
    if max_images is not None:  # the same
        params["max_images"] = int(max_images)
    return params


def plan_fingerprint(
    lengths: npt.ArrayLike,
    capacity: int,
    *,
    visual: npt.ArrayLike | None = None,
    packing_ratio: float = 1.0,
    max_packs: int | None = None,
    overlong: str = "raise",
    world_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    balance: BalancePolicy = "tokens",
    max_visual: int | None = None,
    images: npt.ArrayLike | None = None,
    max_images: int | None = None,
    supervised: npt.ArrayLike | None = None,
    per_rank: int | None = None,
) -> str:
    """The ``fingerprint`` ``plan_packs`` gives these arguments, without planning (hashing the
    lengths only: a plan file is looked up by it, ``plan_file.shared_plan``).

    >>> plan_fingerprint([5, 4, 3], 8, seed=1) == plan_packs([5, 4, 3], 8, seed=1).fingerprint
    True
    """
    total = np.asarray(lengths)
    vis = None if visual is None else np.asarray(visual)
    imgs = None if images is None else np.asarray(images)
    sup = None if supervised is None else np.asarray(supervised)
    params = _params(capacity, packing_ratio, max_packs, overlong, world_size, seed, shuffle,
                     balance, max_visual, max_images, per_rank, total.size)  # fmt: skip
    return _fingerprint(total, vis, params, plan_images(imgs, balance, max_images),
                        plan_supervised(sup, balance))  # fmt: skip


def _check_params(
    capacity: int, packing_ratio: float, max_packs: int | None, world_size: int, seed: int
) -> int:
    if not 0.0 < packing_ratio <= 1.0:
        raise ValueError(f"{packing_ratio=} must be in (0, 1]: the share of capacity to plan for")
    plan_capacity = int(capacity * packing_ratio)
    if plan_capacity < 1:
        raise ValueError(f"{capacity=} x {packing_ratio=} leaves no room to plan")
    if max_packs is not None and max_packs < 1:
        raise ValueError(f"{max_packs=} must be None or >= 1")
    if world_size < 1:
        raise ValueError(f"{world_size=} must be >= 1")
    if seed < 0:
        raise ValueError(f"{seed=} must be >= 0")
    return plan_capacity


def plan_packs(
    lengths: npt.ArrayLike,
    capacity: int,
    *,
    visual: npt.ArrayLike | None = None,
    packing_ratio: float = 1.0,
    max_packs: int | None = None,
    overlong: str = "raise",
    world_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    balance: BalancePolicy = "tokens",
    max_visual: int | None = None,
    images: npt.ArrayLike | None = None,
    max_images: int | None = None,
    supervised: npt.ArrayLike | None = None,
    per_rank: int | None = None,
) -> PackPlan:
    """Plan packs of at most ``capacity`` tokens, grouped for ``world_size`` ranks.

    ``lengths[i]`` is sample ``i``'s token count after the shift, ``visual[i]`` its image and
    video tokens. Packing uses ``floor(capacity * packing_ratio)`` as headroom against low
    estimates; a sample longer than that but within ``capacity`` gets a pack of its own (as in
    the seed). Longer samples raise a ``ValueError`` naming them, or with ``overlong="drop"``
    are left out and listed in ``dropped_ids``. ``max_packs`` keeps the first ``max_packs``
    packs of epoch 0's order (whole step groups in seeded random order, so a sample that is
    fair across visual loads) and lists the rest's samples in ``truncated_ids``.
    ``balance`` picks what the ranks of a step are made alike on (``balance.py``): ``"tokens"``
    (visual, then total tokens), or the compute cost of the language model (``"lm"``), the
    vision encoder (``"vision"``) or both (``"cost"``). Under ``"cost"`` the packs are made
    for their step groups of ``world_size`` (``group_pack.py``; best fit's packs where that is
    not better); the other policies keep best fit's packs and only order them.

    ``max_visual`` is a second budget per pack: at most that many ``visual`` tokens (the vision
    tower's memory; its patches are these tokens times the merge size squared, 4 for Qwen-VL).
    Samples that would exceed it go into another pack (``binpack.best_fit_two_budgets``), never
    dropped; a sample whose visual tokens alone exceed it follows ``overlong`` like a sample
    longer than the pack. None (the default) leaves the plan as it was.

    ``max_images`` is a third budget: at most that many media items (images and video clips,
    ``images[i]`` per sample: ``LengthIndex.images``) per pack, kept the same way and together
    with ``max_visual``. ``images`` also prices the vision encoder under ``balance="cost"`` /
    ``"vision"``: a sample's patches split over its items (``cost.pack_terms``).

    ``supervised``: each sample's supervised (label) tokens (``LengthIndex.supervised``), read
    only by ``balance="supervised"``, which needs them: step groups alike in label tokens
    (best fit's packs, only ordered).

    ``per_rank``: packs per rank per step (a graph's ``batch_size``), when known: under
    ``"cost"`` the made groups are chosen on that step shape (``group_pack.group_packs``);
    None scores them on one and on ``group_pack.SCORE_PER_RANK`` packs per rank. The other
    policies ignore it.

    >>> plan = plan_packs([5, 4, 3, 3, 2], 8)
    >>> len(plan), plan.packs(), plan.totals.tolist()
    (3, [[4], [1, 3], [0, 2]], [2, 7, 8])
    """
    plan_capacity = _check_params(capacity, packing_ratio, max_packs, world_size, seed)
    free_from = 0
    total = check_lengths(lengths, capacity, overlong, "plan_packs", "overlong")
    vis: npt.NDArray[Any] | None = None
    if visual is not None:
        vis = np.asarray(visual)
        if vis.dtype not in (np.int32, np.int64):  # a LengthIndex's int32 is used as it is
            vis = vis.astype(np.int64)
        if vis.shape != total.shape:
            raise ValueError(f"visual has shape {vis.shape}, lengths {total.shape}: one per sample")
        _check_visual(vis, total)
    imgs = None if images is None else _check_images(images, total)
    sup = plan_supervised(None if supervised is None else np.asarray(supervised), balance)
    if sup is not None and sup.shape != total.shape:
        raise ValueError(f"supervised has shape {sup.shape}, lengths {total.shape}: one per sample")
    over_budget = np.zeros(0, dtype=np.int64)
    if max_visual is not None:
        if vis is None:
            raise ValueError(f"plan_packs: {max_visual=} needs visual= (visual tokens per sample)")
        over_budget = check_budget(total, vis, max_visual, overlong, "plan_packs", "max_visual")
    if max_images is not None:
        if imgs is None:
            raise ValueError(f"plan_packs: {max_images=} needs images= (media items per sample)")
        over_images = check_budget(total, imgs, max_images, overlong, "plan_packs",
                                   "max_images", fix="split those records")  # fmt: skip
        over_budget = np.union1d(over_budget, over_images).astype(np.int64)
    if per_rank is not None and per_rank < 1:
        raise ValueError(f"{per_rank=} must be None or >= 1 (packs per rank per step)")
    params = _params(capacity, packing_ratio, max_packs, overlong, world_size, seed, shuffle,
                     balance, max_visual, max_images, per_rank, total.size)  # fmt: skip
    # the fingerprint hashes every length (1.2 s at 100M samples); hashlib and numpy's casts
    # let go of the GIL, so it runs on another core while the packer works
    hashing = ThreadPoolExecutor(1, thread_name_prefix="plan-fingerprint")
    fingerprint_of = hashing.submit(_fingerprint, total, vis, params,
                                    plan_images(imgs, balance, max_images), sup)  # fmt: skip
    hashing.shutdown(wait=False)
    peak = int(total.max()) if total.size else 0
    dropped = np.zeros(0, dtype=np.int64)
    if peak > capacity:
        dropped = np.flatnonzero(total > capacity).astype(np.int64)
    work = total  # the lengths the packer sees; a copy only where some must change
    if peak > plan_capacity:
        work = np.minimum(total, plan_capacity)  # headroom: (plan_capacity, capacity] alone
        work[dropped] = plan_capacity + 1  # still overlong for the packer, which leaves them out
    # packs made for their step groups (group_pack.py) keep the visual budget; with an images
    # budget the cost plan orders best fit's packs instead
    grouped = None
    if balance == "cost" and max_images is None:
        grouped = _group_packs(work, vis, dropped, over_budget, plan_capacity, world_size,
                               max_visual, plan_images(imgs, balance, None), per_rank)  # fmt: skip
    budgets = [(v, b) for v, b in ((vis, max_visual), (imgs, max_images)) if b is not None]
    if grouped is not None:
        offsets, ids, by_load, free_from = grouped
        dropped = np.union1d(dropped, over_budget).astype(np.int64)
        tot_p = _pack_sums(total, offsets, ids)
        vis_p = _pack_sums(vis, offsets, ids) if vis is not None else np.zeros_like(tot_p)
    elif not budgets:
        # each pack's tokens and visual tokens come with the packing (no gather by id)
        carry = ([] if vis is None else [vis]) + ([] if work is total else [total])
        offsets, ids, carried, tot_p = packed_csr(work, plan_capacity, carry=carry)
        if work is not total:
            tot_p = _csr_sums(carried.pop(), offsets)
        vis_p = _csr_sums(carried[0], offsets) if vis is not None else np.zeros_like(tot_p)
        del carried
    else:
        dropped = np.union1d(dropped, over_budget).astype(np.int64)
        placed = np.ones(total.size, dtype=bool)
        placed[dropped] = False
        kept = np.flatnonzero(placed).astype(id_dtype(total.size))
        (v0, b0), *more = [(np.asarray(v)[kept], int(b)) for v, b in budgets]
        offsets, sub = best_fit_two_budgets(work[kept], v0, plan_capacity, b0, more=more)
        ids = kept[sub]
        tot_p = _pack_sums(total, offsets, ids)
        vis_p = _pack_sums(vis, offsets, ids) if vis is not None else np.zeros_like(tot_p)
    del work
    # the cost terms only when a step is balanced on them (the token order needs none)
    terms = (
        pack_cost_terms(
            offsets, ids, total, vis if vis is not None else np.zeros_like(total), images=imgs
        )
        if balance not in ("tokens", "supervised") and grouped is None
        else np.zeros((0, 4))
    )
    if grouped is None:
        sup_p = None if sup is None else _pack_sums(sup, offsets, ids)
        by_load = balanced_order(balance, terms, vis_p, tot_p, world_size, supervised=sup_p)
    truncated = np.zeros(0, dtype=np.int64)
    if max_packs is not None and max_packs < by_load.size:
        free_from = 0  # whole groups no longer line up: the tail comes from any pack
        first = step_group_order(by_load.size, world_size, np.random.default_rng([seed, 0]))
        keep = np.zeros(by_load.size, dtype=bool)
        keep[first[:max_packs]] = True
        cut = by_load[~keep]
        truncated = np.sort(np.concatenate([ids[offsets[g] : offsets[g + 1]] for g in cut]))
        truncated = truncated.astype(np.int64)
        by_load = by_load[keep]
    new_offsets, new_ids = reorder_packs(offsets, ids, by_load)
    del ids
    fingerprint = fingerprint_of.result()
    arrays = [new_offsets, new_ids, tot_p[by_load], vis_p[by_load], dropped, truncated]
    for a in arrays:
        a.flags.writeable = False
    return PackPlan(
        offsets=arrays[0],
        ids=arrays[1],
        totals=arrays[2],
        visual=arrays[3],
        dropped_ids=arrays[4],
        truncated_ids=arrays[5],
        capacity=int(capacity),
        packing_ratio=float(packing_ratio),
        group_size=int(world_size),
        seed=int(seed),
        shuffle=bool(shuffle),
        fingerprint=fingerprint,
        balance=balance,
        free_from=int(free_from),
    )


def _group_packs(
    work: npt.NDArray[Any], vis: npt.NDArray[Any] | None, dropped: IntArray,
    over_budget: IntArray, capacity: int, world_size: int, max_visual: int | None,
    images: npt.NDArray[Any] | None = None, per_rank: int | None = None,
) -> tuple[IntArray, npt.NDArray[Any], IntArray, int] | None:  # fmt: skip
    """``group_pack.group_packs`` over the samples that are not dropped, in sample ids
    (``images``: media items per sample, which price the vision cost)."""
    placed = np.ones(work.shape[0], dtype=bool)
    placed[dropped] = False
    placed[over_budget] = False
    kept = np.flatnonzero(placed).astype(np.int64)
    visual = vis[kept] if vis is not None else np.zeros(kept.size, np.int64)
    imgs = images[kept] if images is not None else None
    # chunked by all the samples, as the fingerprint is (``_params``)
    chunks = chunk_count(work.shape[0])
    made = group_packs(work[kept], visual, capacity, world_size, max_visual=max_visual,
                       images=imgs, per_rank=per_rank, chunks=chunks)  # fmt: skip
    if made is None:
        return None
    offsets, sub, order, free_from = made
    return offsets, kept[sub].astype(id_dtype(work.shape[0])), order, free_from
