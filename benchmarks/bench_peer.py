"""neatpack side by side with the peer framework (NeMo AutoModel 0.7.0's VLM neat packing).

Not run in CI: the peer lives in its own virtual environment. Build it once with

    python3 -m venv /tmp/peer && /tmp/peer/bin/pip install torch==2.13.0 \\
        nemo-automodel==0.7.0 --no-deps transformers==5.18.0 datasets pillow numpy

(or any venv whose python imports ``nemo_automodel`` 0.7.0; ``--peer-python`` or
``NEATPACK_PEER_PYTHON`` names it). Without it this script exits with status 2 and says so.

Same corpus (``write_corpus``: image and text conversations with real image files), same tiny
real Qwen2-VL processor (built offline), same pack size, batch 1, both loaders with
``--workers`` worker processes and a 4D block-causal mask, each in a fresh process:

* neatpack: ``neat_vlm_graph`` with its defaults (exact length index, no truncation);
* peer: ``PreTokenizedDatasetWrapper`` -> ``neat_pack_dataset_vlm`` (its estimate,
  ``greedy_knapsack_vt_balanced``, ``drop_long_samples=True``, ``packing_ratio`` as given, mRoPE
  from a tiny Qwen2-VL's ``get_rope_index``) -> ``DataLoader`` with ``neat_packed_vlm_collater``.

Per side: packs, samples seen, real tokens, real-token utilization (real / packs x pack size),
seconds for the whole epoch (index or estimate included; worker start included), and real
tokens/s over the epoch's batches. Then ``plan_1m``: estimate + plan of ``--plan-records``
metadata records from a JSONL file, neatpack's ``build_length_index`` (estimate mode, the
peer's counterpart; ``--plan-exact`` adds exact mode, which tokenizes every text; on
``--plan-workers`` processes) + ``plan_packs`` against the peer's ``json.loads`` +
``_estimate_sample_length`` + ``greedy_knapsack_vt_balanced``, one after the other in fresh
processes.

    python benchmarks/bench_peer.py                 # 1944 samples, pack 8192, 2 workers, 1M plan
    python benchmarks/bench_peer.py --quick         # 48 samples, pack 4096, 20k plan
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import machine  # benchmarks/ is on sys.path as the script's folder

PEER_MODULE = "nemo_automodel.components.datasets.vlm.neat_packing_vlm"
INSTALL = (
    "python3 -m venv /tmp/peer && /tmp/peer/bin/pip install torch==2.13.0 nemo-automodel==0.7.0 "
    "--no-deps transformers==5.18.0 datasets pillow numpy"
)


def _records(data: Path, media: Path) -> list[dict[str, Any]]:
    """The corpus in the peer's raw form: ``conversation`` with absolute image paths, and
    ``mm_inputs_meta`` (``images_meta`` = [[h, w], ...]) so its estimate sizes the images."""
    out = []
    for line in data.read_text().splitlines():
        rec = json.loads(line)
        conv = []
        for m in rec["messages"]:
            content = m["content"]
            if isinstance(content, list):
                content = [
                    {**b, "image": str(media / b["image"])} if b.get("type") == "image" else b
                    for b in content
                ]
            conv.append({"role": m["role"], "content": content})
        meta = rec.get("images_meta")
        out.append(
            {"conversation": conv, "mm_inputs_meta": {"images_meta": meta} if meta else None}
        )
    return out


def run_peer(args: argparse.Namespace) -> dict[str, Any]:
    """The peer's loader over the corpus (runs in the peer's python)."""
    from functools import partial

    import torch
    from nemo_automodel.components.datasets.vlm.collate_fns import neat_packed_vlm_collater
    from nemo_automodel.components.datasets.vlm.datasets import PreTokenizedDatasetWrapper
    from nemo_automodel.components.datasets.vlm.neat_packing_vlm import neat_pack_dataset_vlm
    from torch.utils.data import DataLoader

    from neatpack.pipes.testing.tiny_models import tiny_model

    torch.set_num_threads(1)
    root = Path(args.root)
    processor = _processor(args.processor)
    pad = int(processor.tokenizer.pad_token_id or 0)
    model = tiny_model("qwen2_vl", processor=processor)
    t0 = time.perf_counter()
    raw = _records(root / "data.jsonl", root / "media")
    ds = PreTokenizedDatasetWrapper(raw, processor, max_length=args.pack_size)
    packed = neat_pack_dataset_vlm(
        ds, pack_size=args.pack_size, padding_idx=pad, drop_long_samples=True,
        get_rope_index=model.model.get_rope_index, ds_raw=raw, processor=processor,
        packing_ratio=args.packing_ratio,
    )  # fmt: skip
    collate = partial(neat_packed_vlm_collater, padding_idx=pad, max_length=args.pack_size)

    def counted(packs: list[dict[str, Any]]) -> dict[str, Any]:
        real = sum(int(sum(p["seq_lens"])) for p in packs)
        docs = sum(len(p["seq_lens"]) for p in packs)
        out: dict[str, Any] = collate(packs)
        out["_real"], out["_docs"] = real, docs
        return out

    dl = DataLoader(
        packed, batch_size=1, num_workers=args.workers, collate_fn=counted, shuffle=False,
        multiprocessing_context="fork" if args.workers else None,
    )  # fmt: skip
    t1 = time.perf_counter()
    real = docs = batches = 0
    for batch in dl:
        real, docs, batches = real + batch["_real"], docs + batch["_docs"], batches + 1
    t2 = time.perf_counter()
    return _side(len(packed), docs, real, args.pack_size, t2 - t0, t2 - t1, len(raw))


def run_neat(args: argparse.Namespace) -> dict[str, Any]:
    """neatpack's default graph over the corpus."""
    import torch

    from neatpack.graphs import NeatVLMConfig, neat_vlm_graph

    torch.set_num_threads(1)
    root = Path(args.root)
    processor = _processor(args.processor)
    cfg = NeatVLMConfig(
        pack_size=args.pack_size, batch_size=1, media_root=str(root / "media"),
        cache_dir=str(root / f"cache-{os.getpid()}"), num_workers=args.workers,
    )  # fmt: skip
    t0 = time.perf_counter()
    loader = neat_vlm_graph(root / "data.jsonl", processor, config=cfg)
    t1 = time.perf_counter()
    real = docs = packs = 0
    for batch in loader:
        for p in batch["packs"]:
            real, docs, packs = real + int(p["real_tokens"]), docs + len(p["sample_ids"]), packs + 1
    t2 = time.perf_counter()
    n = sum(1 for _ in (root / "data.jsonl").open())
    return _side(packs, docs, real, args.pack_size, t2 - t0, t2 - t1, n)


