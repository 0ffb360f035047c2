"""What a GPU trains per second on neatpack's batches (#27 item 6): real tokens/s of a
randomly initialized Qwen2-VL-2B-shaped model, forward + backward, one GPU, under 8 minutes.

The model is built from ``Qwen2VLConfig`` with the 2B sizes (text 1536 wide, 28 layers, 12
heads, 2 KV heads, MLP 8960; vision tower depth 32, width 1280, 16 heads) and the tiny
processor's vocabulary (no download), in bf16 on the GPU. One generated image/text corpus
(``write_corpus``), the same processor for every row. Each row collects its batches first,
then times ``--steps`` forward + backward steps after ``--warmup`` (the first steps of a
process pick kernels and allocate), ``model(**model_inputs(batch, model=model)).loss``:

* ``default``: ``NeatVLMConfig()`` as a user gets it (``attn_implementation="auto"``: on CUDA
  ``flash_attention_2`` batches) and the model prepared as ``NeatTrainer`` prepares it
  (``use_varlen_attention_for``: neatpack's varlen function over PyTorch's varlen kernel);
* ``dense_sdpa``: the same packs with ``attn_implementation="sdpa"`` (a dense 4D mask per row);
* ``varlen``: ``attn_implementation="flash_attention_2"`` + ``use_varlen_attention`` (measured
  only when ``default`` resolved to something else, as on CPU; else ``same_as: default``);
* ``grouped``: ``grouped_vlm_graph`` (length-grouped, padded, not packed), sdpa;
* ``balance_tokens`` / ``balance_cost``: the varlen path on ``--ranks`` simulated ranks
  (``rank=r, world_size=W`` graphs), the plan's step groups balanced on tokens (default) or on
  compute cost (``balance="cost"``); every rank's batch of each of the first ``--balance-steps``
  steps is timed and a step lasts as long as its slowest rank: ``slowest_rank_step_s`` (mean
  over steps of the max over ranks), ``mean_rank_step_s``, and real tokens/s of the W ranks
  at the slowest rank's pace.

Real tokens are the batch's non-padding tokens (``doc_ids > 0``; the grouped graph's
``attention_mask``). A row that runs out of memory is reported as ``{"oom": true}``.
``loss_first`` (the first timed batch's loss) lets the same packs be compared across formats.

    python benchmarks/bench_gpu.py            # one GPU: pack 8192, 8 timed steps per row
    python benchmarks/bench_gpu.py --smoke    # CPU, tiny model, pack 1024: the script works
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

QWEN2_VL_2B = {
    "text": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2,
             "max_position_embeddings": 32768,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                 "mrope_section": [16, 24, 24]}},
    "vision": {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16,
               "mlp_ratio": 4, "patch_size": 14, "spatial_merge_size": 2,
               "temporal_patch_size": 2},
}  # fmt: skip
TINY = {
    "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 4096,
             "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
    "vision": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
               "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
}  # fmt: skip


def build_model(processor: Any, sizes: dict[str, Any], device: str, dtype: torch.dtype) -> Any:
    """A random Qwen2-VL of ``sizes`` with the processor's vocabulary, built on ``device``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from neatpack.pipes.testing.tiny_models import token_ids_from_processor

    ids = token_ids_from_processor(processor)
    text = {
        **sizes["text"],
        "vocab_size": ids.pop("vocab_size"),
        "bos_token_id": None,
        "eos_token_id": ids.pop("eos_token_id"),
        "pad_token_id": ids.pop("pad_token_id"),
    }
    cfg = Qwen2VLConfig(text_config=text, vision_config=sizes["vision"],
                        attn_implementation="sdpa", **ids)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration._from_config(cfg, dtype=dtype)
    model.config.use_cache = False
    model.train()
    return model


def real_tokens(batch: dict[str, Any]) -> int:
    doc = batch.get("doc_ids")
    if isinstance(doc, torch.Tensor):
        return int(doc.gt(0).sum())
    return int(batch["attention_mask"].sum())


def on_device(batch: dict[str, Any], device: str, dtype: torch.dtype) -> dict[str, Any]:
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, non_blocking=True)
            if k == "pixel_values":
                v = v.to(dtype)
        out[k] = v
    return out


