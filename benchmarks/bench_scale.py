"""Scale figures (issue #19): a 10M-sample sharded metadata corpus and a video-heavy corpus.

**Metadata corpus**: ``--records`` records (default 10M) in ``--shards`` Parquet files (default
1,000), each a conversation about one picture with its size in ``images_meta`` (the pictures
are 8 real PNGs under the shards' directory, so batches can be built), in the graph's default
``--mode`` (default ``estimate``: text and media sized from the record without the tokenizer;
``exact``, the graph's default, tokenizes every text once: ~1.4-3.5k records/s per process on
the quick corpus, hours at 10M on a few cores). Measured in one run:

* ``index_records_per_s``: ``build_length_index`` with 1 process and with 2 (``num_workers=2``:
  two spawned processes, each a run of whole shards), and each one's peak RSS;
* ``plan_s``: ``plan_packs`` over the whole index (pack_size 4096, shuffled);
* ``first_batch_s``: ``neat_vlm_graph(..., lengths=index)`` built and its first batch out
  (plan, pack source, the first pack's records read and materialized);
* ``peak_rss_mb``: this process (one rank) at the end.

**Video corpus**: ``--videos`` records, each an mp4 clip (48 frames, 160x128, 8 fps, encoded
here) and a question. ``loader_tokens_per_s`` with 0 and 2 workers (real tokens of all
batches / the iteration's wall time; the length index built beforehand), and ``decode_share``:
the share of the 0-worker iteration spent in ``pipes/video.decode_video``.

    python benchmarks/bench_scale.py            # 10M records, 1,000 shards; 64 videos
    python benchmarks/bench_scale.py --quick    # 20k records, 20 shards; 8 videos
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.reading.shards import ParquetSource
from neatpack.pipes.testing.tiny import load_tiny_processor

WORDS = ("the", "a", "cat", "dog", "picture", "shows", "red", "blue", "small", "large")
SIZES = [(64, 48), (96, 96), (128, 80), (200, 150), (300, 220), (48, 64), (160, 160), (90, 60)]
PACK = 4096


class MetadataParquet(ParquetSource):
    """Rows ``{"messages": <JSON text>, "images_meta": [[w, h]]}``: one flat string column
    (the cheapest Parquet layout to read), decoded here."""

    def raw(self, sample_id: int) -> dict[str, Any]:
        row = super().raw(sample_id)
        row["messages"] = json.loads(row["messages"])
        return row

    def iter_raw(self, start: int, stop: int) -> Any:
        for i in range(start, stop):
            yield self.raw(i)


def write_metadata(root: Path, n: int, shards: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    (root / "imgs").mkdir()
    for k, size in enumerate(SIZES):
        Image.new("RGB", size, (40 * k % 255, 90, 160)).save(root / "imgs" / f"{k}.png")
    rnd = random.Random(0)
    per = -(-n // shards)
    paths = []
    for s in range(shards):
        messages, metas = [], []
        for _ in range(min(per, n - s * per)):
            k = rnd.randrange(len(SIZES))
            q = " ".join(rnd.choices(WORDS, k=rnd.randint(3, 30)))
            a = " ".join(rnd.choices(WORDS, k=rnd.randint(5, 120)))
            content = [{"type": "image", "image": f"imgs/{k}.png"}, {"type": "text", "text": q}]
            messages.append(json.dumps([{"role": "user", "content": content},
                                        {"role": "assistant", "content": a}]))  # fmt: skip
            metas.append([list(SIZES[k][::-1])])  # [height, width]
        path = root / f"part-{s:05d}.parquet"
        table = pa.table({"messages": messages, "images_meta": metas})
        pq.write_table(table, path, row_group_size=2048)
        paths.append(str(path))
    return paths


def _rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return round(resource.getrusage(who).ru_maxrss / 1024, 1)  # Linux: KiB


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def metadata_figures(n: int, shards: int, processor: Any, mode: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths, took = _timed(lambda: write_metadata(root, n, shards))
        out["write_s"] = round(took, 1)
        source, took = _timed(lambda: MetadataParquet(paths, media_root=root))
        out["open_s"] = round(took, 2)
        est = LengthEstimator.from_processor(processor, mode=mode)
        rates, indexes = {}, {}
        for procs in (1, 2):
            index, took = _timed(
                lambda p=procs: build_length_index(
                    source, est, progress=False, num_workers=0 if p == 1 else p
                )
            )
            rates[f"{procs}_process"] = round(n / took)
            indexes[procs] = index
        out["index_records_per_s"] = rates
        out["same_index"] = bool((indexes[1].total == indexes[2].total).all())
        out["index_peak_rss_mb"] = {
            "1_process": _rss_mb(),
            "worker": _rss_mb(resource.RUSAGE_CHILDREN),
        }
        index = indexes[1]
        plan, took = _timed(lambda: plan_packs(index.total, PACK, visual=index.visual, seed=0))
        out["plan_s"] = round(took, 2)
        out["packs"] = len(plan)
        cfg = NeatVLMConfig(pack_size=PACK, batch_size=1, media_root=str(root))
        batch, took = _timed(
            lambda: next(iter(neat_vlm_graph(source, processor, config=cfg, lengths=index)))
        )
        out["first_batch_s"] = round(took, 2)
        out["first_batch_tokens"] = int((batch["doc_ids"] > 0).sum())  # 0: padding
        out["peak_rss_mb"] = _rss_mb()
    return out


def encode(path: Path, n: int = 48, w: int = 160, h: int = 128, fps: int = 8) -> None:
    import av
    import numpy as np

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(n):
            a = np.full((h, w, 3), (i * 7) % 200, np.uint8)
            a[:, (i * 5) % w, :] = 250
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def video_figures(n: int, processor: Any) -> dict[str, Any]:
    from neatpack.pipes import video

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rnd = random.Random(1)
        records = []
        for i in range(n):
            path = root / f"v{i}.mp4"
            encode(path, n=rnd.randint(24, 48))
            user = [{"type": "video", "video": str(path)},
                    {"type": "text", "text": " ".join(rnd.choices(WORDS, k=12))}]  # fmt: skip
            answer = {"role": "assistant", "content": "a bar moves"}
            records.append({"messages": [{"role": "user", "content": user}, answer]})
        est = LengthEstimator.from_processor(processor, mode="exact")
        from neatpack.pipes.reading.read import SequenceSource

        index = build_length_index(SequenceSource(records), est, progress=False)
        decode_s = [0.0]
        real_decode = video.decode_video

        def timed_decode(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real_decode(*a, **k)
            finally:
                decode_s[0] += time.perf_counter() - t0

        rates = {}
        for workers in (0, 2):
            cfg = NeatVLMConfig(pack_size=PACK, batch_size=1, num_workers=workers, seed=0)
            loader = neat_vlm_graph(records, processor, config=cfg, lengths=index)
            video.decode_video = timed_decode  # type: ignore[assignment]  # 0 workers: this process
            decode_s[0] = 0.0
            t0 = time.perf_counter()
            tokens = sum(int((b["doc_ids"] > 0).sum()) for b in loader)  # real tokens
            took = time.perf_counter() - t0
            video.decode_video = real_decode  # type: ignore[assignment]
            rates[f"{workers}_workers"] = round(tokens / took)
            if workers == 0:
                out["decode_share"] = round(decode_s[0] / took, 3)
                out["tokens"] = tokens
        out["loader_tokens_per_s"] = rates
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--shards", type=int, default=1_000)
    ap.add_argument("--videos", type=int, default=64)
    ap.add_argument("--mode", default="estimate", help="the metadata corpus's estimate mode")
    ap.add_argument("--skip-metadata", action="store_true")
    ap.add_argument("--skip-video", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.records, args.shards, args.videos = 20_000, 20, 8
    processor = load_tiny_processor()
    metrics: dict[str, Any] = {}
    if not args.skip_metadata:
        metrics["metadata"] = metadata_figures(args.records, args.shards, processor, args.mode)
    if not args.skip_video:
        metrics["video"] = video_figures(args.videos, processor)
    params = {"records": args.records, "shards": args.shards, "videos": args.videos,
              "pack_size": PACK, "metadata_estimate_mode": args.mode}  # fmt: skip
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "host": platform.node()}
    print(json.dumps({"benchmark": "scale", "params": params, "metrics": metrics, "env": env}))


if __name__ == "__main__":
    main()