def _processor(name: str) -> Any:
    """An embedded tiny processor by name, or one saved with ``save_pretrained`` in a directory
    (a real vocabulary, as ``bench_utilization.py --processor``)."""
    if Path(name).is_dir():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(name, local_files_only=True)  # type: ignore[no-untyped-call]

    from neatpack.pipes.testing.tiny import load_tiny_processor

    return load_tiny_processor(name)


def _side(
    packs: int, docs: int, real: int, size: int, total_s: float, iter_s: float, n: int
) -> dict[str, Any]:
    return {
        "packs": packs,
        "samples_seen": docs,
        "samples_missing": n - docs,
        "real_tokens": real,
        "real_utilization": round(real / max(1, packs * size), 4),
        "epoch_s": round(total_s, 2),
        "real_tokens_per_s": round(real / iter_s),
    }


def plan_corpus(path: Path, n: int, seed: int = 0) -> None:
    """``n`` metadata records (text chars, image sizes; no media files): what a 1M-record plan
    reads. About 70 % have 1-4 images, the rest are text."""
    import random

    rnd = random.Random(seed)
    words = ["the", "a", "photo", "shows", "red", "blue", "document", "table", "value", "total"]
    with path.open("w") as f:
        for i in range(n):
            k = rnd.choice((0, 0, 0, 1, 1, 1, 2, 2, 3, 4))
            user = [{"type": "image", "image": f"{i}_{j}.jpg"} for j in range(k)]
            text = " ".join(rnd.choice(words) for _ in range(rnd.randint(3, 60)))
            user.append({"type": "text", "text": text})
            answer = " ".join(rnd.choice(words) for _ in range(rnd.randint(3, 60)))
            rec: dict[str, Any] = {
                "id": i,
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": answer},
                ],
            }
            if k:
                rec["images_meta"] = [
                    [rnd.randint(64, 1600), rnd.randint(64, 1600)] for _ in range(k)
                ]
            f.write(json.dumps(rec) + "\n")


