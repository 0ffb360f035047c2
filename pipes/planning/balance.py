"""Which packs share a training step: the storage order ``plan_packs`` cuts step groups from.

A step waits for its slowest rank, and a rank's cost is not its token count: the language
model's attention grows with the square of each document's length, the vision encoder's with
the square of each image's patch count. ``balance`` picks what the ranks of a step are made
alike on:

- ``"tokens"``: (visual tokens, total tokens), today's order, bit for bit;
- ``"lm"``: the language model's cost, ``LM_LINEAR * tokens + sum(document length ** 2)``;
- ``"vision"``: the vision encoder's cost, ``VISION_LINEAR * patches + sum(patches ** 2)``;
- ``"cost"``: both at once: the attention part of the language model's cost (sum of squared
  document lengths) and the vision encoder's cost. ``plan_packs`` then makes the packs for
  their step groups where that evens the ranks more (``group_pack.py``); the order below is
  what it compares against and what it orders its leftover packs by. The linear part is
  left to the packing, which fills every pack to within a few percent of its capacity
  (``24576 x 2 %`` of a pack of 8,192 already outweighs the attention of most packs, so
  balancing lm as a whole would mostly sort on fill and leave attention uneven: p95
  max/mean 1.24 against 1.07 at 8 ranks on the OmniBal lengths).
- ``"supervised"``: the supervised (label) tokens of each pack, then its total tokens. With a
  mean loss per rank, a rank with few label tokens weighs each of them more than a rank with
  many, and the loss and lm-head work grow with them; the per-sample counts are the length
  index's optional ``supervised`` column (``pipes/indexing/supervised.py``). It evens only
  that term: on ``bench_supervised_balance.py``'s conversations at 8 ranks, p95 max/mean label
  tokens 1.48 -> 1.003, attention 1.30 -> 2.35.

One term is a sort: neighbours in cost order are alike. Two terms are a snake over a grid:
the packs are cut by attention cost into ``k`` strips of equal count, each strip sorted by
vision cost (every second strip descending, so the order has no seam). Few strips make groups
alike in vision, many alike in attention; ``k`` is the one of ``STRIP_CANDIDATES`` counts
(geometric from 1 to ``n / group_size``) whose groups have the lowest p95 over groups of the
larger of the two max/mean ratios (at 8 ranks on the OmniBal lengths: attention p95 1.02,
against 1.07 for a fixed ``k = sqrt(n / group_size)``). The plan still cuts consecutive packs
into groups and permutes whole groups per epoch, so the balance survives shuffling, resume, and
a new world size (the order is a pure function of the packs and ``group_size``).

Example, four packs of like tokens, two ranks (``k = 1`` strip is best here)::

    pack        0   1   2   3
    attention  10  11  30  31
    vision      5  90   6  91
    "cost" order 0 2 1 3 -> step groups (0, 2) (1, 3): alike in vision (5/6, 90/91)

With many packs ``k`` grows and the groups grow alike in both (``bench_step_balance.py``).

The cost columns come from per-sample lengths: the samples of a pack are its documents, and
visual tokens stand in for an image's patches, split over the sample's media items as equal
images where the length index counts them (``pack_cost_terms``), else one image per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal, get_args

import numpy as np
import numpy.typing as npt

from neatpack.pipes.planning.binpack import IntArray, radix_argsort
from neatpack.pipes.planning.cost import TERMS, CostModel, pack_terms

__all__ = [
    "BALANCE_COST",
    "BALANCE_POLICIES",
    "COST_TERMS",
    "GRAPH_BALANCE",
    "LM_LINEAR",
    "VISION_LINEAR",
    "BalancePolicy",
    "balanced_order",
    "group_p95",
    "imbalance",
    "pack_cost_terms",
    "pack_costs",
    "sample_vision_cost",
]

BalancePolicy = Literal["tokens", "cost", "lm", "vision", "supervised"]
BALANCE_POLICIES: tuple[str, ...] = get_args(BalancePolicy)

#: The graphs' and ``neatpack plan``'s default: a step waits for its slowest rank, and ranks
#: differ by attention and vision-encoder work, not by token counts (README, "Step cost").
#: ``plan_packs`` keeps ``"tokens"`` as its own default (the plain function, bit for bit).
GRAPH_BALANCE: Final[BalancePolicy] = "cost"

#: How many strip counts ``balanced_order("cost", ...)`` tries.
STRIP_CANDIDATES: Final = 12

#: Columns of ``pack_cost_terms``: the cost model's terms (``cost.TERMS``).
COST_TERMS: Final = TERMS

#: Cost of one token's linear layers in units of one attention pair (veRL's ``24576 * s + s^2``:
#: about ``6 * hidden`` for a 4k-hidden model; the ratio only weighs the two parts of one term).
LM_LINEAR: Final = 24576.0
#: The same for the vision encoder: ``6 * 1280`` (Qwen2-VL's ViT width).
VISION_LINEAR: Final = 7680.0
#: The balance's weights as a cost model (one attention pair = 1): ``pack_costs`` prices with it.
BALANCE_COST: Final = CostModel(
    per_token=LM_LINEAR, per_pair=1.0, per_patch=VISION_LINEAR, per_patch_pair=1.0, unit="pair"
)

FloatArray = npt.NDArray[np.float64]


def pack_cost_terms(
    offsets: IntArray,
    ids: IntArray,
    total: IntArray,
    visual: IntArray | None,
    images: npt.ArrayLike | None = None,
) -> FloatArray:
    """Per-pack cost columns ``[n_packs, 4]`` in ``COST_TERMS`` order, from per-sample lengths
    (``visual=None``: no visual tokens, the vision columns are 0). ``images``: media items per
    sample (``LengthIndex.images``): a sample's visual tokens are split over them as equal
    images, ``visual^2 / images`` (exact for equal images); None: one image per sample.

    >>> pack_cost_terms(np.array([0, 2, 3]), np.array([0, 1, 2]),
    ...                 np.array([3, 4, 5]), np.array([0, 2, 1])).tolist()
    [[7.0, 25.0, 2.0, 4.0], [5.0, 25.0, 1.0, 1.0]]
    """
    # the cost model's own terms (pipes/planning/cost.py); the index's visual tokens stand in
    # for patches (merge=1: the balance weights below are per visual token)
    return pack_terms(offsets, ids, total, visual, merge=1, images=images)


def sample_vision_cost(visual: npt.ArrayLike, images: npt.ArrayLike | None = None) -> FloatArray:
    """Each sample's vision-encoder cost as ``pack_costs`` prices a pack's (``VISION_LINEAR``
    a visual token, plus its visual tokens squared split over ``images`` equal images; None,
    or 0 items: one image): what the planners deal and trade samples on.

    >>> sample_vision_cost(np.array([0, 10]), np.array([0, 2])).tolist()  # 7680 * 10 + 2 * 5^2
    [0.0, 76850.0]
    """
    pairs = np.asarray(visual).astype(np.float64) ** 2
    if images is not None:
        pairs /= np.maximum(images, 1)
    return VISION_LINEAR * np.asarray(visual) + pairs


def pack_costs(terms: FloatArray) -> tuple[FloatArray, FloatArray]:
    """The (language model, vision encoder) cost of each pack from its ``pack_cost_terms``."""
    parts = BALANCE_COST.per_term(terms)  # fixed, tokens, attention, patches, patch attention
    return parts[:, 1] + parts[:, 2], parts[:, 3] + parts[:, 4]


def balanced_order(
    balance: BalancePolicy,
    terms: FloatArray,
    visual: IntArray,
    totals: IntArray,
    group_size: int,
    supervised: IntArray | None = None,
) -> IntArray:
    """Pack indices in the order whose ``group_size`` neighbours are alike on ``balance``.
    ``supervised``: each pack's supervised tokens (what ``"supervised"`` sorts on).

    >>> terms = pack_cost_terms(np.arange(5), np.arange(4), np.array([4, 2, 4, 2]),
    ...                         np.array([0, 0, 0, 0]))
    >>> balanced_order("lm", terms, np.zeros(4, np.int64), np.array([4, 2, 4, 2]), 2).tolist()
    [1, 3, 0, 2]
    """
    if balance not in BALANCE_POLICIES:
        raise ValueError(f"{balance=} must be one of {BALANCE_POLICIES}")
    n = int(totals.size)
    index = np.arange(n, dtype=np.int64)
    if balance == "tokens":
        return np.lexsort((totals, visual)).astype(np.int64)
    if balance == "supervised":
        if supervised is None or supervised.shape != totals.shape:
            raise ValueError("balance='supervised' needs supervised= (label tokens per pack)")
        return np.lexsort((index, totals, supervised)).astype(np.int64)
    lm, vision = pack_costs(terms)
    if balance == "lm":
        return np.lexsort((index, vision, lm)).astype(np.int64)
    if balance == "vision":
        return np.lexsort((index, lm, vision)).astype(np.int64)
    attention = terms[:, COST_TERMS.index("attention")]
    if n == 0:
        return index
    # lexsort is stable: equal keys keep the pack order (no index key needed)
    by_attention = np.lexsort((vision, attention)).astype(np.int64)
    by_vision = np.lexsort((attention, vision)).astype(np.int64)
    tries = np.geomspace(1.0, max(1.0, n / max(group_size, 1)), STRIP_CANDIDATES)
    counts = sorted({max(1, round(float(k))) for k in tries})
    best, best_score = index, np.inf
    for i, k in enumerate(counts):  # one order at a time: only the best is held
        order = _snake(by_attention, by_vision, k)
        score = group_p95((attention[order], vision[order]), group_size)
        if i == 0 or score < best_score:  # ties: the fewer strips
            best, best_score = order, score
    return best


def _snake(by_attention: IntArray, by_vision: IntArray, k: int) -> IntArray:
    """``by_attention`` cut into ``k`` strips (``np.array_split``'s: the first ``n % k`` one
    longer), each in ``by_vision`` order (vision, attention, pack), every second one reversed.
    All strips at once: one stable radix sort of the strip ids in ``by_vision`` order, not a
    ``lexsort`` per strip (up to ``n / group_size`` of them: 3x faster at 400k packs)."""
    n = by_attention.size
    sizes = np.full(k, n // k, dtype=np.int64)
    sizes[: n % k] += 1
    bounds = _csr_sizes(sizes)
    strip_at = np.repeat(np.arange(k, dtype=np.int64), sizes)  # the strip of each position
    strip_of = np.empty(n, dtype=np.int64)
    strip_of[by_attention] = strip_at
    out = by_vision[radix_argsort(strip_of[by_vision], (k - 1).bit_length())]
    pos = np.arange(n, dtype=np.int64)
    flip = bounds[strip_at] + bounds[strip_at + 1] - 1 - pos  # a position's mirror in its strip
    return out[np.where(strip_at % 2 == 1, flip, pos)]


def _csr_sizes(sizes: IntArray) -> IntArray:
    out = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


def group_p95(cols: FloatArray | Sequence[FloatArray], group_size: int) -> float:
    """p95 over consecutive groups of the largest max/mean over ``cols``' columns (``[n, c]``,
    or ``c`` columns of ``n``: each gathered on its own is contiguous, twice as fast)."""
    if isinstance(cols, np.ndarray):
        cols = [cols[:, j] for j in range(cols.shape[1])]
    n = cols[0].shape[0] // group_size * group_size
    if n == 0:
        return 1.0
    ratio = np.max([imbalance(col[:n].reshape(-1, group_size)) for col in cols], axis=0)
    return float(np.percentile(ratio, 95))


def imbalance(loads: npt.ArrayLike) -> FloatArray:
    """Per step: max / mean load across the ranks (1.0 = even; a step with no load is even).

    >>> imbalance([[10, 30], [0, 0], [5, 5]]).tolist()
    [1.5, 1.0, 1.0]
    """
    a = np.asarray(loads, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"loads must be [steps, ranks], got shape {a.shape}")
    if a.size == 0:
        return np.ones(a.shape[0])
    mean, peak = a.mean(axis=1), a.max(axis=1)
    return np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)
