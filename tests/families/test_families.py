"""Model families beyond Qwen-VL, each with a tiny offline processor built from real classes.

Gemma 3: labels = exactly the assistant turns, image tokens = the processor's count, length
estimate within a stated bound, and packed-vs-separate parity on a tiny real
``Gemma3ForConditionalGeneration`` (bidirectional image tokens through ``gemma3_packed_mask``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from support.family_checks import label_spans
from support.family_records import conversation_records, with_images_meta
from support.tiny import load_tiny_gemma3_processor
from support.tiny_family_models import tiny_gemma3_model

from neatpack.pipes.collating.mask import to_4d_additive_mask
from neatpack.pipes.families import get_handler, tokenize_with_handler
from neatpack.pipes.families.gemma3 import gemma3_estimator, gemma3_image_tokens, gemma3_packed_mask
from neatpack.pipes.materializing.pack import build_pack
from neatpack.pipes.reading.media import SampleError


@pytest.fixture(scope="module")
def gemma3() -> Any:
    return load_tiny_gemma3_processor()


def _n_images(rec: dict[str, Any]) -> int:
    return sum(b.get("type") == "image" for m in rec["conversation"] for b in m["content"])


def test_gemma3_uses_its_registered_handler(gemma3: Any) -> None:
    assert type(gemma3).__name__ == "Gemma3Processor"
    assert get_handler(gemma3).name == "gemma3"


def test_gemma3_labels_are_exactly_the_assistant_turns(gemma3: Any) -> None:
    tok = gemma3.tokenizer
    for rec in conversation_records(12, seed=1):
        s = tokenize_with_handler(rec, gemma3)
        want = [
            m["content"][0]["text"].strip() + "<end_of_turn>"
            for m in rec["conversation"]
            if m["role"] == "assistant"
        ]
        assert label_spans(tok, s) == want, rec["sample_id"]
        # nothing of the header "<start_of_turn>model\n" nor any user/system token is labelled
        assert int((s["labels"] == tok.convert_tokens_to_ids("<start_of_turn>")).sum()) == 0


def test_gemma3_image_tokens_match_the_processor(gemma3: Any) -> None:
    soft = gemma3.tokenizer.image_token_id
    for rec in conversation_records(12, seed=2):
        s = tokenize_with_handler(rec, gemma3)
        n = _n_images(rec)
        expected = gemma3._get_num_multimodal_tokens(image_sizes=[(1, 1)] * n).num_image_tokens
        assert int((s["input_ids"] == soft).sum()) == sum(expected) == n * gemma3.image_seq_length
        assert torch.equal(s["mm_token_type_ids"], (s["input_ids"] == soft).long())
        assert torch.equal(s["token_type_ids"], s["mm_token_type_ids"])
        assert (s["pixel_values"].shape[0] if n else 0) == n
        assert bool((s["labels"][s["mm_token_type_ids"] == 1] == -100).all())


def test_gemma3_length_estimate_bounds(gemma3: Any) -> None:
    """exact mode: real - n_images <= estimate <= real (BPE merges of the "\\n\\n" around each
    image block cost at most one token per image). estimate mode (chars / 3 on this Python-trained
    vocabulary): within 30 % below the real length on these samples."""
    exact, rough = gemma3_estimator(gemma3, mode="exact"), gemma3_estimator(gemma3)
    assert gemma3_image_tokens(gemma3) == gemma3.image_seq_length + 3  # \n\n boi ... eoi \n\n
    worst_rel = 0.0
    for rec in conversation_records(30, seed=3):
        real = len(tokenize_with_handler(rec, gemma3)["input_ids"]) - 1
        err = exact.estimate(rec)[0] - real
        assert -_n_images(rec) <= err <= 0, (rec["sample_id"], err)
        worst_rel = max(worst_rel, abs(rough.estimate(rec)[0] - real) / real)
    assert worst_rel <= 0.30, worst_rel


@pytest.mark.badinput
def test_gemma3_rejects_video_and_audio_naming_the_sample(gemma3: Any) -> None:
    frames = [Image.new("RGB", (28, 28))] * 2
    for sid, block in ((3, {"type": "video", "video": frames}),
                       (4, {"type": "audio", "audio": [0.0] * 16})):  # fmt: skip
        rec = {"sample_id": sid, "conversation": [
            {"role": "user", "content": [block, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": "noise"}]}  # fmt: skip
        with pytest.raises(SampleError, match=rf"sample_id={sid} \[bad_media\].*Gemma3Processor"):
            tokenize_with_handler(rec, gemma3)


def test_gemma3_packed_mask_is_block_causal_without_images() -> None:
    doc = torch.tensor([[1, 1, 2, 2, 2, 0]])
    assert torch.equal(gemma3_packed_mask(doc, torch.zeros_like(doc)), to_4d_additive_mask(doc))
    with pytest.raises(ValueError, match="sliding_window=4"):
        gemma3_packed_mask(doc, torch.zeros_like(doc), sliding_window=4)


def _separate(model: Any, s: dict[str, Any]) -> torch.Tensor:
    ids = s["input_ids"][:-1][None]
    kw: dict[str, Any] = {"token_type_ids": s["mm_token_type_ids"][:-1][None]}
    if "pixel_values" in s:
        kw["pixel_values"] = s["pixel_values"]
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits[0]


@pytest.mark.parity
@pytest.mark.parametrize("bidirectional", [True, False])
def test_gemma3_packed_equals_separate(gemma3: Any, bidirectional: bool) -> None:
    """One packed row (4D additive mask, reset positions) == each sample alone, max abs diff
    <= 1e-5 fp32; a plain block-causal mask (no bidirectional image runs) must NOT match. The
    images do reach the logits (the tiny model's image projection is random, not zeros): other
    pixels change them by far more than the tolerance, so a wrong image could not pass."""
    model = tiny_gemma3_model(gemma3)
    samples = [
        tokenize_with_handler(r, gemma3) for r in conversation_records(4, seed=5, max_images=2)
    ]
    assert sum("pixel_values" in s for s in samples) >= 2
    with_image = next(s for s in samples if "pixel_values" in s)
    negative = {**with_image, "pixel_values": -with_image["pixel_values"]}  # solid colours
    moved = float((_separate(model, negative) - _separate(model, with_image)).abs().max())
    assert moved > 1e-3, moved
    pack = build_pack(samples)
    doc, tt = pack["attention_mask"][None], pack["mm_token_type_ids"][None]
    window = model.config.text_config.sliding_window
    mask = (
        gemma3_packed_mask(doc, tt, sliding_window=window)
        if bidirectional
        else to_4d_additive_mask(doc)
    )
    kw: dict[str, Any] = {"token_type_ids": tt}
    if pack["pixel_values"] is not None:
        kw["pixel_values"] = pack["pixel_values"]
    with torch.no_grad():
        packed = model(
            input_ids=pack["input_ids"][None],
            attention_mask={"full_attention": mask, "sliding_attention": mask},
            position_ids=pack["text_position_ids"][None],
            **kw,
        ).logits[0]
    worst, start = 0.0, 0
    for s, n in zip(samples, pack["seq_lens"], strict=True):
        worst = max(worst, float((packed[start : start + n] - _separate(model, s)).abs().max()))
        start += n
    if bidirectional:
        assert worst <= 1e-5, worst
    else:
        assert worst > 1e-4, worst


# -- Gemma 4: thinking-channel prefix -------------------------------------------------------


@pytest.fixture(scope="module")
def gemma4() -> Any:
    from support.tiny import load_tiny_gemma4_processor

    return load_tiny_gemma4_processor()


def test_gemma4_prefix_after_every_model_turn_and_never_labelled(gemma4: Any) -> None:
    from neatpack.pipes.families.gemma4 import GEMMA4_THINKING_PREFIX

    tok = gemma4.tokenizer
    assert get_handler(gemma4).name == "gemma4"
    for rec in conversation_records(10, seed=6, max_images=1):
        s = tokenize_with_handler(rec, gemma4)
        answers = [m["content"][0]["text"].strip() for m in rec["conversation"]
                   if m["role"] == "assistant"]  # fmt: skip
        assert label_spans(tok, s) == [a + "<turn|>" for a in answers], rec["sample_id"]
        text = tok.decode(s["input_ids"])
        assert text.count("<|turn>model\n" + GEMMA4_THINKING_PREFIX) == len(answers)
        soft = int((s["input_ids"] == gemma4.image_token_id).sum())
        sizes = [(b["image"].height, b["image"].width) for m in rec["conversation"]
                 for b in m["content"] if b.get("type") == "image"]  # fmt: skip
        want = (
            gemma4._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens if sizes else []
        )
        assert soft == sum(want) == int((s["mm_token_type_ids"] == 1).sum())


def test_gemma4_seed_style_markers_would_label_the_prefix(gemma4: Any) -> None:
    """Peer note B9: with the template's own header as the marker, the injected prefix is
    labelled. The gemma4 handler's markers include the prefix, so it is not."""
    from neatpack.pipes.families.chat_template import tokenize_default
    from neatpack.pipes.families.gemma4 import inject_thinking_prefix

    rec = conversation_records(1, seed=7, max_images=0)[0]
    seed_like = tokenize_default(rec, gemma4, text_hook=inject_thinking_prefix)
    assert label_spans(gemma4.tokenizer, seed_like)[0].startswith("<|channel>thought\n<channel|>")
    ours = tokenize_with_handler(rec, gemma4)
    assert not label_spans(gemma4.tokenizer, ours)[0].startswith("<|channel>")
    plain = tokenize_with_handler(rec, gemma4, thinking_prefix=False)
    assert "<|channel>" not in gemma4.tokenizer.decode(plain["input_ids"])


def test_gemma4_text_length_estimate_bounds(gemma4: Any) -> None:
    """Text-only records, exact mode on the template without the prefix: the estimate is short by
    exactly the prefix's tokens per model turn (the estimator does not know the hook); adding them
    makes it exact."""
    from neatpack.pipes.families.gemma4 import GEMMA4_THINKING_PREFIX
    from neatpack.pipes.indexing.estimate import LengthEstimator

    per_turn = len(gemma4.tokenizer(GEMMA4_THINKING_PREFIX, add_special_tokens=False)["input_ids"])
    est = LengthEstimator(mode="exact", processor=gemma4)
    for rec in conversation_records(15, seed=8, max_images=0):
        real = len(tokenize_with_handler(rec, gemma4)["input_ids"]) - 1
        turns = sum(m["role"] == "assistant" for m in rec["conversation"])
        assert est.estimate(rec)[0] + per_turn * turns == real, rec["sample_id"]


def _silence(sid: str, audio: Any) -> dict[str, Any]:
    return {"sample_id": sid, "conversation": [
        {"role": "user", "content": [{"type": "audio", "audio": audio}]},
        {"role": "assistant", "content": "silence"}]}  # fmt: skip


@pytest.mark.badinput
def test_gemma4_audio_as_a_list_is_refused_naming_the_sample(gemma4: Any) -> None:
    """Gemma 4 takes audio (a .wav path or a float array); a plain list is refused, not guessed
    at. The same second as an array tokenizes."""
    with pytest.raises(
        SampleError, match=r"sample_id=clip-9 \[bad_media\].*is a list; expected a \.wav path"
    ):
        tokenize_with_handler(_silence("clip-9", [0.0] * 16000), gemma4)
    ids = tokenize_with_handler(_silence("clip-9", np.zeros(16000, np.float32)), gemma4)
    audio_id = gemma4.tokenizer.convert_tokens_to_ids(gemma4.audio_token)
    assert int((ids["input_ids"] == audio_id).sum()) > 0


@pytest.mark.badinput
def test_audio_to_llava_onevision_is_refused_naming_the_sample(llava_ov: Any) -> None:
    """A family without audio names the sample, the block and what it takes (Gemma 3: above)."""
    match = r"sample_id=clip-9 \[bad_media\].*'audio' but LlavaOnevisionProcessor takes only"
    with pytest.raises(SampleError, match=match):
        tokenize_with_handler(_silence("clip-9", np.zeros(16000, np.float32)), llava_ov)


# -- LLaVA-OneVision: AnyRes image tokens, image_sizes / batch_num_images in packs -----------


@pytest.fixture(scope="module")
def llava_ov() -> Any:
    from support.tiny import load_tiny_llava_onevision_processor

    return load_tiny_llava_onevision_processor()


def test_llava_onevision_labels_tokens_and_estimate(llava_ov: Any) -> None:
    """Labels = the assistant turns; image tokens == the AnyRes rule per image (processor's
    ``_get_num_multimodal_tokens``); estimate: exact mode == real length, chars/3 mode within
    25 % (this Python-trained vocabulary)."""
    from neatpack.pipes.families.llava_onevision import (
        llava_onevision_estimate,
        llava_onevision_image_tokens,
    )

    tok = llava_ov.tokenizer
    assert get_handler(llava_ov).name == "llava_onevision"
    worst_rel = 0.0
    for rec in with_images_meta(conversation_records(12, seed=9)):
        s = tokenize_with_handler(rec, llava_ov)
        answers = [m["content"][0]["text"] + "<|im_end|>" for m in rec["conversation"]
                   if m["role"] == "assistant"]  # fmt: skip
        assert label_spans(tok, s) == answers, rec["sample_id"]
        sizes = [tuple(m) for m in rec["images_meta"]]
        n_img = int((s["input_ids"] == llava_ov.image_token_id).sum())
        assert n_img == sum(llava_onevision_image_tokens(llava_ov, sizes))
        assert n_img == int((s["mm_token_type_ids"] == 1).sum())
        if sizes:
            assert s["image_sizes"].tolist() == [list(x) for x in sizes]
        real = len(s["input_ids"]) - 1
        assert llava_onevision_estimate(rec, llava_ov) == real, rec["sample_id"]
        rough = llava_onevision_estimate(rec, llava_ov, mode="estimate")
        worst_rel = max(worst_rel, abs(rough - real) / real)
    assert worst_rel <= 0.25, worst_rel


@pytest.mark.parity
def test_llava_onevision_packed_equals_separate(llava_ov: Any) -> None:
    """Packed row (4D additive block-causal mask, reset positions, ``llava_onevision_pack_media``)
    == each sample alone, max abs diff <= 1e-5 fp32; a one-document mask over the same row must
    differ (the mask is really used)."""
    from support.tiny_family_models import tiny_llava_onevision_model

    from neatpack.pipes.families.llava_onevision import llava_onevision_pack_media

    model = tiny_llava_onevision_model(llava_ov)
    small = {"sample_id": 99, "conversation": [
        {"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (28, 28))},
                                     {"type": "text", "text": "tiny"}]},
        {"role": "assistant", "content": "one tile"}]}  # fmt: skip
    recs = [*conversation_records(3, seed=10), small]
    samples = [tokenize_with_handler(r, llava_ov) for r in recs]
    assert sum("pixel_values" in s for s in samples) >= 2
    # images of different tile counts: the pack pads the tiles
    assert len({s["pixel_values"].shape[1] for s in samples if "pixel_values" in s}) >= 2
    pack = build_pack(samples)
    media = llava_onevision_pack_media(samples)
    doc = pack["attention_mask"][None]

    def run(mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            pos = pack["text_position_ids"][None]
            ids = pack["input_ids"][None]
            return model(input_ids=ids, attention_mask=mask, position_ids=pos, **media).logits[0]

    packed = run(to_4d_additive_mask(doc))
    worst, start = 0.0, 0
    for s, n in zip(samples, pack["seq_lens"], strict=True):
        kw = {k: s[k] for k in ("pixel_values", "image_sizes", "batch_num_images") if k in s}
        with torch.no_grad():
            alone = model(input_ids=s["input_ids"][:-1][None], **kw).logits[0]
        worst = max(worst, float((packed[start : start + n] - alone).abs().max()))
        start += n
    assert worst <= 1e-5, worst
    assert float((run(to_4d_additive_mask((doc > 0).long())) - packed).abs().max()) > 1e-3


# -- Qwen2.5-VL / Qwen3-VL video: frame sampling follows the processor ----------------------


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize(("n", "fps"), [(16, 8.0), (24, 24.0), (6, 2.0), (9, 3.0)])
def test_qwen_video_frame_sampling_matches_the_estimate(family: str, n: int, fps: float) -> None:
    """Frames given as a list with their fps: tokenization follows the video processor's
    ``do_sample_frames`` (Qwen3-VL: sample at 2 fps; Qwen2.5-VL: keep all), exactly as the
    length estimator assumes; grids, ``second_per_grid_ts`` and Qwen3-VL's timestamps agree.
    Before, tokenization always kept every frame and the Qwen3-VL estimate was 2-3x short."""
    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.testing.tiny import load_tiny_processor

    proc = load_tiny_processor(family)
    frames = [Image.new("RGB", (64, 48), (10 * i, 0, 0)) for i in range(n)]
    rec = {"sample_id": 0, "videos_meta": [[n, 48, 64, fps, n / fps]], "conversation": [
        {"role": "user", "content": [{"type": "video", "video": frames, "fps": fps},
                                     {"type": "text", "text": "what happens"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "motion"}]}]}  # fmt: skip
    s = tokenize_with_handler(rec, proc)
    est = LengthEstimator.from_processor(proc, mode="exact")
    cfg = est.video
    assert cfg is not None
    total, visual = est.estimate(rec)
    assert total == len(s["input_ids"]) - 1
    grid = s["video_grid_thw"][0].tolist()
    assert grid[0] == cfg.grid_t(n, fps)
    assert visual == int((s["mm_token_type_ids"] == 2).sum())
    kept = cfg.frames(n, fps)
    if family == "qwen3_vl":
        assert kept < n or fps <= proc.video_processor.fps  # really sampled at 2 fps
        text = proc.tokenizer.decode(s["input_ids"])
        for stamp in cfg.timestamp_texts(n, fps):
            assert stamp in text
    else:
        assert kept == n
        spg = float(s["second_per_grid_ts"][0])
        assert spg == pytest.approx(proc.video_processor.temporal_patch_size / fps)


@pytest.mark.parity
@pytest.mark.parametrize("bidirectional_vision", [False, True])
def test_gemma4_packed_equals_separate(gemma4: Any, bidirectional_vision: bool) -> None:
    """Thinking-prefixed samples with images, one packed row vs each alone on a tiny real
    ``Gemma4ForConditionalGeneration``: max abs diff <= 1e-5 fp32, for the default causal text
    model and for ``use_bidirectional_attention="vision"`` (sliding layers see each image run
    both ways); with "vision", a block-causal sliding mask must NOT match."""
    from support.tiny_family_models import tiny_gemma4_model

    from neatpack.pipes.families.gemma4 import gemma4_packed_masks

    model = tiny_gemma4_model(gemma4, bidirectional_vision=bidirectional_vision)
    samples = [
        tokenize_with_handler(r, gemma4) for r in conversation_records(3, seed=11, max_images=1)
    ]
    assert sum("pixel_values" in s for s in samples) >= 1
    pack = build_pack(samples)
    doc, mm = pack["attention_mask"][None], pack["mm_token_type_ids"][None]

    def run(masks: dict[str, torch.Tensor]) -> torch.Tensor:
        kw: dict[str, Any] = {"mm_token_type_ids": mm}
        if pack["pixel_values"] is not None:
            kw.update(
                pixel_values=pack["pixel_values"], image_position_ids=pack["image_position_ids"]
            )
        with torch.no_grad():
            return model(input_ids=pack["input_ids"][None], attention_mask=masks,
                         position_ids=pack["text_position_ids"][None], **kw).logits[0]  # fmt: skip

    packed = run(gemma4_packed_masks(doc, mm, bidirectional_vision=bidirectional_vision))
    worst, start = 0.0, 0
    for s, n in zip(samples, pack["seq_lens"], strict=True):
        kw = {k: s[k] for k in ("pixel_values", "image_position_ids") if k in s}
        kw["mm_token_type_ids"] = s["mm_token_type_ids"][:-1][None]
        with torch.no_grad():
            alone = model(input_ids=s["input_ids"][:-1][None], **kw).logits[0]
        worst = max(worst, float((packed[start : start + n] - alone).abs().max()))
        start += n
    assert worst <= 1e-5, worst
    if bidirectional_vision:
        causal = run(gemma4_packed_masks(doc, mm, bidirectional_vision=False))
        assert float((causal - packed).abs().max()) > 1e-4


# -- the shipped family processors -----------------------------------------------------------

FAMILY_DIRS = ("gemma3", "gemma4", "idefics3", "internvl", "llava_onevision")


def test_family_processor_assets_are_small() -> None:
    from support.tiny import ASSETS

    for family in FAMILY_DIRS:
        folder = ASSETS / family
        size = sum(p.stat().st_size for p in folder.iterdir())
        assert 0 < size < 400 * 1024, (family, size)


@pytest.mark.slow
def test_family_processors_rebuild_byte_for_byte(tmp_path: Any) -> None:
    """``scripts/build_tiny_family_processors.py`` reproduces the committed files exactly."""
    import subprocess
    import sys
    from pathlib import Path

    from support.tiny import ASSETS

    script = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_family_processors.py"
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True)
    for family in FAMILY_DIRS:
        shipped = ASSETS / family
        names = sorted(p.name for p in shipped.iterdir())
        assert names == sorted(p.name for p in (tmp_path / family).iterdir())
        for name in names:
            assert (tmp_path / family / name).read_bytes() == (shipped / name).read_bytes(), name


