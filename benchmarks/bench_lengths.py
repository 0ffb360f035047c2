"""Length index benchmark: records/s building the index from a generated JSONL with image
metadata (estimate mode), and the reload time of a cached index.

    python benchmarks/bench_lengths.py            # 200k records, 10M-entry reload
    python benchmarks/bench_lengths.py --quick    # 5k records, 1M-entry reload

Prints one JSON object: {"benchmark", "params", "metrics", "env"}.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack.pipes import read as read_mod
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.indexing.media_tokens import ImageTokenConfig
from neatpack.pipes.reading.read import JsonlSource

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "picture",
    "shows",
    "red",
    "blue",
    "small",
    "large",
    "left",
    "right",
    "of",
    "in",
    "on",
    "with",
]


def write_jsonl(path: Path, n: int, seed: int = 0) -> int:
    """LLaVA-style and messages-style records, ~1 image each with ``images_meta``."""
    rnd = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            h, w = rnd.randint(16, 2000), rnd.randint(16, 2000)
            q = " ".join(rnd.choices(WORDS, k=rnd.randint(3, 30)))
            a = " ".join(rnd.choices(WORDS, k=rnd.randint(5, 120)))
            if i % 2:
                rec = {
                    "conversations": [
                        {"from": "human", "value": f"<image>\n{q}"},
                        {"from": "gpt", "value": a},
                    ],
                    "image": f"img/{i}.jpg",
                    "images_meta": [[h, w]],
                }
            else:
                content = [{"type": "image", "image": f"img/{i}.jpg"}, {"type": "text", "text": q}]
                rec = {
                    "messages": [
                        {"role": "user", "content": content},
                        {"role": "assistant", "content": a},
                    ],
                    "images_meta": [[h, w]],
                }
            f.write(json.dumps(rec) + "\n")
    return path.stat().st_size


def _tiny_json_us() -> float:
    t0 = time.perf_counter()
    for _ in range(20_000):
        json.loads('{"a": 1}')
    return (time.perf_counter() - t0) / 20_000 * 1e6


def _loop_s() -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(1_000_000):
        x += i
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--records", type=int, default=None)
    ap.add_argument("--reload-entries", type=int, default=None)
    args = ap.parse_args()
    n = args.records or (5_000 if args.quick else 200_000)
    m = args.reload_entries or (1_000_000 if args.quick else 10_000_000)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        size = write_jsonl(root / "data.jsonl", n)
        (root / "img").mkdir()
        t0 = time.perf_counter()
        source = JsonlSource(root / "data.jsonl", media_root=root)
        t_open = time.perf_counter() - t0
        est = LengthEstimator(image=ImageTokenConfig())
        build_length_index(JsonlSource(root / "data.jsonl"), est, progress=False)  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        index = build_length_index(source, est, progress=False)
        t_build = time.perf_counter() - t0
        cpu_build = time.process_time() - c0  # differs from t_build when others take the cores
        raws = list(source.iter_raw(0, n))
        t0 = time.perf_counter()
        est.estimate_raw_batch(raws)
        t_estimate_only = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_length_index(source, est, cache_dir=root / "cache", progress=False)
        t_build_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_length_index(source, est, cache_dir=root / "cache", progress=False)
        t_cached = time.perf_counter() - t0

        rng = np.random.default_rng(0)
        big = LengthIndex(
            total=rng.integers(1, 8192, m, dtype=np.int64),
            visual=rng.integers(0, 4096, m, dtype=np.int64),
            fingerprint="bench",
        )
        t0 = time.perf_counter()
        big.save(root / "big.npz")
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        loaded = LengthIndex.load(root / "big.npz")
        t_reload = time.perf_counter() - t0
        if not np.array_equal(loaded.total, big.total):
            raise SystemExit("reloaded index differs")
    out = {
        "benchmark": "lengths",
        "params": {
            "records": n,
            "reload_entries": m,
            "quick": args.quick,
            "mode": "estimate",
            "processes": 1,  # one process, one thread: records_per_s is per core
            "json_parser": "json" if read_mod._fast_loads is None else "orjson",
        },
        "metrics": {
            "jsonl_bytes": size,
            "open_index_s": round(t_open, 4),
            "build_s": round(t_build, 4),
            "records_per_s": round(n / t_build),
            "records_per_cpu_s": round(n / cpu_build),
            "records_per_s_incl_open": round(n / (t_build + t_open)),
            "records_per_s_estimate_only": round(n / t_estimate_only),
            "build_and_save_s": round(t_build_save, 4),
            "cached_reload_s": round(t_cached, 4),
            "big_save_s": round(t_save, 4),
            "big_reload_s": round(t_reload, 4),
            "mean_total": float(index.total.mean()),
        },
        "env": machine(
            # machine speed yardsticks: a typical 2024 x86 core does these in ~1 us / ~0.04 s
            json_loads_tiny_us=round(_tiny_json_us(), 2),
            python_loop_1m_s=round(_loop_s(), 3),
        ),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
