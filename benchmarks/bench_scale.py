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

**Simulated scale** (``--samples N --ranks R``, issue #29): no corpus on disk. Records are
generated from their ids (record ``i`` is the ``i % 4096``-th of a fixed set of metadata
conversations, read through ``SequenceSource`` like any list), so every step past the reader
is the real one. The length index of the 4,096 distinct records is built by
``build_length_index`` (``index_records_per_s_per_process``: one process, estimate mode), tiled
to ``N`` and saved where the graph finds it (``cache_dir``) in the real cache format. Then
``R`` rank processes (spawned, on this machine, all alive together) each build
``neat_vlm_graph(..., rank=r, world_size=R)`` from the cached index, pull the first batch,
save the loader state, build a fresh loader, load the state and pull the next batch.
Reported per rank: ``first_batch_s`` (graph built from the cached index, plan included, first
batch out), ``resume_s``, both also in CPU seconds of the rank's process (``_cpu_s``, threads
included; summed over ranks per node: the wall times depend on what else shares the cores,
``env.load_average_*``), ``peak_rss_mb`` (VmHWM), ``pss_mb`` / ``private_mb`` (from
``/proc/self/smaps_rollup`` while every rank is alive: PSS counts a page shared by k
processes as 1/k) and their growth over the rank's baseline (taken after a warm-up graph
over the 4,096 patterns alone: modules imported, nothing of the N samples loaded); the first
loader is freed before the resumed one is built, as in a restarted job. Per node: the sums,
and ``bytes_per_sample_node``: the summed PSS growth over N.
``plan_s`` / ``plan_peak_rss_mb``: ``plan_packs`` over the index in a process of its own.

**Reader offsets** (``reader_offsets``, in the simulated-scale run and alone with
``--readers``): bytes a sample of the JSONL line index and the tar offset index, built by the
readers from real files (up to 1M lines / 100k tar samples), cached and mapped, against the
arrays they held before #29; past 1M lines the JSONL arrays are simulated (said in the output:
``simulated_lines``). ``node_files_bytes_per_sample``: index + plan files + each reader's.

    python benchmarks/bench_scale.py            # 10M records, 1,000 shards; 64 videos
    python benchmarks/bench_scale.py --quick    # 20k records, 20 shards; 8 videos
    python benchmarks/bench_scale.py --samples 10000000 --ranks 8
    python benchmarks/bench_scale.py --readers --samples 10000000
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import resource
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.reading.read import SequenceSource
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


PATTERNS = 4096


class IdSource(SequenceSource):
    """``n`` records, record ``i`` being ``patterns[i % len(patterns)]``: a corpus of any size
    read through the real ``SequenceSource`` (its fingerprint: the patterns and ``n``)."""

    def __init__(self, patterns: list[dict[str, Any]], n: int, media_root: str) -> None:
        super().__init__(_Tiled(patterns, n), media_root=media_root)
        self._fingerprint = f"id-source-{n}-" + SequenceSource(patterns).content_fingerprint()


class _Tiled(Sequence[dict[str, Any]]):
    def __init__(self, patterns: list[dict[str, Any]], n: int) -> None:
        self.patterns, self.n = patterns, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        return self.patterns[i % len(self.patterns)]


def metadata_patterns(root: Path, k: int = PATTERNS) -> list[dict[str, Any]]:
    from PIL import Image

    (root / "imgs").mkdir(exist_ok=True)
    for j, size in enumerate(SIZES):
        Image.new("RGB", size, (40 * j % 255, 90, 160)).save(root / "imgs" / f"{j}.png")
    rnd = random.Random(0)
    out = []
    for _ in range(k):
        j = rnd.randrange(len(SIZES))
        q = " ".join(rnd.choices(WORDS, k=rnd.randint(3, 30)))
        a = " ".join(rnd.choices(WORDS, k=rnd.randint(5, 120)))
        content = [{"type": "image", "image": f"imgs/{j}.png"}, {"type": "text", "text": q}]
        out.append({"messages": [{"role": "user", "content": content},
                                 {"role": "assistant", "content": a}],
                    "images_meta": [list(SIZES[j][::-1])]})  # fmt: skip
    return out


