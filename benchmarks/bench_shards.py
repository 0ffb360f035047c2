"""Sharded sources (pipes/reading/shards.py): offset-index build and length-index build, vs JSONL.

Writes the same metadata corpus (text + `images_meta`, ~1 image path per record, no pixels) as
one JSONL file, as `--shards` WebDataset-style tar shards (`key.json` members) and as
`--shards` Parquet files, then times in one process:

* `tar_offset_index_records_per_s`: `TarShardSource(...)` on a cold cache (tar headers read,
  index written to `cache_dir`), and `tar_offset_index_cached_s` with the cache warm;
* `parquet_open_s`: `ParquetSource(...)` (footers only);
* `length_index_records_per_s` for `jsonl`, `tar` and `parquet`: `build_length_index` in
  estimate mode (the fast path over `iter_raw`), one process.

    python benchmarks/bench_shards.py            # 200k records in 100 shards
    python benchmarks/bench_shards.py --quick    # 4k records in 8 shards
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.indexing.media_tokens import ImageTokenConfig
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.reading.shards import ParquetSource, TarShardSource

WORDS = ("the", "a", "cat", "dog", "picture", "shows", "red", "blue", "small", "large")


def records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        q = " ".join(rnd.choices(WORDS, k=rnd.randint(3, 30)))
        a = " ".join(rnd.choices(WORDS, k=rnd.randint(5, 120)))
        content = [{"type": "image", "image": f"img/{i}.jpg"}, {"type": "text", "text": q}]
        out.append({"messages": [{"role": "user", "content": content},
                                 {"role": "assistant", "content": a}],
                    "images_meta": [[rnd.randint(16, 2000), rnd.randint(16, 2000)]]})  # fmt: skip
    return out


def write_all(root: Path, recs: list[dict[str, Any]], shards: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    per = -(-len(recs) // shards)
    for k in range(shards):
        part = recs[k * per : (k + 1) * per]
        with tarfile.open(root / f"shard-{k:04d}.tar", "w") as tf:
            for i, r in enumerate(part):
                body = json.dumps(r).encode()
                info = tarfile.TarInfo(f"{k * per + i:09d}.json")
                info.size = len(body)
                tf.addfile(info, io.BytesIO(body))
        rows = [{"messages": json.dumps(r["messages"]), "images_meta": r["images_meta"]}
                for r in part]  # fmt: skip
        pq.write_table(pa.Table.from_pylist(rows), root / f"part-{k:04d}.parquet",
                       row_group_size=1024)  # fmt: skip


class _Parquet(ParquetSource):
    """The messages column is stored as JSON text (one flat string column)."""

    def raw(self, sample_id: int) -> dict[str, Any]:
        row = super().raw(sample_id)
        row["messages"] = json.loads(row["messages"])
        return row


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--shards", type=int, default=100)
    args = ap.parse_args()
    if args.quick:
        args.records, args.shards = 4000, 8
    n = args.records
    metrics: dict[str, Any] = {}
    est = LengthEstimator(image=ImageTokenConfig())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_all(root, records(n), args.shards)
        tars = sorted(str(p) for p in root.glob("shard-*.tar"))
        cache = root / "cache"
        tar, cold = _timed(lambda: TarShardSource(tars, cache_dir=cache))
        _, warm = _timed(lambda: TarShardSource(tars, cache_dir=cache))
        parts = sorted(str(p) for p in root.glob("part-*.parquet"))
        parquet, popen = _timed(lambda: _Parquet(parts))
        metrics["tar_offset_index_records_per_s"] = round(n / cold)
        metrics["tar_offset_index_cached_s"] = round(warm, 4)
        metrics["parquet_open_s"] = round(popen, 4)
        rates = {}
        sources = {"jsonl": JsonlSource(root / "data.jsonl"), "tar": tar, "parquet": parquet}
        totals = {}
        for name, source in sources.items():
            index, took = _timed(lambda s=source: build_length_index(s, est, progress=False))
            rates[name] = round(n / took)
            totals[name] = int(index.total.sum())
        metrics["length_index_records_per_s"] = rates
        metrics["same_lengths"] = len(set(totals.values())) == 1
    params = {"records": n, "shards": args.shards}
    env = machine()
    print(json.dumps({"benchmark": "shards", "params": params, "metrics": metrics, "env": env}))


if __name__ == "__main__":
    main()
