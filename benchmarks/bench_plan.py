"""Planner speed and pack count: the seed's greedy_knapsack vs best_fit_decreasing, same lengths.

Prints one JSON object. For each length distribution and size: seconds (best of
``--repeats``; wall clock, and ``*_cpu_s`` this process's CPU time) and packs for the fast
planner (CSR output and bin-ids output), for ``greedy_knapsack`` (one run), and the lower
bound max(ceil(sum / capacity), Martello-Toth L2).
``gap_pp`` is ``(packs - bound) / bound`` in percentage points. ``greedy_knapsack`` at a size
whose predicted time (10x the next smaller size, +15%) exceeds ``--greedy-timeout`` seconds is
not run; ``greedy_skipped`` says why.

The vision budget (``plan_packs(max_visual=)``, #27 item 4), under ``metrics["visual_budget"]``:
on generated VLM lengths (``vlm/<n>``: 35% text-only, the rest 1-4 images of 64..1280 visual
tokens) and on the generated image/text corpus (``corpus/<n>``: ``write_corpus`` sized by the
tiny Qwen2-VL processor's exact length index), ``plan_packs`` without a budget and with budgets
at a fraction of the unbudgeted plan's mean visual tokens per pack: seconds, packs, the lower
bound ``max(ceil(sum total / capacity), ceil(sum visual / budget))``, token fill, the largest
pack's visual tokens.

The images budget (``plan_packs(max_images=)``), under ``metrics["images_budget"]``: on the
same lengths with their media items per sample (``vlm``: the 1-4 images drawn; ``corpus``: the
length index's ``images``), budgets at a fraction of the unbudgeted plan's mean items per
pack, alone and with the visual budget at ``x1.0``: the same columns, the lower bound
``max(ceil(sum total / capacity), ceil(sum images / max_images)[, ceil(sum visual /
max_visual)])`` and the largest pack's items.

The planning time of a step balance (``plan_packs(balance=...)``), under
``metrics["balance_plan"]``: ``vlm/<n>/<ranks>`` rows per ``--balance`` policy (seconds,
packs, token fill, ``free_from``: packs made as step groups under ``"cost"``).
``--baseline DIR`` times the same rows with the neatpack of another checkout (``git
worktree`` or ``git archive`` of the commit to compare with), in a subprocess per repeat,
alternating with this one's, under ``metrics["balance_plan_baseline"]``; the plans must be
the same (``same_plan``: a hash of offsets and ids), only the time may differ.

    python benchmarks/bench_plan.py            # 1M and 10M samples, capacity 8192
    python benchmarks/bench_plan.py --quick    # 100k samples
    python benchmarks/bench_plan.py --balance-only --baseline /tmp/base   # before / after
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from _checkout import run_in_checkout  # benchmarks/ is on sys.path as the script's folder
from _machine import machine

from neatpack.pipes.planning.binpack import (
    best_fit_decreasing,
    bfd_bin_ids,
    greedy_knapsack,
    lower_bound,
)
from neatpack.pipes.planning.plan import plan_packs

DISTRIBUTIONS = ("lognormal", "uniform", "uniform_full")


def make_lengths(kind: str, n: int, capacity: int, seed: int) -> np.ndarray:
    """lognormal: median 700 tokens, sigma 1, clipped to [1, capacity]; uniform: 50..4096
    (the peer notes' case); uniform_full: 1..capacity (the hardest for any-fit packers)."""
    rng = np.random.default_rng([seed, DISTRIBUTIONS.index(kind)])
    if kind == "lognormal":
        x = rng.lognormal(mean=np.log(700.0), sigma=1.0, size=n)
        return np.clip(np.rint(x), 1, capacity).astype(np.int64)
    if kind == "uniform":
        return rng.integers(50, 4097, size=n, dtype=np.int64)
    if kind == "uniform_full":
        return rng.integers(1, capacity + 1, size=n, dtype=np.int64)
    raise ValueError(f"{kind=!r} is not one of {DISTRIBUTIONS}")


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any, float]:
    """Best wall seconds, the last output, and best CPU seconds of this process (on a shared
    machine the CPU time shows the work when other jobs take the cores; both are reported)."""
    best, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best, out, best_cpu