def _proc_mb() -> dict[str, float]:
    """Peak RSS (VmHWM), RSS, PSS and private memory of this process, in MB."""
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                out["peak_rss" if "HWM" in line else "rss"] = int(line.split()[1]) / 1024
    roll: dict[str, int] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                roll[parts[0].rstrip(":")] = int(parts[1])
    out["pss"] = roll.get("Pss", 0) / 1024
    out["private"] = (roll.get("Private_Clean", 0) + roll.get("Private_Dirty", 0)) / 1024
    out["anon"] = roll.get("Anonymous", 0) / 1024  # heap: never shared with another rank
    out["shared_file"] = (roll.get("Shared_Clean", 0) + roll.get("Shared_Dirty", 0)) / 1024
    return {k: round(v, 1) for k, v in out.items()}


def _vlm_config(cache_dir: str, root: str, workers: int) -> Any:
    return NeatVLMConfig(
        pack_size=PACK, batch_size=1, media_root=root, cache_dir=cache_dir,
        estimate_mode="estimate", num_workers=workers, progress=False,
    )  # fmt: skip


def _rank_main(
    rank: int, world: int, n: int, root: str, cache_dir: str, workers: int, barrier: Any, q: Any
) -> None:
    """One simulated rank: baseline memory, graph from the cached index, first batch, state,
    resume into a fresh loader; memory read while every rank is alive (``barrier``)."""
    try:
        processor = load_tiny_processor()
        patterns = metadata_patterns(Path(root))
        source = IdSource(patterns, n, root)
        cfg = _vlm_config(cache_dir, root, workers)
        # warm up on the patterns alone (every module imported, every cache filled), so the
        # growth over the baseline below is what the N samples cost
        warm = IdSource(patterns, len(patterns), root)
        with neat_vlm_graph(warm, processor, config=cfg, rank=rank, world_size=world) as ready:
            next(iter(ready))  # closed: its prefetch would build batches on the timed clock
        gc.collect()
        base = _proc_mb()
        t0, c0 = time.perf_counter(), time.process_time()
        loader = neat_vlm_graph(source, processor, config=cfg, rank=rank, world_size=world)
        it = iter(loader)
        first = next(it)
        first_s, first_cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = int((first["doc_ids"] > 0).sum())
        state = loader.state_dict()
        expect = next(it)["input_ids"]
        del loader, it, first  # a restarted rank holds one loader: free this one first
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        again = neat_vlm_graph(source, processor, config=cfg, rank=rank, world_size=world)
        again.load_state_dict(state)
        got = next(iter(again))["input_ids"]
        resume_s, resume_cpu = time.perf_counter() - t0, time.process_time() - c0
        barrier.wait()  # every rank holds its graphs now: PSS splits shared pages among them
        mem = _proc_mb()
        barrier.wait()
        q.put({
            "rank": rank, "first_batch_s": round(first_s, 2), "resume_s": round(resume_s, 2),
            "first_batch_cpu_s": round(first_cpu, 2), "resume_cpu_s": round(resume_cpu, 2),
            "resume_exact": bool((got == expect).all()),
            "first_batch_tokens": tokens,
            "base": base, "mem": mem,
        })  # fmt: skip
    except BaseException as e:  # the parent reports it
        barrier.abort()
        q.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def _plan_main(path: str, world: int, q: Any) -> None:
    index = LengthIndex.load(path)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = plan_packs(index.total, PACK, visual=index.visual, world_size=world, seed=0)
    took = time.perf_counter() - t0
    q.put({"plan_s": round(took, 2), "plan_cpu_s": round(time.process_time() - c0, 2),
           "packs": len(plan), "plan_peak_rss_mb": _proc_mb()})  # fmt: skip


