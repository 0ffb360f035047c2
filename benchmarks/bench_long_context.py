"""Long context (#20): the packing-leak probe per hybrid family on CPU, and context-parallel
balance on a generated corpus of long videos and short text.

Prints one JSON object:

* ``probe/<family>``: the largest change of any other document's hidden states (any layer)
  when one document of a packed row changes, on a tiny random model with transformers' CPU
  code paths (the torch fallbacks of the linear-attention / Mamba-2 kernels); the first
  leaking layer and whether transformers refused ``seq_idx`` / ``cu_seq_lens`` there.
* ``cp<k>``: per pack, causal attention work of each CP rank (query-key pairs); ``max/mean``
  worst over packs for the head-and-tail split, mean and worst for a contiguous split of the
  row, and the padding the 2*cp alignment adds (% of real tokens).

    python benchmarks/bench_long_context.py            # 2000 samples, pack 32768, cp 2/4/8
    python benchmarks/bench_long_context.py --quick    # 300 samples, 2 probe families
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
from _machine import machine  # benchmarks/ is on sys.path as the script's folder


def corpus(n: int, seed: int) -> np.ndarray:
    """20 % long videos (lognormal, median 8000 tokens, 1000..30000), 80 % short text
    (median 300, 20..4000): the mix that makes long rows and many small documents."""
    rng = np.random.default_rng(seed)
    video = rng.random(n) < 0.2
    lv = rng.lognormal(np.log(8000.0), 0.6, n).clip(1000, 30000)
    lt = rng.lognormal(np.log(300.0), 0.9, n).clip(20, 4000)
    return np.rint(np.where(video, lv, lt)).astype(np.int64)


def contiguous_work(spans: list[int], cp: int) -> list[int]:
    """Work per rank when the row is cut into cp contiguous pieces (no head-and-tail)."""
    offsets = np.concatenate([np.arange(n) for n in spans]) + 1
    return [int(p.sum()) for p in np.array_split(offsets, cp)]


def cp_balance(lengths: np.ndarray, pack_size: int, cp: int) -> dict[str, Any]:
    import torch

    from neatpack.pipes import attention_work_per_rank, cp_padded_lengths, plan_packs

    padded = cp_padded_lengths(lengths, cp)
    plan = plan_packs(padded, pack_size, shuffle=False, overlong="drop")
    ht, naive = [], []
    for ids in plan.packs():
        spans = [int(x) for x in padded[ids]]
        tail = pack_size - sum(spans)
        doc_ids = torch.repeat_interleave(torch.arange(1, len(spans) + 1), torch.tensor(spans))
        doc_ids = torch.cat([doc_ids, torch.zeros(tail, dtype=torch.long)])[None]
        w = attention_work_per_rank(doc_ids, cp)
        ht.append(max(w) / (sum(w) / cp))
        nv = contiguous_work(spans + ([tail] if tail else []), cp)
        naive.append(max(nv) / (sum(nv) / cp))
    kept = np.setdiff1d(np.arange(lengths.size), plan.dropped_ids)
    return {
        "packs": len(ht),
        "head_tail_max_over_mean_worst": round(max(ht), 6),
        "contiguous_max_over_mean_mean": round(float(np.mean(naive)), 4),
        "contiguous_max_over_mean_worst": round(max(naive), 4),
        "alignment_padding_pct": round(
            100.0 * float(padded[kept].sum() - lengths[kept].sum()) / float(lengths[kept].sum()), 3
        ),
    }


def probe(family: str) -> dict[str, Any]:
    from neatpack.pipes import check_packing, tiny_hybrid_model
    from neatpack.pipes.testing.tiny_models import tiny_model

    model = tiny_model("qwen2") if family == "qwen2" else tiny_hybrid_model(family)
    report = check_packing(model, allow_leak=True)
    first = next((x for x in report.layers if x.max_change > report.tolerance), None)
    return {
        "leaks": report.leaks,
        "max_change": float(f"{report.max_change:.3e}"),
        "first_leaking_layer": None if first is None else f"{first.index} ({first.kind})",
        "boundaries_refused": report.boundaries_refused is not None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    n = 300 if args.quick else 2000
    pack_size = 32768
    families = (
        ("qwen2", "bamba")
        if args.quick
        else ("qwen2", "qwen3_next", "qwen3_5", "mamba2", "bamba", "nemotron_h", "falcon_h1")
    )
    lengths = corpus(n, args.seed)
    metrics: dict[str, Any] = {f"probe/{f}": probe(f) for f in families}
    for cp in (2, 4, 8):
        metrics[f"cp{cp}"] = cp_balance(lengths, pack_size, cp)
    print(
        json.dumps(
            {
                "benchmark": "long_context",
                "params": {"samples": n, "pack_size": pack_size, "seed": args.seed},
                "metrics": metrics,
                "env": machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
