"""``NeatVLMConfig(max_visual_tokens=)`` and ``NeatVLMConfig(max_images=)`` through
``neat_vlm_graph`` on a generated image/text corpus (records of 0 to 3 images) with the tiny
Qwen2-VL processor: no materialized pack holds more image tokens (or their patches), or more
images, than its budget, no sample is dropped, and resume and elastic resume stay exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.testing.resume import assert_exactly_once, same_item
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

N = 40
BUDGET = 700  # image tokens per pack; the corpus's largest sample has 684, packs reach ~1,400
IMAGES = 3  # images per pack; the corpus's records hold up to 3, packs reach more
#: the budgets each test runs under, as config options
BUDGETS = {
    "visual": {"max_visual_tokens": BUDGET},
    "images": {"max_images": IMAGES},
    "both": {"max_visual_tokens": BUDGET, "max_images": IMAGES},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("budget")
    write_corpus(root, num_samples=N, seed=7)
    return root


@pytest.fixture(scope="module")
def processor() -> Any:
    return load_tiny_processor()


def config(corpus: Path, budget: int | None = None, **kw: Any) -> NeatVLMConfig:
    kw.setdefault("max_visual_tokens", budget)
    return NeatVLMConfig(
        pack_size=2048, media_root=str(corpus / "media"), cache_dir=str(corpus / "cache"),
        num_workers=0, **kw,
    )  # fmt: skip


def media_items(batch: dict[str, Any], processor: Any) -> list[int]:
    """Images (and video clips) of each row (pack) of a batch, counted in the batch itself: one
    ``<|vision_start|>`` each, and one ``image_grid_thw`` / ``video_grid_thw`` row each."""
    start = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    rows = (batch["input_ids"] == start).sum(dim=1).tolist()
    grids = sum(batch[k].shape[0] for k in ("image_grid_thw", "video_grid_thw") if k in batch)
    assert grids == sum(rows)
    return [int(r) for r in rows]


def within(batch: dict[str, Any], processor: Any, budgets: dict[str, int]) -> bool:
    """Every row of ``batch`` keeps ``budgets`` (config options, as in ``BUDGETS``)."""
    tokens, items = image_tokens(batch, processor), media_items(batch, processor)
    return max(tokens) <= budgets.get("max_visual_tokens", BUDGET * 100) and max(items) <= (
        budgets.get("max_images", IMAGES * 100)
    )


def image_tokens(batch: dict[str, Any], processor: Any) -> list[int]:
    """Image tokens of each row (pack) of a batch, counted in the batch itself."""
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rows = (batch["input_ids"] == pad).sum(dim=1).tolist()
    patches = batch["pixel_values"].shape[0] if "pixel_values" in batch else 0
    assert patches == 4 * sum(rows)  # the vision tower's input: 2x2 patches per image token
    return [int(r) for r in rows]


def plan_args(corpus: Path) -> list[str]:
    """``neatpack plan``'s arguments for the corpus, its report as JSON."""
    return [str(corpus / "data.jsonl"), "--processor", "qwen2_vl", "--pack-size", "2048",
            "--media-root", str(corpus / "media"), "--json"]  # fmt: skip


