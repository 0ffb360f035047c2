"""``neatpack plan --mixture mix.json``: the mixture's epoch plan, realized share per source
next to the target, for the epoch and per window of training steps.

``mix.json`` (relative paths resolve against its folder)::

    {"sources": [{"name": "caption", "data": "caption.jsonl", "media_root": "media",
                  "weight": 0.6},
                 {"name": "charts", "data": "charts.jsonl", "samples": 5000}],
     "epoch_tokens": null, "single_source_packs": false}

Printed (``--json`` for one object)::

    neatpack plan --mixture: mix.json (2 sources, 412 packs, epoch 0)
      source     samples  uses/epoch  x size  target %  epoch %  window % (min..max)
      caption       9000        8123    0.90     60.00    60.02    59.41..60.57
      charts        1000        5000    5.00     40.00    39.98    39.43..40.59
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from neatpack.pipes.mixtures.mixture import Mixture, MixtureSource
from neatpack.pipes.mixtures.mixture_report import realized_shares, target_shares
from neatpack.pipes.mixtures.mixture_source import MixtureLayout
from neatpack.pipes.planning.balance import GRAPH_BALANCE, BalancePolicy

__all__ = ["cmd_plan_mixture", "load_mixture", "mixture_plan_report"]

SOURCE_KEYS = ("name", "data", "media_root", "weight", "samples")


def load_mixture(path: str | Path) -> Mixture:
    """A ``Mixture`` from a JSON file (format in the module doc)."""
    from neatpack.graphs.command.cli_inputs import UsageError

    where = Path(path)
    try:
        spec = json.loads(where.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read --mixture {str(where)!r}: {exc}") from exc
    if not isinstance(spec, dict) or not isinstance(spec.get("sources"), list):
        raise UsageError(f"--mixture {str(where)!r} needs {{'sources': [...]}}, got {spec!r:.80}")
    sources = []
    for i, entry in enumerate(spec["sources"]):
        bad = sorted(set(entry) - set(SOURCE_KEYS)) if isinstance(entry, dict) else entry
        if bad or not isinstance(entry, dict):
            raise UsageError(
                f"--mixture {str(where)!r} source {i}: unknown keys {bad}; valid: {SOURCE_KEYS}"
            )
        fields = dict(entry)
        for key in ("data", "media_root"):
            if fields.get(key) is not None:
                fields[key] = str(where.parent / str(fields[key]))
        try:
            sources.append(MixtureSource(**fields))
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--mixture {str(where)!r} source {i}: {exc}") from exc
    extra = {k: spec[k] for k in ("epoch_tokens", "single_source_packs") if k in spec}
    try:
        return Mixture(sources=sources, **extra)
    except ValueError as exc:
        raise UsageError(f"--mixture {str(where)!r}: {exc}") from exc


def mixture_plan_report(
    mix: Mixture,
    processor: Any,
    *,
    pack_size: int,
    world_size: int = 1,
    window_steps: int = 100,
    epoch: int = 0,
    seed: int = 0,
    estimate_mode: str = "exact",
    cache_dir: str | None = None,
    balance: BalancePolicy = GRAPH_BALANCE,
    max_visual: int | None = None,
    max_images: int | None = None,
    batch_size: int = 1,
) -> dict[str, Any]:
    """The report ``neatpack plan --mixture`` prints, as a dict (the plan with the graph's
    ``balance`` and ``max_visual_tokens`` / ``max_images`` budgets, as ``--balance`` /
    ``--max-visual-tokens`` / ``--max-images``; ``batch_size``: packs per rank per step, the
    step shape ``balance="cost"`` plans for, as the graph's, and a window's steps hold)."""
    from neatpack.graphs.open_data import open_source
    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.indexing.lengths import build_length_index
    from neatpack.pipes.indexing.supervised import supervised_estimator

    estimator = LengthEstimator.from_processor(processor, mode=estimate_mode)
    if balance == "supervised":  # counted only when asked
        estimator = supervised_estimator(estimator, processor)
    indexes = []
    for spec in mix.sources:
        source = open_source(spec.data, spec.media_root)
        indexes.append(build_length_index(source, estimator, cache_dir=cache_dir, progress=False))
    layout = MixtureLayout(
        names=mix.names, sizes=tuple(len(i) for i in indexes),
        total=np.concatenate([i.total for i in indexes]).astype(np.int64),
        visual=np.concatenate([i.visual for i in indexes]).astype(np.int64),
        capacity=pack_size, packing_ratio=1.0, overlong="drop", seed=seed,
        single_source=mix.single_source_packs, lengths_fingerprint="", balance=balance,
        max_visual=max_visual, max_images=max_images,
        images=None if max_images is None else np.concatenate(
            [i.require_images("--max-images") for i in indexes]
        ),
        supervised=None if balance != "supervised" else np.concatenate(
            [i.require_supervised("--balance supervised") for i in indexes]
        ).astype(np.int64),
        per_rank=batch_size,  # as the graph passes it (read under cost only)
    )  # fmt: skip
    blend = mix.blend()
    plan = layout.epoch_plan([(0, blend)], epoch, world_size)
    src = plan.source_of(plan.ids)
    planned = [int(layout.total[plan.ids][src == s].sum()) for s in range(len(mix.names))]
    target = target_shares(blend, planned)
    window = max(window_steps * world_size * batch_size, 1)
    shares = realized_shares(plan, layout.total, mix.names, target, window=window)
    uses = layout.targets(blend)
    rows = []
    for s, name in enumerate(mix.names):
        got = [w["shares"][s] for w in shares["windows"]] or [shares["epoch"][s]]
        rows.append({
            "source": name, "samples": layout.sizes[s], "uses": int(uses[s]),
            "repeat": round(int(uses[s]) / layout.sizes[s], 3), "target": target[s],
            "epoch": shares["epoch"][s], "window_min": min(got), "window_max": max(got),
        })  # fmt: skip
    return {
        "packs": len(plan),
        "epoch": epoch,
        "world_size": world_size,
        "batch_size": batch_size,
        "window_steps": window_steps,
        "window_packs": window,
        "worst_window_error": shares["worst"],
        "sources": rows,
        "windows": shares["windows"],
    }


def _text(path: str, r: dict[str, Any]) -> str:
    lines = [
        f"neatpack plan --mixture: {path} ({len(r['sources'])} sources, {r['packs']} packs, "
        f"epoch {r['epoch']}, windows of {r['window_steps']} steps = {r['window_packs']} packs)",
        f"  {'source':<12}{'samples':>9}{'uses/epoch':>12}{'x size':>8}{'target %':>10}"
        f"{'epoch %':>9}  window % (min..max)",
    ]
    lines.extend(
        f"  {row['source']:<12}{row['samples']:>9}{row['uses']:>12}{row['repeat']:>8.2f}"
        f"{100 * row['target']:>10.2f}{100 * row['epoch']:>9.2f}  "
        f"{100 * row['window_min']:.2f}..{100 * row['window_max']:.2f}"
        for row in r["sources"]
    )
    lines.append(f"  worst window error {100 * r['worst_window_error']:.2f} points")
    return "\n".join(lines)


def cmd_plan_mixture(args: argparse.Namespace) -> int:
    """``neatpack plan --mixture FILE``."""
    from neatpack.graphs.command.cli_inputs import UsageError, load_processor

    if args.data is not None:
        raise UsageError("pass either a data file or --mixture, not both")
    batch_size = getattr(args, "batch_size", 1)
    if args.world_size < 1 or args.window_steps < 1 or batch_size < 1:
        raise UsageError(f"--world-size {args.world_size}, --window-steps {args.window_steps} "
                         f"and --batch-size {batch_size} must be >= 1")  # fmt: skip
    mix = load_mixture(args.mixture)
    report = mixture_plan_report(
        mix, load_processor(args.processor), pack_size=args.pack_size,
        world_size=args.world_size, window_steps=args.window_steps, seed=args.seed,
        estimate_mode=args.estimate_mode, cache_dir=args.cache_dir,
        balance=getattr(args, "balance", GRAPH_BALANCE),
        max_visual=getattr(args, "max_visual_tokens", None),
        max_images=getattr(args, "max_images", None), batch_size=batch_size,
    )  # fmt: skip
    print(json.dumps(report, indent=2) if args.json else _text(args.mixture, report))
    return 0