# -- Idefics3 / SmolVLM-style tiles ----------------------------------------------------------


@pytest.fixture(scope="module")
def idefics3() -> Any:
    from support.tiny import load_tiny_idefics3_processor

    return load_tiny_idefics3_processor()


def test_idefics3_labels_tokens_and_estimate(idefics3: Any) -> None:
    """Labels = the assistant turns (the space after "Assistant:" rides in the first labelled
    token); ``<image>`` tokens == image_seq_len x tiles; estimate exact mode == real length,
    chars/3 mode within 25 %."""
    from neatpack.pipes.families.idefics3 import idefics3_estimate, idefics3_image_tokens

    tok = idefics3.tokenizer
    assert get_handler(idefics3).name == "idefics3"
    worst_rel = 0.0
    for rec in with_images_meta(conversation_records(12, seed=12)):
        s = tokenize_with_handler(rec, idefics3)
        answers = [m["content"][0]["text"] + "<end_of_utterance>" for m in rec["conversation"]
                   if m["role"] == "assistant"]  # fmt: skip
        assert [x.lstrip(" ") for x in label_spans(tok, s)] == answers, rec["sample_id"]
        sizes = [tuple(m) for m in rec["images_meta"]]
        n_img = int((s["input_ids"] == idefics3.image_token_id).sum())
        assert n_img == sum(idefics3_image_tokens(idefics3, sizes))
        assert n_img == int((s["mm_token_type_ids"] == 1).sum())
        if sizes:
            assert n_img == idefics3.image_seq_len * s["pixel_values"].shape[1]
        real = len(s["input_ids"]) - 1
        assert idefics3_estimate(rec, idefics3) == real, rec["sample_id"]
        worst_rel = max(
            worst_rel, abs(idefics3_estimate(rec, idefics3, mode="estimate") - real) / real
        )
    assert worst_rel <= 0.25, worst_rel


