"""tokenize_conversation speed vs the processor's own one-call path, on the synth corpus.

Prints one JSON object. Per processor family: ``neatpack_ms`` = ``tokenize_conversation`` per
sample (validation, image loading from disk, RGB conversion, template, processor, checks,
labels); ``reference_ms`` = ``processor.apply_chat_template(conv, tokenize=True,
return_dict=True)`` on the same conversation with the images opened from disk inside the timed
call, no labels (what a plain collate does); ``labels_ms`` = ``build_labels`` alone on the ids.
Means and p50/p95 over samples, best of ``--repeats`` passes, single process.

    python benchmarks/bench_tokenize.py            # 200 samples, 3 families
    python benchmarks/bench_tokenize.py --quick    # 24 samples, qwen2_vl only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import machine  # benchmarks/ is on sys.path as the script's folder
from PIL import Image

from neatpack.pipes.materializing.labels import build_labels, resolve_role_markers
from neatpack.pipes.materializing.tokenize import tokenize_conversation
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import FAMILIES, load_tiny_processor


def _reference_conv(rec: dict[str, Any]) -> list[dict[str, Any]]:
    conv = []
    for m in rec["conversation"]:
        blocks = [
            {"type": "image", "image": Image.open(b["image"])} if b["type"] == "image" else b
            for b in m["content"]
        ]
        conv.append({"role": m["role"], "content": blocks})
    return conv


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "mean": round(statistics.fmean(xs), 3),
        "p50": round(xs[len(xs) // 2], 3),
        "p95": round(xs[min(len(xs) - 1, int(0.95 * len(xs)))], 3),
    }


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def run_family(family: str, records: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    p = load_tiny_processor(family)
    markers = resolve_role_markers(p)
    best: dict[str, list[float]] = {}
    tokens = 0
    for _ in range(repeats):
        ours, ref, lab = [], [], []
        tokens = 0
        for rec in records:
            ms, s = _timed(lambda r=rec: tokenize_conversation(r, p, markers=markers))
            ours.append(ms)
            tokens += int(s["input_ids"].numel())
            ms, _ = _timed(
                lambda r=rec: p.apply_chat_template(
                    _reference_conv(r), tokenize=True, return_dict=True, return_tensors="pt"
                )
            )
            ref.append(ms)
            ms, _ = _timed(lambda s=s: build_labels(s["input_ids"], p, markers=markers))
            lab.append(ms)
        if not best or sum(ours) < sum(best["ours"]):
            best = {"ours": ours, "ref": ref, "lab": lab}
    total_s = sum(best["ours"]) / 1e3
    return {
        "samples": len(records),
        "tokens": tokens,
        "neatpack_ms": _stats(best["ours"]),
        "reference_ms": _stats(best["ref"]),
        "labels_ms": _stats(best["lab"]),
        "samples_per_s": round(len(records) / total_s, 1),
        "tokens_per_s": round(tokens / total_s, 1),
        "overhead_vs_reference": round(sum(best["ours"]) / sum(best["ref"]), 3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="24 samples, qwen2_vl only")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = 24 if args.quick else args.samples
    families = ("qwen2_vl",) if args.quick else FAMILIES
    with tempfile.TemporaryDirectory() as tmp:
        path = write_corpus(tmp, num_samples=n, seed=args.seed)
        source = JsonlSource(path, media_root=Path(tmp) / "media")
        records = [source[i] for i in range(len(source))]
        metrics = {f: run_family(f, records, args.repeats) for f in families}

    out = {
        "benchmark": "tokenize",
        "params": {
            "samples": n,
            "families": list(families),
            "repeats": args.repeats,
            "seed": args.seed,
            "corpus": "neatpack.pipes.testing.synth.write_corpus",
        },
        "metrics": metrics,
        "env": machine(),
    }
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
