"""Start-up: time from ``neat_vlm_graph(...)`` to the first batch, with a cached length index.

Measured in one warm process (imports and the processor load are not counted), 0 workers,
prefetch 0, the default config otherwise (``exact`` index, sdpa mask). ``graph_s`` is the
graph's construction (index cache hit, overlong check, nodes); ``first_batch_s`` adds the first
``next()``: one pack materialized by the processor and collated. Best of ``--repeats``.

    python benchmarks/bench_startup.py           # 400 samples, pack sizes 2048 and 8192
    python benchmarks/bench_startup.py --quick   # 40 samples, pack size 2048
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


def first_batch(data: Any, processor: Any, cfg: NeatVLMConfig) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    loader = neat_vlm_graph(data, processor, config=cfg)
    graph_s = time.perf_counter() - t0
    batch = next(iter(loader))
    return graph_s, time.perf_counter() - t0, int(batch["packs"][0]["real_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n, sizes = (40, (2048,)) if args.quick else (args.samples, (2048, 8192))
    root = tempfile.mkdtemp(prefix="neatpack-bench-startup-")
    data = write_corpus(root, num_samples=n, seed=7, max_images=4)
    processor = load_tiny_processor("qwen2_vl")
    metrics: dict[str, Any] = {}
    for size in sizes:
        cfg = NeatVLMConfig(
            pack_size=size, media_root=f"{root}/media", cache_dir=f"{root}/cache",
            num_workers=0, prefetch=0,
        )  # fmt: skip
        t0 = time.perf_counter()
        first_batch(data, processor, cfg)  # builds and caches the index
        cold = time.perf_counter() - t0
        runs = [first_batch(data, processor, cfg) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r[1])
        metrics[f"pack_{size}"] = {
            "cold_first_batch_s": round(cold, 3),
            "graph_s": round(min(r[0] for r in runs), 4),
            "first_batch_s": round(best[1], 3),
            "first_pack_real_tokens": best[2],
        }
    print(
        json.dumps(
            {
                "benchmark": "startup",
                "params": {
                    "samples": n,
                    "repeats": args.repeats,
                    "workers": 0,
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