@pytest.mark.parity
def test_idefics3_packed_equals_separate(idefics3: Any) -> None:
    """Packed row (block-causal 4D additive mask, reset positions, tiles concatenated) == each
    sample alone (max abs diff <= 1e-5 fp32); a one-document mask over the same row differs."""
    from support.tiny_family_models import tiny_idefics3_model

    from neatpack.pipes.families.idefics3 import idefics3_pack_media

    model = tiny_idefics3_model(idefics3)
    samples = [tokenize_with_handler(r, idefics3) for r in conversation_records(4, seed=13)]
    assert sum("pixel_values" in s for s in samples) >= 2
    pack = build_pack(samples)
    media = idefics3_pack_media(samples)
    doc = pack["attention_mask"][None]

    def run(mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            pos, ids = pack["text_position_ids"][None], pack["input_ids"][None]
            return model(input_ids=ids, attention_mask=mask, position_ids=pos, **media).logits[0]

    packed = run(to_4d_additive_mask(doc))
    worst, start = 0.0, 0
    for s, n in zip(samples, pack["seq_lens"], strict=True):
        kw = {k: s[k] for k in ("pixel_values", "pixel_attention_mask") if k in s}
        with torch.no_grad():
            alone = model(input_ids=s["input_ids"][:-1][None], **kw).logits[0]
        worst = max(worst, float((packed[start : start + n] - alone).abs().max()))
        start += n
    assert worst <= 1e-5, worst
    assert float((run(to_4d_additive_mask((doc > 0).long())) - packed).abs().max()) > 1e-3


# -- one entry point for every 1-D-position family -------------------------------------------

_FAMILIES: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    # family: (model builder in support.tiny_family_models, per-sample media keys, token-type kwarg)
    "gemma3": ("tiny_gemma3_model", ("pixel_values",), "token_type_ids"),
    "gemma4": ("tiny_gemma4_model", ("pixel_values", "image_position_ids"),
               "mm_token_type_ids"),
    "llava_onevision": ("tiny_llava_onevision_model",
                        ("pixel_values", "image_sizes", "batch_num_images"), None),
    "idefics3": ("tiny_idefics3_model",
                 ("pixel_values", "pixel_attention_mask"), None),
    "internvl": ("tiny_internvl_model", ("pixel_values",), None),
}  # fmt: skip


