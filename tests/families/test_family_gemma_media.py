"""Gemma 3 pan-and-scan crops and Gemma 4 video / audio, on the tiny real processors and models.

Pan-and-scan: the tiny processor's images are 28x28, so crops are enabled with
``min_crop_size=14`` (the real default, 256, never fires on these small images).
"""

from __future__ import annotations

import random
import re
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from support.family_checks import label_spans, worst_vs_alone
from support.tiny import load_tiny_gemma3_processor
from support.tiny_family_models import tiny_gemma3_model
from support.versions import batches_unequal_videos

from neatpack.pipes.families import tokenize_with_handler
from neatpack.pipes.families.gemma3 import (
    PanAndScan,
    gemma3_estimator,
    gemma3_num_crops,
    gemma3_pack_media,
    gemma3_packed_mask,
    gemma3_pan_and_scan,
    gemma3_pan_and_scan_settings,
)
from neatpack.pipes.materializing.pack import build_pack
from neatpack.pipes.reading.media import SampleError

WORDS = "the a cat sat on mat dog ran far quick brown fox jumps over lazy river".split()  # noqa: SIM905
# (width, height): square, wide and tall (crops), just under / at the 1.2 ratio, very wide
SIZES = [(28, 28), (140, 56), (56, 140), (33, 28), (34, 28), (200, 30), (60, 200), (90, 40)]


@pytest.fixture(scope="module")
def gemma3_pas() -> Any:
    return gemma3_pan_and_scan(load_tiny_gemma3_processor(), min_crop_size=14)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def _image(rng: random.Random) -> Image.Image:
    w, h = rng.choice(SIZES)
    return Image.new("RGB", (w, h), (rng.randint(0, 255), rng.randint(0, 255), 40))


def _record(sid: int, rng: random.Random, max_images: int = 2) -> dict[str, Any]:
    conv: list[dict[str, Any]] = []
    for _ in range(rng.randint(1, 2)):
        user: list[dict[str, Any]] = [
            {"type": "image", "image": _image(rng)} for _ in range(rng.randint(0, max_images))
        ]
        user.append({"type": "text", "text": _text(rng, 2, 20)})
        conv.append({"role": "user", "content": user})
        conv.append({"role": "assistant", "content": [{"type": "text", "text": _text(rng, 1, 25)}]})
    return {"sample_id": sid, "conversation": conv}


def _images(rec: dict[str, Any]) -> list[Image.Image]:
    return [b["image"] for m in rec["conversation"] for b in m["content"] if b["type"] == "image"]


# -- Gemma 3 pan-and-scan ----------------------------------------------------------------------


def test_pan_and_scan_is_off_by_default_and_settings_are_the_processors() -> None:
    plain = load_tiny_gemma3_processor()
    assert gemma3_pan_and_scan_settings(plain) is None
    assert gemma3_num_crops(plain, 28, 140) == 0
    on = gemma3_pan_and_scan(load_tiny_gemma3_processor(), min_crop_size=14, max_num_crops=3)
    assert gemma3_pan_and_scan_settings(on) == PanAndScan(14, 3, 1.2)
    # the real processor call honours it (setting image_processor.do_pan_and_scan would not)
    out = on(text=["<start_of_image>"], images=[Image.new("RGB", (200, 30))], return_tensors="pt")
    assert out["pixel_values"].shape[0] == 1 + gemma3_num_crops(on, 30, 200) == 4


