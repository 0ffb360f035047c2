"""How close the planner's vision pair term is to the exact one, per pack (#27 item 3).

The planner prices a pack's vision encoder from the length index: per sample its visual tokens
and (since the index counts them) its media items. The exact term is the sum over images of
patches squared (``pack_terms`` with each image's own patch count). Before the counts, a sample
counted as one image: ``visual^2``, which overstates a sample of ``n`` images up to ``n``
times; now its images are taken as equal: ``visual^2 / n``, exact for equal images and a lower
bound otherwise (``sum p_i^2 >= P^2 / n``).

On a ``write_corpus`` corpus (every record with ``images_meta``, so each image's visual tokens
are known exactly from the tiny Qwen2-VL processor's ``ImageTokenConfig``), planned at 2048
tokens: per pack with images, the ratio of each estimate to the exact term (median, p95, min,
max) and the Spearman rank correlation of each estimate with the exact term, for records of up
to 3 and up to 6 images.

    python benchmarks/bench_vision_pairs.py           # 2,000 records per corpus
    python benchmarks/bench_vision_pairs.py --quick   # 300
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _machine import machine  # benchmarks/ is on sys.path as the script's folder

from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.planning.cost import pack_terms
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

PACK = 2048


def _ratios(estimate: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    r = estimate / exact
    return {
        "median": round(float(np.median(r)), 4),
        "p95": round(float(np.percentile(r, 95)), 4),
        "min": round(float(r.min()), 4),
        "max": round(float(r.max()), 4),
    }


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return round(float(np.corrcoef(ra, rb)[0, 1]), 4)


def corpus_case(n: int, max_images: int, seed: int, estimator: LengthEstimator) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        data = write_corpus(root, num_samples=n, seed=seed, with_meta=1.0, max_images=max_images)
        source = JsonlSource(data, media_root=str(root / "media"))
        index = build_length_index(source, estimator, progress=False, num_workers=0)
        if estimator.image is None or index.images is None:
            raise RuntimeError("the tiny processor sizes images and a fresh index counts them")
        per = [
            [estimator.image.tokens(h, w) for h, w in json.loads(line).get("images_meta", [])]
            for line in data.read_text().splitlines()
        ]
    if [sum(p) for p in per] != np.asarray(index.visual).tolist():
        raise RuntimeError("the index's visual tokens are not the images' sums")
    image_offsets = np.concatenate([[0], np.cumsum([len(p) for p in per])])
    image_tokens = np.asarray([t for p in per for t in p], np.int64)
    plan = plan_packs(index.total, PACK, visual=index.visual)
    off, ids = np.asarray(plan.offsets), np.asarray(plan.ids)
    exact = pack_terms(off, ids, index.total, image_offsets=image_offsets,
                       image_patches=image_tokens)[:, 3]  # fmt: skip
    one = pack_terms(off, ids, index.total, index.visual, merge=1)[:, 3]
    split = pack_terms(off, ids, index.total, index.visual, merge=1, images=index.images)[:, 3]
    keep = exact > 0
    return {
        "samples": n,
        "multi_image_samples": int((np.asarray(index.images) > 1).sum()),
        "packs_with_images": int(keep.sum()),
        "one_image_per_sample_over_exact": _ratios(one[keep], exact[keep]),
        "equal_images_over_exact": _ratios(split[keep], exact[keep]),
        "spearman_vs_exact": {
            "one_image_per_sample": _spearman(one[keep], exact[keep]),
            "equal_images": _spearman(split[keep], exact[keep]),
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="300 records per corpus")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args(argv)
    n = 300 if args.quick else args.samples
    estimator = LengthEstimator.from_processor(load_tiny_processor(), mode="estimate")
    metrics = {f"up_to_{k}_images": corpus_case(n, k, args.seed, estimator) for k in (3, 6)}
    out = {
        "benchmark": "vision_pairs",
        "params": {
            "samples": n,
            "pack_size": PACK,
            "seed": args.seed,
            "quick": args.quick,
            "processor": "tiny qwen2_vl",
        },
        "metrics": metrics,
        "env": machine(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