@pytest.mark.parity
@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_packed_model_inputs_equal_separate_runs(family: str) -> None:
    """``registry.packed_model_inputs`` (the handler's pack media and packed mask) gives each
    family's tiny real model the same logits as the samples run alone (<= 1e-5 fp32)."""
    from support import tiny, tiny_family_models

    from neatpack.pipes.families import packed_model_inputs

    builder, keys, types_kw = _FAMILIES[family]
    proc = getattr(tiny, f"load_tiny_{family}_processor")()
    model = getattr(tiny_family_models, builder)(proc)
    samples = [
        tokenize_with_handler(r, proc) for r in conversation_records(3, seed=21, max_images=1)
    ]
    assert sum("pixel_values" in s for s in samples) >= 1
    inputs = packed_model_inputs(samples, proc)
    lens = inputs.pop("seq_lens")
    with torch.no_grad():
        packed = model(**inputs).logits[0]
    worst, start = 0.0, 0
    for s, n in zip(samples, lens, strict=True):
        kw = {k: s[k] for k in keys if k in s}
        if types_kw is not None:
            kw[types_kw] = s["mm_token_type_ids"][:-1][None]
        with torch.no_grad():
            alone = model(input_ids=s["input_ids"][:-1][None], **kw).logits[0]
        worst = max(worst, float((packed[start : start + n] - alone).abs().max()))
        start += n
    assert worst <= 1e-5, (family, worst)


