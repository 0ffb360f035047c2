"""Does ``CostModel`` predict a pack's forward + backward time? (#27, "Done when").

Packs come from the real graph (``neat_vlm_graph`` over a ``write_corpus`` corpus, the tiny
Qwen2-VL processor) at a few pack sizes, the same packs in two formats: ``sdpa`` (a dense 4D
mask) and ``flash_attention_2`` run through neatpack's varlen attention function (on CPU its
per-document sdpa reference: attention within each document). A small random Qwen2-VL built
from ``Qwen2VLConfig`` (text 128 wide, 4 layers; tower 64 wide, 4 blocks; fp32, CPU) runs
forward + backward on each pack: after one warm-up step, the median of ``--repeats`` timed
runs, timed as the process's CPU time on one thread (the machine is shared; wall time there
swings tenfold with the neighbours' load).

Each pack's terms (``pack_terms``: tokens, sum of squared document lengths, patches, sum of
squared patches per image, from the batch's documents and ``image_grid_thw``) go through
``CostModel.from_config(config, fmt).cost(terms, row_length=S)`` (FLOPs, no fitting), and
through ``calibrate`` fitted on a random half of the packs and scored on the other half.
Metrics per format: Spearman rank correlation (ranks, then Pearson; numpy) between prediction
and measured time, over all packs (FLOPs) and over the held-out half (calibrated), and the
calibrated model's median relative error there. The goal is Spearman >= 0.9 over >= 50 packs;
``spearman_flops_per_row_length`` is the harder figure, among packs of one padded row length
(the spread there comes from the documents and the images alone).

    python benchmarks/bench_cost_model.py          # 3 pack sizes, 51 packs per format, ~2.5 min CPU
    python benchmarks/bench_cost_model.py --quick  # 2 small pack sizes, 12 packs, ~20 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _machine import machine  # benchmarks/ is on sys.path as the script's folder

FORMATS = ("sdpa", "flash_attention_2")


def spearman(a: Any, b: Any) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (ties get their mean rank)."""

    def ranks(x: Any) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="stable")
        r = np.empty(x.size)
        r[order] = np.arange(x.size, dtype=np.float64)
        for v in np.unique(x):  # ties: mean rank
            tie = x == v
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def build_model(processor: Any) -> Any:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from neatpack.pipes.testing.tiny_models import token_ids_from_processor

    ids = token_ids_from_processor(processor)
    text = {
        "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192,
        "vocab_size": ids.pop("vocab_size"), "eos_token_id": ids.pop("eos_token_id"),
        "pad_token_id": ids.pop("pad_token_id"), "bos_token_id": None,
        "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6]},
    }  # fmt: skip
    vision = {"depth": 4, "embed_dim": 64, "hidden_size": 128, "num_heads": 4,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}  # fmt: skip
    torch.manual_seed(0)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, attn_implementation="sdpa", **ids)
    model = Qwen2VLForConditionalGeneration(cfg)
    model.config.use_cache = False
    return model


def batch_terms(batch: dict[str, Any]) -> np.ndarray:
    """The batch's one pack as a ``pack_terms`` row, its documents and images exact."""
    from neatpack.pipes.planning.cost import grid_patches, pack_terms

    doc = batch["doc_ids"][0]
    real = doc[doc > 0]
    lengths = np.bincount(real.numpy())[1:]
    lengths = lengths[lengths > 0]
    image_offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    patches = np.zeros(0, dtype=np.int64)
    if batch.get("image_grid_thw") is not None:
        patches = grid_patches(batch["image_grid_thw"].numpy())
        # images follow the documents' order: the first document holds them all for a pack's
        # sums (the terms are per pack), which is exact for both vision columns
        image_offsets[1:] = patches.size
    return pack_terms([0, lengths.size], np.arange(lengths.size), lengths,
                      image_offsets=image_offsets, image_patches=patches)[0]  # fmt: skip


def collect(corpus: Path, processor: Any, fmt: str, sizes: list[int], per_size: int) -> list[Any]:
    from neatpack.graphs import NeatVLMConfig, neat_vlm_graph

    batches = []
    for size in sizes:
        cfg = NeatVLMConfig(pack_size=size, batch_size=1, media_root=str(corpus.parent / "media"),
                            prefetch=0, shuffle=False, attn_implementation=fmt,
                            overlong="drop")  # fmt: skip
        for i, b in enumerate(neat_vlm_graph(corpus, processor, config=cfg)):
            if i >= per_size:
                break
            batches.append(b)
    return batches


