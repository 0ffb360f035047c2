"""``neatpack plan --mixture``: realized mixture next to the target, per source and per window
of steps, from a mixture JSON over generated sources (real tiny processor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neatpack.graphs.command.cli import main
from neatpack.pipes.testing.synth import write_corpus


@pytest.fixture(scope="module")
def mix_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixcli")
    for name, n, seed in (("cap", 20, 1), ("ocr", 10, 2), ("ch", 3, 3)):
        write_corpus(root / name, num_samples=n, seed=seed)
    sources = [
        {"name": "cap", "data": "cap/data.jsonl", "media_root": "cap/media", "weight": 0.6},
        {"name": "ocr", "data": "ocr/data.jsonl", "media_root": "ocr/media", "weight": 0.3},
        {"name": "ch", "data": "ch/data.jsonl", "media_root": "ch/media", "samples": 8},
    ]
    (root / "mix.json").write_text(json.dumps({"sources": sources}))
    return root / "mix.json"


def test_plan_prints_realized_vs_target_per_source_and_window(
    mix_json: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["plan", "--mixture", str(mix_json), "--processor", "qwen2_vl", "--pack-size", "1024"]
    assert main([*args, "--window-steps", "2", "--world-size", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["source"]: r for r in report["sources"]}
    assert [rows[n]["samples"] for n in ("cap", "ocr", "ch")] == [20, 10, 3]
    assert rows["ch"]["uses"] == 8  # fixed samples: 2 whole repeats and 2 drawn
    assert rows["ch"]["target"] == rows["ch"]["epoch"]  # a fixed source's target is its plan
    weighted = rows["cap"]["target"] / rows["ocr"]["target"]
    assert weighted == pytest.approx(2.0, rel=1e-3)  # 0.6 : 0.3 of what the fixed one leaves
    assert report["window_packs"] == 4
    assert len(report["windows"]) == report["packs"] // 4  # full windows
    for w in report["windows"]:
        assert sum(w["shares"]) == pytest.approx(1.0, abs=1e-5)
    assert main([*args, "--window-steps", "2"]) == 0
    text = capsys.readouterr().out
    assert "window % (min..max)" in text
    assert "ch" in text


def test_plan_mixture_takes_the_batch_size(
    mix_json: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--batch-size`` (packs per rank per step, as the graph's): a window of steps holds
    ``world_size x batch_size`` packs a step, ``--balance cost`` plans for it (``per_rank``,
    as the mixture graph does), and a size under 1 is a usage error."""
    args = ["plan", "--mixture", str(mix_json), "--processor", "qwen2_vl", "--pack-size", "1024",
            "--window-steps", "2", "--world-size", "2", "--balance", "cost", "--json"]  # fmt: skip
    assert main([*args, "--batch-size", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["batch_size"], report["window_packs"]) == (2, 8)
    assert len(report["windows"]) == report["packs"] // 8
    assert main([*args, "--batch-size", "0"]) == 2
    assert "--batch-size 0 must be >= 1" in capsys.readouterr().err


def test_plan_mixture_errors_are_one_line(
    mix_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sources": [{"name": "a", "data": "x.jsonl", "wieght": 1}]}))
    args = ["plan", "--mixture", str(bad), "--processor", "qwen2_vl", "--pack-size", "1024"]
    assert main(args) == 2
    assert "unknown keys ['wieght']" in capsys.readouterr().err
    both = ["plan", "x.jsonl", "--mixture", str(mix_json), "--processor", "qwen2_vl"]
    assert main([*both, "--pack-size", "1024"]) == 2
    assert "not both" in capsys.readouterr().err


def test_plan_mixture_takes_the_images_budget(
    mix_json: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["plan", "--mixture", str(mix_json), "--processor", "qwen2_vl", "--pack-size", "1024",
            "--json"]  # fmt: skip
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--max-images", "3"]) == 0  # tighter than the packs hold: more packs
    budgeted = json.loads(capsys.readouterr().out)
    assert budgeted["packs"] > plain["packs"]
    assert [r["uses"] for r in budgeted["sources"]] == [r["uses"] for r in plain["sources"]]