@pytest.mark.badinput
def test_packed_model_inputs_refuses_mrope_families() -> None:
    from neatpack.pipes.families import packed_model_inputs
    from neatpack.pipes.testing.tiny import load_tiny_processor

    with pytest.raises(ValueError, match="'qwen_vl' needs mRoPE positions"):
        packed_model_inputs([], load_tiny_processor("qwen2_vl"))


# -- InternVL: the processor-agnostic default, no family code ---------------------------------


def test_internvl_through_the_default_handler() -> None:
    """No InternVL code in neatpack: labels decoded = the assistant turns, image tokens (with
    ``<img>``/``</img>``) == the processor's count, ``default_estimate`` exact == real length and
    chars/3 within 25 %."""
    from support.tiny import load_tiny_internvl_processor

    from neatpack.pipes.families.chat_template import default_estimate

    proc = load_tiny_internvl_processor()
    assert get_handler(proc).name == "chat_template"
    tok = proc.tokenizer
    worst_rel = 0.0
    for rec in with_images_meta(conversation_records(12, seed=14)):
        s = tokenize_with_handler(rec, proc)
        answers = [m["content"][0]["text"] + "<|im_end|>" for m in rec["conversation"]
                   if m["role"] == "assistant"]  # fmt: skip
        assert label_spans(tok, s) == answers, rec["sample_id"]
        sizes = [list(m) for m in rec["images_meta"]]
        want = proc._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens if sizes else []
        assert int((s["mm_token_type_ids"] == 1).sum()) == sum(want)
        context = int((s["input_ids"] == proc.image_token_id).sum())
        assert context == proc.image_seq_length * (s["pixel_values"].shape[0] if sizes else 0)
        real = len(s["input_ids"]) - 1
        assert default_estimate(rec, proc) == real, rec["sample_id"]
        worst_rel = max(worst_rel, abs(default_estimate(rec, proc, mode="estimate") - real) / real)
    assert worst_rel <= 0.25, worst_rel


