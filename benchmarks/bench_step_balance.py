"""Per-step compute balance across ranks: token order, cost order, Karmarkar-Karp, LPT + swaps.

Prints one JSON object. Best fit's packs (``plan_packs`` at capacity 8192) are served four
ways, and ``balance="cost"``'s packs a fifth, shuffle on, the same lengths for every method:

- ``tokens``: the plan's step groups on (visual, total) tokens (``balance="tokens"``, default);
- ``cost_order``: best fit's packs in step groups cut from the attention x vision snake
  (``balance.balanced_order("cost")``: what ``balance="cost"`` did before it made packs);
- ``cost``: ``balance="cost"``: packs made for their step groups (``group_pack.py``) where
  that beats ``cost_order`` on the plan's own groups, else ``cost_order``'s (``made_groups``
  says which, ``fill`` what it cost); planned with ``per_rank`` as a graph passes its
  ``batch_size``;
- ``kk``: veRL's way: packs in a random order per epoch, each step's ``world x per_rank``
  packs split over the ranks by Karmarkar-Karp (equal count) on the step cost;
- ``lpt_swaps``: LoongForge's way: the same random steps, longest-processing-time first,
  then swaps between the slowest and the fastest rank while they help.

Cost per pack (``pipes/planning/balance.py``): attention = sum of squared document lengths
(varlen), vision = ``VISION_LINEAR * patches + sum(patches ** 2)`` with a sample's visual tokens
standing in for one image's patches, lm = ``LM_LINEAR * tokens + attention``, step = lm +
vision. For every step, max/mean over ranks of the rank's attention and vision cost:
p50 / p95 / max over steps; the simulated epoch time is the sum over steps of the slowest
rank's step cost, over the same sum of the mean rank (1.0 = no waiting).

Lengths: ``generated`` (the VLM draw of ``bench_balance.py``) and the real per-sample lengths
of ai2d, chartqa and docvqa, whole (``benchmarks/data/omnibal_lengths.npz``, from ModelTC/OmniBal:
448px tiles of 256 tokens each).

``metrics["mixture"]``: mixtures whose sources are used more than once, planned as a graph
plans them (``MixtureLayout.epoch_plan``, ``balance="cost"``, ``per_rank``) and served in
their mixed order: ``generated`` split 80 / 20 % of the samples at weights 0.5 / 0.5 (the
small source used 2.5 times, the big one 0.625), ``real`` ai2d / chartqa / docvqa at 0.4 /
0.3 / 0.3 (ai2d used 2.2 times); packs mixing sources, and one source a pack
(``single_source``). Per case: p50 / p95 / max attention and vision max/mean, fill, and
``one_plan``: one ``plan_packs`` of the same uses in its own epoch order (copies of a
sample may share a pack there: the reference, not a valid plan), and ``best_fit_fill``, best
fit's fill of the same uses (per source with ``single_source``; the goal: within 0.2
points). ``--baseline DIR`` gives the same rows with another checkout's neatpack
(``metrics["mixture_baseline"]``: before / after).

    python benchmarks/bench_step_balance.py           # 100k generated samples, 2 epochs
    python benchmarks/bench_step_balance.py --quick   # 20k generated, real lengths at 8 ranks
    python benchmarks/bench_step_balance.py --mixture-only --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from _checkout import run_in_checkout  # benchmarks/ is on sys.path as the script's folder
from _machine import machine
from bench_balance import make_samples

from neatpack.pipes.mixtures.mixture import Mixture, MixtureSource
from neatpack.pipes.mixtures.mixture_plan import plan_mixture
from neatpack.pipes.mixtures.mixture_source import MixtureLayout
from neatpack.pipes.planning.balance import (
    COST_TERMS,
    balanced_order,
    pack_cost_terms,
    pack_costs,
)
from neatpack.pipes.planning.plan import PackPlan, plan_packs, step_group_order

DATA = Path(__file__).resolve().parent / "data" / "omnibal_lengths.npz"
REAL = ("ai2d", "chartqa", "docvqa")
TILE_TOKENS = 256
LENGTHS: list[np.ndarray] = []  # (total, visual) of the corpus being evaluated


def real_lengths(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(total, visual) tokens per sample of one real dataset."""
    with np.load(DATA) as z:
        total = z[f"{name}_token_num"].astype(np.int64)
        visual = z[f"{name}_vit_num"].astype(np.int64) * TILE_TOKENS
    return total, np.minimum(visual, total)


