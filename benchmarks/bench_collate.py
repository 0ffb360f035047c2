"""Collate time and memory per attention-mask format, side by side, on one batch of packs.

B packs of length up to S (each 90-100% full, 2-8 documents, seeded), collated to ``[B, S]``
(``max_length=S``) once per format with ``neat_packed_vlm_collater``, torch on one thread (as in
loader worker processes; ``--threads`` to change). Per format: ``collate_ms`` (median and best
of ``--repeats`` full collates: padding + mask), ``mask_ms`` (best, the mask conversion alone
from ``[B, S]`` document ids), ``output_bytes`` (``nbytes`` of every tensor in the batch,
BlockMask and THD params included) and ``rss_peak_delta_bytes`` (growth of the process's peak
RSS, ``resource.getrusage(RUSAGE_SELF).ru_maxrss``, while that format ran; formats run from the
smallest to the largest output, so each delta is that format's excess over every earlier peak;
tracemalloc does not see torch's allocations).

    python benchmarks/bench_collate.py            # B=4, S=16384
    python benchmarks/bench_collate.py --quick    # B=4, S=2048
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from neatpack.pipes import mask as M
from neatpack.pipes.collate import neat_packed_vlm_collater

#: Run order: compact formats first, then the ones whose output grows with S^2.
FORMATS = (
    "doc_ids",
    "position_ids",
    "flash_attention_2",
    "thd",
    "flex_attention",
    "sdpa",
    "eager",
)
MASK_ONLY: dict[str, Callable[[torch.Tensor], Any]] = {
    "doc_ids": lambda d: d,
    "position_ids": M.to_text_position_ids,
    "flash_attention_2": M.to_cu_seqlens,
    "thd": M.to_thd_params,
    "flex_attention": M.to_block_mask,
    "sdpa": M.to_4d_bool_mask,
    "eager": M.to_4d_additive_mask,
}


def make_packs(b: int, s: int, seed: int) -> list[dict[str, Any]]:
    """B packs by the data contract: 2-8 documents each, 90-100% of S tokens."""
    gen = torch.Generator().manual_seed(seed)
    packs = []
    for row in range(b):
        t = int(torch.randint(int(0.9 * s), s + 1, (1,), generator=gen))
        k = int(torch.randint(2, 9, (1,), generator=gen))
        cuts = torch.randperm(t - 1, generator=gen)[: k - 1].add(1).sort().values.tolist()
        lens = [e - a for a, e in zip([0, *cuts], [*cuts, t], strict=True)]
        ids = torch.randint(0, 150_000, (t,), generator=gen)
        doc = torch.repeat_interleave(torch.arange(1, k + 1), torch.tensor(lens))
        pos = torch.cat([torch.arange(n) for n in lens])
        packs.append(
            {
                "sample_ids": list(range(row * 10, row * 10 + k)),
                "input_ids": ids,
                "labels": ids.clone(),
                "attention_mask": doc,
                "position_ids": pos,
                "text_position_ids": pos.clone(),
                "mm_token_type_ids": torch.zeros(t, dtype=torch.long),
                "seq_lens": lens,
                "seq_lens_padded": lens,
                "n_images": 0,
                "n_videos": 0,
            }
        )
    return packs


def nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(nbytes(v) for v in obj)
    if type(obj).__name__ == "BlockMask":
        return sum(nbytes(getattr(obj, a, None)) for a in ("kv_num_blocks", "kv_indices",
                   "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                   "full_q_num_blocks", "full_q_indices"))  # fmt: skip
    return 0


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    times, out = [], None
    for _ in range(repeats):
        out = None  # free the previous output before the next run
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times, out


def run(b: int, s: int, repeats: int, heavy_repeats: int, seed: int) -> dict[str, Any]:
    import torch.nn.attention.flex_attention  # noqa: F401  # import cost is not the mask's

    packs = make_packs(b, s, seed)
    doc_ids = neat_packed_vlm_collater(packs, max_length=s, mask_format="doc_ids")["doc_ids"]
    metrics: dict[str, Any] = {}
    for fmt in FORMATS:
        heavy = fmt in ("sdpa", "eager", "flex_attention")
        n = heavy_repeats if heavy else repeats
        rss0 = peak_rss()
        neat_packed_vlm_collater(packs, max_length=s, mask_format=fmt)  # warm-up
        times, out = timed(
            lambda f=fmt: neat_packed_vlm_collater(packs, max_length=s, mask_format=f), n
        )
        out_bytes = nbytes({k: v for k, v in out.items() if k != "sample_ids"})
        mask_bytes = nbytes(out.get("attention_mask")) + nbytes(out.get("packed_seq_params"))
        del out
        mask_times, _ = timed(lambda f=fmt: MASK_ONLY[f](doc_ids), n)
        metrics[fmt] = {
            "collate_ms_median": round(statistics.median(times), 3),
            "collate_ms_best": round(min(times), 3),
            "mask_ms_best": round(min(mask_times), 3),
            "output_bytes": out_bytes,
            "mask_bytes": mask_bytes,
            "rss_peak_delta_bytes": peak_rss() - rss0,
            "repeats": n,
        }
    return metrics


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="S=2048 instead of 16384")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="S (default 16384, or 2048 --quick)")
    ap.add_argument("--repeats", type=int, default=30, help="runs of each compact format")
    ap.add_argument("--heavy-repeats", type=int, default=3, help="runs of sdpa/eager/flex")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1, as in loader workers)"
    )
    args = ap.parse_args(argv)
    s = args.seq or (2048 if args.quick else 16384)
    torch.set_num_threads(args.threads)
    metrics = run(args.batch, s, args.repeats, args.heavy_repeats, args.seed)
    print(
        json.dumps(
            {
                "benchmark": "collate",
                "params": {
                    "batch": args.batch,
                    "seq": s,
                    "docs_per_pack": [2, 8],
                    "fill": [0.9, 1.0],
                    "repeats": args.repeats,
                    "heavy_repeats": args.heavy_repeats,
                    "seed": args.seed,
                    "memory": "output_bytes = tensor nbytes of the batch; rss_peak_delta_bytes = "
                    "ru_maxrss growth while the format ran (formats in increasing size order)",
                },
                "metrics": metrics,
                "env": {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                },
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
