"""The ``neatpack`` command: ``demo``, ``plan`` and ``inspect``.

Errors a user can fix (a missing file, a bad processor path, a pack size too small) print one
line saying what to do and exit with code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from neatpack.graphs.command.cli_inputs import UsageError, load_processor

__all__ = ["UsageError", "main"]


def cmd_demo(args: argparse.Namespace) -> int:
    """Generate data, load the embedded processor, iterate, checkpoint, resume, compare."""
    from tqdm import tqdm

    from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
    from neatpack.pipes.testing.resume import same_item
    from neatpack.pipes.testing.synth import write_corpus

    for flag, value, least in (
        ("--samples", args.samples, 1),
        ("--pack-size", args.pack_size, 2),
        ("--batch-size", args.batch_size, 1),
        ("--workers", args.workers, 0),
    ):
        if value < least:  # 0 samples planned no packs and ended in the source's traceback
            raise UsageError(f"{flag} {value} is too small: pass at least {least}")
    processor = load_processor(args.processor)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="neatpack-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    data = write_corpus(root, num_samples=args.samples, seed=args.seed)
    # a choice the config or the plan refuses (--attn: the config checks it against the
    # collate's MASK_FORMATS; a pack too small) is one line too
    try:
        config = NeatVLMConfig(
            pack_size=args.pack_size,
            batch_size=args.batch_size,
            media_root=str(root / "media"),
            cache_dir=str(root / "cache"),
            num_workers=args.workers,
            seed=args.seed,
            attn_implementation=args.attn,
        )
        loader = neat_vlm_graph(data, processor, config=config)
    except ValueError as exc:
        raise UsageError(" ".join(str(exc).split())) from exc
    print(
        f"neatpack demo: {args.samples} conversations in {root}, pack size {args.pack_size}, "
        f"{args.workers} worker(s)"
    )
    t0 = time.perf_counter()
    batches = list(
        tqdm(loader, desc="epoch 0", unit="batch", total=len(loader), disable=args.quiet)
    )
    elapsed = time.perf_counter() - t0
    checks: dict[str, bool] = {}
    ledger = loader.ledgers[0]
    checks["every sample consumed once"] = sorted(ledger.consumed) == list(range(args.samples))
    # Checkpoint in the middle of the next epoch, resume in a fresh loader, compare.
    mid = max(len(batches) // 2, 1)
    reference = neat_vlm_graph(data, processor, config=config)
    list(reference)
    it = iter(reference)
    for _ in range(mid):
        next(it)
    state = reference.state_dict()
    rest_ref = list(it)
    resumed = neat_vlm_graph(data, processor, config=config)
    resumed.load_state_dict(state)
    rest = list(resumed)
    checks["resume mid-epoch gives identical batches"] = same_item(
        [_comparable(b) for b in rest], [_comparable(b) for b in rest_ref]
    )
    stats = loader.stats
    summary = {
        "samples": args.samples,
        "packs": stats.packs,
        "batches": stats.batches,
        "utilization_real_tokens": round(stats.utilization(), 4),
        "estimate_error": {k: round(v, 4) for k, v in stats.estimate_error().items()},
        "step_balance_2_ranks": _balance(loader, world_size=2, batch_size=args.batch_size),
        "batches_per_s": round(stats.batches / elapsed, 2) if elapsed > 0 else None,
        "resumed_at_batch": mid,
        "checks": checks,
    }
    print(json.dumps(summary, indent=2))
    ok = all(checks.values())
    print("demo OK" if ok else "demo FAILED: " + ", ".join(k for k, v in checks.items() if not v))
    return 0 if ok else 1


def _comparable(batch: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k != "packs"} | {
        "ids": [m["sample_ids"] for m in batch["packs"]]
    }


def _balance(loader: Any, world_size: int = 2, batch_size: int = 1) -> dict[str, float]:
    """Mean over steps of the slowest rank's cost over the mean rank's, per cost column
    (attention, vision encoder, the whole step: ``graphs/runtime/step_cost.py``).

    Computed on the epoch-0 plan for ``world_size`` ranks of ``batch_size`` packs each, with
    the config's balance (cost by default): what a run on that many GPUs would see (1.0 is
    even; a step waits for its slowest rank).
    """
    import numpy as np

    from neatpack.graphs.command.report import step_rows

    plan = loader.source.plan_for(world_size)
    ratios: dict[str, list[float]] = {}
    for packs in step_rows(plan, world_size, 0, batch_size):  # each step's [B, W] packs
        for column, (peak, mean) in loader.step_cost.pack_loads(plan, packs).items():
            ratios.setdefault(column, []).append(peak / mean if mean > 0 else 1.0)
    return {c: round(float(np.mean(r)), 4) for c, r in ratios.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neatpack", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the whole graph on generated data (no download)")
    demo.add_argument("--dir", help="where to write the generated data (default: a temp dir)")
    demo.add_argument("--samples", type=int, default=96)
    demo.add_argument("--pack-size", type=int, default=2048)
    demo.add_argument("--batch-size", type=int, default=2)
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--attn", default="sdpa", help="mask format / attention implementation")
    demo.add_argument(
        "--processor",
        default="qwen2_vl",
        help="embedded tiny processor name or a saved processor directory",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(func=cmd_demo)
    from neatpack.graphs.command.report import add_report_commands

    add_report_commands(sub)
    return parser


def _version() -> str:
    """The installed distribution's version (pyproject.toml's ``version``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("neatpack")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"neatpack {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # UsageError lives in cli_inputs, so this __main__ copy catches the class report.py raises.
    sys.exit(main())