def scale_figures(n: int, ranks: int, workers: int, workdir: str | None) -> dict[str, Any]:
    import multiprocessing as mp

    import numpy as np

    from neatpack.graphs.families import plan_family
    from neatpack.graphs.open_data import MISSING_MEDIA_FIX
    from neatpack.pipes.indexing.lengths import length_index_fingerprint

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root, cache = Path(tmp), str(Path(tmp) / "cache")
        processor = load_tiny_processor()
        cfg = _vlm_config(cache, tmp, workers)
        patterns = metadata_patterns(root)
        family = plan_family(processor, cfg)
        sub = IdSource(patterns, len(patterns) * 4, tmp)
        est = family.estimator(processor, "estimate", sub, missing_media_fix=MISSING_MEDIA_FIX)
        small, took = _timed(lambda: build_length_index(sub, est, progress=False, num_workers=0))
        out["index_records_per_s_per_process"] = round(len(sub) / took)
        source = IdSource(patterns, n, tmp)
        est = family.estimator(processor, "estimate", source, missing_media_fix=MISSING_MEDIA_FIX)
        fp = length_index_fingerprint(source, est)
        k = len(patterns)
        fb = small.fallback_ids[small.fallback_ids < k]
        fallback = (fb[None, :] + np.arange(0, n, k)[:, None]).reshape(-1)
        index = LengthIndex(
            total=np.resize(small.total[:k].astype(np.int32), n),
            visual=np.resize(small.visual[:k].astype(np.int32), n),
            fingerprint=fp, fallback_ids=fallback[fallback < n].astype(np.int64),
            fallback_counts=small.fallback_counts,
        )  # fmt: skip
        path = Path(cache) / f"{fp}.npz"
        t0 = time.perf_counter()
        index.save(path)
        out["index_save_s"] = round(time.perf_counter() - t0, 2)
        out["index_file_mb"] = round(path.stat().st_size / 2**20, 1)
        del index, small
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_plan_main, args=(str(path), ranks, q))
        p.start()
        out.update(q.get())
        p.join()
        barrier = ctx.Barrier(ranks)
        procs = [ctx.Process(target=_rank_main,
                             args=(r, ranks, n, tmp, cache, workers, barrier, q))
                 for r in range(ranks)]  # fmt: skip
        for p in procs:
            p.start()
        got = sorted((q.get() for _ in procs), key=lambda d: d["rank"])
        for p in procs:
            p.join()
        errors = [g["error"] for g in got if "error" in g]
        if errors:
            raise RuntimeError("; ".join(errors))
        per_rank = []
        for g in got:
            base, mem = g.pop("base"), g.pop("mem")
            g.update({f"{k}_mb": v for k, v in mem.items()})
            g["pss_growth_mb"] = round(mem["pss"] - base["pss"], 1)
            g["private_growth_mb"] = round(mem["private"] - base["private"], 1)
            g["anon_growth_mb"] = round(mem["anon"] - base["anon"], 1)
            per_rank.append(g)
        out["per_rank"] = per_rank
        plans = list(Path(cache).glob("plan-*.npz"))  # shared plan files (none before #29)
        out["plan_files_mb"] = round(sum(p.stat().st_size for p in plans) / 2**20, 1)
        growth = sum(g["pss_growth_mb"] for g in per_rank)
        out["node"] = {
            "pss_mb": round(sum(g["pss_mb"] for g in per_rank), 1),
            "pss_growth_mb": round(growth, 1),
            "bytes_per_sample_node": round(growth * 2**20 / n, 2),
            "max_private_mb": max(g["private_mb"] for g in per_rank),
            "max_peak_rss_mb": max(g["peak_rss_mb"] for g in per_rank),
            "max_first_batch_s": max(g["first_batch_s"] for g in per_rank),
            "max_resume_s": max(g["resume_s"] for g in per_rank),
            # CPU seconds of every rank together (threads included): what the node's cores
            # must give, whatever else runs on them (the wall times above depend on that)
            "first_batch_cpu_s": round(sum(g["first_batch_cpu_s"] for g in per_rank), 2),
            "resume_cpu_s": round(sum(g["resume_cpu_s"] for g in per_rank), 2),
            "resume_exact": all(g["resume_exact"] for g in per_rank),
        }
        offsets = reader_offsets(n, root)
        per_sample = (path.stat().st_size + sum(p.stat().st_size for p in plans)) / n
        out["reader_offsets"] = offsets
        out["node_files_bytes_per_sample"] = {  # index + plan files, plus each reader's offsets
            "parquet": round(per_sample, 2),
            "jsonl": round(per_sample + offsets["jsonl"]["bytes_per_sample"], 2),
            "tar": round(per_sample + offsets["tar"]["bytes_per_sample"], 2),
        }
    return out


