"""``neatpack plan`` and ``neatpack inspect``: what a plan and a batch look like, before training.

    neatpack plan data.jsonl --processor qwen2_vl --pack-size 4096 --world-size 8 --png plan.png
    neatpack inspect data.jsonl --processor qwen2_vl --pack-size 4096 --batch 3 --png batch.png

``plan`` builds (or reuses, with ``--cache-dir``) the length index and reports the plan:
packs against the lower bound, estimated utilization, overlong samples, estimator fallbacks
and the per-step imbalance across ranks. ``inspect`` builds the real loader
(``neat_vlm_graph``, no workers) and draws one batch: its documents, label coverage and mask.

The figures are pure functions (:func:`step_loads`, :func:`imbalance`, :func:`plan_report`,
:func:`batch_summary`); the commands only read, call and print.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from neatpack.graphs.command.cli_inputs import UsageError, load_processor, writable_path
from neatpack.pipes.indexing.lengths import LengthIndex
from neatpack.pipes.indexing.overlong import OverlongSummary, summarize_overlong
from neatpack.pipes.planning.balance import (
    BALANCE_POLICIES,
    COST_TERMS,
    GRAPH_BALANCE,
    imbalance,
    pack_cost_terms,
    pack_costs,
)
from neatpack.pipes.planning.binpack import OVERLONG_POLICIES, lower_bound
from neatpack.pipes.planning.plan import PackPlan

__all__ = [
    "add_report_commands",
    "batch_summary",
    "imbalance",
    "plan_report",
    "step_costs",
    "step_loads",
    "step_rows",
]

FIRST_IDS = 10  # ids listed for overlong samples and fallbacks
TEXT_STEPS = 16  # steps listed one per line in the text report (--json lists every step)
#: The cost terms reported per step (``pipes/planning/balance.py``).
STEP_COSTS = ("lm", "attention", "vision")
PICTURE_STEPS = 64  # steps drawn in the plan picture
MISSING_MEDIA = ("raise", "fallback")


def step_rows(plan: PackPlan, world_size: int, epoch: int = 0, batch_size: int = 1) -> Any:
    """The epoch's pack indices as ``[steps, batch_size, world_size]``, as the loader serves
    them: slot ``s`` of the epoch's order goes to rank ``s % W`` (``PackSource``) and each rank
    batches its next ``batch_size`` packs, so step ``k`` is the ``W x B`` slots from ``k*W*B``
    and rank ``r`` trains on slots ``k*W*B + j*W + r``, ``j < B`` (one pack of each of ``B``
    consecutive groups of ``W``). A short last step (the tail the source pads or drops) is
    left out.

    >>> class Plan:  # 10 packs served in order, 2 ranks x 2 packs per step: 2 steps, 2 left
    ...     def epoch_order(self, epoch): return np.arange(10)
    >>> step_rows(Plan(), 2, batch_size=2).tolist()  # rank 0 trains on packs 0 and 2
    [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    """
    if world_size < 1 or batch_size < 1:
        raise ValueError(
            f"{world_size=} and {batch_size=} must be >= 1 (ranks, and packs per rank per step)"
        )
    unit = world_size * batch_size
    order = np.asarray(plan.epoch_order(epoch))
    return order[: order.size // unit * unit].reshape(-1, batch_size, world_size)


def step_loads(
    plan: PackPlan, world_size: int, epoch: int = 0, batch_size: int = 1
) -> tuple[Any, Any]:
    """``(visual, total)`` tokens as ``[steps, world_size]``: each rank's ``batch_size`` packs
    of a step summed, steps and ranks as the loader serves them (:func:`step_rows`)."""
    rows = step_rows(plan, world_size, epoch, batch_size)
    return (
        np.asarray(plan.visual)[rows].sum(axis=1),
        np.asarray(plan.totals)[rows].sum(axis=1),
    )


def step_costs(
    plan: PackPlan,
    total: npt.ArrayLike,
    visual: npt.ArrayLike,
    world_size: int,
    epoch: int = 0,
    images: npt.ArrayLike | None = None,
    supervised: npt.ArrayLike | None = None,
    batch_size: int = 1,
) -> dict[str, npt.NDArray[np.float64]]:
    """Each cost term of ``STEP_COSTS`` as ``[steps, world_size]``, each rank's
    ``batch_size`` packs of a step summed (:func:`step_rows`, as the loader serves them):
    ``lm`` (linear + attention), ``attention`` (sum of squared document
    lengths), ``vision`` (patches + squared patches per image, a sample's ``images`` taken as
    equal), from per-sample lengths; and ``supervised`` (label tokens) when the per-sample
    counts are given (``LengthIndex.supervised``: an index that counts them)."""
    tot = np.asarray(total, np.int64)
    vis = np.zeros_like(tot) if visual is None else np.asarray(visual, np.int64)
    terms = pack_cost_terms(np.asarray(plan.offsets), np.asarray(plan.ids), tot, vis, images)
    lm, vision = pack_costs(terms)
    per_pack = {"lm": lm, "attention": terms[:, COST_TERMS.index("attention")], "vision": vision}
    if supervised is not None:
        labels = np.asarray(supervised, np.int64)[np.asarray(plan.ids)]
        starts = np.asarray(plan.offsets)[:-1]
        per_pack["supervised"] = (
            np.add.reduceat(labels, starts).astype(np.float64)
            if labels.size
            else np.zeros(len(plan), np.float64)
        )
    rows = step_rows(plan, world_size, epoch, batch_size)
    return {k: v[rows].sum(axis=1) for k, v in per_pack.items()}


def _quantiles(x: npt.NDArray[np.float64]) -> dict[str, float]:
    if x.size == 0:
        return {"p50": 1.0, "p95": 1.0, "max": 1.0}
    return {
        "p50": round(float(np.percentile(x, 50)), 4),
        "p95": round(float(np.percentile(x, 95)), 4),
        "max": round(float(x.max()), 4),
    }


def _stats(x: npt.NDArray[np.float64]) -> dict[str, float]:
    if x.size == 0:
        return {"mean": 1.0, "p95": 1.0, "max": 1.0}
    return {
        "mean": round(float(x.mean()), 4),
        "p95": round(float(np.percentile(x, 95)), 4),
        "max": round(float(x.max()), 4),
    }


def plan_report(
    index: LengthIndex, plan: PackPlan, *, world_size: int, batch_size: int = 1
) -> dict[str, Any]:
    """The figures of ``neatpack plan`` (plain JSON-able values). A step is ``world_size``
    ranks of ``batch_size`` packs each (the graph's ``batch_size``), its per-rank loads and
    costs each rank's packs summed as the loader serves them (:func:`step_rows`).

    ``lower_bound`` is for the samples the plan kept, at the planning capacity
    (``pack_size x packing_ratio``; longer samples get a pack alone, as the planner does).
    ``estimated_utilization`` = sum of pack totals / (packs x pack size).
    """
    total = np.asarray(index.total, np.int64)
    keep = np.ones(total.size, bool)
    keep[np.asarray(plan.dropped_ids, np.int64)] = False
    cap = max(int(plan.capacity * plan.packing_ratio), 1)
    bound = lower_bound(np.minimum(total[keep], cap), cap)
    vis, tot = step_loads(plan, world_size, batch_size=batch_size)
    costs = step_costs(plan, total, index.visual, world_size, images=index.images,
                       supervised=index.supervised, batch_size=batch_size)  # fmt: skip
    packs = len(plan)
    fill = np.asarray(plan.totals, float) / plan.capacity * 100.0
    fallback_ids = np.asarray(index.fallback_ids, np.int64)
    return {
        "samples": int(total.size),
        "packs": packs,
        "lower_bound": int(bound),
        "pack_size": int(plan.capacity),
        "planning_capacity": cap,
        "world_size": int(world_size),
        "batch_size": int(batch_size),
        "steps": int(vis.shape[0]),
        "tail_packs": packs - int(vis.size) * int(batch_size),
        "estimated_tokens": int(np.asarray(plan.totals).sum()),
        "estimated_utilization": round(
            float(np.asarray(plan.totals).sum()) / max(packs * plan.capacity, 1), 4
        ),
        "fill_pct": {
            "min": round(float(fill.min()), 2) if packs else 0.0,
            "mean": round(float(fill.mean()), 2) if packs else 0.0,
            "max": round(float(fill.max()), 2) if packs else 0.0,
        },
        "overlong": {
            "count": int(plan.dropped_ids.size),
            "first_ids": [int(i) for i in plan.dropped_ids[:FIRST_IDS]],
        },
        "fallbacks": {
            "count": int(fallback_ids.size),
            "first_ids": [int(i) for i in fallback_ids[:FIRST_IDS]],
            "reasons": dict(index.fallback_counts),
        },
        "imbalance": {"visual": _stats(imbalance(vis)), "total": _stats(imbalance(tot))},
        "balance": plan.balance,
        "step_cost": {k: _quantiles(imbalance(v)) for k, v in costs.items()},
        "per_step_cost": {k: [round(float(x), 4) for x in imbalance(v)] for k, v in costs.items()},
        "fingerprint": plan.fingerprint,
    }


def batch_summary(batch: dict[str, Any]) -> dict[str, Any]:
    """Rows, documents per row, sample ids and label coverage of one collated batch.

    Coverage is the share of real (non-padding) tokens whose label is not -100.
    """
    docs = np.asarray(batch["doc_ids"], np.int64)
    labelled = (np.asarray(batch["labels"], np.int64) != -100) & (docs > 0)
    real = (docs > 0).sum(axis=1)
    return {
        "rows": int(docs.shape[0]),
        "sequence_length": int(docs.shape[1]),
        "documents_per_row": [int(r.max(initial=0)) for r in docs],
        "sample_ids": [[int(i) for i in row] for row in batch["sample_ids"]],
        "real_tokens_per_row": [int(r) for r in real],
        "label_coverage_per_row": [
            round(float(c) / max(int(r), 1), 4)
            for c, r in zip(labelled.sum(axis=1), real, strict=True)
        ],
        "label_coverage": round(float(labelled.sum()) / max(int(real.sum()), 1), 4),
    }


# -- the commands ---------------------------------------------------------------------------


@contextmanager
def _output(path: str | None) -> Iterator[Path | None]:
    """Check ``path`` is writable up front; remove the empty file it leaves if we fail."""
    if path is None:
        yield None
        return
    existed = os.path.exists(path)
    out = writable_path(path)
    try:
        yield out
    except BaseException:
        if not existed and out.exists() and out.stat().st_size == 0:
            out.unlink()
        raise


def _check_common(args: argparse.Namespace) -> None:
    if args.data is None:
        raise UsageError("pass a data file (.jsonl or .json), or --mixture FILE to plan")
    if not Path(args.data).is_file():
        raise UsageError(f"data file {args.data!r} does not exist: pass a .jsonl or .json file")
    if args.pack_size < 2:
        raise UsageError(f"--pack-size {args.pack_size} is too small: pass at least 2 tokens")
    if args.media_root is not None and not Path(args.media_root).is_dir():
        raise UsageError(f"--media-root {args.media_root!r} is not a folder")
    if args.cache_dir is not None:
        try:
            Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"cannot create --cache-dir {args.cache_dir!r}: {exc.strerror}"
            ) from exc
        if not os.access(args.cache_dir, os.W_OK):
            raise UsageError(f"--cache-dir {args.cache_dir!r} is not writable: pass another folder")


def _length_index(
    args: argparse.Namespace, processor: Any, missing: str | None = None
) -> tuple[LengthIndex, bool]:
    """Build (or reuse from ``--cache-dir``) the data's length index; ``True`` if reused."""
    from neatpack.graphs.open_data import open_source
    from neatpack.pipes.families import get_handler
    from neatpack.pipes.indexing.handler_lengths import handler_estimator
    from neatpack.pipes.indexing.lengths import build_length_index
    from neatpack.pipes.indexing.supervised import supervised_estimator
    from neatpack.pipes.reading.read import RecordError

    error = ""
    try:
        source = open_source(args.data, args.media_root)
        fix = f"(relative media paths resolve against --media-root={args.media_root!r})"
        # the processor's family estimates (Qwen-VL: LengthEstimator, which takes the options)
        estimator = handler_estimator(
            processor, get_handler(processor), getattr(args, "estimate_mode", "exact"),
            source=source, on_missing_media=missing or "raise",
            missing_media_fix=fix + (", or pass --missing-media fallback to count it (plan)"
                                     if missing else ""),
        )  # fmt: skip
        if getattr(args, "balance", "tokens") == "supervised":  # counted only when asked
            try:
                estimator = supervised_estimator(estimator, processor)
            except ValueError as exc:
                raise UsageError(f"--balance supervised: {exc}") from exc
        before = set(os.listdir(args.cache_dir)) if args.cache_dir and os.path.isdir(
            args.cache_dir) else set()  # fmt: skip
        index = build_length_index(source, estimator, cache_dir=args.cache_dir, progress=True)
    except (RecordError, json.JSONDecodeError) as exc:
        error = _line(exc)
    if error:
        # Raised outside the except block so the failed build's frames (and its open progress
        # bar) are freed first: the bar ends its line and the error gets a line of its own.
        gc.collect()
        raise UsageError(error)
    return index, f"{index.fingerprint}.npz" in before


def _line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _check_overlong(
    index: LengthIndex, pack_size: int, overlong: str, args: argparse.Namespace
) -> OverlongSummary:
    """The graph's summary of the samples longer than the pack (by modality, with the fixes):
    a usage error under ``--overlong raise``, printed with the report under ``drop``."""
    from neatpack.graphs.open_data import open_source

    total = np.asarray(index.total)
    source = open_source(args.data, args.media_root) if (total > pack_size).any() else None
    summary = summarize_overlong(total, index.visual, pack_size, source)
    if overlong == "raise" and summary.count:
        text = summary.message("raise").replace("overlong='drop'", "--overlong drop")
        text = text.replace("pack_size", "--pack-size")
        raise UsageError(" ".join(line.strip() for line in text.splitlines()))  # one line
    return summary


def cmd_plan(args: argparse.Namespace) -> int:
    """``neatpack plan``: build the length index and the plan, print the report."""
    from neatpack.pipes.planning.plan import plan_packs

    if getattr(args, "mixture", None):  # several weighted sources (#16)
        from neatpack.graphs.command.mixture_cli import cmd_plan_mixture

        rc: int = cmd_plan_mixture(args)
        return rc
    _check_common(args)
    if args.world_size < 1:
        raise UsageError(f"--world-size {args.world_size} must be >= 1")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} must be >= 1 (packs per rank per step)")
    if not 0.0 < args.packing_ratio <= 1.0:
        raise UsageError(f"--packing-ratio {args.packing_ratio} must be in (0, 1]")
    budget = getattr(args, "max_visual_tokens", None)
    if budget is not None and budget < 1:
        raise UsageError(f"--max-visual-tokens {budget} must be >= 1 (visual tokens per pack)")
    max_images = getattr(args, "max_images", None)
    if max_images is not None and max_images < 1:
        raise UsageError(f"--max-images {max_images} must be >= 1 (media items per pack)")
    with _output(args.png) as png:
        processor = load_processor(args.processor)
        index, reused = _length_index(args, processor, args.missing_media)
        overlong = _check_overlong(index, args.pack_size, args.overlong, args)
        over = np.flatnonzero(np.asarray(index.visual) > (budget or np.inf))
        if over.size and args.overlong == "raise":
            raise UsageError(
                f"{over.size} sample(s) over --max-visual-tokens {budget} on their own: samples "
                f"{over[:FIRST_IDS].tolist()}; raise it, or pass --overlong drop to leave them out"
            )
        images = index.images
        if max_images is not None:
            try:
                images = index.require_images("--max-images")
            except ValueError as e:
                raise UsageError(str(e)) from e
            many = np.flatnonzero(np.asarray(images) > max_images)
            if many.size and args.overlong == "raise":
                raise UsageError(
                    f"{many.size} sample(s) over --max-images {max_images} on their own: samples "
                    f"{many[:FIRST_IDS].tolist()}; raise it, or pass --overlong drop to leave "
                    "them out"
                )
        plan = plan_packs(
            index.total, args.pack_size, visual=index.visual, packing_ratio=args.packing_ratio,
            overlong=args.overlong, world_size=args.world_size, seed=args.seed,
            balance=args.balance, max_visual=budget, images=images, max_images=max_images,
            supervised=index.supervised,
            per_rank=args.batch_size,  # as the graphs pass it (read under cost only)
        )  # fmt: skip
        report = {
            "data": str(args.data),
            **plan_report(index, plan, world_size=args.world_size, batch_size=args.batch_size),
        }
        report["visual_per_pack"] = {  # the second budget (#27): its limit and the largest pack
            "max_visual_tokens": budget,
            "max": int(plan.visual.max()) if len(plan) else 0,
        }
        report["images_per_pack"] = {  # the third budget: media items (None: index has none)
            "max_images": max_images,
            "max": _max_items(plan, images),
        }
        report["length_index_reused"] = reused
        report["overlong"].update(overlong.as_dict())
        if overlong.count:
            report["overlong"]["message"] = overlong.message(args.overlong)
        if png is not None:
            from neatpack.graphs.command.pictures import plan_picture

            vis, tot = step_loads(plan, args.world_size, batch_size=args.batch_size)
            title = (f"{Path(args.data).name}: {len(plan)} packs of {args.pack_size} tokens, "
                     f"{args.world_size} rank(s) x {args.batch_size} pack(s), epoch 0")  # fmt: skip
            img = plan_picture(
                np.asarray(plan.totals) / args.pack_size * 100.0,
                vis[:PICTURE_STEPS], tot[:PICTURE_STEPS], title=title,
                step_cost={
                    k: imbalance(v[:PICTURE_STEPS])
                    for k, v in step_costs(
                        plan, index.total, index.visual, args.world_size, images=images,
                        supervised=index.supervised, batch_size=args.batch_size,
                    ).items()
                },
            )  # fmt: skip
            img.save(png, format="PNG")
            report["png"] = {"path": str(png), "width": img.width, "height": img.height}
    print(json.dumps(report, indent=2) if args.json else _plan_text(report))
    return 0


def _max_items(plan: PackPlan, images: npt.ArrayLike | None) -> int | None:
    """The most media items in one pack of ``plan`` (None: the counts are unknown)."""
    if images is None:
        return None
    if not len(plan):
        return 0
    per_sample = np.asarray(images, np.int64)[np.asarray(plan.ids)]
    return int(np.add.reduceat(per_sample, np.asarray(plan.offsets)[:-1]).max())


def _plan_text(r: dict[str, Any]) -> str:
    def imb(k: str) -> str:
        s = r["imbalance"][k]
        return f"mean {s['mean']:.3f}  p95 {s['p95']:.3f}  max {s['max']:.3f}"

    lines = [
        f"neatpack plan: {r['data']}",
        f"  samples             {r['samples']}",
        f"  packs               {r['packs']} (lower bound {r['lower_bound']})",
        f"  pack size           {r['pack_size']} (planning capacity {r['planning_capacity']})",
        f"  est. utilization    {100 * r['estimated_utilization']:.1f} % "
        f"(fill min {r['fill_pct']['min']} %, max {r['fill_pct']['max']} %)",
        f"  steps               {r['steps']} of {r['world_size']} rank(s) x "
        f"{r['batch_size']} pack(s), {r['tail_packs']} tail pack(s)",
        f"  overlong samples    {r['overlong']['count']} {r['overlong']['first_ids'] or ''}",
        *(
            ("    " + line for line in r["overlong"]["message"].splitlines())
            if "message" in r["overlong"]
            else ()
        ),
        f"  estimator fallbacks {r['fallbacks']['count']} {r['fallbacks']['first_ids'] or ''}"
        f"{' ' + str(r['fallbacks']['reasons']) if r['fallbacks']['reasons'] else ''}",
        f"  step imbalance      visual max/mean: {imb('visual')}",
        f"                      total  max/mean: {imb('total')}",
        f"  step balance        on {r['balance']}; cost max/mean over ranks (p50 p95 max):",
        *(
            f"    {k:<9} {q['p50']:.3f} {q['p95']:.3f} {q['max']:.3f}"
            for k, q in r["step_cost"].items()
        ),
        f"  per step            {'  '.join(f'{k:>9}' for k in r['per_step_cost'])}",
        *(
            f"    step {s:<5}       "
            + "  ".join(f"{r['per_step_cost'][k][s]:>9.3f}" for k in r["per_step_cost"])
            for s in range(min(TEXT_STEPS, r["steps"]))
        ),
        *(
            (f"    ... {r['steps'] - TEXT_STEPS} more step(s) (--json lists every step)",)
            if r["steps"] > TEXT_STEPS
            else ()
        ),
        f"  visual per pack     max {r['visual_per_pack']['max']}"
        f" (budget {r['visual_per_pack']['max_visual_tokens'] or 'none'})",
        f"  images per pack     max {r['images_per_pack']['max']}"
        f" (budget {r['images_per_pack']['max_images'] or 'none'})",
        f"  length index        {'reused from cache' if r['length_index_reused'] else 'built'}",
    ]
    if "png" in r:
        lines.append(f"  picture             {r['png']['path']} "
                     f"({r['png']['width']} x {r['png']['height']})")  # fmt: skip
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``neatpack inspect``: build the loader, take batch K, draw it and print a summary."""
    from neatpack.graphs.command.pictures import batch_picture
    from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
    from neatpack.pipes.reading.read import RecordError

    _check_common(args)
    if args.batch < 0 or args.batch_size < 1 or args.mask_max_side < 1:
        raise UsageError(
            f"--batch {args.batch} must be >= 0, --batch-size {args.batch_size} and "
            f"--mask-max-side {args.mask_max_side} >= 1"
        )
    with _output(args.png) as png:
        if png is None:
            raise UsageError("--png FILE is required: where to write the picture")
        processor = load_processor(args.processor)
        index, _ = _length_index(args, processor)
        _check_overlong(index, args.pack_size, args.overlong, args)
        if not np.any(np.asarray(index.total) <= args.pack_size):
            raise UsageError(
                f"nothing to inspect: {args.data!r} has {len(index)} sample(s), none within "
                f"--pack-size {args.pack_size}; pass a file with samples or a larger --pack-size"
            )
        config = NeatVLMConfig(
            pack_size=args.pack_size, batch_size=args.batch_size, media_root=args.media_root,
            cache_dir=args.cache_dir, seed=args.seed, overlong=args.overlong, num_workers=0,
            prefetch=0, attn_implementation="sdpa", estimate_mode=args.estimate_mode,
        )  # fmt: skip
        loader = neat_vlm_graph(args.data, processor, config=config, lengths=index)
        try:
            seen = list(islice(iter(loader), args.batch + 1))
        except RecordError as exc:
            raise UsageError(f"{_line(exc)} (media paths resolve against --media-root)") from exc
        if len(seen) <= args.batch:
            raise UsageError(
                f"--batch {args.batch} is past the end: epoch 0 has {len(seen)} batch(es) of "
                f"{args.batch_size} pack(s); pass --batch 0..{len(seen) - 1}"
            )
        batch = seen[args.batch]
        summary = {"data": str(args.data), "batch": args.batch, **batch_summary(batch)}
        mask = batch["attention_mask"]
        img, layout = batch_picture(
            batch["doc_ids"], batch["labels"], batch["sample_ids"], mask[0, 0].numpy(),
            max_side=args.mask_max_side,
            title=f"{Path(args.data).name}: batch {args.batch}, {summary['rows']} row(s) x "
            f"{summary['sequence_length']} tokens",
        )  # fmt: skip
        img.save(png, format="PNG")
    summary["png"] = {"path": str(png), "width": img.width, "height": img.height}
    summary["layout"] = {
        "factor": layout.factor,
        "mask_of_row_0": list(layout.mask),
        "bands": [list(b) for b in layout.bands],
        "strips": [list(b) for b in layout.strips],
    }
    print(json.dumps(summary, indent=2) if args.json else _inspect_text(summary))
    return 0


def _inspect_text(s: dict[str, Any]) -> str:
    rows = [
        f"  row {r}: {d} document(s) {ids}, {n} real tokens, label coverage {100 * c:.1f} %"
        for r, (d, ids, n, c) in enumerate(zip(
            s["documents_per_row"], s["sample_ids"], s["real_tokens_per_row"],
            s["label_coverage_per_row"], strict=True))
    ]  # fmt: skip
    return "\n".join([
        f"neatpack inspect: {s['data']}, batch {s['batch']}: {s['rows']} row(s) x "
        f"{s['sequence_length']} tokens",
        *rows,
        f"  label coverage {100 * s['label_coverage']:.1f} % of real tokens",
        f"  picture {s['png']['path']} ({s['png']['width']} x {s['png']['height']}), mask of "
        f"row 0 at {s['layout']['mask_of_row_0']} (1 px = {s['layout']['factor']} token(s))",
    ])  # fmt: skip


def _common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", nargs="?", help="a .jsonl or .json file of conversations")
    p.add_argument(
        "--processor",
        required=True,
        help="embedded tiny processor name (qwen2_vl, ...) or a saved processor folder",
    )
    p.add_argument("--pack-size", type=int, required=True, help="tokens per pack")
    p.add_argument("--media-root", help="folder that relative media paths resolve against")
    p.add_argument("--cache-dir", help="keep the length index here and reuse it next time")
    p.add_argument(
        "--overlong",
        choices=OVERLONG_POLICIES,
        default="raise",
        help="a sample longer than the pack: raise (default) or drop (counted)",
    )
    p.add_argument(
        "--estimate-mode",
        choices=("exact", "estimate"),
        default="exact",
        help="length index: exact (default, as the graph: real lengths) or estimate (faster)",
    )
    p.add_argument("--seed", type=int, default=0, help="plan seed (epoch order)")
    p.add_argument("--json", action="store_true", help="print one JSON object")  # fmt: skip


def add_report_commands(sub: Any) -> None:
    """Register ``plan`` and ``inspect`` on the ``neatpack`` subparsers object."""
    plan = sub.add_parser("plan", help="report the pack plan: utilization, overlong, balance")
    _common_arguments(plan)
    plan.add_argument("--world-size", type=int, default=1, help="ranks the plan is grouped for")
    plan.add_argument(
        "--packing-ratio",
        type=float,
        default=1.0,
        help="plan to this share of the pack size (headroom for estimate error)",
    )
    plan.add_argument(
        "--max-visual-tokens",
        type=int,
        default=None,
        help="a second budget per pack: at most this many image and video tokens",
    )
    plan.add_argument(
        "--max-images",
        type=int,
        default=None,
        help="a third budget per pack: at most this many media items (images and video clips)",
    )
    plan.add_argument(
        "--missing-media",
        choices=MISSING_MEDIA,
        default="raise",
        help="a media file that cannot be read: raise, or fallback (counted)",
    )
    plan.add_argument(
        "--balance",
        choices=BALANCE_POLICIES,
        default=GRAPH_BALANCE,
        help="what the ranks of a step are made alike on: cost (the default, as the graphs: "
        "attention and vision-encoder work), tokens, the language model's cost alone (lm), "
        "the vision encoder's alone (vision), or the supervised (label) tokens (supervised: "
        "the length index then counts them)",
    )
    plan.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="packs per rank per step (the graph's batch_size): --balance cost makes its step "
        "groups for it, so the plan printed is the one the loader trains on",
    )
    plan.add_argument("--png", help="write a picture of pack fill and per-step balance")
    plan.add_argument(
        "--mixture", help="a mixture JSON (graphs/command/mixture_cli.py) instead of data"
    )
    plan.add_argument("--window-steps", type=int, default=100, help="mixture: steps per window")
    plan.set_defaults(func=cmd_plan)
    inspect = sub.add_parser("inspect", help="draw one batch: documents, labels, mask")
    _common_arguments(inspect)
    inspect.add_argument("--batch", type=int, default=0, help="which batch of epoch 0 (from 0)")
    inspect.add_argument("--batch-size", type=int, default=2, help="packs per batch")
    inspect.add_argument(
        "--mask-max-side",
        type=int,
        default=1024,
        help="downsample the mask by an integer factor to fit this many pixels",
    )
    inspect.add_argument("--png", required=True, help="where to write the picture")
    inspect.set_defaults(func=cmd_inspect)
