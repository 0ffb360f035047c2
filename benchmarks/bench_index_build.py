"""Length index build in pieces (pipes/indexing/index_parts.py): cold, resumed after a kill,
extended after the dataset grew, on a generated Parquet corpus in estimate mode.

Writes `--records` records in `--shards` Parquet files (the bench_shards.py records: text and
one sized image each, nested `messages` column), then times `build_length_index` (one rank,
`--workers` processes, 0: this process) with a `cache_dir`:

* `cold_s`: empty cache; every shard estimated and saved as a piece, the index assembled;
  `cold_no_cache_s` the same build without a cache (no pieces written: their cost is the
  difference);
* `resume_s`: a fresh cache, a build killed (`os._exit` in the estimator, no cleanup) once it
  has estimated `--kill-at` of the records, then the build again: it reads the finished
  pieces and estimates the rest (`resume_estimated_records`);
* `append_s`: after the cold build, `--append` of the shard count more shards (same size)
  written next to them: only those are estimated (`append_estimated_records`), and the index
  equals a full rebuild of the grown dataset (`append_same_as_rebuild`, `append_rebuild_s`);
* `cached_s`: the whole index loaded from the cache.

    python benchmarks/bench_index_build.py            # 200k records in 100 shards
    python benchmarks/bench_index_build.py --quick    # 4k records in 10 shards
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.indexing.media_tokens import ImageTokenConfig
from neatpack.pipes.reading.shards import ParquetSource
from neatpack.pipes.testing.counting import CountingEstimator, counted

WORDS = ("the", "a", "cat", "dog", "picture", "shows", "red", "blue", "small", "large")


def shard_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        q = " ".join(rnd.choices(WORDS, k=rnd.randint(3, 30)))
        a = " ".join(rnd.choices(WORDS, k=rnd.randint(5, 120)))
        user = [{"type": "image", "text": None, "image": f"img/{seed}_{i}.jpg"},
                {"type": "text", "text": q, "image": None}]  # fmt: skip
        out.append({"messages": [{"role": "user", "content": user},
                                 {"role": "assistant", "content": [
                                     {"type": "text", "text": a, "image": None}]}],
                    "images_meta": [[rnd.randint(16, 2000), rnd.randint(16, 2000)]]})  # fmt: skip
    return out


def write_shards(root: Path, first: int, count: int, per: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k in range(first, first + count):
        table = pa.Table.from_pylist(shard_rows(per, k))
        pq.write_table(table, root / f"part-{k:05d}.parquet", row_group_size=1024)


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _killed(data: str, cache: str, log: str, die_after: int, workers: int) -> None:
    source = ParquetSource(f"{data}/*.parquet")
    build_length_index(source, _est(log, die_after), cache_dir=cache, progress=False,
                       num_workers=workers)  # fmt: skip


def _est(log: str = "", die_after: int = -1) -> CountingEstimator:
    return CountingEstimator(image=ImageTokenConfig(), log=log, die_after=die_after)


def _same(a: LengthIndex, b: LengthIndex) -> bool:
    return bool(np.array_equal(a.total, b.total) and np.array_equal(a.visual, b.visual)
                and np.array_equal(a.fallback_ids, b.fallback_ids))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--append", type=float, default=0.1, help="shards appended, of --shards")
    ap.add_argument("--kill-at", type=float, default=0.5, help="records estimated, of all")
    ap.add_argument("--workers", type=int, default=0, help="index worker processes per rank")
    args = ap.parse_args()
    if args.quick:
        args.records, args.shards = 4000, 10
    per = args.records // args.shards
    n = per * args.shards
    extra = max(1, round(args.shards * args.append))
    metrics: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "data"
        data.mkdir()
        write_shards(data, 0, args.shards, per)

        def build(cache: Path | None, log: str = "") -> LengthIndex:
            source = ParquetSource(f"{data}/*.parquet")
            return build_length_index(source, _est(log), cache_dir=cache, progress=False,
                                      num_workers=args.workers)  # fmt: skip

        _, metrics["cold_no_cache_s"] = _timed(lambda: build(None))
        cold, metrics["cold_s"] = _timed(lambda: build(root / "cache"))
        _, metrics["cached_s"] = _timed(lambda: build(root / "cache"))
        pieces = list((root / "cache").glob("length-piece-*.npz"))
        metrics["pieces"] = len(pieces)
        metrics["piece_bytes_per_record"] = round(sum(p.stat().st_size for p in pieces) / n, 2)

        # killed once it has estimated --kill-at of the records, then started again
        kill_cache, kill_log = root / "kill-cache", str(root / "killed.log")
        child = mp.get_context("fork").Process(
            target=_killed,
            args=(str(data), str(kill_cache), kill_log, int(n * args.kill_at), args.workers),
        )
        child.start()
        child.join()
        metrics["killed_exit_code"] = child.exitcode
        metrics["killed_after_records"] = sum(counted(kill_log))
        metrics["pieces_saved_before_kill"] = len(list(kill_cache.glob("length-piece-*.npz")))
        log = str(root / "resume.log")
        resumed, metrics["resume_s"] = _timed(lambda: build(kill_cache, log))
        metrics["resume_estimated_records"] = sum(counted(log))
        metrics["resume_same_as_cold"] = _same(resumed, cold)

        # the dataset grows by --append of its shards
        write_shards(data, args.shards, extra, per)
        log = str(root / "append.log")
        grown, metrics["append_s"] = _timed(lambda: build(root / "cache", log))
        metrics["append_estimated_records"] = sum(counted(log))
        rebuilt, metrics["append_rebuild_s"] = _timed(lambda: build(None))
        metrics["append_same_as_rebuild"] = _same(grown, rebuilt)
    metrics = {k: round(v, 3) if isinstance(v, float) else v for k, v in metrics.items()}
    params = {"records": n, "shards": args.shards, "appended_shards": extra,
              "kill_at": args.kill_at, "workers": args.workers, "mode": "estimate"}  # fmt: skip
    env = machine()
    print(json.dumps({"benchmark": "index_build", "params": params, "metrics": metrics,
                      "env": env}))  # fmt: skip


if __name__ == "__main__":
    main()