def plan_reports(
    capsys: pytest.CaptureFixture[str], base: list[str], *extras: list[str]
) -> list[dict[str, Any]]:
    """``neatpack plan`` run once with each list of ``extras`` added to ``base``: the reports."""
    import json

    from neatpack.graphs.command.cli import main

    reports = []
    for extra in extras:
        assert main(["plan", *base, *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    return reports


def sample_ids(batches: list[dict[str, Any]]) -> list[int]:
    return [int(i) for b in batches for m in b["packs"] for i in m["sample_ids"]]


@pytest.mark.parametrize("name", BUDGETS)
def test_no_pack_exceeds_the_vision_budgets_and_none_is_dropped(
    corpus: Path, processor: Any, name: str
) -> None:
    data = corpus / "data.jsonl"
    budgets = BUDGETS[name]
    plain = list(neat_vlm_graph(data, processor, config=config(corpus)))
    assert max(t for b in plain for t in image_tokens(b, processor)) > BUDGET
    assert max(t for b in plain for t in media_items(b, processor)) > IMAGES  # both bind
    loader = neat_vlm_graph(data, processor, config=config(corpus, batch_size=2, **budgets))
    batches = list(loader)
    assert all(within(b, processor, budgets) for b in batches)
    for count in (image_tokens, media_items):
        real = [  # the packs of the epoch, without the tail's repeats (tail="pad")
            t
            for b in batches
            for t, m in zip(count(b, processor), b["packs"], strict=True)
            if not m["padded"]
        ]
        assert sum(real) == sum(t for b in plain for t in count(b, processor))
    ledger = loader.ledgers[0]
    assert_exactly_once(ledger.consumed, range(N), excused=ledger.tail_dropped)


@pytest.mark.parametrize("name", BUDGETS)
def test_resume_with_the_budget_is_exact(corpus: Path, processor: Any, name: str) -> None:
    data = corpus / "data.jsonl"
    budgets = BUDGETS[name]
    cfg = config(corpus, **budgets)
    reference = list(neat_vlm_graph(data, processor, config=cfg))
    first = neat_vlm_graph(data, processor, config=cfg)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    resumed = neat_vlm_graph(data, processor, config=cfg)
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    assert same_item(head + rest, reference)
    assert_exactly_once(sample_ids(head) + resumed.ledgers[0].consumed, range(N))
    other = {k: v + 1 for k, v in budgets.items()}  # another budget: another plan
    with pytest.raises(ValueError, match=next(iter(budgets))):
        neat_vlm_graph(data, processor, config=config(corpus, **other)).load_state_dict(
            first.state_dict()
        )


@pytest.mark.parametrize("name", ["visual", "both"])
def test_elastic_resume_two_to_three_ranks_with_the_budget(
    corpus: Path, processor: Any, name: str
) -> None:
    data = corpus / "data.jsonl"
    budgets = BUDGETS[name]
    cfg = config(corpus, **budgets)
    loaders = [neat_vlm_graph(data, processor, config=cfg, rank=r, world_size=2) for r in (0, 1)]
    its = [iter(x) for x in loaders]
    seen = [next(it) for it in its]
    states = [x.state_dict() for x in loaders]
    resumed = [neat_vlm_graph(data, processor, config=cfg, rank=r, world_size=3) for r in range(3)]
    for r, x in enumerate(resumed):
        x.load_state_dict(states[r % 2])
    rest = [list(x) for x in resumed]
    assert len({len(b) for b in rest}) == 1, "every rank yields the same number of batches"
    for b in seen + [b for bs in rest for b in bs]:
        assert within(b, processor, budgets)
    consumed = [i for x in loaders for i in x.ledgers[0].consumed]
    consumed += [i for x in resumed for i in x.ledgers[0].consumed]
    dropped = [i for x in resumed for i in x.ledgers[0].tail_dropped]
    assert_exactly_once(consumed, range(N), excused=dropped)
    assert torch.is_tensor(seen[0]["input_ids"])


def test_neatpack_plan_reports_and_keeps_the_budget(
    corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from neatpack.graphs.command.cli import main

    base = plan_args(corpus)
    plain, budgeted = plan_reports(capsys, base, [], ["--max-visual-tokens", str(BUDGET)])
    assert plain["visual_per_pack"] == {
        "max_visual_tokens": None,
        "max": plain["visual_per_pack"]["max"],
    }
    assert plain["visual_per_pack"]["max"] > BUDGET
    assert budgeted["visual_per_pack"]["max_visual_tokens"] == BUDGET
    assert budgeted["visual_per_pack"]["max"] <= BUDGET
    assert budgeted["packs"] >= plain["packs"]
    assert budgeted["overlong"]["count"] == 0
    assert main(["plan", *base, "--max-visual-tokens", "600"]) == 2  # sample 25 has 684 alone
    assert "over --max-visual-tokens 600 on their own: samples [25]" in capsys.readouterr().err
    assert main(["plan", *base, "--max-visual-tokens", "600", "--overlong", "drop"]) == 0
    assert json.loads(capsys.readouterr().out)["overlong"]["first_ids"] == [25]


def test_neatpack_plan_keeps_the_images_budget(
    corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from neatpack.graphs.command.cli import main

    base = plan_args(corpus)
    plain, budgeted, both = plan_reports(
        capsys,
        base,
        [],
        ["--max-images", str(IMAGES)],
        ["--max-images", str(IMAGES), "--max-visual-tokens", str(BUDGET)],
    )
    assert plain["images_per_pack"]["max_images"] is None
    assert plain["images_per_pack"]["max"] > IMAGES
    for r in (budgeted, both):
        assert r["images_per_pack"] == {"max_images": IMAGES, "max": IMAGES}
        assert r["packs"] >= plain["packs"]
    assert both["visual_per_pack"]["max"] <= BUDGET
    assert main(["plan", *base, "--max-images", "2"]) == 2  # records of 3 images alone
    assert "over --max-images 2 on their own" in capsys.readouterr().err
    assert main(["plan", *base, "--max-images", "2", "--overlong", "drop"]) == 0
    dropped = json.loads(capsys.readouterr().out)
    assert dropped["images_per_pack"]["max"] <= 2
    assert dropped["overlong"]["first_ids"]  # the records of 3 images, left out