def karmarkar_karp(costs: np.ndarray, k: int) -> list[list[int]]:
    """Equal-count Karmarkar-Karp (veRL's ``get_seqlen_balanced_partitions``): ``k`` parts."""
    order = np.argsort(-costs, kind="stable")
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for n, start in enumerate(range(0, costs.size, k)):
        chunk = order[start : start + k]
        parts = [(float(costs[i]), [int(i)]) for i in chunk]
        parts += [(0.0, []) for _ in range(k - len(parts))]
        parts.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), n, parts))
    tie = costs.size
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)]
        merged.sort(key=lambda p: -p[0])
        tie += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
    return [p[1] for p in heap[0][2]]


def lpt_swaps(costs: np.ndarray, k: int, per_rank: int) -> list[list[int]]:
    """LPT with ``per_rank`` packs per rank, then swaps between slowest and fastest rank."""
    parts: list[list[int]] = [[] for _ in range(k)]
    load = np.zeros(k)
    for i in np.argsort(-costs, kind="stable"):
        open_ = [r for r in range(k) if len(parts[r]) < per_rank]
        r = min(open_, key=lambda j: load[j])
        parts[r].append(int(i))
        load[r] += costs[i]
    for _ in range(4 * k):
        hi, lo = int(load.argmax()), int(load.argmin())
        best, pair = load[hi], None
        for a in parts[hi]:
            for b in parts[lo]:
                worse = max(load[hi] - costs[a] + costs[b], load[lo] - costs[b] + costs[a])
                if worse < best - 1e-9:
                    best, pair = worse, (a, b)
        if pair is None:
            break
        a, b = pair
        parts[hi][parts[hi].index(a)], parts[lo][parts[lo].index(b)] = b, a
        load[hi] += costs[b] - costs[a]
        load[lo] += costs[a] - costs[b]
    return parts


