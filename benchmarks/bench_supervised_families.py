"""What counting supervised tokens costs each family's length index, and how close the
tokenizer-free estimate comes to the exact count (``balance="supervised"``).

Prints one JSON object. For each family with a tiny real processor (the Qwen-VL ones shipped in
the package, the others committed under ``tests/support/assets/processors``, loaded offline),
on ``bench_supervised_balance.py``'s generated conversations (VQA, captions, text chat; images
sized by ``images_meta``, never read): the length index built in ``exact`` mode without and with
the supervised counts (``supervised_estimator``, as ``neat_vlm_graph`` builds it under
``balance="supervised"``), microseconds a record each, and whether the family counts through its
own tokenize (``label_handler``, ``pipes/indexing/family_labels.py``) or the batched formula;
then ``estimate`` mode's counts against ``exact``'s (|estimate / exact - 1|: p50, p95, and the
sums' ratio). One process, ``num_workers=0``.

    python benchmarks/bench_supervised_families.py            # 1,000 conversations a family
    python benchmarks/bench_supervised_families.py --quick    # 100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _machine import machine  # benchmarks/ is on sys.path as the script's folder
from bench_supervised_balance import conversations

from neatpack.pipes.families import get_handler
from neatpack.pipes.indexing.handler_lengths import handler_estimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.indexing.supervised import supervised_estimator
from neatpack.pipes.reading.read import SequenceSource
from neatpack.pipes.testing.tiny import FAMILIES as QWEN_VL
from neatpack.pipes.testing.tiny import load_tiny_processor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import tiny


def processor(family: str) -> Any:
    if family in QWEN_VL:
        return load_tiny_processor(family)
    return getattr(tiny, f"load_tiny_{family}_processor")()


def build(source: Any, est: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    index = build_length_index(source, est, progress=False, num_workers=0)
    return index, (time.perf_counter() - t0) / len(source) * 1e6


def family_row(family: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    proc = processor(family)
    handler = get_handler(proc)
    source = SequenceSource(records)
    plain = handler_estimator(proc, handler, "exact")
    counting = supervised_estimator(plain, proc, handler)
    _, us_plain = build(source, plain)
    exact, us_counting = build(source, counting)
    rough_est = supervised_estimator(handler_estimator(proc, handler, "estimate"), proc, handler)
    rough, _ = build(source, rough_est)
    truth = np.maximum(np.asarray(exact.supervised, np.float64), 1.0)
    err = np.abs(np.asarray(rough.supervised, np.float64) / truth - 1.0)
    return {
        "handler": handler.name,
        "counts_through": "family tokenize" if counting.label_handler else "formula",
        "label_marks": int(counting.label_marks),
        "exact_us_per_record": round(us_plain, 1),
        "exact_supervised_us_per_record": round(us_counting, 1),
        "estimate_vs_exact": {
            "p50": round(float(np.percentile(err, 50)), 4),
            "p95": round(float(np.percentile(err, 95)), 4),
            "sum_ratio": round(float(np.sum(rough.supervised) / np.sum(exact.supervised)), 4),
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="100 conversations a family")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = 100 if args.quick else args.samples
    records = conversations(n, args.seed)
    import transformers

    # Nemotron-H Omni's processor is new in transformers 5.18: left out on an older one
    new = getattr(transformers, "NemotronH_Omni_Reasoning_V3Processor", None) is not None
    families = (*QWEN_VL, *sorted(f for f in tiny.PROCESSORS if new or f != "nemotron_omni"))
    metrics = {f: family_row(f, records) for f in families}
    out = {
        "benchmark": "supervised_families",
        "params": {"samples": n, "seed": args.seed, "families": list(families)},
        "metrics": metrics,
        "env": machine(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
