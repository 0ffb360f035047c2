"""Supervised-token balance across the ranks of a step: ``balance="tokens"`` vs
``balance="supervised"`` on generated conversations, counted through the real estimator.

Prints one JSON object. The conversations look like VLM SFT data: 40 % short-answer VQA
(an image, 1-3 turns, answers of 1-6 words), 30 % captions (an image, one answer of 40-400
words), 30 % text chat (1-4 turns, questions of 10-300 words, log-normal answers). Their
length index is built by ``build_length_index`` with the tiny Qwen2-VL processor's
``LengthEstimator`` (``estimate`` mode, the fast raw path) switched to count supervised tokens
(``supervised_estimator``), as ``neat_vlm_graph`` does under ``balance="supervised"``. Both
policies plan the same lengths (``plan_packs``, pack 8192) for 8 and 64 ranks; per step of
epoch 1's (shuffled) order, ``max/mean`` over ranks of each rank's supervised tokens (and of
total tokens and attention cost, what the other balance keeps), as p50 / p95 / max over steps,
and ``sum(max) / sum(mean)``. ``estimate_vs_exact``: on the first 2,000 conversations, the
relative error of the ``estimate`` / ``calibrated`` counts against ``exact`` mode (which equals
the materializer's labels, ``tests/graphs/test_supervised_balance.py``).

    python benchmarks/bench_supervised_balance.py           # 200k conversations
    python benchmarks/bench_supervised_balance.py --quick   # 12k
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.indexing.supervised import supervised_estimator
from neatpack.pipes.planning.balance import imbalance
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.reading.read import SequenceSource
from neatpack.pipes.testing.tiny import load_tiny_processor

WORDS = (
    *("the", "cat", "sat", "on", "a", "mat", "while", "birds", "sang", "loudly", "what"),
    *("color", "is", "chart", "value", "shows", "figure", "document", "table", "answer"),
)
PACK = 8192


def conversations(n: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    words = np.asarray(WORDS)

    def text(k: int) -> str:
        return " ".join(words[rng.integers(0, len(words), size=max(int(k), 1))])

    out: list[dict[str, Any]] = []
    kinds = rng.choice(3, size=n, p=[0.4, 0.3, 0.3])
    for kind in kinds:
        turns: list[dict[str, Any]] = []
        meta = None
        if kind == 0:  # VQA: an image, short answers
            for t in range(int(rng.integers(1, 4))):
                q: list[dict[str, Any]] = [{"type": "text", "text": text(rng.integers(5, 30))}]
                if t == 0:
                    q.insert(0, {"type": "image", "image": "img.jpg"})
                turns += [{"role": "user", "content": q},
                          {"role": "assistant", "content": text(rng.integers(1, 7))}]  # fmt: skip
            meta = [[int(x) for x in rng.integers(200, 1400, size=2)]]
        elif kind == 1:  # caption: an image, one long answer
            turns = [{"role": "user", "content": [{"type": "image", "image": "img.jpg"},
                                                  {"type": "text", "text": "Describe it."}]},
                     {"role": "assistant", "content": text(rng.integers(40, 400))}]  # fmt: skip
            meta = [[int(x) for x in rng.integers(200, 1400, size=2)]]
        else:  # text chat
            for _ in range(int(rng.integers(1, 5))):
                answer = min(rng.lognormal(np.log(120.0), 1.0), 1500)
                turns += [{"role": "user", "content": text(rng.integers(10, 300))},
                          {"role": "assistant", "content": text(answer)}]  # fmt: skip
        record: dict[str, Any] = {"messages": turns}
        if meta is not None:
            record["images_meta"] = meta
        out.append(record)
    return out


def ratios(per_pack: np.ndarray, order: np.ndarray, world: int) -> np.ndarray:
    take = order[: order.size // world * world].reshape(-1, world)
    return imbalance(per_pack[take])


def stats(r: np.ndarray, per_pack: np.ndarray, order: np.ndarray, world: int) -> dict[str, float]:
    take = order[: order.size // world * world].reshape(-1, world)
    loads = per_pack[take]
    return {
        "p50": round(float(np.percentile(r, 50)), 4),
        "p95": round(float(np.percentile(r, 95)), 4),
        "max": round(float(r.max()), 4),
        "sum_max_over_sum_mean": round(float(loads.max(1).sum() / loads.mean(1).sum()), 4),
    }


def per_pack(values: np.ndarray, plan: Any) -> np.ndarray:
    return np.add.reduceat(np.asarray(values, np.float64)[plan.ids], plan.offsets[:-1])


def relative_errors(source: Any, processor: Any) -> dict[str, dict[str, float]]:
    """|estimate / exact - 1| of the supervised counts, per mode, on ``source``."""
    counts = {}
    for mode in ("exact", "estimate", "calibrated"):
        if mode == "calibrated":
            base = LengthEstimator.calibrate(source, processor, on_missing_media="fallback")
        else:
            base = LengthEstimator.from_processor(processor, mode=mode,
                                                  on_missing_media="fallback")  # fmt: skip
        index = build_length_index(source, supervised_estimator(base, processor), progress=False)
        assert index.supervised is not None
        counts[mode] = np.asarray(index.supervised, np.float64)
    exact = np.maximum(counts["exact"], 1.0)
    out = {}
    for mode in ("estimate", "calibrated"):
        err = np.abs(counts[mode] / exact - 1.0)
        out[mode] = {
            "p50": round(float(np.percentile(err, 50)), 4),
            "p95": round(float(np.percentile(err, 95)), 4),
            "sum_ratio": round(float(counts[mode].sum() / counts["exact"].sum()), 4),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--quick", action="store_true", help="12k conversations")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = 12_000 if args.quick else args.samples
    processor = load_tiny_processor("qwen2_vl")
    records = conversations(n, args.seed)
    source = SequenceSource(records)
    est = supervised_estimator(
        LengthEstimator.from_processor(processor, mode="estimate", on_missing_media="fallback"),
        processor,
    )
    t0 = time.perf_counter()
    index = build_length_index(source, est, progress=False, num_workers=0)
    build_s = time.perf_counter() - t0
    assert index.supervised is not None
    total = np.asarray(index.total, np.int64)
    visual = np.asarray(index.visual, np.int64)
    sup = np.asarray(index.supervised, np.int64)
    metrics: dict[str, Any] = {
        "samples": n,
        "index_build_s": round(build_s, 2),
        "supervised_share": round(float(sup.sum() / total.sum()), 4),
    }
    for world in (8, 64):
        row: dict[str, Any] = {}
        for balance in ("tokens", "supervised"):
            t0 = time.perf_counter()
            plan = plan_packs(total, PACK, visual=visual, world_size=world, balance=balance,
                              supervised=sup, overlong="drop")  # fmt: skip
            plan_s = time.perf_counter() - t0
            order = plan.epoch_order(1)
            cols = {
                "supervised": per_pack(sup, plan),
                "total": per_pack(total, plan),
                "attention": per_pack(total.astype(np.float64) ** 2, plan),
            }
            row[balance] = {
                "packs": len(plan),
                "steps": len(plan) // world,
                "fill": round(plan.utilization(), 4),
                "plan_s": round(plan_s, 3),
                **{k: stats(ratios(v, order, world), v, order, world) for k, v in cols.items()},
            }
        metrics[f"{world}_ranks"] = row
    small = SequenceSource(records[:2000])
    metrics["estimate_vs_exact"] = relative_errors(small, processor)
    out = {
        "benchmark": "supervised_balance",
        "params": {
            "samples": n,
            "pack_size": PACK,
            "seed": args.seed,
            "worlds": [8, 64],
            "estimate_mode": "estimate",
            "epoch": 1,
        },
        "metrics": metrics,
        "env": machine(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