def collect(loader: Any, n: int) -> list[dict[str, Any]]:
    out = []
    for batch in loader:
        out.append(dict(batch))
        if len(out) == n:
            break
    return out


def step_seconds(
    model: Any, batch: dict[str, Any], device: str, dtype: torch.dtype
) -> tuple[float, float]:
    """One forward + backward: (seconds, loss)."""
    from neatpack.graphs.train import model_inputs

    inputs = model_inputs(on_device(batch, device, dtype), model=model)
    sync(device)
    t0 = time.perf_counter()
    loss = model(**inputs).loss
    loss.backward()
    sync(device)
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt, float(loss.detach())


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_row(model: Any, batches: list[dict[str, Any]], warmup: int, device: str,
              dtype: torch.dtype) -> dict[str, Any]:  # fmt: skip
    """Real tokens/s over the batches after ``warmup`` of them (run untimed)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        for b in batches[:warmup]:
            step_seconds(model, b, device, dtype)
        seconds, losses, tokens, padded = 0.0, [], 0, 0
        for b in batches[warmup:]:
            dt, loss = step_seconds(model, b, device, dtype)
            seconds += dt
            losses.append(loss)
            tokens += real_tokens(b)
            padded += int(b["input_ids"].numel())
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return {"oom": True}
    steps = len(batches) - warmup
    row = {
        "steps": steps,
        "ms_per_step": round(1000 * seconds / max(steps, 1), 1),
        "real_tokens_per_step": round(tokens / max(steps, 1), 1),
        "real_fraction": round(tokens / max(padded, 1), 4),
        "real_tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "loss_first": round(losses[0], 4) if losses else None,
    }
    if device == "cuda":
        row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    return row


def balance_row(model: Any, per_rank: list[list[dict[str, Any]]], device: str,
                dtype: torch.dtype) -> dict[str, Any]:  # fmt: skip
    """The varlen path on simulated ranks (``per_rank[r]``: rank r's first batches): each
    step lasts its slowest rank."""
    ranks = len(per_rank)
    steps = min(len(b) for b in per_rank)
    try:
        step_seconds(model, per_rank[0][0], device, dtype)  # warm: this row's shapes
        times = [[step_seconds(model, per_rank[r][s], device, dtype)[0] for r in range(ranks)]
                 for s in range(steps)]  # fmt: skip
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return {"oom": True}
    slowest = [max(t) for t in times]
    mean = [sum(t) / len(t) for t in times]
    tokens = sum(real_tokens(per_rank[r][s]) for r in range(ranks) for s in range(steps))
    return {
        "ranks": ranks,
        "steps": steps,
        "slowest_rank_step_s": round(sum(slowest) / steps, 4),
        "mean_rank_step_s": round(sum(mean) / steps, 4),
        "slowest_over_mean": round(sum(slowest) / sum(mean), 4),
        "real_tokens_per_s_all_ranks": round(tokens / sum(slowest), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--smoke",
        "--quick",
        action="store_true",
        dest="smoke",
        help="CPU, tiny model, small packs: checks the script, measures nothing",
    )
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--pack-size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--grouped-batch", type=int, default=None)
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--balance-steps", type=int, default=None)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="rows not started by then are reported as skipped")  # fmt: skip
    args = ap.parse_args()
    smoke = args.smoke
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    samples = args.samples or (24 if smoke else 1200)
    pack = args.pack_size or (1024 if smoke else 8192)
    steps = args.steps or (1 if smoke else 8)
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 2)
    grouped_batch = args.grouped_batch or (4 if smoke else 8)
    ranks = args.ranks or (2 if smoke else 8)
    balance_steps = args.balance_steps or (1 if smoke else 4)
    workers = (
        args.workers if args.workers is not None else (0 if smoke else min(8, os.cpu_count() or 1))
    )
    if smoke:
        torch.set_num_threads(min(2, torch.get_num_threads()))

    from neatpack.graphs import GroupedConfig, NeatVLMConfig, grouped_vlm_graph, neat_vlm_graph
    from neatpack.graphs.train import use_varlen_attention_for
    from neatpack.pipes import register_varlen_attention
    from neatpack.pipes.testing.synth import write_corpus
    from neatpack.pipes.testing.tiny import load_tiny_processor

    t_start = time.perf_counter()
    processor = load_tiny_processor("qwen2_vl")
    metrics: dict[str, Any] = {}
    resolved: dict[str, str] = {}
    rows: dict[str, Any] = {}  # name -> batches (a row), or per-rank batches (a balance row)
    # Every batch is built before the model touches the GPU: the length index and the loader
    # fork worker processes, which must not inherit a CUDA context.
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(tmp, num_samples=samples, seed=0)
        media = str(Path(tmp) / "media")
        n = warmup + steps
        base = NeatVLMConfig(pack_size=pack, media_root=media, cache_dir=f"{tmp}/cache",
                             num_workers=workers, overlong="drop", shuffle=False)  # fmt: skip

        def graph(cfg: Any, rank: int = 0, world: int = 1) -> Any:
            return neat_vlm_graph(corpus, processor, config=cfg, rank=rank, world_size=world)

        default_loader = graph(base)  # what a user gets: the graph's "auto"
        resolved["default"] = default_loader.config["attn_implementation"]
        rows["default"] = collect(default_loader, n)
        rows["dense_sdpa"] = collect(
            graph(dataclasses.replace(base, attn_implementation="sdpa")), n
        )
        if resolved["default"] != "flash_attention_2":
            varlen = dataclasses.replace(base, attn_implementation="flash_attention_2")
            rows["varlen"] = collect(graph(varlen), n)
        gcfg = GroupedConfig(batch_size=grouped_batch, media_root=media, shuffle=False,
                             cache_dir=f"{tmp}/cache-grouped", num_workers=workers)  # fmt: skip
        rows["grouped"] = collect(grouped_vlm_graph(corpus, processor, config=gcfg), n)
        for balance in ("tokens", "cost"):
            cfg = dataclasses.replace(
                base, balance=balance, attn_implementation="flash_attention_2"
            )
            rows[f"balance_{balance}"] = [
                collect(graph(cfg, r, ranks), balance_steps) for r in range(ranks)
            ]
        metrics["batches_built_s"] = round(time.perf_counter() - t_start, 1)

    model = build_model(processor, TINY if smoke else QWEN2_VL_2B, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    varlen_name = register_varlen_attention()

    def over_budget(name: str) -> bool:
        if time.perf_counter() - t_start <= args.budget_s:
            return False
        metrics[name] = {"skipped": f"over --budget-s {args.budget_s}"}
        return True

    # the model as NeatTrainer prepares it for the default loader
    resolved["default_model"] = use_varlen_attention_for(model, default_loader)
    metrics["default"] = timed_row(model, rows["default"], warmup, device, dtype)
    if not over_budget("dense_sdpa"):
        model.set_attn_implementation("sdpa")
        metrics["dense_sdpa"] = timed_row(model, rows["dense_sdpa"], warmup, device, dtype)
    if "varlen" not in rows:
        metrics["varlen"] = {"same_as": "default"}
    elif not over_budget("varlen"):
        model.set_attn_implementation(varlen_name)
        metrics["varlen"] = timed_row(model, rows["varlen"], warmup, device, dtype)
    if not over_budget("grouped"):
        model.set_attn_implementation("sdpa")
        metrics["grouped"] = timed_row(model, rows["grouped"], warmup, device, dtype)
    model.set_attn_implementation(varlen_name)
    for balance in ("tokens", "cost"):
        name = f"balance_{balance}"
        if not over_budget(name):
            metrics[name] = balance_row(model, rows[name], device, dtype)

    default = metrics["default"].get("real_tokens_per_s")
    for name in ("dense_sdpa", "grouped"):
        other = metrics.get(name, {}).get("real_tokens_per_s")
        if default and other:
            metrics[f"default_over_{name}"] = round(default / other, 3)
    metrics["wall_s"] = round(time.perf_counter() - t_start, 1)
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "platform": platform.platform(), "device": device,
           "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}  # fmt: skip
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    print(json.dumps({
        "benchmark": "gpu",
        "params": {"smoke": smoke, "samples": samples, "pack_size": pack, "steps": steps,
                   "warmup": warmup, "grouped_batch": grouped_batch, "ranks": ranks,
                   "balance_steps": balance_steps, "workers": workers,
                   "model_parameters": params, "dtype": str(dtype).removeprefix("torch."),
                   "formats": resolved},
        "metrics": metrics,
        "env": env,
    }))  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
