"""Kimi K2.5: pre-expanded image tokens and fixed-length (PP) rows, with the real
``Kimi_K25Processor`` (tiny, offline) and a tiny real ``Kimi_K25ForConditionalGeneration``.

Labels = exactly the assistant turns (decoded), ``<|media_pad|>`` per image == the grid's
``(h // 2) * (w // 2)`` == the features the model's ``get_image_features`` returns, the length
estimate against the real length, fixed-length rows (exactly ``max_length``, padding labelled
-100, a longer row named by its sample ids), bad input naming the sample, and packed-vs-separate
parity through ``registry.packed_model_inputs`` and through the fixed-length batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from PIL import Image
from support.family_checks import (
    assert_script_rebuilds,
    check_packed_equals_separate,
    label_spans,
    logits_alone,
    runs,
)
from support.family_records import conversation_records, with_images_meta
from support.tiny import ASSETS, load_tiny_kimi_k25_processor
from support.tiny_family_models import tiny_kimi_k25_model

from neatpack.pipes.families import get_handler, tokenize_with_handler
from neatpack.pipes.families.chat_template import default_estimate
from neatpack.pipes.families.kimi import kimi_k25_fixed_length_batch, kimi_k25_image_tokens
from neatpack.pipes.reading.media import SampleError

_FOLDER = ASSETS / "kimi_k25"


@pytest.fixture(scope="module")
def kimi() -> Any:
    return load_tiny_kimi_k25_processor()


@pytest.fixture(scope="module")
def model(kimi: Any) -> Any:
    return tiny_kimi_k25_model(kimi)


def _answers(rec: dict[str, Any]) -> list[str]:
    return [m["content"][0]["text"] + "<|im_end|>" for m in rec["conversation"]
            if m["role"] == "assistant"]  # fmt: skip


def test_kimi_uses_its_registered_handler(kimi: Any) -> None:
    assert type(kimi).__name__ == "Kimi_K25Processor"
    assert get_handler(kimi).name == "kimi_k25"
    assert (_FOLDER / "processor_config.json").is_file()
    assert sum(p.stat().st_size for p in _FOLDER.iterdir()) < 300 * 1024


def test_kimi_labels_pre_expanded_tokens_and_estimate(kimi: Any, model: Any) -> None:
    """Labels decoded = the assistant turns; each image's ``<|media_pad|>`` run == ``(h // 2) *
    (w // 2)`` of its grid == the processor's count == the features the model makes for it;
    ``default_estimate`` exact mode == real length, chars/3 mode within 25 %."""
    pad = kimi.image_token_id
    worst_rel, n_images = 0.0, 0
    for rec in with_images_meta(conversation_records(12, seed=31)):
        s = tokenize_with_handler(rec, kimi)
        assert label_spans(kimi.tokenizer, s) == _answers(rec), rec["sample_id"]
        sizes = [tuple(m) for m in rec["images_meta"]]
        pads = runs(s["input_ids"].tolist(), pad)
        assert pads == kimi_k25_image_tokens(kimi, sizes)
        assert int((s["mm_token_type_ids"] == 1).sum()) == sum(pads)
        assert bool((s["labels"][s["mm_token_type_ids"] == 1] == -100).all())
        if sizes:
            grid = s["image_grid_thw"]
            assert pads == (grid[:, 0] * (grid[:, 1] // 2) * (grid[:, 2] // 2)).tolist()
            assert s["pixel_values"].shape[0] == int(grid.prod(-1).sum())
            with torch.no_grad():
                feats = model.model.get_image_features(s["pixel_values"], grid).pooler_output
            assert [int(f.shape[0]) for f in feats] == pads
            n_images += len(sizes)
        real = len(s["input_ids"]) - 1
        assert default_estimate(rec, kimi) == real, rec["sample_id"]
        rough = default_estimate(rec, kimi, mode="estimate")
        worst_rel = max(worst_rel, abs(rough - real) / real)
    assert n_images >= 8
    assert worst_rel <= 0.25, worst_rel


def test_kimi_fixed_length_rows(kimi: Any) -> None:
    """Every row is exactly ``max_length``; padding is the pad id, label -100, document id 0;
    media concatenated with per-row image counts; a longer row names its sample ids."""
    samples = [tokenize_with_handler(r, kimi) for r in conversation_records(5, seed=32)]
    rows = [samples[:2], samples[2:3], samples[3:]]
    lengths = [sum(len(s["input_ids"]) - 1 for s in r) for r in rows]
    max_length = max(lengths) + 7
    batch = kimi_k25_fixed_length_batch(rows, kimi, max_length=max_length)
    assert batch["input_ids"].shape == (3, max_length)
    assert batch["labels"].shape == batch["position_ids"].shape == (3, max_length)
    assert batch["attention_mask"].shape == (3, 1, max_length, max_length)
    pad = kimi.tokenizer.pad_token_id
    for row, n in enumerate(lengths):
        assert bool((batch["labels"][row, n:] == -100).all())
        assert bool((batch["input_ids"][row, n:] == pad).all())
        assert bool((batch["doc_ids"][row, n:] == 0).all())
        assert bool(batch["doc_ids"][row, :n].all())
    n_img = [sum(len(s["image_grid_thw"]) for s in r if "image_grid_thw" in s) for r in rows]
    assert batch["n_images_per_sample"].tolist() == n_img
    tokens = (batch["mm_token_type_ids"] == 1).sum(-1).tolist()
    grid = batch["image_grid_thw"]
    assert sum(tokens) == int((grid.prod(-1) // 4).sum())
    too_long = min(lengths[0] - 1, max(lengths[1:]))
    with pytest.raises(ValueError, match=rf"sample_ids=\[0, 1\]\) has {lengths[0]} tokens"):
        kimi_k25_fixed_length_batch(rows, kimi, max_length=too_long)


@pytest.mark.badinput
def test_kimi_rejects_video_and_audio_naming_the_sample(kimi: Any) -> None:
    frames = [Image.new("RGB", (28, 28))] * 2
    for sid, block in ((7, {"type": "video", "video": frames}),
                       (8, {"type": "audio", "audio": [0.0] * 16})):  # fmt: skip
        rec = {"sample_id": sid, "conversation": [
            {"role": "user", "content": [block, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": "noise"}]}  # fmt: skip
        with pytest.raises(SampleError, match=rf"sample_id={sid} \[bad_media\].*Kimi_K25"):
            tokenize_with_handler(rec, kimi)
    bad = {
        "sample_id": 9,
        "conversation": [
            {"role": "user", "content": "hi <|media_pad|>"},
            {"role": "assistant", "content": "x"},
        ],
    }
    with pytest.raises(SampleError, match=r"sample_id=9"):
        tokenize_with_handler(bad, kimi)


KIMI_KEYS = ("pixel_values", "image_grid_thw")


@pytest.mark.parity
def test_kimi_packed_equals_separate(kimi: Any, model: Any) -> None:
    """``registry.packed_model_inputs`` (block-causal mask, reset positions, pixels + grids
    concatenated) == each sample alone, max abs diff <= 1e-5 fp32; a one-document mask over the
    same row must differ (the mask is really used)."""
    samples = [tokenize_with_handler(r, kimi) for r in conversation_records(3, seed=33)]
    assert sum("pixel_values" in s for s in samples) >= 2
    check_packed_equals_separate(model, kimi, samples, KIMI_KEYS)


@pytest.mark.parity
def test_kimi_fixed_length_batch_equals_separate(kimi: Any, model: Any) -> None:
    """The fixed-length ``[B, max_length]`` batch (eager additive mask, padding attending to
    itself) gives every document the logits it has alone (<= 1e-5 fp32)."""
    samples = [tokenize_with_handler(r, kimi) for r in conversation_records(4, seed=34)]
    rows = [samples[:2], samples[2:]]
    max_length = max(sum(len(s["input_ids"]) - 1 for s in r) for r in rows) + 5
    batch = kimi_k25_fixed_length_batch(rows, kimi, max_length=max_length)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            pixel_values=batch.get("pixel_values"),
            image_grid_thw=batch.get("image_grid_thw"),
        ).logits
    worst = 0.0
    for row, docs in enumerate(rows):
        start = 0
        for s in docs:
            n = len(s["input_ids"]) - 1
            diff = logits[row, start : start + n] - logits_alone(model, s, KIMI_KEYS)
            worst = max(worst, float(diff.abs().max()))
            start += n
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_crop_family_processors_rebuild_byte_for_byte(tmp_path: Any) -> None:
    """``scripts/build_tiny_crop_family_processors.py`` reproduces the committed Kimi K2.5,
    Step3 and (with ``num2words``) SmolVLM files exactly."""
    import importlib.util

    families = ["kimi_k25", "step3"]
    if importlib.util.find_spec("num2words") is not None:
        families.append("smolvlm")
    assert_script_rebuilds("build_tiny_crop_family_processors.py", tmp_path, families)