def test_crops_and_soft_tokens_match_the_processor(gemma3_pas: Any) -> None:
    """Per size: pixel rows == 1 + crops, one soft-token run of image_seq_length per row, the
    processor's own text around them; wide and tall sizes do crop."""
    tok, seq = gemma3_pas.tokenizer, int(gemma3_pas.image_seq_length)
    seen = set()
    for w, h in SIZES:
        n = gemma3_num_crops(gemma3_pas, h, w)
        seen.add(n)
        rec = {"sample_id": w * 1000 + h, "conversation": [
            {"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (w, h))},
                                         {"type": "text", "text": "what is it"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a box"}]}]}  # fmt: skip
        s = tokenize_with_handler(rec, gemma3_pas)
        assert s["pixel_values"].shape[0] == 1 + n, (w, h)
        soft = s["mm_token_type_ids"] == 1
        assert int(soft.sum()) == seq * (1 + n)
        runs = int((soft & ~torch.nn.functional.pad(soft, (1, 0))[:-1]).sum())
        assert runs == 1 + n  # each crop its own run
        text = tok.decode(s["input_ids"])
        assert ("here are some crops" in text) == (n > 0)
        assert label_spans(tok, s) == ["a box<end_of_turn>"]  # labels unchanged by crops
    assert {0, 2, 3}.issubset(seen), seen


def test_labels_are_unchanged_by_pan_and_scan(gemma3_pas: Any) -> None:
    plain, rng = load_tiny_gemma3_processor(), random.Random(4)
    for rec in (_record(i, rng) for i in range(12)):
        a, b = tokenize_with_handler(rec, plain), tokenize_with_handler(rec, gemma3_pas)
        assert label_spans(plain.tokenizer, a) == label_spans(gemma3_pas.tokenizer, b)
        assert bool((b["labels"][b["mm_token_type_ids"] == 1] == -100).all())


def test_estimate_with_pan_and_scan(gemma3_pas: Any) -> None:
    """exact mode == real length on every record (crops counted from the image sizes, also from
    images_meta alone). estimate mode: the same visual tokens (crops exact), text by chars / 3,
    which runs low on this Python-trained vocabulary: observed -32 % .. -4 %, bound -35 .. +5 %."""
    exact, rough = gemma3_estimator(gemma3_pas, mode="exact"), gemma3_estimator(gemma3_pas)
    assert exact.pan_and_scan == PanAndScan(14, 4, 1.2)
    rng, cropped = random.Random(11), 0
    for rec in (_record(i, rng, max_images=3) for i in range(40)):
        real = len(tokenize_with_handler(rec, gemma3_pas)["input_ids"]) - 1
        assert exact.estimate(rec)[0] == real, rec["sample_id"]
        meta = {**rec, "images_meta": [[im.height, im.width] for im in _images(rec)]}
        assert exact.estimate(meta)[0] == real
        cropped += sum(gemma3_num_crops(gemma3_pas, im.height, im.width) > 0 for im in _images(rec))
        total, visual = rough.estimate(meta)
        assert visual == exact.estimate(meta)[1]
        rel = (total - real) / real
        assert -0.35 <= rel <= 0.05, (rec["sample_id"], rel)
    assert cropped >= 10
    assert not exact.fallbacks.counts


@pytest.mark.parity
def test_gemma3_pan_and_scan_packed_equals_separate(gemma3_pas: Any) -> None:
    """A packed row holding cropped images (pixel rows = thumbnails + crops in document order)
    == each sample alone, max abs diff <= 1e-5 fp32."""
    model = tiny_gemma3_model(gemma3_pas)
    rng = random.Random(2)
    samples = [tokenize_with_handler(_record(i, rng), gemma3_pas) for i in range(4)]
    rows = [s["pixel_values"].shape[0] for s in samples if "pixel_values" in s]
    assert len(rows) >= 2  # several images,
    assert max(rows) >= 3  # at least one cropped
    pack = build_pack(samples)
    doc, tt = pack["attention_mask"][None], pack["mm_token_type_ids"][None]
    mask = gemma3_packed_mask(doc, tt, sliding_window=model.config.text_config.sliding_window)
    with torch.no_grad():
        packed = model(
            input_ids=pack["input_ids"][None],
            attention_mask={"full_attention": mask, "sliding_attention": mask},
            position_ids=pack["text_position_ids"][None],
            token_type_ids=tt,
            **gemma3_pack_media(samples),
        ).logits[0]
    worst, start = 0.0, 0
    for s, n in zip(samples, pack["seq_lens"], strict=True):
        kw: dict[str, Any] = {"token_type_ids": s["mm_token_type_ids"][:-1][None]}
        if "pixel_values" in s:
            kw["pixel_values"] = s["pixel_values"]
        with torch.no_grad():
            alone = model(input_ids=s["input_ids"][:-1][None], **kw).logits[0]
        worst = max(worst, float((packed[start : start + n] - alone).abs().max()))
        start += n
    assert worst <= 1e-5, worst


@pytest.mark.badinput
def test_bad_pan_and_scan_settings() -> None:
    with pytest.raises(ValueError, match="max_num_crops=1"):
        gemma3_pan_and_scan(load_tiny_gemma3_processor(), max_num_crops=1)


# -- Gemma 4 video -----------------------------------------------------------------------------

G4_KEYS = ("pixel_values", "image_position_ids", "pixel_values_videos", "video_position_ids",
           "num_frames_per_video")  # fmt: skip


@pytest.fixture(scope="module")
def gemma4() -> Any:
    from support.tiny import load_tiny_gemma4_processor

    return load_tiny_gemma4_processor()


def _video(rng: random.Random) -> list[Image.Image]:
    w, h = rng.choice([(32, 24), (24, 40), (28, 28), (48, 16)])
    return [
        Image.new("RGB", (w, h), (rng.randint(0, 255), 20 * k, 9)) for k in range(rng.randint(1, 4))
    ]


def _g4_record(sid: int, rng: random.Random) -> dict[str, Any]:
    user: list[dict[str, Any]] = []
    for _ in range(rng.randint(0, 2)):
        if rng.random() < 0.6:
            user.append({"type": "video", "video": _video(rng)})
        else:
            user.append({"type": "image", "image": _image(rng)})
    if rng.random() < 0.5:  # frame rates for all the videos (else the processor's 24 fps)
        for block in user:
            block.update({"fps": rng.choice([0.5, 1.0, 2.0])} if block["type"] == "video" else {})
    user.append({"type": "text", "text": _text(rng, 2, 15)})
    answer = [{"type": "text", "text": _text(rng, 1, 15)}]
    return {"sample_id": sid, "conversation": [
        {"role": "user", "content": user}, {"role": "assistant", "content": answer}]}  # fmt: skip


def test_gemma4_video_tokens_labels_and_estimate(gemma4: Any) -> None:
    """Per video: k tokens per frame, frames * k == the processor's _get_num_multimodal_tokens,
    one "mm:ss <|image>...<image|>" run per frame, mm:ss at the blocks' fps; labels are exactly
    the answer; the exact estimate == the real length; the estimate mode within -35 % .. +5 %
    (chars / 3 text)."""
    from neatpack.pipes.families.gemma4 import gemma4_estimate, gemma4_video_tokens

    tok, rng, videos, timed = gemma4.tokenizer, random.Random(5), 0, 0
    unequal_ok = batches_unequal_videos(gemma4)
    for rec in (_g4_record(i, rng) for i in range(20)):
        vids = [b["video"] for b in rec["conversation"][0]["content"] if b["type"] == "video"]
        if not unequal_ok and len({len(v) for v in vids}) > 1:
            # transformers 5.17's video processor stacks a sample's videos: refused by name
            with pytest.raises(SampleError, match=rf"sample_id={rec['sample_id']} \[processor"):
                tokenize_with_handler(rec, gemma4)
            continue
        s = tokenize_with_handler(rec, gemma4)
        videos += len(vids)
        sizes = [(len(v), v[0].height, v[0].width) for v in vids]
        want = [gemma4_video_tokens(gemma4, *size) for size in sizes]
        assert int((s["mm_token_type_ids"] == 2).sum()) == sum(want)
        if vids:
            if "num_frames_per_video" in s:  # transformers 5.2x; 5.17 keeps [videos, frames]
                assert s["num_frames_per_video"].tolist() == [len(v) for v in vids]
            pixels = s["pixel_values_videos"]
            assert pixels.reshape(-1, *pixels.shape[-2:]).shape[0] == sum(len(v) for v in vids)
            blocks = [b for b in rec["conversation"][0]["content"] if b["type"] == "video"]
            timed += any("fps" in b for b in blocks)
            stamps = [f"{int(k / b.get('fps', 24)) // 60:02d}:{int(k / b.get('fps', 24)) % 60:02d}"
                      for b in blocks for k in range(len(b["video"]))]  # fmt: skip
            assert re.findall(r"(\d\d:\d\d) <\|image>", tok.decode(s["input_ids"])) == stamps
        answer = rec["conversation"][1]["content"][0]["text"]
        assert label_spans(tok, s) == [answer + "<turn|>"]
        real = len(s["input_ids"]) - 1
        assert gemma4_estimate(rec, gemma4) == real, rec["sample_id"]
        rel = (gemma4_estimate(rec, gemma4, mode="estimate") - real) / real
        assert -0.35 <= rel <= 0.05, (rec["sample_id"], rel)
    assert videos >= 8
    assert timed >= 3


@pytest.mark.parity
@pytest.mark.parametrize(
    "bidirectional_vision", [pytest.param(False, marks=pytest.mark.slow), True]
)
def test_gemma4_video_packed_equals_separate(gemma4: Any, bidirectional_vision: bool) -> None:
    """Documents with videos and images in one packed row (``gemma4_pack_media``: frames,
    positions and frame counts in document order; ``gemma4_packed_masks``: with "vision" each
    frame's run sees itself both ways on the sliding layers) == each alone, <= 1e-5 fp32."""
    from support.tiny_family_models import tiny_gemma4_model

    from neatpack.pipes.families.gemma4 import gemma4_pack_media, gemma4_packed_masks

    model = tiny_gemma4_model(gemma4, bidirectional_vision=bidirectional_vision)
    rng = random.Random(13)  # 3 documents with videos (2 with an fps), 2 with images
    samples = [tokenize_with_handler(_g4_record(i, rng), gemma4) for i in range(4)]
    assert sum("pixel_values_videos" in s for s in samples) >= 2
    pack = build_pack(samples)
    doc, mm = pack["attention_mask"][None], pack["mm_token_type_ids"][None]
    with torch.no_grad():
        packed = model(
            input_ids=pack["input_ids"][None],
            attention_mask=gemma4_packed_masks(doc, mm, bidirectional_vision=bidirectional_vision),
            position_ids=pack["text_position_ids"][None],
            mm_token_type_ids=mm,
            **gemma4_pack_media(samples),
        ).logits[0]
    worst = worst_vs_alone(model, samples, packed, pack["seq_lens"], G4_KEYS, token_types=True)
    assert worst <= 1e-5, worst


# -- Gemma 4 audio -----------------------------------------------------------------------------


def _wave(rng: random.Random, n: int) -> np.ndarray:
    t = np.arange(n, dtype=np.float32)
    wav: np.ndarray = (0.3 * np.sin(t * rng.uniform(0.01, 0.3))).astype(np.float32)
    return wav


def _audio_record(sid: int, rng: random.Random, tmp: Path) -> dict[str, Any]:
    user: list[dict[str, Any]] = []
    for k in range(rng.randint(1, 2)):
        wav = _wave(rng, rng.randint(2000, 40000))
        if k == 0 and rng.random() < 0.5:  # a real WAV file for the first clip, sometimes
            path = tmp / f"clip{sid}.wav"
            with wave.open(str(path), "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(16000)
                w.writeframes((wav * 32767).astype("<i2").tobytes())
            user.append({"type": "audio", "audio": str(path)})
        else:
            user.append({"type": "audio", "audio": wav})
    if rng.random() < 0.5:
        user.append({"type": "image", "image": _image(rng)})
    user.append({"type": "text", "text": _text(rng, 2, 12)})
    answer = [{"type": "text", "text": _text(rng, 1, 12)}]
    return {"sample_id": sid, "conversation": [
        {"role": "user", "content": user}, {"role": "assistant", "content": answer}]}  # fmt: skip


def _n_samples(audio: Any) -> int:
    if isinstance(audio, np.ndarray):
        return int(audio.shape[0])
    with wave.open(audio) as w:
        return int(w.getnframes())


def test_gemma4_audio_tokens_labels_and_estimate(gemma4: Any, tmp_path: Path) -> None:
    """Each audio's run == the processor's duration rule (``_get_num_multimodal_tokens``, 25 per
    second), inside <|audio> ... <audio|>; labels are the answer only; the exact estimate ==
    the real length (also from audios_meta seconds alone); estimate mode -35 % .. +5 %."""
    from neatpack.pipes.families.gemma4 import gemma4_estimate

    tok, rng, clips = gemma4.tokenizer, random.Random(6), 0
    for rec in (_audio_record(i, rng, tmp_path) for i in range(12)):
        s = tokenize_with_handler(rec, gemma4)
        blocks = [b for b in rec["conversation"][0]["content"] if b["type"] == "audio"]
        clips += len(blocks)
        lengths = [_n_samples(b["audio"]) for b in blocks]
        want = gemma4._get_num_multimodal_tokens(audio_lengths=lengths).num_audio_tokens
        audio = (s["mm_token_type_ids"] == 3).long()
        starts = audio & ~torch.nn.functional.pad(audio, (1, 0))[:-1].bool()
        assert int(starts.sum()) == len(blocks)
        assert int(audio.sum()) == sum(want)
        assert s["input_features"].shape[0] == s["input_features_mask"].shape[0] == len(blocks)
        answer = rec["conversation"][1]["content"][0]["text"]
        assert label_spans(tok, s) == [answer + "<turn|>"]
        real = len(s["input_ids"]) - 1
        assert gemma4_estimate(rec, gemma4) == real, rec["sample_id"]
        meta = {**rec, "audios_meta": [n / 16000 for n in lengths]}
        assert gemma4_estimate(meta, gemma4) == real
        rel = (gemma4_estimate(rec, gemma4, mode="estimate") - real) / real
        assert -0.35 <= rel <= 0.05, (rec["sample_id"], rel)
    assert clips >= 15


@pytest.mark.parity
def test_gemma4_audio_packed_equals_separate(gemma4: Any, tmp_path: Path) -> None:
    """Documents with audio (and images) in one packed row on a tiny Gemma 4 WITH an audio
    tower: features padded in time to the longest clip (mask False) == each alone, <= 1e-5."""
    from support.tiny_family_models import tiny_gemma4_model

    from neatpack.pipes.families.gemma4 import gemma4_pack_media, gemma4_packed_masks

    model = tiny_gemma4_model(gemma4, audio=True)
    rng = random.Random(9)
    samples = [tokenize_with_handler(_audio_record(i, rng, tmp_path), gemma4) for i in range(3)]
    media = gemma4_pack_media(samples)
    widths = {int(s["input_features"].shape[1]) for s in samples}
    assert len(widths) > 1  # the padding in time is exercised
    pack = build_pack(samples)
    doc, mm = pack["attention_mask"][None], pack["mm_token_type_ids"][None]

    def run(**over: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(  # type: ignore[no-any-return]
                input_ids=pack["input_ids"][None],
                attention_mask=gemma4_packed_masks(doc, mm),
                position_ids=pack["text_position_ids"][None],
                mm_token_type_ids=mm,
                **{**media, **over},
            ).logits[0]

    packed = run()
    keys = (*G4_KEYS, "input_features", "input_features_mask")
    worst = worst_vs_alone(model, samples, packed, pack["seq_lens"], keys, token_types=True)
    assert worst <= 1e-5, worst
    silent = run(input_features=torch.zeros_like(media["input_features"]))
    assert float((silent - packed).abs().max()) > 1e-4  # the audio really reaches the logits


@pytest.mark.badinput
def test_gemma4_bad_audio_names_the_sample(gemma4: Any) -> None:
    from neatpack.pipes.reading.media import SampleError

    def rec(block: dict[str, Any]) -> dict[str, Any]:
        return {"sample_id": "a-7", "conversation": [
            {"role": "user", "content": [block, {"type": "text", "text": "hear"}]},
            {"role": "assistant", "content": "ok"}]}  # fmt: skip

    long = np.zeros(16000 * 31, np.float32)
    with pytest.raises(SampleError, match=r"sample_id=a-7 .*longer than"):
        tokenize_with_handler(rec({"type": "audio", "audio": long}), gemma4)
    block = {"type": "audio", "audio": np.zeros(800, np.float32), "sampling_rate": 22050}
    with pytest.raises(SampleError, match=r"sample_id=a-7 .*22050 Hz"):
        tokenize_with_handler(rec(block), gemma4)
    with pytest.raises(SampleError, match=r"sample_id=a-7 .*too short for one token"):
        tokenize_with_handler(rec({"type": "audio", "audio": np.zeros(100, np.float32)}), gemma4)
