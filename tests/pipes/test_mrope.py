"""mrope_position_ids vs the real `model.model.get_rope_index` of tiny transformers models."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from support.versions import TRUNCATED_VIDEO_TIME, rope_index_truncates_video_time

from neatpack.pipes.materializing.mrope import (
    MRopeConfig,
    compute_mrope_position_ids,
    mrope_position_ids,
)
from neatpack.pipes.testing.tiny_models import tiny_model

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
N_CASES = 24


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param)


def _make_case(family: str, seed: int) -> dict[str, Any]:
    """A random sample layout: text runs, 0-3 images, 0-2 videos (token ids are arbitrary)."""
    rng = random.Random(seed)
    ids: list[int] = []
    types: list[int] = []
    image_grids: list[list[int]] = []
    video_grids: list[list[int]] = []
    seconds: list[float] = []

    def text(n: int) -> None:
        ids.extend(rng.randrange(0, 4000) for _ in range(n))
        types.extend([0] * n)

    def block(kind: int, n: int) -> None:
        text(1)  # <|vision_start|>
        ids.extend([4108 if kind == 1 else 4109] * n)
        types.extend([kind] * n)
        text(1)  # <|vision_end|>

    text(rng.randrange(1, 20))
    n_img = rng.randrange(0, 4)
    n_vid = rng.randrange(0, 3) if seed % 3 else 0
    kinds = [1] * n_img + [2] * n_vid
    rng.shuffle(kinds)
    for kind in kinds:
        h, w = 2 * rng.randrange(1, 6), 2 * rng.randrange(1, 6)
        if kind == 1:
            image_grids.append([1, h, w])
            block(1, h * w // 4)
        else:
            t = rng.randrange(1, 4)
            video_grids.append([t, h, w])
            seconds.append(rng.choice([0.5, 1.0, 1.3, 2.0, 0.7]))
            if family == "qwen3_vl":  # "<t> seconds" text before every frame
                for _ in range(t):
                    text(rng.randrange(1, 4))
                    block(2, h * w // 4)
            else:
                block(2, t * h * w // 4)
        text(rng.randrange(0, 12))
    return {
        "input_ids": torch.tensor(ids),
        "mm_token_type_ids": torch.tensor(types),
        "image_grid_thw": torch.tensor(image_grids) if image_grids else None,
        "video_grid_thw": torch.tensor(video_grids) if video_grids else None,
        "second_per_grid_ts": torch.tensor(seconds) if seconds else None,
    }


def _reference(model: Any, case: dict[str, Any], attention_mask: Any = None) -> torch.Tensor:
    kw: dict[str, Any] = {
        "image_grid_thw": case["image_grid_thw"],
        "video_grid_thw": case["video_grid_thw"],
        "attention_mask": None if attention_mask is None else attention_mask[None],
    }
    if model.config.model_type == "qwen2_5_vl":
        kw["second_per_grid_ts"] = case["second_per_grid_ts"]
    vg = case["video_grid_thw"]
    if vg is not None:
        kw["video_grid_thw"] = vg.clone()  # Qwen3-VL edits it in place
    pos, _ = model.model.get_rope_index(
        case["input_ids"][None], case["mm_token_type_ids"][None], **kw
    )
    return pos[:, 0]


def _ours(cfg: MRopeConfig, case: dict[str, Any], attention_mask: Any = None) -> torch.Tensor:
    return mrope_position_ids(
        case["input_ids"],
        case["mm_token_type_ids"],
        case["image_grid_thw"],
        case["video_grid_thw"],
        case["second_per_grid_ts"],
        config=cfg,
        attention_mask=attention_mask,
    )


def _fractional_time(case: dict[str, Any]) -> bool:
    seconds = case["second_per_grid_ts"]
    return seconds is not None and bool((seconds != seconds.round()).any())


def test_matches_get_rope_index_on_generated_cases(model: Any) -> None:
    cfg = MRopeConfig.from_model_config(model.config)
    truncates = rope_index_truncates_video_time(model)  # transformers 5.17.0 (TRUNCATED_...)
    n_media = 0
    for seed in range(N_CASES):
        case = _make_case(cfg.family, seed)
        if truncates and _fractional_time(case):
            continue  # the reference itself is wrong there: TRUNCATED_VIDEO_TIME
        ref = _reference(model, case)
        got = _ours(cfg, case)
        assert torch.equal(got, ref), (cfg.family, seed)
        n_media += int(case["image_grid_thw"] is not None) + int(case["video_grid_thw"] is not None)
    assert n_media >= N_CASES // 2  # the generator really produced media


def test_text_only_is_arange(model: Any) -> None:
    cfg = MRopeConfig.from_model_config(model.config)
    ids = torch.arange(17)
    got = mrope_position_ids(ids, torch.zeros(17, dtype=torch.long), config=cfg)
    assert torch.equal(got, torch.arange(17).expand(3, -1))
    ref, _ = model.model.get_rope_index(ids[None], torch.zeros(1, 17, dtype=torch.long))
    assert torch.equal(got, ref[:, 0])


def test_masked_fake_image_matches_model(model: Any) -> None:
    cfg = MRopeConfig.from_model_config(model.config)
    ids = torch.arange(20)
    types = torch.tensor([0] * 5 + [1] * 4 + [0] * 11)
    mask = (types == 0).long()
    case = {
        "input_ids": ids, "mm_token_type_ids": types, "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "video_grid_thw": None, "second_per_grid_ts": None,
    }  # fmt: skip
    got = _ours(cfg, case, mask)
    assert torch.equal(got, _reference(model, case, mask))
    assert got[:, 5:9].eq(0).all()
    assert got[0, 9].item() == 5  # text resumes as if the masked image were absent


def test_user_get_rope_index_callable(model: Any) -> None:
    cfg = MRopeConfig.from_model_config(model.config)
    case = _make_case(cfg.family, 7)
    if rope_index_truncates_video_time(model) and _fractional_time(case):
        pytest.skip(TRUNCATED_VIDEO_TIME)
    sample = {k: v for k, v in case.items() if v is not None}
    if sample.get("video_grid_thw") is not None:
        sample["video_grid_thw"] = sample["video_grid_thw"].clone()
    got = compute_mrope_position_ids(sample, model.model.get_rope_index)
    assert got is not None
    assert torch.equal(got, _ours(cfg, case))


def test_mismatched_grid_raises() -> None:
    cfg = MRopeConfig(family="qwen2_vl")
    types = torch.tensor([0, 1, 1, 1, 0])
    with pytest.raises(ValueError, match="needs 4 tokens"):
        mrope_position_ids(torch.zeros(5), types, torch.tensor([[1, 4, 4]]), config=cfg)
    with pytest.raises(ValueError, match="image_grid_thw has 0 rows"):
        mrope_position_ids(torch.zeros(5), types, torch.zeros(0, 3), config=cfg)


def test_adjacent_images_without_separator_are_split() -> None:
    cfg = MRopeConfig(family="qwen2_vl")
    types = torch.tensor([1] * 4 + [1] * 2)
    got = mrope_position_ids(
        torch.zeros(6), types, torch.tensor([[1, 4, 4], [1, 2, 4]]), config=cfg
    )
    assert got[2].tolist() == [0, 1, 0, 1, 2, 3]


def test_config_validation_and_token_types() -> None:
    with pytest.raises(ValueError, match="qwen2_vl"):
        MRopeConfig(family="llama")
    cfg = MRopeConfig(family="qwen3_vl", image_token_id=7, video_token_id=8)
    assert cfg.token_types(torch.tensor([1, 7, 8, 7])).tolist() == [0, 1, 2, 1]
