"""Loader throughput and resume cost, side by side in one run.

* ``neat_vlm_graph`` with 0, 1 and 2 worker processes: batches/s and real packed tokens/s;
  and with the most workers again with batches handed over by torch's own tensor path
  (``worker_transfer="torch"``) instead of reused segments (``pipes/materializing/transfer.py``);
* a map-style ``torch.utils.data.DataLoader`` over a PackedDatasetWrapper-style dataset (each
  item materializes one pack of the same plan with the same processor), at the same workers;
* the bare single-process processor (chat template + processor call) on the same samples;
  with 0 workers also per CPU second (``cpu_ratio_neat_0_workers_vs_bare_processor``: the
  ratio that other load on a shared machine does not move);
* time to first batch after ``load_state_dict`` at 0 %, 50 % and 95 % of an epoch, on a
  corpus of identical records (every batch costs the same, so only the resume differs).

Each loader run reports whole-epoch rates (``tokens_per_s``: worker start-up and pipeline
fill included, paid once per epoch) and steady-state rates after the first batch
(``steady_tokens_per_s``: what a long epoch runs at). The ratios are given for both. Each
loader runs ``--repeats`` times (neat and DataLoader alternating), each run in a fresh
process, and the best run is kept.

    python benchmarks/bench_loader.py            # 480 samples, pack size 4096
    python benchmarks/bench_loader.py --quick    # 24 samples
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from _machine import machine  # benchmarks/ is on sys.path as the script's folder
from torch.utils.data import DataLoader, Dataset

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.collating.collate import neat_packed_vlm_collater
from neatpack.pipes.materializing.materialize import MaterializeConfig, materialize_pack
from neatpack.pipes.materializing.transfer import segments_seen
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


class PackDataset(Dataset[dict[str, Any]]):
    """The baseline: pack ``k`` of a plan, built in ``__getitem__`` (the peer's wrapper shape)."""

    def __init__(
        self, source: Any, packs: list[list[int]], processor: Any, pack_size: int, pad: int
    ) -> None:
        self.source, self.packs, self.processor = source, packs, processor
        self.config = MaterializeConfig(pack_size=pack_size, padding_idx=pad, overflow="truncate")

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, k: int) -> dict[str, Any]:
        pack, _ = materialize_pack(self.source, self.packs[k], self.processor, self.config)
        return pack


def _collate(packs: list[dict[str, Any]]) -> dict[str, Any]:
    return neat_packed_vlm_collater(packs, padding_idx=PAD, attn_implementation="doc_ids")


PAD = 0


def _tokens(batch: dict[str, Any]) -> int:
    return int((batch["doc_ids"] > 0).sum())