def run(
    sizes: list[int], capacity: int, repeats: int, greedy_timeout: float, seed: int
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in DISTRIBUTIONS:
        last_greedy: float | None = None
        for n in sizes:
            lengths = make_lengths(kind, n, capacity, seed)
            bound = lower_bound(lengths, capacity)
            t_csr, (offsets, ids), cpu_csr = best_time(
                partial(best_fit_decreasing, lengths, capacity), repeats
            )
            t_bins, _, cpu_bins = best_time(partial(bfd_bin_ids, lengths, capacity), repeats)
            fills = np.add.reduceat(lengths[ids], offsets[:-1])
            packs = int(offsets.size - 1)
            row: dict[str, Any] = {
                "n": n,
                "lower_bound": bound,
                "fast_packs": packs,
                "fast_gap_pp": round((packs - bound) / bound * 100, 5),
                "fast_csr_s": round(t_csr, 4),
                "fast_bin_ids_s": round(t_bins, 4),
                "fast_csr_cpu_s": round(cpu_csr, 4),
                "fast_bin_ids_cpu_s": round(cpu_bins, 4),
                "fast_utilization": round(float(lengths.sum()) / (packs * capacity), 6),
                "fast_half_full_packs": int((2 * fills <= capacity).sum()),
            }
            predicted = None if last_greedy is None else last_greedy * 10 * 1.15
            if predicted is not None and predicted > greedy_timeout:
                row["greedy_skipped"] = (
                    f"predicted {predicted:.0f} s > {greedy_timeout:.0f} s from the "
                    f"{n // 10} run; compare at the smaller size"
                )
            else:
                values = lengths.tolist()
                t0 = time.perf_counter()
                bins = greedy_knapsack(values, capacity)
                t_greedy = time.perf_counter() - t0
                last_greedy = t_greedy
                row.update(
                    greedy_packs=len(bins),
                    greedy_gap_pp=round((len(bins) - bound) / bound * 100, 5),
                    greedy_s=round(t_greedy, 3),
                    speedup_csr=round(t_greedy / t_csr, 1),
                    fast_minus_greedy_packs=packs - len(bins),
                )
                del bins, values
            results[f"{kind}/{n}"] = row
    return results


BUDGET_FRACTIONS = (None, 1.25, 1.1, 1.0, 0.8)  # x the unbudgeted plan's mean visual per pack


def vlm_lengths(n: int, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(total, visual, images): 35% text-only (median ~400 tokens), the rest 1-4 images of
    64..1280 visual tokens each plus ~150 text tokens; clipped to the capacity."""
    rng = np.random.default_rng([seed, 99])
    text_only = rng.random(n) < 0.35
    n_images = np.where(text_only, 0, rng.choice([1, 2, 3, 4], size=n, p=[0.5, 0.25, 0.15, 0.1]))
    visual = (rng.integers(64, 1281, size=(n, 4)) * (np.arange(4) < n_images[:, None])).sum(1)
    text = np.where(text_only, rng.lognormal(6.0, 0.9, n), rng.lognormal(5.0, 0.8, n))
    total = np.minimum(np.rint(text).astype(np.int64) + 1 + visual, capacity)
    return total, np.minimum(visual, total).astype(np.int64), n_images.astype(np.int64)


def corpus_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(total, visual, images) of ``write_corpus(num_samples=n)`` from the tiny Qwen2-VL
    processor's exact length index (the lengths ``neat_vlm_graph`` plans with)."""

    from neatpack.graphs import NeatVLMConfig
    from neatpack.graphs.families import plan_family
    from neatpack.graphs.open_data import MISSING_MEDIA_FIX, open_source
    from neatpack.pipes import load_tiny_processor, write_corpus
    from neatpack.pipes.indexing.lengths import build_length_index

    with tempfile.TemporaryDirectory() as d:
        data = write_corpus(d, num_samples=n, seed=seed)
        processor = load_tiny_processor()
        cfg = NeatVLMConfig(media_root=f"{d}/media")
        source = open_source(data, cfg.media_root)
        family = plan_family(processor, cfg)
        est = family.estimator(
            processor, cfg.estimate_mode, source, missing_media_fix=MISSING_MEDIA_FIX
        )
        index = build_length_index(source, est, progress=False)
    assert index.images is not None  # a fresh index counts them
    return np.asarray(index.total), np.asarray(index.visual), np.asarray(index.images, np.int64)


def budget_rows(
    total: np.ndarray, visual: np.ndarray, capacity: int, repeats: int, world_size: int
) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    mean_visual = 0.0
    for frac in BUDGET_FRACTIONS:
        budget = None if frac is None else int(mean_visual * frac)
        t, plan, cpu = best_time(
            partial(plan_packs, total, capacity, visual=visual, max_visual=budget,
                    overlong="drop", world_size=world_size),
            repeats,
        )  # fmt: skip
        if frac is None:
            mean_visual = float(plan.visual.mean())
        kept = np.setdiff1d(np.arange(total.size), plan.dropped_ids)
        bound = -(-int(total[kept].sum()) // capacity)
        if budget is not None:
            bound = max(bound, -(-int(visual[kept].sum()) // budget))
        rows["none" if frac is None else f"x{frac}"] = {
            "max_visual": budget,
            "plan_s": round(t, 4),
            "plan_cpu_s": round(cpu, 4),
            "packs": len(plan),
            "lower_bound": bound,
            "gap_pp": round((len(plan) - bound) / max(bound, 1) * 100, 3),
            "utilization": round(plan.utilization(), 5),
            "max_pack_visual": int(plan.visual.max()) if len(plan) else 0,
            "mean_pack_visual": round(float(plan.visual.mean()), 1) if len(plan) else 0.0,
            "dropped": int(plan.dropped_ids.size),
        }
    return rows


IMAGE_FRACTIONS = (None, 1.25, 1.0, 0.8)  # x the unbudgeted plan's mean items per pack


def images_rows(
    total: np.ndarray,
    visual: np.ndarray,
    images: np.ndarray,
    capacity: int,
    repeats: int,
    world_size: int,
) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    plain = plan_packs(total, capacity, visual=visual, overlong="drop", world_size=world_size)
    mean_items = float(images[plain.ids].sum()) / max(len(plain), 1)
    mean_visual = float(plain.visual.mean()) if len(plain) else 0.0
    cases = [(f, None) for f in IMAGE_FRACTIONS] + [(1.0, 1.0)]
    for frac, vfrac in cases:
        max_images = None if frac is None else max(1, round(mean_items * frac))
        max_visual = None if vfrac is None else int(mean_visual * vfrac)
        t, plan, cpu = best_time(
            partial(plan_packs, total, capacity, visual=visual, max_visual=max_visual,
                    images=images, max_images=max_images, overlong="drop",
                    world_size=world_size),
            repeats,
        )  # fmt: skip
        kept = np.setdiff1d(np.arange(total.size), plan.dropped_ids)
        bound = -(-int(total[kept].sum()) // capacity)
        if max_images is not None:
            bound = max(bound, -(-int(images[kept].sum()) // max_images))
        if max_visual is not None:
            bound = max(bound, -(-int(visual[kept].sum()) // max_visual))
        per_pack = (
            np.add.reduceat(images[plan.ids], plan.offsets[:-1]) if len(plan) else np.zeros(1)
        )
        name = "none" if frac is None else f"x{frac}" + ("" if vfrac is None else "+visual")
        rows[name] = {
            "max_images": max_images,
            "max_visual": max_visual,
            "plan_s": round(t, 4),
            "plan_cpu_s": round(cpu, 4),
            "packs": len(plan),
            "lower_bound": bound,
            "gap_pp": round((len(plan) - bound) / max(bound, 1) * 100, 3),
            "utilization": round(plan.utilization(), 5),
            "max_pack_images": int(per_pack.max()),
            "mean_pack_images": round(float(per_pack.mean()), 2),
            "max_pack_visual": int(plan.visual.max()) if len(plan) else 0,
            "dropped": int(plan.dropped_ids.size),
        }
    return rows


def balance_rows(
    sizes: list[int], ranks: list[int], balances: list[str], capacity: int, repeats: int,
    seed: int,
) -> dict[str, Any]:  # fmt: skip
    """``plan_packs`` on the VLM lengths per size, ranks and balance: best of ``repeats``."""
    rows: dict[str, Any] = {}
    for n in sizes:
        total, visual, _ = vlm_lengths(n, capacity, seed)
        for world in ranks:
            row: dict[str, Any] = {}
            for balance in balances:
                t, plan, cpu = best_time(
                    partial(plan_packs, total, capacity, visual=visual, world_size=world,
                            balance=balance),
                    repeats,
                )  # fmt: skip
                digest = hashlib.sha256(np.asarray(plan.offsets, np.int64).tobytes())
                digest.update(np.asarray(plan.ids, np.int64).tobytes())
                row[balance] = {
                    "plan_s": round(t, 3),
                    "plan_cpu_s": round(cpu, 3),
                    "packs": len(plan),
                    "free_from": int(plan.free_from),
                    "utilization": round(plan.utilization(), 5),
                    "plan_hash": digest.hexdigest()[:16],
                }
            rows[f"vlm/{n}/{world}"] = row
    return rows


def baseline_rows(checkout: str, argv: list[str]) -> tuple[dict[str, Any], str]:
    """This script's ``--balance-only`` rows with the neatpack of ``checkout`` (its ``pipes``
    and ``graphs`` folders as ``neatpack.pipes`` / ``neatpack.graphs``), in a subprocess, and
    the file its ``plan_packs`` came from."""
    printed = run_in_checkout(checkout, __file__, [*argv, "--balance-only", "--repeats", "1"])
    return printed["metrics"]["balance_plan"], printed["params"]["planner"]


def _min_rows(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cell, the run of least ``plan_s``."""
    best = runs[0]
    for run_rows in runs[1:]:
        for key, row in run_rows.items():
            for balance, cell in row.items():
                if cell["plan_s"] < best[key][balance]["plan_s"]:
                    best[key][balance] = cell
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100k samples only")
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--greedy-timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", type=int, default=None, help="write_corpus samples (1944)")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--balance", default="tokens,cost", help="policies timed (balance_plan)")
    ap.add_argument("--ranks", default="8,64", help="world sizes of the balance_plan rows")
    ap.add_argument("--sizes", default=None, help="samples, comma-separated (1M,10M; quick: 100k)")
    ap.add_argument("--balance-only", action="store_true", help="only the balance_plan rows")
    ap.add_argument("--baseline", default=None, help="a checkout to time balance_plan against")
    args = ap.parse_args(argv)
    sizes = [100_000] if args.quick else [1_000_000, 10_000_000]
    if args.sizes:
        sizes = [int(float(x)) for x in args.sizes.split(",")]
    corpus_n = args.corpus or (100 if args.quick else 1944)
    ranks = [int(x) for x in args.ranks.split(",")]
    balances = args.balance.split(",")
    bal_args = ["--sizes", ",".join(map(str, sizes)), "--ranks", args.ranks,
                "--balance", args.balance, "--capacity", str(args.capacity),
                "--seed", str(args.seed)]  # fmt: skip
    mine: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    planner = ""
    for _ in range(args.repeats if args.baseline else 1):  # alternate: the same machine load
        if args.baseline:
            rows, planner = baseline_rows(args.baseline, bal_args)
            theirs.append(rows)
        reps = 1 if args.baseline else args.repeats
        mine.append(balance_rows(sizes, ranks, balances, args.capacity, reps, args.seed))
    metrics: dict[str, Any] = {"balance_plan": _min_rows(mine)}
    if theirs:
        base = _min_rows(theirs)
        for key, row in metrics["balance_plan"].items():
            for balance, cell in row.items():
                cell["same_plan"] = cell["plan_hash"] == base[key][balance]["plan_hash"]
                cell["baseline_plan_s"] = base[key][balance]["plan_s"]
        metrics["balance_plan_baseline"] = {"planner": planner, "rows": base}
    if not args.balance_only:
        metrics.update(run(sizes, args.capacity, args.repeats, args.greedy_timeout, args.seed))
        budget: dict[str, Any] = {}
        items: dict[str, Any] = {}
        for n in sizes[:1]:
            total, visual, images = vlm_lengths(n, args.capacity, args.seed)
            budget[f"vlm/{n}"] = budget_rows(
                total, visual, args.capacity, args.repeats, args.world_size
            )
            items[f"vlm/{n}"] = images_rows(
                total, visual, images, args.capacity, args.repeats, args.world_size
            )
        total, visual, images = corpus_lengths(corpus_n, args.seed)
        budget[f"corpus/{corpus_n}"] = budget_rows(
            total, visual, args.capacity, args.repeats, args.world_size
        )
        items[f"corpus/{corpus_n}"] = images_rows(
            total, visual, images, args.capacity, args.repeats, args.world_size
        )
        metrics["visual_budget"] = budget
        metrics["images_budget"] = items
    out = {
        "benchmark": "plan",
        "params": {
            "sizes": sizes,
            "capacity": args.capacity,
            "repeats": args.repeats,
            "greedy_timeout_s": args.greedy_timeout,
            "seed": args.seed,
            "distributions": list(DISTRIBUTIONS),
            "quick": args.quick,
            "corpus_samples": corpus_n,
            "world_size": args.world_size,
            "budget_fractions": list(BUDGET_FRACTIONS),
            "image_fractions": list(IMAGE_FRACTIONS),
            "balance": balances,
            "ranks": ranks,
            "balance_only": args.balance_only,
            "baseline": args.baseline,
            "planner": os.path.realpath(plan_packs.__code__.co_filename),
        },
        "metrics": metrics,
        "env": machine(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
