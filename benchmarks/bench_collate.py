"""Collate time and memory per attention-mask format, side by side, on one batch of packs.

B packs of length up to S (each 90-100% full, 2-8 documents, seeded), collated to ``[B, S]``
(``max_length=S``) once per format with ``neat_packed_vlm_collater``, torch on one thread (as in
loader worker processes; ``--threads`` to change). Per format: ``collate_ms_*`` over
``--repeats`` full collates (padding + mask): ``best``, ``median``, ``p90`` and
``median_unpreempted`` (the median of the calls in which the process was never switched out),
with ``preempted_calls``, ``page_faults_per_call_median`` and ``gc_runs`` beside them (see
below); ``mask_ms`` (best, the mask conversion alone from ``[B, S]`` document ids),
``output_bytes`` (``nbytes`` of every tensor in the batch, BlockMask and THD params included)
and ``rss_peak_delta_bytes`` (growth of the process's peak RSS, ``ru_maxrss``, while that
format ran; formats run from the smallest to the largest output, so each delta is that
format's excess over every earlier peak; tracemalloc does not see torch's allocations). For
the compact formats, ``general_path`` times the same collate with the fast path switched off:
the code as it was before it (key-by-key padding, ``check_doc_ids``, masks from the ids).

    python benchmarks/bench_collate.py            # B=4, S=16384
    python benchmarks/bench_collate.py --quick    # B=4, S=2048
    python benchmarks/bench_collate.py --cold-malloc   # as a fresh process (see below)

Why a median can sit far above the best (measured on a 2-core VM shared with other jobs,
B=4, S=16384, 30-60 calls per format, per-call ``getrusage`` deltas):

* Preemption, the main cause. A call in which the scheduler hands the core to another process
  (``ru_nivcsw`` grows) takes 2-10x longer. With load average ~2 on 2 cores, 13/60 (thd) and
  29/60 (position_ids) of the old 2.6-4.7 ms collates were preempted, and 1-14 of 30 of the new
  0.6-0.9 ms ones; ``collate_ms_median_unpreempted`` stays within ~10% of ``best`` on a quiet
  machine, and ``p90`` shows the preempted tail. A shorter call is also less likely to be hit.
* Page faults of fresh memory, in a process whose allocator is still cold. glibc hands
  memory at the top of its heap back to the OS once more than its trim threshold is free;
  that threshold is twice the dynamic mmap threshold, which grows to the largest mmapped block
  freed so far. While both are small (a fresh process), every call's freed ``[B, S]`` tensors
  go back to the OS and are faulted in again by the next call, ~1.7 us per 4 KiB page: the old
  code took 480-496 minor faults per call in a fresh process (~0.8 ms), and the fast path did
  in 1 of 12 cold runs (thd: 480 faults, median 1.68 ms against 0.85 ms). After one 16 MiB
  block has been freed, as in any loader worker that decoded an image, both paths take 0
  faults per call (measured). So the benchmark frees such a block first (``--cold-malloc``
  to skip it) and reports ``page_faults_per_call_median`` for every format.
* Not GC: ``gc_runs`` is 0 in every compact format's timed loop.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack import pipes as M
from neatpack.pipes import collate as C
from neatpack.pipes.collating.attention_formats import MASK_CONVERSIONS

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


class Timing:
    """Per-call wall time plus what else happened in the call: page faults, preemption, GC.

    ``ru_minflt`` (minor page faults: first touch of freshly mapped memory) and ``ru_nivcsw``
    (involuntary context switches: the scheduler gave the core to another process) come from
    ``getrusage`` before and after each call; ``gc.callbacks`` counts Python collections.
    """

    def __init__(self) -> None:
        self.ms: list[float] = []
        self.faults: list[int] = []
        self.preempted: list[bool] = []
        self.gc_runs = 0

    def summary(self) -> dict[str, Any]:
        quiet = [t for t, p in zip(self.ms, self.preempted, strict=True) if not p]
        return {
            "collate_ms_median": round(statistics.median(self.ms), 3),
            "collate_ms_best": round(min(self.ms), 3),
            "collate_ms_p90": round(sorted(self.ms)[math.ceil(0.9 * len(self.ms)) - 1], 3),
            "collate_ms_median_unpreempted": round(statistics.median(quiet), 3) if quiet else None,
            "preempted_calls": sum(self.preempted),
            "page_faults_per_call_median": statistics.median(self.faults),
            "gc_runs": self.gc_runs,
        }


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Timing, Any]:
    timing, out = Timing(), None

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        timing.gc_runs += phase == "start"

    gc.callbacks.append(on_gc)
    try:
        for _ in range(repeats):
            out = None  # free the previous output before the next run
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            out = fn()
            timing.ms.append((time.perf_counter() - t0) * 1e3)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            timing.faults.append(r1.ru_minflt - r0.ru_minflt)
            timing.preempted.append(r1.ru_nivcsw > r0.ru_nivcsw)
    finally:
        gc.callbacks.remove(on_gc)
    return timing, out


@contextmanager
def general_path() -> Iterator[None]:
    """Collate through the general path only: the code before the fast path, as a baseline."""
    fast = C.pad_packs_fast
    C.pad_packs_fast = lambda *args, **kwargs: None
    try:
        yield
    finally:
        C.pad_packs_fast = fast


#: Freed once before timing unless ``--cold-malloc``: a loader worker has freed blocks this big
#: (decoded images, pixel tensors), which lifts glibc's dynamic mmap / trim thresholds past a
#: batch's tensors (see the module docstring).
WARM_MALLOC_BYTES = 16 << 20


def warm_malloc() -> None:
    block = torch.empty(WARM_MALLOC_BYTES // 8, dtype=torch.long)
    del block


def run(b: int, s: int, repeats: int, heavy_repeats: int, seed: int) -> dict[str, Any]:
    import torch.nn.attention.flex_attention  # noqa: F401  # import cost is not the mask's

    packs = make_packs(b, s, seed)
    doc_ids = C.neat_packed_vlm_collater(packs, max_length=s, mask_format="doc_ids")["doc_ids"]
    metrics: dict[str, Any] = {}
    for fmt in FORMATS:
        heavy = fmt in MASK_CONVERSIONS  # a mask built per batch: slower, fewer repeats
        n = heavy_repeats if heavy else repeats
        rss0 = peak_rss()
        collate = partial(C.neat_packed_vlm_collater, packs, max_length=s, mask_format=fmt)
        collate()  # warm-up
        timing, out = timed(collate, n)
        out_bytes = nbytes({k: v for k, v in out.items() if k != "sample_ids"})
        mask_bytes = nbytes(out.get("attention_mask")) + nbytes(out.get("packed_seq_params"))
        del out
        mask_timing, _ = timed(partial(MASK_ONLY[fmt], doc_ids), n)
        metrics[fmt] = {
            **timing.summary(),
            "mask_ms_best": round(min(mask_timing.ms), 3),
            "output_bytes": out_bytes,
            "mask_bytes": mask_bytes,
            "rss_peak_delta_bytes": peak_rss() - rss0,
            "repeats": n,
        }
        if not heavy:  # the same collate through the general path, in the same run
            with general_path():
                collate()
                general, _ = timed(collate, n)
            metrics[fmt]["general_path"] = general.summary()
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
    ap.add_argument(
        "--cold-malloc",
        action="store_true",
        help="skip freeing one 16 MiB block first (a fresh process, not a loader worker)",
    )
    args = ap.parse_args(argv)
    s = args.seq or (2048 if args.quick else 16384)
    torch.set_num_threads(args.threads)
    if not args.cold_malloc:
        warm_malloc()
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
                    "malloc_warmup_bytes": 0 if args.cold_malloc else WARM_MALLOC_BYTES,
                    "memory": "output_bytes = tensor nbytes of the batch; rss_peak_delta_bytes = "
                    "ru_maxrss growth while the format ran (formats in increasing size order)",
                },
                "metrics": metrics,
                "env": machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