def plan_neat(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.indexing.lengths import build_length_index
    from neatpack.pipes.planning.plan import plan_packs
    from neatpack.pipes.reading.read import JsonlSource
    from neatpack.pipes.testing.tiny import load_tiny_processor

    processor = load_tiny_processor("qwen2_vl")
    t0 = time.perf_counter()
    source = JsonlSource(args.plan_file)
    est = LengthEstimator.from_processor(processor, mode=mode)
    index = build_length_index(source, est, progress=False, num_workers=args.plan_workers)
    plan = plan_packs(index.total, args.pack_size, visual=index.visual, overlong="drop")
    dt = time.perf_counter() - t0
    return {"seconds": round(dt, 2), "packs": len(plan), "records": len(source)}


def plan_peer(args: argparse.Namespace) -> dict[str, Any]:
    from nemo_automodel.components.datasets.vlm.neat_packing_vlm import (
        _estimate_sample_length,
        greedy_knapsack_vt_balanced,
    )
    from nemo_automodel.components.datasets.vlm.samplers import LengthGroupedSampler

    from neatpack.pipes.testing.tiny import load_tiny_processor

    processor = load_tiny_processor("qwen2_vl")
    image_cfg = LengthGroupedSampler._extract_image_config(processor)
    t0 = time.perf_counter()
    lengths, visual = [], []
    with open(args.plan_file) as f:
        for line in f:
            rec = json.loads(line)
            rec["conversation"] = rec.pop("messages")
            meta = rec.pop("images_meta", None)
            rec["mm_inputs_meta"] = {"images_meta": meta} if meta else None
            est, vt = _estimate_sample_length(rec, image_cfg, None, return_media_tokens=True)
            lengths.append(min(max(est - 1, 0), args.pack_size))
            visual.append(vt)
    bins = greedy_knapsack_vt_balanced(lengths, args.pack_size, visual)
    dt = time.perf_counter() - t0
    return {"seconds": round(dt, 2), "packs": len(bins), "records": len(lengths)}


def _importable(neatpack: Any, root: Path) -> str:
    """A folder from which the peer's python imports this neatpack (for the tiny processor):
    the installed package's parent, or for an editable install (the repository root is the
    package) a folder holding a ``neatpack`` link to it."""
    pkg = Path(neatpack.pipes.__file__).resolve().parent.parent
    if pkg.name == "neatpack":
        return str(pkg.parent)
    site = root / "site"
    site.mkdir(exist_ok=True)
    (site / "neatpack").symlink_to(pkg, target_is_directory=True)
    return str(site)


def _child(python: str, what: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    cmd = [python, __file__, "--one", what, "--root", args.root, "--pack-size",
           str(args.pack_size), "--workers", str(args.workers), "--packing-ratio",
           str(args.packing_ratio), "--plan-file", str(args.plan_file),
           "--plan-workers", str(args.plan_workers), "--processor", args.processor]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{what} run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--peer-python", default=os.environ.get("NEATPACK_PEER_PYTHON"))
    ap.add_argument("--samples", type=int, default=1944)
    ap.add_argument("--processor", default="qwen2_vl", help="tiny processor name or a saved dir")
    ap.add_argument("--pack-size", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--packing-ratio", type=float, default=1.0)
    ap.add_argument("--plan-records", type=int, default=1_000_000)
    ap.add_argument("--plan-workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--plan-exact", action="store_true", help="also plan in exact mode (slow)")
    ap.add_argument("--repeats", type=int, default=1, help="fresh-process runs per side, best kept")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--plan-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        fn = {
            "neat": run_neat,
            "peer": run_peer,
            "plan_neat_exact": lambda a: plan_neat(a, "exact"),
            "plan_neat_estimate": lambda a: plan_neat(a, "estimate"),
            "plan_peer": plan_peer,
        }
        print(json.dumps(fn[args.one](args)))
        return
    python = args.peer_python or "/tmp/peer/bin/python"
    probe = subprocess.run(
        [python, "-c", f"import {PEER_MODULE}"], capture_output=True, text=True, check=False
    ) if Path(python).exists() else None  # fmt: skip
    if probe is None or probe.returncode != 0:
        why = "not found" if probe is None else probe.stderr.strip().splitlines()[-1]
        print(
            f"bench_peer: the peer framework is not installed ({python}: {why}). Install it "
            f"into its own venv first: {INSTALL}; or pass --peer-python / NEATPACK_PEER_PYTHON.",
            file=sys.stderr,
        )
        sys.exit(2)
    if args.quick:
        args.samples, args.pack_size, args.plan_records = 48, 4096, 20_000
    import neatpack
    import neatpack.pipes
    from neatpack.pipes.testing.synth import write_corpus

    args.root = tempfile.mkdtemp(prefix="neatpack-bench-peer-")
    write_corpus(args.root, num_samples=args.samples, seed=3)
    args.plan_file = Path(args.root) / "plan.jsonl"
    if args.plan_records:  # 0: no plan comparison
        plan_corpus(args.plan_file, args.plan_records)
    peer_env = {**os.environ, "PYTHONPATH": _importable(neatpack, Path(args.root))}
    runs: dict[str, list[dict[str, Any]]] = {"neat": [], "peer": []}
    for _ in range(args.repeats):  # alternating, each in a fresh process
        runs["neat"].append(_child(sys.executable, "neat", args, dict(os.environ)))
        runs["peer"].append(_child(python, "peer", args, peer_env))
    best = {k: max(v, key=lambda r: r["real_tokens_per_s"]) for k, v in runs.items()}
    modes: tuple[str, ...] = ("estimate", "exact") if args.plan_exact else ("estimate",)
    modes = modes if args.plan_records else ()
    plan = {f"neat_{m}": _child(sys.executable, f"plan_neat_{m}", args, dict(os.environ))
            for m in modes}  # fmt: skip
    if modes:
        plan["peer"] = _child(python, "plan_peer", args, peer_env)
    metrics = {
        **best,
        "ratio_real_tokens_per_s": round(
            best["neat"]["real_tokens_per_s"] / best["peer"]["real_tokens_per_s"], 3
        ),
        "plan": plan,
        "ratio_plan_speed": {
            k: round(plan["peer"]["seconds"] / plan[f"neat_{k}"]["seconds"], 2) for k in modes
        },
    }
    print(
        json.dumps(
            {
                "benchmark": "peer",
                "params": {
                    "samples": args.samples,
                    "pack_size": args.pack_size,
                    "workers": args.workers,
                    "batch_size": 1,
                    "packing_ratio": args.packing_ratio,
                    "plan_records": args.plan_records,
                    "plan_workers": args.plan_workers,
                    "repeats": args.repeats,
                    "quick": args.quick,
                    "peer_python": python,
                    "processor": args.processor,
                },
                "metrics": metrics,
                "env": machine(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
