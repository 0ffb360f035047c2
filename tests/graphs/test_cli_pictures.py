"""Issue 18 item 10: ``neatpack plan --png`` on corpora the CLI did not generate itself.

Before the fix a 10,000-record corpus of images, videos and text crashed the picture with
``ValueError: y1 must be greater than or equal to y0`` (``pictures._bar_panel``): a histogram
bin holding a few packs next to one holding thousands is under a pixel tall, and PIL refuses
the inverted rectangle. Each case runs the command (``main``), then reads the PNG back and
checks every panel against the plan recomputed from the library's own pieces: every non-empty
bin / (step, rank) load has a bar of at least one pixel, every empty one has none.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from neatpack.graphs.command.cli import main
from neatpack.graphs.command.pictures import (
    _LEFT,
    _RIGHT,
    COST_PANEL,
    PLAN_SIZE,
    RANK_COLORS,
    WHITE,
)
from neatpack.graphs.command.report import PICTURE_STEPS, step_loads
from neatpack.graphs.open_data import open_source
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.testing.tiny import load_tiny_processor

WORDS = ("cat", "dog", "tree", "sky", "blue", "chart", "page", "road")


def write_records(path: Path, n: int, *, seed: int = 0, long_every: int = 0,
                  text_only: bool = False) -> Path:  # fmt: skip
    """``n`` records as a user's corpus: images / videos with their metadata (no files: the
    estimate reads ``images_meta`` / ``videos_meta``), text, and every ``long_every``-th record
    far longer than any pack."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        kind = 1.0 if text_only else rng.random()
        user: list[dict[str, Any]] = []
        rec: dict[str, Any] = {"id": f"user-{i}"}
        if kind < 0.4:
            metas = []
            for j in range(rng.randint(1, 3)):
                user.append({"type": "image", "image": f"img_{i}_{j}.png"})
                metas.append([rng.randint(28, 1500), rng.randint(28, 1500)])
            rec["images_meta"] = metas
        elif kind < 0.6:
            user.append({"type": "video", "video": f"vid_{i}.mp4"})
            frames = rng.randint(4, 32)
            rec["videos_meta"] = [[frames, rng.randint(64, 360), rng.randint(64, 480), 2.0,
                                   frames / 2.0]]  # fmt: skip
        words = 6000 if long_every and i % long_every == 0 else rng.randint(3, 300)
        user.append({"type": "text", "text": " ".join(rng.choice(WORDS) for _ in range(words))})
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 100)))
        rec["messages"] = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def plan_png(capsys: pytest.CaptureFixture[str], data: Path, out: Path, pack: int, world: int,
             *extra: str) -> dict[str, Any]:  # fmt: skip
    rc = main(["plan", str(data), "--processor", "qwen2_vl", "--pack-size", str(pack),
               "--world-size", str(world), "--json", "--png", str(out),
               "--estimate-mode", "estimate", *extra])  # fmt: skip
    got, err = capsys.readouterr()
    assert "Traceback" not in err
    assert rc == 0, err
    report: dict[str, Any] = json.loads(got)
    return report


def expected_plan(data: Path, pack: int, world: int, overlong: str = "raise") -> Any:
    index = build_length_index(
        open_source(data, None), LengthEstimator.from_processor(load_tiny_processor()),
        progress=False,
    )  # fmt: skip
    # the CLI's defaults: the graphs' balance (cost), planned for one pack per rank
    return plan_packs(index.total, pack, visual=index.visual, images=index.images,
                      overlong=overlong, world_size=world, seed=0, balance="cost",
                      per_rank=1)  # fmt: skip


def check_panel(img: Image.Image, box: tuple[int, int, int, int], values: Any) -> None:
    """``values[g, k] > 0`` <=> bar ``k`` of group ``g`` is drawn (>= 1 px at the bottom row),
    the geometry of ``pictures._bar_panel``; ``g == 0`` or all zero: no bar at all."""
    left, top, right, bottom = box
    v = np.asarray(values, float)
    region = np.asarray(img.convert("RGB"))[top:bottom, left + 1 : right]
    colored = {tuple(int(c) for c in px) for row in region for px in row} - {WHITE}
    if v.size == 0 or v.max() <= 0:
        assert not colored & set(RANK_COLORS), "bars drawn for an empty panel"
        return
    g, k = v.shape
    slot = (right - left - 2) / g
    bar = max(1.0, slot / (k + 1))
    px = img.convert("RGB").load()
    assert px is not None
    for i in range(g):
        for j in range(k):
            x = math.floor(left + 1 + i * slot + j * bar)
            bottom_px = px[x, bottom - 1]
            if v[i, j] > 0:
                assert bottom_px == RANK_COLORS[j % len(RANK_COLORS)], (i, j, v[i, j], bottom_px)
            else:
                assert bottom_px == WHITE, (i, j, bottom_px)
    # the largest value reaches the top of the panel
    i, j = np.unravel_index(int(np.argmax(v)), v.shape)
    x = math.floor(left + 1 + i * slot + j * bar)
    assert px[x, top + 1] == RANK_COLORS[j % len(RANK_COLORS)]


def check_picture(png: Path, plan: Any, pack: int, world: int, batch_size: int = 1) -> None:
    with Image.open(png) as img:
        assert img.format == "PNG"
        assert img.size == PLAN_SIZE
        img.load()
        right = PLAN_SIZE[0] - _RIGHT
        fill = np.clip(np.asarray(plan.totals, float) / pack * 100.0, 0.0, 100.0)
        counts, _ = np.histogram(fill, bins=20, range=(0.0, 100.0))
        check_panel(img, (_LEFT + 10, 70, right, 250), counts[:, None])
        vis, tot = step_loads(plan, world, batch_size=batch_size)
        check_panel(img, (_LEFT + 10, 320, right, 490), vis[:PICTURE_STEPS])
        check_panel(img, (_LEFT + 10, 545, right, 715), tot[:PICTURE_STEPS])