def rank_slots(
    plan: PackPlan, step_cost: np.ndarray, method: str, epoch: int, world: int, per_rank: int
) -> np.ndarray:
    """``[steps, world, per_rank]`` pack indices of one epoch for one method."""
    unit = world * per_rank
    if method in ("tokens", "cost", "cost_order"):
        order = plan.epoch_order(epoch)
        if method == "cost_order":  # the same shuffle, over the snake's storage order
            terms = pack_cost_terms(plan.offsets, plan.ids, *LENGTHS)
            snake = balanced_order("cost", terms, plan.visual, plan.totals, world)
            rng = np.random.default_rng([plan.seed, epoch])
            order = snake[step_group_order(len(plan), world, rng)]
        steps = order[: order.size // unit * unit].reshape(-1, per_rank, world)
        return steps.transpose(0, 2, 1)
    order = np.random.default_rng([plan.seed, epoch, 7]).permutation(len(plan))
    out = []
    for step in order[: order.size // unit * unit].reshape(-1, unit):
        c = step_cost[step]
        parts = karmarkar_karp(c, world) if method == "kk" else lpt_swaps(c, world, per_rank)
        out.append([[int(step[i]) for i in p] for p in parts])
    return np.asarray(out, dtype=np.int64).reshape(-1, world, per_rank)


def ratio_stats(per_rank_cost: np.ndarray) -> dict[str, float]:
    mean = per_rank_cost.mean(axis=1)
    keep = mean > 0
    r = per_rank_cost[keep].max(axis=1) / mean[keep]
    if r.size == 0:
        return {"p50": 1.0, "p95": 1.0, "max": 1.0}
    return {
        "p50": round(float(np.percentile(r, 50)), 4),
        "p95": round(float(np.percentile(r, 95)), 4),
        "max": round(float(r.max()), 4),
    }


def evaluate(
    total: np.ndarray, visual: np.ndarray, world: int, per_rank: int, epochs: int, seed: int
) -> dict[str, Any]:
    LENGTHS[:] = [total, visual]
    kw: dict[str, Any] = {"visual": visual, "world_size": world, "seed": seed, "overlong": "drop"}
    plans = {
        "tokens": plan_packs(total, 8192, balance="tokens", **kw),
        # as a graph plans it: its batch_size is the packs per rank per step
        "cost": plan_packs(total, 8192, balance="cost", per_rank=per_rank, **kw),
    }
    same = sorted(map(tuple, plans["tokens"].packs())) == sorted(map(tuple, plans["cost"].packs()))
    out: dict[str, Any] = {
        "packs": {k: len(p) for k, p in plans.items()},
        "same_packs": same,
        "made_groups": plans["cost"].free_from // world,
        "fill": {k: round(p.utilization(), 5) for k, p in plans.items()},
    }
    for method in ("tokens", "cost_order", "cost", "kk", "lpt_swaps"):
        plan = plans["cost" if method == "cost" else "tokens"]
        terms = pack_cost_terms(plan.offsets, plan.ids, total, visual)
        lm, vision = pack_costs(terms)
        attention = terms[:, COST_TERMS.index("attention")]
        slots = np.concatenate(
            [rank_slots(plan, lm + vision, method, e, world, per_rank) for e in range(epochs)]
        )
        step = (lm + vision)[slots].sum(axis=2)
        out[method] = {
            "steps": int(slots.shape[0]),
            "attention": ratio_stats(attention[slots].sum(axis=2)),
            "vision": ratio_stats(vision[slots].sum(axis=2)),
            "epoch_time": (
                round(float(step.max(axis=1).sum() / step.mean(axis=1).sum()), 4)
                if slots.shape[0]
                else None  # fewer packs than one step takes
            ),
        }
    base = out["tokens"]["epoch_time"]
    for method in ("cost_order", "cost", "kk", "lpt_swaps"):
        t = out[method]["epoch_time"]
        out[method]["speedup_vs_tokens"] = None if None in (base, t) else round(base / t, 4)
    return out


def mixture_corpora(n: int, seed: int) -> dict[str, tuple[list[str], list[float], list[Any]]]:
    """name -> (source names, weights, per source (total, visual)): the module doc's mixtures."""
    total, visual = make_samples(n, seed)
    cut = int(n * 0.8)
    real = [real_lengths(name) for name in REAL]
    return {
        "generated": (["big", "small"], [0.5, 0.5],
                      [(total[:cut], visual[:cut]), (total[cut:], visual[cut:])]),
        "real": (list(REAL), [0.4, 0.3, 0.3], real),
    }  # fmt: skip


def mixture_case(
    corpus: tuple[list[str], list[float], list[Any]],
    world: int,
    per_rank: int,
    single_source: bool,
    epochs: int,
    seed: int,
) -> dict[str, Any]:
    """One mixture served ``epochs`` epochs on ``world`` ranks x ``per_rank`` packs a step."""
    names, weights, parts = corpus
    total = np.concatenate([t for t, _ in parts])
    visual = np.concatenate([v for _, v in parts])
    mix = Mixture(sources=[MixtureSource(name=nm, data=None, weight=w)
                           for nm, w in zip(names, weights, strict=True)])  # fmt: skip
    layout = MixtureLayout(
        names=tuple(names), sizes=tuple(t.size for t, _ in parts), total=total, visual=visual,
        capacity=8192, packing_ratio=1.0, overlong="drop", seed=seed,
        single_source=single_source, lengths_fingerprint="bench", balance="cost",
        per_rank=per_rank,
    )  # fmt: skip
    blend = mix.blend()
    unit = world * per_rank
    out: dict[str, Any] = {}
    rows: dict[str, list[np.ndarray]] = {"mixture": [], "one_plan": []}
    for epoch in range(epochs):
        plan = layout.epoch_plan([(0, blend)], epoch, world)
        one = plan_packs(total[plan.ids], 8192, visual=visual[plan.ids], world_size=world,
                         seed=seed, balance="cost", per_rank=per_rank)  # fmt: skip
        cases = (
            ("mixture", plan.offsets, plan.ids, plan.order),
            ("one_plan", one.offsets, plan.ids[one.ids], one.epoch_order(epoch)),
        )
        for key, offsets, ids, order in cases:
            terms = pack_cost_terms(offsets, ids, total, visual)
            vision = pack_costs(terms)[1]
            attention = terms[:, COST_TERMS.index("attention")]
            slots = order[: order.size // unit * unit].reshape(-1, per_rank, world)
            rows[key].append(np.stack([attention[slots].sum(axis=1),
                                       vision[slots].sum(axis=1)]))  # fmt: skip
            fill = float(total[ids].sum()) / max((offsets.size - 1) * 8192, 1)
            out.setdefault(key, {"packs": offsets.size - 1, "fill": round(fill, 5)})
        if epoch == 0:
            # best fit of the same uses (copies may share a pack), per source for single_source
            src = plan.source_of(plan.ids)
            uses = [plan.ids[src == k] for k in range(len(names))] if single_source else [plan.ids]
            n_fit = sum(len(plan_packs(total[u], 8192, world_size=world, seed=seed)) for u in uses)
            out["best_fit_fill"] = round(float(total[plan.ids].sum()) / (n_fit * 8192), 5)
            uses = np.bincount(plan.source_of(plan.ids), minlength=len(names))
            sizes = [t.size for t, _ in parts]
            out["uses_per_sample"] = [
                round(int(u) / z, 3) for u, z in zip(uses, sizes, strict=True)
            ]
    for key, stats in rows.items():
        both = np.concatenate(stats, axis=1)  # [2, steps, world]
        out[key]["steps"] = int(both.shape[1])
        out[key]["attention"] = ratio_stats(both[0])
        out[key]["vision"] = ratio_stats(both[1])
    return out


def mixture_rows(
    n: int, ranks: list[int], per_ranks: list[int], epochs: int, seed: int
) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, corpus in mixture_corpora(n, seed).items():
        for single in (False, True):
            for world in ranks:
                for per_rank in per_ranks:
                    key = f"{name}/single_source={single}/ranks={world}/per_rank={per_rank}"
                    rows[key] = mixture_case(corpus, world, per_rank, single, epochs, seed)
    return rows


def baseline_mixture(checkout: str, argv: list[str]) -> tuple[dict[str, Any], str]:
    """The ``--mixture-only`` rows with the neatpack of ``checkout`` (its ``pipes`` and
    ``graphs`` as ``neatpack.pipes`` / ``neatpack.graphs``), in a subprocess, and the file
    its ``plan_mixture`` came from (as ``bench_plan.py``'s ``--baseline``)."""
    printed = run_in_checkout(checkout, __file__, [*argv, "--mixture-only"])
    return printed["metrics"]["mixture"], printed["params"]["planner"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20k generated samples, 8 ranks")
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--packs-per-rank", default="1,4")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mixture-only", action="store_true", help="only metrics['mixture']")
    ap.add_argument("--baseline", default=None, help="a checkout to run the mixture rows with")
    args = ap.parse_args(argv)
    n = 20_000 if args.quick else args.samples
    ranks = [8] if args.quick else [int(r) for r in args.ranks.split(",")]
    per_ranks = [1] if args.quick else [int(p) for p in args.packs_per_rank.split(",")]
    corpora = {"generated": make_samples(n, args.seed)}
    corpora.update({name: real_lengths(name) for name in REAL})
    both = [np.concatenate(x) for x in zip(*(corpora[name] for name in REAL), strict=True)]
    corpora["real_mix"] = (both[0], both[1])
    metrics: dict[str, Any] = {}
    for name, (total, visual) in [] if args.mixture_only else corpora.items():
        for world in ranks:
            for per_rank in per_ranks:
                key = f"{name}/ranks={world}/per_rank={per_rank}"
                metrics[key] = evaluate(total, visual, world, per_rank, args.epochs, args.seed)
    metrics["mixture"] = mixture_rows(n, ranks, per_ranks, args.epochs, args.seed)
    if args.baseline:
        passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--mixture-only"]
        at = passed.index("--baseline") if "--baseline" in passed else None
        if at is not None:
            passed = passed[:at] + passed[at + 2 :]
        passed = [a for a in passed if not a.startswith("--baseline=")]
        base, planner = baseline_mixture(args.baseline, passed)
        metrics["mixture_baseline"] = {"planner": planner, "rows": base}
    out = {
        "benchmark": "step_balance",
        "params": {
            "generated_samples": n,
            "real_samples": {name: int(corpora[name][0].size) for name in REAL},
            "capacity": 8192,
            "ranks": ranks,
            "packs_per_rank": per_ranks,
            "epochs": args.epochs,
            "seed": args.seed,
            "shuffle": True,
            "quick": args.quick,
            "mixture_only": args.mixture_only,
            "planner": plan_mixture.__code__.co_filename,
            "real_source": "ModelTC/OmniBal@fc12bce data/vision/*_wh_token_lengths.json",
        },
        "metrics": metrics,
        "env": machine(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
