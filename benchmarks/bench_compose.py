"""A hand-built graph against the prebuilt one, side by side in one run (issue #14: within 5 %).

Three loaders over the same corpus, processor, plan and worker count:

* ``prebuilt``: ``neat_vlm_graph``;
* ``hand_chain``: the same graph composed by hand from the public pieces, with one user step
  (a pass-through over each pack) in the worker ``StepChain`` between materialize and collate;
* ``hand_readme``: the README recipe: materialize in a worker stage, the user step as its own
  node, collate as its own node (in the main process).

Runs alternate ``--repeats`` rounds, the order rotated each round (a kind that always ran first
or last would carry the machine's drift); the best run of each is kept. ``tokens_per_s``
counts real packed tokens over a whole epoch.

    python benchmarks/bench_compose.py            # 240 samples, pack size 4096, 2 workers
    python benchmarks/bench_compose.py --quick    # 24 samples, 1 worker
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import machine  # benchmarks/ is on sys.path as the script's folder
from torchdata.nodes import BaseNode, Batcher, Mapper

from neatpack.graphs import NeatVLMConfig, map_stage, neat_vlm_graph, neat_vlm_parts
from neatpack.pipes import PerPack, StepChain, load_tiny_processor, write_corpus


def user_step(pack: dict[str, Any]) -> dict[str, Any]:
    """The user's step: a pass-through, so only the composition differs."""
    return pack


def _tokens(batch: dict[str, Any]) -> int:
    return int(sum(m["real_tokens"] for m in batch["packs"]))


def _epoch(loader: Any) -> dict[str, float]:
    t0 = time.perf_counter()
    n = tokens = 0
    for batch in loader:
        n += 1
        tokens += _tokens(batch)
    s = time.perf_counter() - t0
    return {"tokens_per_s": tokens / s, "batches": n, "tokens": tokens, "seconds": s}


def _loader(kind: str, data: Path, processor: Any, cfg: NeatVLMConfig) -> Any:
    if kind == "prebuilt":
        return neat_vlm_graph(data, processor, config=cfg)
    parts = neat_vlm_parts(data, processor, config=cfg)

    def hand_chain(source: BaseNode[Any]) -> BaseNode[Any]:
        refs = Batcher(source, cfg.batch_size, drop_last=False)
        chain = StepChain(PerPack(parts.materialize), PerPack(user_step), parts.collate)
        return map_stage(refs, chain, num_workers=cfg.num_workers, prefetch=cfg.prefetch)

    def hand_readme(source: BaseNode[Any]) -> BaseNode[Any]:
        refs = Batcher(source, cfg.batch_size, drop_last=False)
        packs = map_stage(refs, PerPack(parts.materialize), num_workers=cfg.num_workers)
        packs = Mapper(packs, PerPack(user_step))
        return map_stage(Mapper(packs, parts.collate), lambda b: b, num_workers=0,
                         prefetch=cfg.prefetch)  # fmt: skip

    return parts.loader(hand_chain if kind == "hand_chain" else hand_readme)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    samples = 24 if args.quick else args.samples
    workers = 1 if args.quick else args.workers
    repeats = 1 if args.quick else args.repeats
    pack_size = 2048 if args.quick else 4096
    root = Path(tempfile.mkdtemp(prefix="bench_compose_"))
    data = write_corpus(root, num_samples=samples, seed=0)
    processor = load_tiny_processor()
    cfg = NeatVLMConfig(
        pack_size=pack_size,
        batch_size=2,
        media_root=str(root / "media"),
        cache_dir=str(root / "cache"),
        num_workers=workers,
        prefetch=2,
    )
    kinds = ("prebuilt", "hand_chain", "hand_readme")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    _epoch(_loader("prebuilt", data, processor, cfg))  # warm: length index, page cache
    for r in range(repeats):
        for kind in kinds[r % 3 :] + kinds[: r % 3]:  # rotate: no kind always runs first
            loader = _loader(kind, data, processor, cfg)
            runs[kind].append(_epoch(loader))
            del loader
            gc.collect()  # the last loader's workers are gone before the next one starts
    best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in runs.items()}
    assert len({b["tokens"] for b in best.values()}) == 1, "the loaders packed different tokens"
    base = best["prebuilt"]["tokens_per_s"]
    metrics: dict[str, Any] = {k: best[k] for k in kinds}
    metrics["ratio_hand_chain_vs_prebuilt"] = best["hand_chain"]["tokens_per_s"] / base
    metrics["ratio_hand_readme_vs_prebuilt"] = best["hand_readme"]["tokens_per_s"] / base
    metrics["all_runs_tokens_per_s"] = {k: [r["tokens_per_s"] for r in v] for k, v in runs.items()}
    print(
        json.dumps(
            {
                "benchmark": "compose",
                "params": {
                    "samples": samples,
                    "pack_size": pack_size,
                    "batch_size": 2,
                    "workers": workers,
                    "repeats": repeats,
                },
                "metrics": metrics,
                "env": machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