@pytest.fixture(scope="module")
def corpus_10k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_records(tmp_path_factory.mktemp("c10k") / "data.jsonl", 10_000)


@pytest.mark.parametrize("world", [1, 8])
def test_plan_png_10k_images_videos_text(
    corpus_10k: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], world: int
) -> None:
    png = tmp_path / "plan.png"
    report = plan_png(capsys, corpus_10k, png, 8192, world)
    plan = expected_plan(corpus_10k, 8192, world)
    assert report["packs"] == len(plan)
    fill = np.asarray(plan.totals) / 8192 * 100
    counts, _ = np.histogram(fill, bins=20, range=(0.0, 100.0))
    assert (counts == 0).any()  # empty bins
    if world == 1:  # best fit's last packs are part-filled (cost's made groups at 8: none)
        assert ((counts > 0) & (counts < counts.max() / 180)).any()  # a bin under a pixel tall
    check_picture(png, plan, 8192, world)


def test_plan_png_one_pack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_records(tmp_path / "one.jsonl", 1, text_only=True)
    for world in (1, 4):  # 4 ranks and one pack: no whole step to draw
        png = tmp_path / f"one_{world}.png"
        report = plan_png(capsys, data, png, 4096, world)
        assert report["packs"] == 1
        assert report["steps"] == (1 if world == 1 else 0)
        check_picture(png, expected_plan(data, 4096, world), 4096, world)


def test_plan_png_overlong_dropped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_records(tmp_path / "long.jsonl", 3000, long_every=7, seed=3)
    png = tmp_path / "long.png"
    report = plan_png(capsys, data, png, 4096, 8, "--overlong", "drop")
    plan = expected_plan(data, 4096, 8, overlong="drop")
    assert report["overlong"]["count"] == plan.dropped_ids.size > 0
    assert report["overlong"]["first_ids"][:3] == [0, 7, 14]
    check_picture(png, plan, 4096, 8)


def test_plan_png_100k_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_records(tmp_path / "big.jsonl", 100_000, seed=11)
    png = tmp_path / "big.png"
    report = plan_png(capsys, data, png, 16384, 8)
    plan = expected_plan(data, 16384, 8)
    assert report["samples"] == 100_000
    assert report["packs"] == len(plan)
    check_picture(png, plan, 16384, 8)


@pytest.mark.parametrize("batch", [1, 2])
def test_plan_png_balance_cost_draws_each_steps_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], batch: int
) -> None:
    """``--balance cost``: the cost panel shows, per step and term, how far the slowest rank's
    cost exceeds the mean rank's, recomputed here from each pack's samples; with
    ``--batch-size 2`` a rank's load in a step is its 2 packs (slots ``k*W*2 + j*W + r``)."""
    data = write_records(tmp_path / "data.jsonl", 600, seed=4)
    png = tmp_path / "plan.png"
    world = 4
    report = plan_png(capsys, data, png, 4096, world, "--balance", "cost", "--batch-size",
                      str(batch))  # fmt: skip
    index = build_length_index(
        open_source(data, None), LengthEstimator.from_processor(load_tiny_processor()),
        progress=False,
    )  # fmt: skip
    assert index.images is not None
    assert int(index.images.max()) > 1  # multi-image records: the vision cost splits them
    # per_rank: the plan command's --batch-size, as the graphs pass batch_size
    plan = plan_packs(index.total, 4096, visual=index.visual, images=index.images,
                      world_size=world, balance="cost", per_rank=batch)  # fmt: skip
    assert report["balance"] == "cost"
    assert report["packs"] == len(plan)
    tot, vis = np.asarray(index.total, float), np.asarray(index.visual, float)
    items = np.maximum(np.asarray(index.images, float), 1.0)  # a sample's images taken as equal
    per_pack = {"lm": [], "attention": [], "vision": []}
    for g in range(len(plan)):
        s = plan.pack(g)
        per_pack["attention"].append(float((tot[s] ** 2).sum()))
        per_pack["lm"].append(24576.0 * tot[s].sum() + float((tot[s] ** 2).sum()))
        per_pack["vision"].append(7680.0 * vis[s].sum() + float((vis[s] ** 2 / items[s]).sum()))
    order = plan.epoch_order(0)
    unit = world * batch
    steps = order[: order.size // unit * unit].reshape(-1, batch, world)  # [step, pack, rank]
    assert report["steps"] == steps.shape[0] >= 4
    ratios = {}
    for k, v in per_pack.items():
        loads = np.asarray(v)[steps].sum(axis=1)  # each rank's packs of the step
        mean = loads.mean(axis=1)
        ratios[k] = np.where(mean > 0, loads.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)
        assert report["per_step_cost"][k] == pytest.approx(ratios[k].tolist(), abs=1e-4)
        q = report["step_cost"][k]
        assert q["p50"] == pytest.approx(np.percentile(ratios[k], 50), abs=1e-4)
        assert q["p95"] == pytest.approx(np.percentile(ratios[k], 95), abs=1e-4)
        assert q["max"] == pytest.approx(ratios[k].max(), abs=1e-4)
    excess = np.stack([ratios[k][:PICTURE_STEPS] for k in ("lm", "attention", "vision")], 1)
    excess = np.round(np.clip((excess - 1.0) * 100.0, 0.0, None), 3)
    assert (excess > 0).any()
    with Image.open(png) as img:
        assert img.size == PLAN_SIZE
        img.load()
        check_panel(img, COST_PANEL, excess)
    check_picture(png, plan, 4096, world, batch)  # the other panels are where they were
