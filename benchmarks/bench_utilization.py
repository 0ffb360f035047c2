"""Real utilization of packed batches, per estimate mode, through the whole VLM graph.

Real utilization = materialized real tokens / (packs x pack size): the share of every GPU
step that trains. For each mode (``estimate``, ``calibrated``, ``exact``) the corpus is planned,
every pack is built with the real processor, and the run reports utilization, the planned
(estimated) utilization, the estimator's real/estimated ratio p50/p99 per pack, and how many
packs overflowed (handled by the ``truncate`` policy and counted in the ledger). Each run is
``MODE@PACKING_RATIO``: a ratio below 1 plans to a smaller capacity, headroom for estimate error;
``default`` is ``NeatVLMConfig()``'s own choice (``exact`` at ratio 1.0), the row a user gets.
``index_build_s`` is the length index built cold in the warm process (estimator set-up, the
calibration fit for ``calibrated``, then every record): the price of each mode's accuracy.
``index_and_plan_s`` is the graph's own first build (cold cache per row) plus the plan.

    python benchmarks/bench_utilization.py           # 2000 samples, pack size 8192
    python benchmarks/bench_utilization.py --quick   # 60 samples, pack size 2048
    python benchmarks/bench_utilization.py --processor DIR  # a saved processor (real vocab)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.neat_vlm import open_source
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


def run_mode(
    data: Any, processor: Any, root: str, spec: str, pack_size: int, workers: int
) -> dict[str, Any]:
    mode, _, ratio = spec.partition("@")
    chosen: dict[str, Any] = {}
    if mode != "default":  # "default": the config's own estimate_mode and packing_ratio
        chosen = {"estimate_mode": mode, "packing_ratio": float(ratio or 1.0)}
    config = NeatVLMConfig(
        pack_size=pack_size,
        media_root=f"{root}/media",
        **chosen,
        cache_dir=f"{root}/cache-{spec}",  # each row builds its index cold
        overflow="truncate",
        num_workers=workers,
        attn_implementation="doc_ids",
        shuffle=False,
    )
    t0 = time.perf_counter()
    loader = neat_vlm_graph(data, processor, config=config)
    plan = loader.source.plan_for(1)
    plan_s = time.perf_counter() - t0
    ratios, overflowed = [], 0
    for batch in loader:
        for meta in batch["packs"]:
            ratios.append(meta["real_tokens"] / max(meta["estimated_tokens"], 1))
            report = meta["report"] or {}
            overflowed += bool(report.get("truncated") or report.get("dropped"))
    ledger = loader.ledgers[0]
    r = np.asarray(ratios)
    build_s = index_build_seconds(data, processor, root, config.estimate_mode)
    return {
        "estimate_mode": config.estimate_mode,
        "packing_ratio": config.packing_ratio,
        "packs": len(plan),
        "real_utilization": round(loader.stats.utilization(), 4),
        "planned_utilization": round(float(plan.totals.sum()) / (len(plan) * pack_size), 4),
        "real_over_estimated_p50": round(float(np.percentile(r, 50)), 4),
        "real_over_estimated_p99": round(float(np.percentile(r, 99)), 4),
        "real_over_estimated_max": round(float(r.max()), 4),
        "packs_overflowed": overflowed,
        "samples_truncated": len(ledger.truncated),
        "samples_dropped": len(ledger.dropped),
        "samples_consumed": len(ledger.consumed),
        "index_build_s": round(build_s, 3),
        "index_and_plan_s": round(plan_s, 2),
        "total_s": round(time.perf_counter() - t0, 2),
    }


def index_build_seconds(data: Any, processor: Any, root: str, mode: str) -> float:
    """The length index built cold (no cache) as the graph builds it for ``mode``, in this
    warm process: the estimator (and ``calibrated``'s fit on 200 records) plus the build."""
    source = open_source(data, f"{root}/media")
    t0 = time.perf_counter()
    if mode == "calibrated":
        estimator = LengthEstimator.calibrate(source, processor, mode="calibrated")
    else:
        estimator = LengthEstimator.from_processor(processor, mode=mode)
    build_length_index(source, estimator, progress=False)
    return time.perf_counter() - t0


def _processor(name: str) -> Any:
    if Path(name).is_dir():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(name, local_files_only=True)  # type: ignore[no-untyped-call]
    return load_tiny_processor(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--pack-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--modes",
        default="default,estimate@1.0,calibrated@1.0,calibrated@0.98,exact@1.0",
        help="comma-separated MODE@PACKING_RATIO, or default (the config's own)",
    )
    parser.add_argument(
        "--processor",
        default="qwen2_vl",
        help="embedded tiny processor name or a directory saved with save_pretrained",
    )
    args = parser.parse_args()
    n, pack_size = (60, 2048) if args.quick else (args.samples, args.pack_size)
    root = tempfile.mkdtemp(prefix="neatpack-bench-util-")
    data = write_corpus(root, num_samples=n, seed=7, max_images=4)
    processor = _processor(args.processor)
    metrics = {
        mode: run_mode(data, processor, root, mode, pack_size, args.workers)
        for mode in args.modes.split(",")
    }
    print(
        json.dumps(
            {
                "benchmark": "utilization",
                "params": {
                    "samples": n,
                    "pack_size": pack_size,
                    "workers": args.workers,
                    "overflow_policy": "truncate",
                    "processor": args.processor,
                    "quick": args.quick,
                },
                "metrics": metrics,
                "env": machine(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