#: Reader offsets: real files up to these sizes; past them the arrays are simulated.
REAL_LINES, REAL_TAR, SIM_LINES, TAR_SHARD = 1_000_000, 100_000, 10_000_000, 10_000


def _old_tar_bytes(listed: list[Any]) -> int:
    """What the offset index before #29 held for one shard: numpy strings and int64."""
    import numpy as np

    members = [(e, o, s) for _, m in listed for e, (o, s) in m.items()]
    return sum(a.nbytes for a in (
        np.array([k for k, _ in listed], dtype=str), np.zeros(len(listed) + 1, np.int64),
        np.array([e for e, _, _ in members], dtype=str), np.zeros(2 * len(members), np.int64),
    ))  # fmt: skip


def _write_tar(path: Path, first: int, n: int, patterns: list[dict[str, Any]]) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w") as tf:
        for i in range(first, first + n):
            body = json.dumps(patterns[i % len(patterns)]).encode()
            for name, data in ((f"{i:09d}.json", body), (f"{i:09d}.jpg", b"\xff" * (i % 700))):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def reader_offsets(n: int, root: Path) -> dict[str, Any]:
    """Bytes a sample of the readers' offset indexes (issue #29): a JSONL file's line index
    (``JsonlSource.lines``) and tar shards' offset index (``TarShardSource.index``), each built
    from real files by the reader (``min(n, REAL_LINES)`` lines; ``min(n, REAL_TAR)`` samples
    of a .json and a .jpg member, keys ``%09d``, shards of ``TAR_SHARD``), cached and mapped as
    a loader maps them; ``before``: the arrays the reader held before (JSONL: int64 starts +
    uint32 sizes, mapped; tar: numpy strings + int64, read whole into every process). Past the
    real sizes the JSONL arrays are built from the real file's line sizes repeated to
    ``min(n, SIM_LINES)`` lines (``simulated_lines``); the tar layout's bytes a sample do not
    grow with n while its positions fit uint32 (4G members, 4 GB of key tails). JSONL times:
    ``open_cached_s``, a ``JsonlSource`` opened from its cache (what every rank pays; median of
    5); ``overlong_pass_s``, one pass over the simulated lines for the over-long check
    (``max_record_bytes``), which ``overlong_pass_per_open`` says whether an open runs."""
    import numpy as np

    from neatpack.pipes.reading.line_index import LineIndex
    from neatpack.pipes.reading.read import MAX_RECORD_BYTES, JsonlSource
    from neatpack.pipes.reading.shards import TarShardSource, index_tar
    from neatpack.pipes.reading.tar_index import TarIndex

    patterns = metadata_patterns(root)
    out: dict[str, Any] = {}
    lines = min(n, REAL_LINES)
    path = root / "offsets.jsonl"
    with path.open("w") as f:
        for i in range(lines):
            f.write(json.dumps(patterns[i % len(patterns)]) + "\n")
    cache = root / "offsets-cache"
    JsonlSource(path, cache_dir=cache)  # builds and writes the cache
    src = JsonlSource(path, cache_dir=cache)  # maps it
    opens = []
    for _ in range(5):
        t0 = time.perf_counter()
        JsonlSource(path, cache_dir=cache)
        opens.append(time.perf_counter() - t0)
    sizes = src.lines.ends(0, lines) - src.lines.starts(0, lines)
    # before: int64 starts + uint32 sizes (+ int64 line numbers had the file a blank line)
    before = src.lines.starts(0, lines).nbytes + sizes.astype(np.uint32).nbytes
    sim = max(lines, min(n, SIM_LINES))
    starts = np.concatenate([[0], np.cumsum(np.resize(sizes + 1, sim))[:-1]])
    built = LineIndex.build(starts, starts + np.resize(sizes, sim))
    del starts
    built.longest = None  # as an index that does not know its longest line: the pass runs
    t0 = time.perf_counter()
    built.over(MAX_RECORD_BYTES)
    overlong_pass = time.perf_counter() - t0
    out["jsonl"] = {
        "real_lines": lines, "simulated_lines": sim if sim > lines else 0,
        "bytes_per_sample": round(built.nbytes / sim, 3),
        "real_bytes_per_sample": round(src.lines.nbytes / lines, 3),
        "cache_file_bytes_per_sample": round(
            sum(p.stat().st_size for p in cache.glob("jsonl-index-*.npz")) / lines, 3),
        "before_bytes_per_sample": round(before / lines, 3), "held": "once per node (mapped)",
        "open_cached_s": round(sorted(opens)[2], 4), "overlong_pass_s": round(overlong_pass, 3),
        "overlong_pass_per_open": getattr(src.lines, "longest", None) is None,
    }  # fmt: skip
    del built, sizes, src
    path.unlink()
    samples = min(n, REAL_TAR)
    paths = []
    for first in range(0, samples, TAR_SHARD):
        paths.append(root / f"offsets-{first // TAR_SHARD:05d}.tar")
        _write_tar(paths[-1], first, min(TAR_SHARD, samples - first), patterns)
    tcache = root / "offsets-tar-cache"
    TarShardSource(paths, cache_dir=tcache)
    tar = TarShardSource(paths, cache_dir=tcache)
    listings = [index_tar(str(p)) for p in paths]
    before = sum(_old_tar_bytes(listed) for listed in listings)
    # the same shards had their keys been 16 hex digits (not a run of numbers): kept as bytes
    hexed = TarIndex.concat([TarIndex.from_samples(
        [(hashlib.sha1(k.encode()).hexdigest()[:16], m) for k, m in listed])
        for listed in listings])  # fmt: skip
    out["tar"] = {
        "real_samples": samples, "members_per_sample": 2, "key": "%09d",
        "bytes_per_sample": round(tar.index.nbytes / samples, 3),
        "cache_file_bytes_per_sample": round(
            sum(p.stat().st_size for p in tcache.glob("tar-set-*.npz")) / samples, 3),
        "before_bytes_per_sample": round(before / samples, 3),
        "hex_keys_bytes_per_sample": round(hexed.nbytes / samples, 3),
        "held": "once per node (mapped; before: per process, all-gathered)",
    }  # fmt: skip
    for p in paths:
        p.unlink()
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
    ap.add_argument("--samples", type=int, default=0, help="simulated scale: samples")
    ap.add_argument("--ranks", type=int, default=8, help="simulated scale: rank processes")
    ap.add_argument("--workers", type=int, default=0, help="simulated scale: workers per rank")
    ap.add_argument("--workdir", default=None, help="simulated scale: where the cache goes")
    ap.add_argument(
        "--readers",
        action="store_true",
        help="only the readers' offset bytes a sample at --samples (default 10M)",
    )
    args = ap.parse_args()
    env = machine(load_average_at_start=[round(x, 1) for x in os.getloadavg()])
    if args.readers:
        n = args.samples or 10_000_000
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            metrics = {"reader_offsets": reader_offsets(n, Path(tmp))}
        params = {"samples": n, "real_lines": min(n, REAL_LINES), "real_tar": min(n, REAL_TAR)}
        print(json.dumps({"benchmark": "scale", "params": params, "metrics": metrics, "env": env}))
        return
    if args.samples:
        metrics = scale_figures(args.samples, args.ranks, args.workers, args.workdir)
        env["load_average_at_end"] = [round(x, 1) for x in os.getloadavg()]
        params = {"samples": args.samples, "ranks": args.ranks, "workers": args.workers,
                  "pack_size": PACK, "mode": "estimate"}  # fmt: skip
        print(json.dumps({"benchmark": "scale", "params": params, "metrics": metrics, "env": env}))
        return
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
    print(json.dumps({"benchmark": "scale", "params": params, "metrics": metrics, "env": env}))


if __name__ == "__main__":
    main()