# -- template probe: a declared placeholder the vocabulary lacks -------------------------------


def test_a_placeholder_missing_from_the_vocabulary_is_reported_not_looked_up() -> None:
    """SmolVLMProcessor declares ``video_token="<video>"`` whatever its tokenizer holds; with a
    vocabulary without it (the tiny Idefics3 one, as in the real SmolVLM) the lookup gave None
    and the probe died on ``int(None)``. Now the token is reported as missing, the image token
    is still left out of the count, and the video's text pieces are counted as text."""
    pytest.importorskip("num2words", reason="SmolVLMProcessor imports num2words (test extra)")
    import transformers as tf
    from support.tiny import load_tiny_idefics3_processor, load_tiny_smolvlm_processor

    from neatpack.pipes.indexing._template_probe import (
        placeholder_tokens,
        probe_overhead,
        templated_text_tokens,
    )

    small, tok = load_tiny_smolvlm_processor(), load_tiny_idefics3_processor().tokenizer
    assert tok.convert_tokens_to_ids("<video>") is None
    proc = tf.SmolVLMProcessor(
        image_processor=small.image_processor, tokenizer=tok,
        video_processor=small.video_processor, image_seq_len=small.image_seq_len,
        chat_template=small.chat_template,
    )  # fmt: skip
    image_id = tok.convert_tokens_to_ids("<image>")
    assert placeholder_tokens(proc) == ({"<image>": image_id}, ["<video>"])
    assert placeholder_tokens(small) == (
        {"<image>": image_id, "<video>": small.tokenizer.convert_tokens_to_ids("<video>")},
        [],
    )
    conv = [{"role": "user", "content": [
        {"type": "video", "video": "v.mp4"}, {"type": "image", "image": "a.jpg"},
        {"type": "text", "text": "hi"}]}]  # fmt: skip
    ids = tok(proc.apply_chat_template(conv, tokenize=False), add_special_tokens=False)
    assert templated_text_tokens(proc, conv) == len(ids["input_ids"]) - 1  # one <image>
    overhead = probe_overhead(proc)
    assert overhead.per_image == probe_overhead(small).per_image
    assert overhead.per_video > probe_overhead(small).per_video  # "<video>" counted as text