def time_packs(model: Any, batches: list[Any], repeats: int) -> list[float]:
    from neatpack.graphs.train import model_inputs

    def step(b: Any) -> float:
        t0 = time.process_time()
        model(**model_inputs(b)).loss.backward()
        dt = time.process_time() - t0
        model.zero_grad(set_to_none=True)
        return dt

    step(batches[0])  # the first step of a process is slow (allocation, kernel choice)
    return [statistics.median(step(b) for _ in range(repeats)) for b in batches]


def score(model_cfg: Any, fmt: str, terms: np.ndarray, rows: np.ndarray,
          seconds: np.ndarray, seed: int) -> dict[str, Any]:  # fmt: skip
    from neatpack.pipes.planning.cost import CostModel

    flops = CostModel.from_config(model_cfg, fmt)
    pred = flops.cost(terms, row_length=rows)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(seconds))
    fit, held = order[: len(order) // 2], order[len(order) // 2 :]
    cal = flops.calibrate(terms[fit], seconds[fit], row_length=rows[fit])
    got = cal.cost(terms[held], row_length=rows[held])
    share = flops.per_term(terms, row_length=rows).sum(axis=0)
    parts = ("fixed", "tokens", "attention", "patches", "patch_attention")
    coefs = ("per_pack", "per_token", "per_pair", "per_patch", "per_patch_pair")
    spread = (seconds.min(), np.median(seconds), seconds.max())
    within = {
        str(int(r)): round(spearman(pred[rows == r], seconds[rows == r]), 4)
        for r in np.unique(rows)
        if np.count_nonzero(rows == r) >= 3
    }
    return {
        "spearman_flops": round(spearman(pred, seconds), 4),
        "spearman_flops_per_row_length": within,
        "spearman_calibrated_held_out": round(spearman(got, seconds[held]), 4),
        "calibrated_median_rel_error": round(
            float(np.median(np.abs(got - seconds[held]) / seconds[held])), 4
        ),
        "flops_share": dict(zip(parts, np.round(share / share.sum(), 4).tolist(), strict=True)),
        "calibrated": {k: getattr(cal, k) for k in coefs},
        "seconds_min_median_max": [round(float(f), 4) for f in spread],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from neatpack.pipes import register_varlen_attention

    # One thread, CPU time: on a shared 2-core machine the wall time of the same pack ranged
    # 1.5-10 s (load 5); one thread's CPU time ranged 0.32-0.39 s.
    torch.set_num_threads(1)
    from neatpack.pipes.testing.synth import write_corpus
    from neatpack.pipes.testing.tiny import load_tiny_processor

    sizes = [512, 1024] if args.quick else [384, 768, 1536]
    per_size = 6 if args.quick else 17
    repeats = args.repeats or (1 if args.quick else 3)
    samples = 24 if args.quick else 200
    processor = load_tiny_processor("qwen2_vl")
    model = build_model(processor)
    varlen = register_varlen_attention()
    metrics: dict[str, Any] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(tmp, num_samples=samples, seed=args.seed)
        for fmt in FORMATS:
            batches = collect(corpus, processor, fmt, sizes, per_size)
            model.set_attn_implementation("sdpa" if fmt == "sdpa" else varlen)
            seconds = np.array(time_packs(model, batches, repeats))
            terms = np.stack([batch_terms(b) for b in batches])
            rows = np.array([int(b["input_ids"].shape[1]) for b in batches], dtype=np.float64)
            metrics[fmt] = {"packs": len(batches), **score(model.config, fmt, terms, rows,
                                                           seconds, args.seed)}  # fmt: skip
    metrics["packs"] = min(metrics[f]["packs"] for f in FORMATS)
    metrics["spearman_min"] = min(
        min(metrics[f]["spearman_flops"], metrics[f]["spearman_calibrated_held_out"])
        for f in FORMATS
    )
    metrics["goal_met"] = metrics["spearman_min"] >= 0.9 and metrics["packs"] >= 50
    metrics["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps({
        "benchmark": "cost_model",
        "params": {"quick": args.quick, "pack_sizes": sizes, "packs_per_size": per_size,
                   "repeats": repeats, "samples": samples, "seed": args.seed,
                   "formats": {"sdpa": "dense 4D mask",
                               "flash_attention_2": "neatpack_varlen (per-document sdpa on CPU)"},
                   "model": "Qwen2VLConfig text 128x4 layers, vision 64x4 blocks, fp32"},
        "metrics": metrics,
        "env": machine(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
