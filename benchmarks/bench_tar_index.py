"""Random access into the tar offset index (``pipes/reading/tar_index.py``): records/s of
``TarIndex.__getitem__`` at random sample ids, and bytes a sample, for a regular shard set (a
.json and a .jpg member a sample, numbered keys) and an irregular one (a sample in 7 lacks
its .jpg), both saved and mapped as a loader maps them. Prints one JSON object.

    python benchmarks/bench_tar_index.py [--samples 1000000] [--shard 10000] [--reads 200000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from neatpack.pipes.reading.tar_index import TarIndex


def shard(first: int, n: int, irregular: bool) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    rng = np.random.default_rng(first)
    out, offset = [], 512  # the first member's data follows its header
    for i in range(first, first + n):
        members = {}
        for ext in ("json", "jpg") if not (irregular and i % 7 == 3) else ("json",):
            size = int(rng.integers(200, 600) if ext == "json" else rng.integers(5_000, 90_000))
            members[ext] = (offset, size)
            offset += -(-size // 512) * 512 + 512
        out.append((f"{i:09d}", members))
    return out


def measure(samples: int, per: int, reads: int, irregular: bool, root: Path) -> dict[str, Any]:
    parts = [TarIndex.from_samples(shard(f, min(per, samples - f), irregular))
             for f in range(0, samples, per)]  # fmt: skip
    path = root / f"set-{int(irregular)}.npz"
    TarIndex.concat(parts).save(path)
    index, _ = TarIndex.load(path)
    ids = np.random.default_rng(0).integers(0, samples, reads).tolist()
    check = {i: parts[i // per][i % per] for i in ids[:1000]}
    assert all(index[i] == want for i, want in check.items())
    t = time.perf_counter()
    for i in ids:
        index[i]
    took = time.perf_counter() - t
    return {
        "records_per_s": round(reads / took),
        "bytes_per_sample": round(index.nbytes / samples, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--shard", type=int, default=10_000)
    ap.add_argument("--reads", type=int, default=200_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = {
            "params": vars(args),
            "regular": measure(args.samples, args.shard, args.reads, False, Path(tmp)),
            "irregular": measure(args.samples, args.shard, args.reads, True, Path(tmp)),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
