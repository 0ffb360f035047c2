"""``neatpack plan`` / ``neatpack inspect`` on a generated corpus with the real tiny processor.

Every figure the commands print is recomputed here from the library's own pieces (length
index, ``plan_packs``, ``neat_vlm_graph``), and the pictures are decoded and compared pixel by
pixel with the batch they claim to show.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from neatpack.graphs.command.cli import main
from neatpack.graphs.command.pictures import (
    COVER,
    GREY,
    PLAN_SIZE,
    WHITE,
    batch_picture,
    block_factor,
    doc_color,
    mask_image,
)
from neatpack.graphs.command.report import imbalance
from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph, open_source
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.planning.binpack import lower_bound
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

PACK = 1024


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root, num_samples=30, seed=0)
    return root


@pytest.fixture(scope="module")
def index(corpus: Path) -> LengthIndex:
    source = open_source(corpus / "data.jsonl", str(corpus / "media"))
    estimator = LengthEstimator.from_processor(load_tiny_processor("qwen2_vl"), mode="exact")
    return build_length_index(source, estimator, progress=False)


def base(root: Path, pack: int = PACK) -> list[str]:
    return [str(root / "data.jsonl"), "--processor", "qwen2_vl", "--pack-size", str(pack),
            "--media-root", str(root / "media")]  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def error_line(err: str, command: str) -> str:
    """The one error line (the progress bar may precede it on stderr); no traceback."""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"neatpack {command}: error: ")
    return lines[0]


# -- plan ----------------------------------------------------------------------------------


def test_plan_json_matches_the_plan(
    corpus: Path, index: LengthIndex, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "plan.png"
    rc, out, err = run(capsys, "plan", *base(corpus), "--world-size", "2", "--json",
                       "--png", str(png))  # fmt: skip
    assert rc == 0, err
    assert "length index" in err  # the progress bar goes to stderr
    r = json.loads(out)
    total = index.total
    # the CLI's defaults: the graphs' balance (cost), planned for one pack per rank
    plan = plan_packs(total, PACK, visual=index.visual, world_size=2, balance="cost", per_rank=1)
    assert r["samples"] == 30 == total.size
    assert r["packs"] == len(plan)
    assert r["lower_bound"] == lower_bound(total, PACK) <= r["packs"]
    assert r["estimated_tokens"] == int(total.sum())  # nothing dropped: every sample planned
    assert r["estimated_utilization"] == pytest.approx(total.sum() / (len(plan) * PACK), abs=1e-4)
    assert r["overlong"] == {"count": 0, "first_ids": [], "pack_size": PACK, "by_modality": {}}
    assert r["fallbacks"]["count"] == 0
    assert r["steps"] == len(plan) // 2
    assert r["tail_packs"] == len(plan) % 2
    # Imbalance recomputed by hand from the epoch-0 order: packs 2s and 2s+1 form step s.
    order = plan.epoch_order(0).tolist()
    for key, per_pack in (("visual", plan.visual), ("total", plan.totals)):
        ratios = []
        for s in range(len(order) // 2):
            a, b = int(per_pack[order[2 * s]]), int(per_pack[order[2 * s + 1]])
            ratios.append(max(a, b) / ((a + b) / 2) if a + b else 1.0)
        got = r["imbalance"][key]
        assert got["mean"] == pytest.approx(np.mean(ratios), abs=1e-4)
        assert got["max"] == pytest.approx(max(ratios), abs=1e-4)
        assert 1.0 <= got["mean"] <= got["p95"] <= got["max"]
    with Image.open(png) as img:
        assert img.format == "PNG"
        assert img.size == PLAN_SIZE
        colors = {c for _, c in img.convert("RGB").getcolors(1 << 20) or []}
    assert doc_color(1) in colors
    assert doc_color(2) in colors
    assert r["png"] == {"path": str(png), "width": PLAN_SIZE[0], "height": PLAN_SIZE[1]}


def test_plan_text_and_cache_reuse(
    corpus: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    args = ["plan", *base(corpus), "--cache-dir", str(cache)]
    rc, out, _ = run(capsys, *args)
    assert rc == 0
    assert "packs" in out
    assert "lower bound" in out
    assert "est. utilization" in out
    assert "length index        built" in out
    assert len(list(cache.glob("*.npz"))) == 1
    rc, out, err = run(capsys, *args, "--json")
    assert rc == 0
    assert json.loads(out)["length_index_reused"] is True
    assert "length index:" not in err  # reused: no progress bar


def test_plan_overlong_drop_counts_them(
    corpus: Path, index: LengthIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    pack = 400
    rc, out, _ = run(capsys, "plan", *base(corpus, pack), "--overlong", "drop", "--json")
    assert rc == 0
    r = json.loads(out)
    over = np.flatnonzero(index.total > pack).tolist()
    assert over, "the corpus should have samples over 400 tokens"
    assert r["overlong"]["count"] == len(over)
    assert r["overlong"]["first_ids"] == over[:10]
    # by modality, as the graph reports them at build time (test_overlong.py)
    groups = r["overlong"]["by_modality"]
    assert sum(g["count"] for g in groups.values()) == len(over)
    assert set(groups) <= {"image", "text"}  # this corpus has no video or audio
    for g in groups.values():
        assert max(index.total[g["first_ids"]]) <= g["max_tokens"]
        assert g["min_tokens"] > pack
    assert r["overlong"]["message"].startswith(f"{len(over)} sample(s) are longer than")
    rc, out, _ = run(capsys, "plan", *base(corpus, pack), "--overlong", "drop")
    assert rc == 0
    assert "Fixes: overlong='drop' leaves them out" in out
    assert f"pack_size >= {int(index.total.max())} fits them all" in out
    assert r["estimated_tokens"] == int(index.total[index.total <= pack].sum())
    assert r["fill_pct"]["max"] <= 100.0


def test_plan_missing_media_fallback_is_counted(
    corpus: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    records = [json.loads(ln) for ln in (corpus / "data.jsonl").read_text().splitlines()]
    sid = next(i for i, r in enumerate(records) if "images_meta" not in r and
               any(b.get("type") == "image" for b in r["messages"][0]["content"]))  # fmt: skip
    shutil.copytree(corpus / "media", tmp_path / "media")
    shutil.copy(corpus / "data.jsonl", tmp_path / "data.jsonl")
    first_image = records[sid]["messages"][0]["content"][0]["image"]
    (tmp_path / "media" / first_image).unlink()
    rc, _, err = run(capsys, "plan", *base(tmp_path))
    assert f"sample_id={sid}" in error_line(err, "plan")
    assert "--missing-media" in err
    rc, out, _ = run(capsys, "plan", *base(tmp_path), "--missing-media", "fallback", "--json")
    assert rc == 0
    fallbacks = json.loads(out)["fallbacks"]
    assert fallbacks["count"] == 1
    assert fallbacks["first_ids"] == [sid]


def test_imbalance_literal() -> None:
    assert imbalance([[10, 30], [0, 0], [7, 7]]).tolist() == [1.5, 1.0, 1.0]
    assert imbalance(np.zeros((0, 4))).tolist() == []


# -- inspect -------------------------------------------------------------------------------


def reference_batch(corpus: Path, k: int, batch_size: int) -> dict[str, Any]:
    config = NeatVLMConfig(pack_size=PACK, batch_size=batch_size, media_root=str(corpus / "media"),
                           num_workers=0, prefetch=0)  # fmt: skip
    loader = neat_vlm_graph(corpus / "data.jsonl", load_tiny_processor("qwen2_vl"), config=config)
    for i, batch in enumerate(loader):
        if i == k:
            return dict(batch)
    raise AssertionError(f"no batch {k}")


def crop(img: Image.Image, box: list[int]) -> np.ndarray:
    left, top, right, bottom = box
    return np.asarray(img.convert("RGB").crop((left, top, right, bottom)))


def test_inspect_draws_the_batch(
    corpus: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "batch.png"
    rc, out, err = run(capsys, "inspect", *base(corpus), "--batch", "1", "--batch-size", "2",
                       "--png", str(png), "--json")  # fmt: skip
    assert rc == 0, err
    s = json.loads(out)
    ref = reference_batch(corpus, 1, 2)
    docs, labels = ref["doc_ids"].numpy(), ref["labels"].numpy()
    assert s["rows"] == 2
    assert s["sequence_length"] == PACK == docs.shape[1]
    assert s["sample_ids"] == ref["sample_ids"]
    assert s["documents_per_row"] == [len(ids) for ids in ref["sample_ids"]]
    real = docs > 0
    covered = (labels != -100) & real
    assert s["label_coverage"] == pytest.approx(covered.sum() / real.sum(), abs=1e-4)
    assert 0.0 < s["label_coverage"] < 1.0
    lay = s["layout"]
    assert lay["factor"] == 1
    with Image.open(png) as img:
        assert img.format == "PNG"
        assert [img.width, img.height] == [s["png"]["width"], s["png"]["height"]]
        # The mask: pixel (x=j, y=i) is on (not white) iff the batch's mask[0, 0, i, j].
        pixels = crop(img, lay["mask_of_row_0"])
        assert pixels.shape[:2] == (PACK, PACK)
        on = (pixels != WHITE).any(axis=-1)
        np.testing.assert_array_equal(on, ref["attention_mask"][0, 0].numpy())
        for r in range(2):
            band = crop(img, lay["bands"][r])[-1]  # bottom pixel row: below the id labels
            starts = np.flatnonzero(np.diff(docs[r], prepend=-1) != 0)
            want = np.asarray([doc_color(int(d)) for d in docs[r]], np.uint8)
            keep = np.ones(PACK, bool)
            keep[starts] = False  # a white line marks where each document starts
            np.testing.assert_array_equal(band[keep], want[keep])
            strip = crop(img, lay["strips"][r])[0]
            want = np.where(covered[r][:, None], COVER, WHITE)
            want[~real[r]] = GREY
            np.testing.assert_array_equal(strip, want)


def test_inspect_downsamples_the_mask(
    corpus: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "small.png"
    rc, out, _ = run(capsys, "inspect", *base(corpus), "--batch-size", "1", "--png", str(png),
                     "--mask-max-side", "300", "--json")  # fmt: skip
    assert rc == 0
    s = json.loads(out)
    f = s["layout"]["factor"]
    assert f == 4 == block_factor(PACK, 300)
    mask = reference_batch(corpus, 0, 1)["attention_mask"][0, 0].numpy()
    pooled = mask.reshape(PACK // f, f, PACK // f, f).any(axis=(1, 3))
    with Image.open(png) as img:
        on = (crop(img, s["layout"]["mask_of_row_0"]) != WHITE).any(axis=-1)
    np.testing.assert_array_equal(on, pooled)
    assert "row 0" not in out  # --json: one JSON object


def test_mask_image_literal() -> None:
    doc_ids = np.array([1, 1, 2, 0])
    mask = (doc_ids[:, None] == doc_ids[None, :]) & np.tril(np.ones((4, 4), bool))
    mask[3, 3] = True  # padding attends to itself
    img = mask_image(mask, doc_ids=doc_ids)
    assert img.size == (4, 4)
    got = [[img.getpixel((x, y)) != WHITE for x in range(4)] for y in range(4)]
    assert got == mask.tolist()
    assert img.getpixel((0, 1)) == doc_color(1)
    assert img.getpixel((2, 2)) == doc_color(2)


def test_batch_picture_layout_literal() -> None:
    docs = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    labels = np.array([[-100, 5, -100, 6, 7, -100], [-100] * 6])
    mask = np.eye(6, dtype=bool)
    img, lay = batch_picture(docs, labels, [[4, 9], [3]], mask, max_side=3)
    assert lay.factor == 2
    assert lay.mask[2] - lay.mask[0] == 3
    strip = np.asarray(img.crop(lay.strips[0]))[0]
    # blocks: tokens (0,1) half labelled, (2,3) half, (4,5) one real token, labelled
    half = tuple(round(255 + 0.5 * (c - 255)) for c in COVER)
    assert [tuple(p) for p in strip] == [half, half, COVER]
    assert [tuple(p) for p in np.asarray(img.crop(lay.strips[1]))[0]] == [WHITE] * 3


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.badinput
@pytest.mark.parametrize(
    ("command", "change", "expect"),
    [
        ("plan", {"data": "missing.jsonl"}, "does not exist"),
        ("plan", {"--processor": "/no/such/processor"}, "--processor"),
        ("plan", {"--pack-size": "100"}, "--overlong drop"),
        ("plan", {"--png": "/no/such/folder/plan.png"}, "cannot write"),
        ("plan", {"--cache-dir": "/proc/no/cache"}, "--cache-dir"),
        ("plan", {"--media-root": "/no/such/media"}, "--media-root"),
        ("inspect", {"--png": "/no/such/folder/b.png"}, "cannot write"),
        ("inspect", {"--batch": "99"}, "past the end"),
        ("inspect", {"--pack-size": "100"}, "--pack-size"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    corpus: Path,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    command: str,
    change: dict[str, str],
    expect: str,
) -> None:
    argv = [*base(corpus), "--cache-dir", str(tmp_path / "cache")]
    if "data" in change:
        argv[0] = str(tmp_path / change.pop("data"))
    for flag, value in change.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    if command == "inspect" and "--png" not in argv:
        argv += ["--png", str(tmp_path / "b.png")]
    rc, out, err = run(capsys, command, *argv)
    assert rc == 2
    assert out == ""
    assert expect in error_line(err, command)
    assert not (tmp_path / "b.png").exists()  # a failed command leaves no empty picture


@pytest.mark.badinput
@pytest.mark.parametrize("how", ["console_script", "python_m"])
def test_console_script_exit_2_without_traceback(tmp_path: Path, how: str) -> None:
    """Also as ``python -m neatpack.graphs.command.cli``, whose ``__main__`` copy of cli.py must
    catch
    the ``UsageError`` that report.py raises (one class, in graphs/command/cli_inputs.py)."""
    script = Path(sys.executable).parent / "neatpack"
    code = "import sys; from neatpack.graphs.command.cli import main; sys.exit(main())"
    cmd = [str(script)] if script.exists() else [sys.executable, "-c", code]
    if how == "python_m":
        cmd = [sys.executable, "-m", "neatpack.graphs.command.cli"]
    proc = subprocess.run(
        [*cmd, "plan", str(tmp_path / "nope.jsonl"), "--processor", "qwen2_vl", "--pack-size",
         "1024"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("neatpack plan: error: data file")
    assert "nope.jsonl" in proc.stderr


def _neatpack(*argv: str) -> subprocess.CompletedProcess[str]:
    """The ``neatpack`` command as a user runs it, to its exit."""
    return subprocess.run(
        [sys.executable, "-m", "neatpack.graphs.command.cli", *argv], capture_output=True,
        text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False,
    )  # fmt: skip


def test_version_flag_prints_the_installed_version() -> None:
    import tomllib
    from importlib.metadata import version

    proc = _neatpack("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"neatpack {version('neatpack')}"
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert version("neatpack") == pyproject["project"]["version"]


@pytest.mark.badinput
@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--samples", "0"], "--samples 0 is too small: pass at least 1"),
        (["--samples", "-3"], "--samples -3 is too small"),
        (["--batch-size", "0"], "--batch-size 0 is too small"),
        (["--workers", "-1"], "--workers -1 is too small: pass at least 0"),
        (["--attn", "nope"], "attn_implementation='nope'"),
        (["--attn", "nope"], "valid: sdpa, eager, flash_attention_2"),
        (["--attn", "nope"], "Fix: pass one of them"),
    ],
)
def test_demo_bad_numbers_are_one_line_exit_2(tmp_path: Path, argv: list[str], expect: str) -> None:
    proc = _neatpack("demo", "--dir", str(tmp_path), "--samples", "8", "--quiet", *argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("neatpack demo: error: ")
    assert expect in proc.stderr


def test_plan_more_ranks_than_packs(
    corpus: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "wide.png"
    rc, out, _ = run(capsys, "plan", *base(corpus), "--world-size", "64", "--json",
                     "--png", str(png))  # fmt: skip
    assert rc == 0
    r = json.loads(out)
    assert r["steps"] == 0
    assert r["tail_packs"] == r["packs"] > 0
    with Image.open(png) as img:
        assert img.size == PLAN_SIZE


@pytest.mark.badinput
def test_bad_records_name_the_sample(
    corpus: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lines = (corpus / "data.jsonl").read_text().splitlines()[:3]
    (tmp_path / "data.jsonl").write_text("\n".join([*lines, '{"messages": [oops']) + "\n")
    (tmp_path / "media").symlink_to(corpus / "media")
    rc, _, err = run(capsys, "plan", *base(tmp_path))
    assert rc == 2
    assert "sample_id=3" in error_line(err, "plan")
    (tmp_path / "data.jsonl").write_text("")
    rc, _, err = run(capsys, "inspect", *base(tmp_path), "--png", str(tmp_path / "e.png"))
    assert rc == 2
    assert "nothing to inspect" in error_line(err, "inspect")
    assert not (tmp_path / "e.png").exists()