def _drain(batches: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Whole-epoch rates, and steady-state rates after the first batch (which pays for
    starting the workers and filling the pipeline once per epoch)."""
    t0, c0 = time.perf_counter(), time.process_time()
    it = iter(batches)
    first = next(it)
    t1 = time.perf_counter()
    n, tokens = 1, _tokens(first)
    rest_tokens = 0
    for batch in it:
        n += 1
        rest_tokens += _tokens(batch)
    t2, c2 = time.perf_counter(), time.process_time()
    return {
        "batches_per_s": n / (t2 - t0),
        "cpu_s": c2 - c0,  # this process only (workers' CPU not counted)
        "tokens_per_cpu_s": (tokens + rest_tokens) / (c2 - c0),
        "tokens_per_s": (tokens + rest_tokens) / (t2 - t0),
        "first_batch_s": t1 - t0,
        "steady_batches_per_s": (n - 1) / (t2 - t1) if n > 1 else float("nan"),
        "steady_tokens_per_s": rest_tokens / (t2 - t1) if n > 1 else float("nan"),
        "seconds": t2 - t0,
        "batches": n,
    }


def time_neat(data: Any, processor: Any, cfg: NeatVLMConfig) -> dict[str, float]:
    before = segments_seen()
    rates = _drain(neat_vlm_graph(data, processor, config=cfg))
    # distinct worker segments the batches came through (0: torch's own path carried them)
    rates["segments_received"] = segments_seen() - before
    return rates


def time_dataloader(ds: PackDataset, workers: int, batch_size: int) -> dict[str, float]:
    dl = DataLoader(
        ds,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=_collate,
        multiprocessing_context="fork" if workers else None,
    )
    return _drain(dl)


def time_bare_processor(source: Any, processor: Any, ids: list[int]) -> dict[str, float]:
    from neatpack.pipes.reading.media import load_image

    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for i in ids:
        conv = source[i]["conversation"]
        images = [
            load_image(b["image"], sample_id=i)
            for m in conv
            for b in m["content"]
            if b["type"] == "image"
        ]
        text = processor.apply_chat_template(conv, tokenize=False)
        out = processor(text=[text], images=images or None, return_tensors="pt")
        tokens += int(out["input_ids"].shape[1]) - 1
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "samples_per_s": len(ids) / dt,
        "tokens_per_s": tokens / dt,
        "seconds": dt,
        "tokens_per_cpu_s": tokens / cpu,
    }


def uniform_corpus(data: Path, n: int) -> Path:
    """``n`` copies of the corpus's first one-image record: every pack and batch then costs the
    same, so resume times at different cursors differ only by the resume itself."""
    lines = data.read_text().splitlines()
    one = next(ln for ln in lines if len(json.loads(ln).get("images_meta") or []) == 1)
    out = data.with_name("uniform.jsonl")
    out.write_text((one + "\n") * n)
    return out


def time_resume(data: Any, processor: Any, cfg: NeatVLMConfig, fraction: float) -> float:
    """Best of 3: ``load_state_dict`` of a state saved at ``fraction`` of the epoch, then the
    first batch (worker start-up included, as after a real restart)."""
    ref = neat_vlm_graph(data, processor, config=cfg)
    it = iter(ref)
    for _ in range(int(len(ref) * fraction)):
        next(it)
    state = ref.state_dict()
    best = float("inf")
    for _ in range(3):
        resumed = neat_vlm_graph(data, processor, config=cfg)
        t0 = time.perf_counter()
        resumed.load_state_dict(state)
        next(iter(resumed))
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(args: argparse.Namespace) -> dict[str, float]:
    """One throughput run (``--one KIND:WORKERS[:TRANSFER]``), in this fresh process."""
    kind, w, *transfer = args.one.split(":")
    workers = int(w)
    torch.set_num_threads(1)
    root, n = Path(args.root), _samples(args)
    data, processor = root / "data.jsonl", load_tiny_processor("qwen2_vl")
    global PAD
    PAD = int(processor.tokenizer.pad_token_id)
    cfg = _config(args, root, workers, *transfer)
    if kind == "neat":
        return time_neat(data, processor, cfg)
    source = JsonlSource(data, media_root=root / "media")
    if kind == "bare":
        return time_bare_processor(source, processor, list(range(n)))
    plan = neat_vlm_graph(data, processor, config=cfg).source.plan_for(1)
    packs = [plan.pack(int(k)) for k in plan.epoch_order(0)]
    ds = PackDataset(source, packs, processor, args.pack_size, PAD)
    return time_dataloader(ds, workers, args.batch_size)


def _samples(args: argparse.Namespace) -> int:
    return 24 if args.quick else int(args.samples)


def _config(
    args: argparse.Namespace, root: Path, workers: int, transfer: str = "segment"
) -> NeatVLMConfig:
    return NeatVLMConfig(
        pack_size=args.pack_size,
        batch_size=args.batch_size,
        media_root=str(root / "media"),
        cache_dir=str(root / "cache"),
        num_workers=workers,
        attn_implementation="doc_ids",
        prefetch=2 if workers else 0,  # as DataLoader: no read-ahead without workers
        worker_transfer=transfer,  # type: ignore[arg-type]  # the config checks it
    )


def _run_one(args: argparse.Namespace, what: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--one", what, "--root", args.root,
           "--samples", str(args.samples), "--pack-size", str(args.pack_size),
           "--batch-size", str(args.batch_size)] + (["--quick"] if args.quick else [])  # fmt: skip
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--samples", type=int, default=480)
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per loader")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one run, in a child
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_measure(args)))
        return
    n = _samples(args)
    if args.quick:
        args.repeats = 1
    workers_list = [0, 1] if args.quick else [0, 1, 2]
    torch.set_num_threads(1)
    args.root = tempfile.mkdtemp(prefix="neatpack-bench-loader-")
    root = Path(args.root)
    data = write_corpus(root, num_samples=n, seed=1)
    processor = load_tiny_processor("qwen2_vl")

    def cfg(workers: int) -> NeatVLMConfig:
        return _config(args, root, workers)

    packs = len(neat_vlm_graph(data, processor, config=cfg(0)).source.plan_for(1))  # + index
    metrics: dict[str, Any] = {"neat": {}, "dataloader": {}}

    def best(runs: list[dict[str, float]]) -> dict[str, float]:
        return max(runs, key=lambda r: r["tokens_per_s"])

    # Every throughput run is a fresh process (same start: allocator, caches, imports); the two
    # loaders alternate; the best of --repeats is kept for each.
    for w in workers_list:
        neat_runs, dl_runs = [], []
        for _ in range(args.repeats):
            neat_runs.append(_run_one(args, f"neat:{w}"))
            dl_runs.append(_run_one(args, f"dataloader:{w}"))
        metrics["neat"][f"workers_{w}"] = best(neat_runs)
        metrics["dataloader"][f"workers_{w}"] = best(dl_runs)
    metrics["bare_processor"] = best([_run_one(args, "bare:0") for _ in range(args.repeats)])
    top = max(workers_list)
    # The same top-worker graph with batches handed over by torch's own tensor path (a fresh
    # shared-memory file per tensor per batch) instead of reused segments
    # (pipes/materializing/transfer.py).
    torch_path = best([_run_one(args, f"neat:{top}:torch") for _ in range(args.repeats)])
    metrics["neat_torch_transfer"] = {f"workers_{top}": torch_path}
    metrics["ratio_transfer_segments_vs_torch_path"] = {
        rate: metrics["neat"][f"workers_{top}"][rate] / torch_path[rate]
        for rate in ("tokens_per_s", "steady_tokens_per_s")
    }
    for rate in ("tokens_per_s", "steady_tokens_per_s"):
        tag = "" if rate == "tokens_per_s" else "steady_"
        metrics[f"{tag}ratio_neat_vs_dataloader"] = {
            f"workers_{w}": metrics["neat"][f"workers_{w}"][rate]
            / metrics["dataloader"][f"workers_{w}"][rate]
            for w in workers_list
        }
        metrics[f"{tag}ratio_neat_{top}_workers_vs_bare_processor"] = (
            metrics["neat"][f"workers_{top}"][rate] / metrics["bare_processor"]["tokens_per_s"]
        )
    # Per CPU second (one process, one torch thread): robust to other load on a shared machine,
    # where wall-clock ratios move by tens of percent between runs.
    metrics["cpu_ratio_neat_0_workers_vs_bare_processor"] = (
        metrics["neat"]["workers_0"]["tokens_per_cpu_s"]
        / metrics["bare_processor"]["tokens_per_cpu_s"]
    )
    uniform = uniform_corpus(Path(data), n)
    resume = {
        f"{int(f * 100)}%": time_resume(uniform, processor, cfg(top), f) for f in (0.0, 0.5, 0.95)
    }
    metrics["resume_first_batch_s"] = resume
    metrics["resume_95_vs_0"] = resume["95%"] / resume["0%"]
    print(
        json.dumps(
            {
                "benchmark": "loader",
                "params": {
                    "samples": n,
                    "pack_size": args.pack_size,
                    "batch_size": args.batch_size,
                    "workers": workers_list,
                    "packs": packs,
                    "quick": args.quick,
                    "repeats": args.repeats,
                },
                "metrics": metrics,
                "env": machine(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
