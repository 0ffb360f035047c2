"""Per-step load balance across ranks: the plan's step-group order vs a per-pack random shuffle.

Prints one JSON object. Samples are generated to look like VLM SFT data: 35% text-only, the
rest with 1-4 images of 64..1280 visual tokens each. ``plan_packs`` packs them at capacity
8192 for ``--world-size`` ranks; each epoch's order is cut into steps of world_size x
packs-per-rank packs, rank ``r`` taking slots ``r, r + W, ...`` (the pack source's rule). For
each step, ``max/mean`` over ranks of the rank's visual tokens (and text, total tokens);
reported as the mean, p95 and max over steps with visual load, and ``sum(max) / sum(mean)``
(the share of vision-encoder time a step spends waiting for its slowest rank, plus one).

    python benchmarks/bench_balance.py           # 200k samples, 3 epochs
    python benchmarks/bench_balance.py --quick   # 20k samples
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack.pipes.planning.plan import PackPlan, plan_packs


def make_samples(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(total, visual) tokens per sample."""
    rng = np.random.default_rng(seed)
    text_only = rng.random(n) < 0.35
    n_images = np.where(text_only, 0, rng.choice([1, 2, 3, 4], size=n, p=[0.5, 0.25, 0.15, 0.1]))
    per_image = rng.integers(64, 1281, size=(n, 4))
    visual = (per_image * (np.arange(4) < n_images[:, None])).sum(axis=1)
    text = np.where(
        text_only,
        rng.lognormal(np.log(400.0), 0.9, size=n),
        rng.lognormal(np.log(150.0), 0.8, size=n),
    )
    total = np.rint(text).astype(np.int64) + 1 + visual
    return total, visual.astype(np.int64)


def step_stats(loads: np.ndarray, order: np.ndarray, world: int, per_rank: int) -> np.ndarray:
    """max/mean over ranks of per-rank load, one value per step (steps with zero load: NaN)."""
    unit = world * per_rank
    slots = order[: order.size // unit * unit].reshape(-1, per_rank, world)
    rank_load = loads[slots].sum(axis=1)  # [steps, world]
    mean = rank_load.mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, rank_load.max(axis=1) / mean, np.nan)


def summarize(
    ratios: list[np.ndarray], loads: np.ndarray, orders: list[np.ndarray], world: int, per_rank: int
) -> dict[str, float]:
    r = np.concatenate(ratios)
    r = r[~np.isnan(r)]
    unit = world * per_rank
    tot_max = tot_mean = 0.0
    for order in orders:
        slots = order[: order.size // unit * unit].reshape(-1, per_rank, world)
        rank_load = loads[slots].sum(axis=1)
        tot_max += float(rank_load.max(axis=1).sum())
        tot_mean += float(rank_load.mean(axis=1).sum())
    return {
        "mean": round(float(r.mean()), 4),
        "p95": round(float(np.percentile(r, 95)), 4),
        "max": round(float(r.max()), 4),
        "sum_max_over_sum_mean": round(tot_max / tot_mean, 4),
    }


def evaluate(plan: PackPlan, epochs: int, world: int, per_rank: int, seed: int) -> dict[str, Any]:
    loads = {
        "visual": plan.visual,
        "text": plan.totals - plan.visual,
        "total": plan.totals,
    }
    orders = {
        "plan_order": [plan.epoch_order(e) for e in range(epochs)],
        "random_shuffle": [
            np.random.default_rng([seed, e, 1]).permutation(len(plan)) for e in range(epochs)
        ],
    }
    out: dict[str, Any] = {}
    for name, ords in orders.items():
        out[name] = {
            key: summarize(
                [step_stats(load, o, world, per_rank) for o in ords], load, ords, world, per_rank
            )
            for key, load in loads.items()
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20k samples")
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--packs-per-rank", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = 20_000 if args.quick else args.samples
    total, visual = make_samples(n, args.seed)
    plan = plan_packs(
        total, args.capacity, visual=visual, world_size=args.world_size, seed=args.seed,
        overlong="drop",
    )  # fmt: skip
    metrics = evaluate(plan, args.epochs, args.world_size, args.packs_per_rank, args.seed)
    metrics["packs"] = len(plan)
    metrics["dropped_overlong"] = int(plan.dropped_ids.size)
    metrics["utilization"] = round(plan.utilization(), 5)
    metrics["mean_visual_per_pack"] = round(float(plan.visual.mean()), 1)
    metrics["text_only_packs"] = int((plan.visual == 0).sum())
    out = {
        "benchmark": "balance",
        "params": {
            "samples": n,
            "capacity": args.capacity,
            "world_size": args.world_size,
            "packs_per_rank": args.packs_per_rank,
            "epochs": args.epochs,
            "seed": args.seed,
            "quick": args.quick,
            "distribution": "35% text-only (lognormal median 400); else 1-4 images of "
            "U[64,1280] visual tokens + lognormal median 150 text",
        },
        "metrics": metrics,
        "env": machine(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
