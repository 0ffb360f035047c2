"""Planning an epoch of a 5-source mixture next to planning one source of the same size.

Lengths arrays stand in for the sources' cached length indexes (no records): ``single`` plans
10M samples with ``plan_packs``; ``mixture`` plans an epoch of 5 sources holding 10M samples in
all (sizes 4M / 3M / 2M / 900k / 100k, weights 0.3 / 0.25 / 0.2 / 0.15 / 0.1, so the two small
ones are upsampled and the big ones downsampled) with ``MixtureLayout.epoch_plan``: the seeded
selection, ``plan_packs`` over the uses, and the source-spreading serving order. Each is timed
(best of ``--repeats``, wall and CPU) and its peak traced memory measured in a separate run
(``tracemalloc``: numpy's arrays included). ``worst_window_error`` is the mixture's largest
token-share error (points) over consecutive windows of 1000 packs.

    python benchmarks/bench_mixture.py            # 10M samples, capacity 8192, 8 ranks
    python benchmarks/bench_mixture.py --quick    # 1M samples
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack.pipes.mixtures.mixture import Mixture, MixtureSource
from neatpack.pipes.mixtures.mixture_report import realized_shares, target_shares
from neatpack.pipes.mixtures.mixture_source import MixtureLayout
from neatpack.pipes.planning.plan import plan_packs

SHARES = (0.4, 0.3, 0.2, 0.09, 0.01)  # of the samples
WEIGHTS = (0.3, 0.25, 0.2, 0.15, 0.1)  # of the tokens
NAMES = ("caption", "ocr", "chat", "charts", "video_qa")


def lengths(n: int, seed: int, capacity: int) -> list[np.ndarray]:
    """Per source a lognormal length distribution (medians 300..1500 tokens)."""
    rng = np.random.default_rng(seed)
    sizes = [int(n * s) for s in SHARES]
    sizes[0] += n - sum(sizes)
    out = []
    for i, size in enumerate(sizes):
        x = rng.lognormal(mean=np.log(300.0 * (1 + i)), sigma=0.8, size=size)
        out.append(np.clip(np.rint(x), 1, capacity).astype(np.int64))
    return out


def measure(fn: Callable[[], Any], repeats: int) -> tuple[dict[str, float], Any]:
    best, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    out = None
    tracemalloc.start()
    out = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "s": round(best, 3),
        "cpu_s": round(best_cpu, 3),
        "peak_mb": round(peak / 2**20, 1),
    }, out


def run(n: int, capacity: int, world_size: int, repeats: int, seed: int) -> dict[str, Any]:
    parts = lengths(n, seed, capacity)
    total = np.concatenate(parts)
    single, plan = measure(
        lambda: plan_packs(total, capacity, world_size=world_size, seed=seed), repeats
    )
    single["packs"] = len(plan)
    del plan
    mix = Mixture(sources=[MixtureSource(name=name, data=None, weight=w)
                           for name, w in zip(NAMES, WEIGHTS, strict=True)])  # fmt: skip
    layout = MixtureLayout(
        names=mix.names, sizes=tuple(p.size for p in parts), total=total,
        visual=np.zeros_like(total), capacity=capacity, packing_ratio=1.0, overlong="raise",
        seed=seed, single_source=False, lengths_fingerprint="bench",
    )  # fmt: skip
    blend = mix.blend()
    mixture, mplan = measure(lambda: layout.epoch_plan([(0, blend)], 0, world_size), repeats)
    src = mplan.source_of(mplan.ids)
    planned = [int(total[mplan.ids][src == s].sum()) for s in range(len(NAMES))]
    shares = realized_shares(mplan, total, NAMES, target_shares(blend, planned), window=1000)
    uses = layout.targets(blend)
    mixture.update(
        packs=len(mplan),
        uses=int(uses.sum()),
        repeat_per_source=[round(int(u) / p.size, 3) for u, p in zip(uses, parts, strict=True)],
        epoch_shares=shares["epoch"],
        worst_window_error=shares["worst"],
    )
    time_ratio = mixture["s"] / max(single["s"], 1e-9)
    memory_ratio = mixture["peak_mb"] / max(single["peak_mb"], 1e-9)
    return {
        "single": single,
        "mixture": mixture,
        "time_ratio": round(time_ratio, 2),
        "memory_ratio": round(memory_ratio, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M samples (the smoke test)")
    ap.add_argument("--samples", type=int, default=None, help="samples in all (default 10M)")
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = args.samples or (1_000_000 if args.quick else 10_000_000)
    metrics = run(n, args.capacity, args.world_size, args.repeats, args.seed)
    print(json.dumps({
        "benchmark": "mixture",
        "params": {"samples": n, "sources": len(NAMES), "capacity": args.capacity,
                   "world_size": args.world_size, "repeats": args.repeats, "seed": args.seed,
                   "weights": list(WEIGHTS)},
        "metrics": metrics,
        "env": machine(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
