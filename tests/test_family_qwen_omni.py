"""Qwen2.5-Omni: text, images and audio through the real ``Qwen2_5OmniProcessor`` (tiny, offline).

Labels = exactly the assistant turns (decoded), image tokens = grid / merge**2, audio tokens = the
processor's duration rule and the features' mask, the length estimate against the real length,
bad audio refused naming the sample, and packed-vs-separate parity on a tiny real
``Qwen2_5OmniThinkerForConditionalGeneration`` with positions from its own ``get_rope_index``.
WAV files are written with the stdlib ``wave`` module.
"""

from __future__ import annotations

import random
import sys
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from neatpack.pipes.family_qwen_omni import (
    _FOLDER,
    load_tiny_qwen_omni_processor,
    qwen_omni_audio_tokens,
    qwen_omni_estimate,
    qwen_omni_mrope,
    qwen_omni_pack_media,
    qwen_omni_position_ids,
    tiny_qwen_omni_model,
    tokenize_qwen_omni,
)
from neatpack.pipes.mask import to_4d_additive_mask
from neatpack.pipes.media import SampleError
from neatpack.pipes.pack import build_pack
from neatpack.pipes.registry import get_handler, tokenize_with_handler

WORDS = (
    "the", "cat", "sat", "on", "a", "mat", "while", "data", "flows", "through", "every",
    "packed", "row", "of", "tokens", "and", "sounds", "return", "value",
)  # fmt: skip
RATE = 16000


@pytest.fixture(scope="module")
def omni() -> Any:
    return load_tiny_qwen_omni_processor()


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE, channels: int = 1) -> Path:
    """16-bit PCM WAV of ``samples`` (floats in [-1, 1]; ``[n, channels]`` when channels > 1)."""
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


def _wave_form(rng: random.Random, n: int) -> np.ndarray:
    t = np.arange(n) / RATE
    return (0.3 * np.sin(2 * np.pi * rng.uniform(100, 900) * t)).astype(np.float32)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def _record(sid: int, rng: random.Random, tmp: Path) -> dict[str, Any]:
    """1-3 turns; each user turn has 0-2 audio clips (WAV file or array, 0.05-4 s), 0-1 image."""
    conv: list[dict[str, Any]] = []
    images_meta: list[list[int]] = []
    audios_meta: list[float] = []
    if rng.random() < 0.4:
        conv.append({"role": "system", "content": [{"type": "text", "text": _text(rng, 2, 8)}]})
    for turn in range(rng.randint(1, 3)):
        user: list[dict[str, Any]] = []
        for k in range(rng.randint(0, 2)):
            n = rng.randint(800, 4 * RATE)
            wav = _wave_form(rng, n)
            if rng.random() < 0.5:
                src: Any = str(write_wav(tmp / f"s{sid}_{turn}_{k}.wav", wav))
            else:
                src = wav
            user.append({"type": "audio", "audio": src, "_seconds": n / RATE})
        if rng.random() < 0.5:
            h, w = rng.randint(28, 120), rng.randint(28, 120)
            user.append(
                {"type": "image", "image": Image.new("RGB", (w, h), (rng.randint(0, 255), 9, 9))}
            )
        rng.shuffle(user)
        for b in user:  # metadata in block order
            if b["type"] == "audio":
                audios_meta.append(b.pop("_seconds"))
            else:
                images_meta.append([b["image"].height, b["image"].width])
        user.append({"type": "text", "text": _text(rng, 2, 20)})
        conv.append({"role": "user", "content": user})
        conv.append({"role": "assistant", "content": [{"type": "text", "text": _text(rng, 1, 25)}]})
    return {"sample_id": sid, "conversation": conv, "images_meta": images_meta,
            "audios_meta": audios_meta}  # fmt: skip


def _records(n: int, seed: int, tmp: Path) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_record(i, rng, tmp) for i in range(n)]


def _blocks(rec: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [b for m in rec["conversation"] for b in m["content"] if b.get("type") == kind]


def _spans(tok: Any, s: dict[str, Any]) -> list[str]:
    keep, ids = (s["labels"] != -100).tolist(), s["input_ids"].tolist()
    out, cur = [], []
    for k, t in zip([*keep, False], [*ids, -1], strict=True):
        if k:
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out


def _runs(s: dict[str, Any], code: int) -> list[int]:
    """Lengths of the maximal runs of token type ``code``, in order."""
    out, n = [], 0
    for t in [*s["mm_token_type_ids"].tolist(), -1]:
        if t == code:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


def _frames(n: int, w: int = 40, h: int = 60, shade: int = 0) -> list[Image.Image]:
    return [Image.new("RGB", (w, h), ((40 * k + shade) % 256, 9, 200)) for k in range(n)]


def video_records() -> list[dict[str, Any]]:
    """Videos of 2-8 frames at fps None (processor default), 0.5 ... 29.97, some with an image
    and audio in the same turn, one given as ``videos_meta`` only."""
    rng = random.Random(21)
    recs: list[dict[str, Any]] = []
    for sid, fps in enumerate((None, 0.5, 1.0, 2.0, 3.0, 7.0, 24.0, 29.97)):
        n = (4, 2, 6, 4, 4, 6, 2, 8)[sid]  # each frame pair costs >= 128 tokens (processor)
        video: dict[str, Any] = {"type": "video", "video": _frames(n, shade=sid)}
        if fps is not None:
            video["fps"] = fps
        user: list[dict[str, Any]] = [video]
        if sid % 2:
            user.append({"type": "audio", "audio": _wave_form(rng, rng.randint(900, 3 * RATE))})
        if sid % 3 == 0:
            user.insert(0, {"type": "image", "image": Image.new("RGB", (60, 40), (9, 9, sid))})
        user.append({"type": "text", "text": _text(rng, 2, 8)})
        answer = {"role": "assistant", "content": [{"type": "text", "text": _text(rng, 1, 9)}]}
        recs.append({"sample_id": 500 + sid, "conversation": [
            {"role": "user", "content": user}, answer]})  # fmt: skip
    return recs


def test_the_processor_is_real_and_registered(omni: Any) -> None:
    assert type(omni).__name__ == "Qwen2_5OmniProcessor"
    assert type(omni.feature_extractor).__name__ == "WhisperFeatureExtractor"
    assert type(omni.image_processor).__name__ == "Qwen2VLImageProcessor"
    fe = omni.feature_extractor
    assert (fe.sampling_rate, fe.feature_size, fe.hop_length, fe.n_samples) == (
        16000,
        128,
        160,
        480000,
    )
    assert get_handler(omni).name == "qwen_omni"
    size = sum(p.stat().st_size for p in _FOLDER.iterdir())
    assert 0 < size < 400 * 1024, size
    # the feature extractor is numpy/torch only: tokenizing audio imports neither of these
    rec = {"sample_id": 0, "conversation": [
        {"role": "user", "content": [{"type": "audio", "audio": np.zeros(RATE, np.float32)}]},
        {"role": "assistant", "content": "quiet"}]}  # fmt: skip
    tokenize_with_handler(rec, omni)
    assert "librosa" not in sys.modules
    assert "torchaudio" not in sys.modules


def test_labels_are_exactly_the_assistant_turns(omni: Any, tmp_path: Path) -> None:
    tok = omni.tokenizer
    recs = _records(10, seed=1, tmp=tmp_path)
    assert sum(len(_blocks(r, "audio")) for r in recs) >= 5
    for rec in recs:
        s = tokenize_with_handler(rec, omni)
        want = [m["content"][0]["text"] + "<|im_end|>" for m in rec["conversation"]
                if m["role"] == "assistant"]  # fmt: skip
        assert _spans(tok, s) == want, rec["sample_id"]
        assert bool((s["labels"][s["mm_token_type_ids"] != 0] == -100).all())
        assert s["attention_mask"].tolist() == [1] * len(s["input_ids"])


def test_media_token_counts_match_the_processor(omni: Any, tmp_path: Path) -> None:
    """Image runs == prod(grid) / merge**2; audio runs == the processor's own duration rule
    (``_get_num_multimodal_tokens(audio_lengths=...)``) == what the encoder gives for
    ``feature_attention_mask``; token types == the processor's ``mm_token_type_ids``."""
    for rec in _records(10, seed=2, tmp=tmp_path):
        s = tokenize_with_handler(rec, omni)
        n_img, n_aud = len(_blocks(rec, "image")), len(_blocks(rec, "audio"))
        if n_img:
            grids = s["image_grid_thw"]
            assert _runs(s, 1) == (grids.prod(-1) // 4).tolist()
        else:
            assert "pixel_values" not in s
            assert _runs(s, 1) == []
        lengths = [round(d * RATE) for d in rec["audios_meta"]]
        if n_aud:
            want = omni._get_num_multimodal_tokens(audio_lengths=lengths).num_audio_tokens
            assert _runs(s, 3) == list(want) == [qwen_omni_audio_tokens(omni, n) for n in lengths]
            assert s["input_features"].shape == (n_aud, 128, 3000)
            frames = s["feature_attention_mask"].sum(-1)
            assert frames.tolist() == [-(-n // 160) for n in lengths]
            assert (((frames - 1) // 2 + 1 - 2) // 2 + 1).tolist() == list(want)
        else:
            assert "input_features" not in s
            assert _runs(s, 3) == []
        text = omni.tokenizer.decode(s["input_ids"][s["mm_token_type_ids"] == 0])
        assert text.count("<|audio_bos|>") == n_aud
        assert text.count("<|vision_bos|>") == n_img
        theirs = omni.create_mm_token_type_ids(s["input_ids"][None].tolist())
        assert torch.equal(torch.as_tensor(theirs)[0].long(), s["mm_token_type_ids"])


def test_a_wav_file_and_its_array_give_the_same_sample(omni: Any, tmp_path: Path) -> None:
    """The WAV reader returns exactly int16 / 32768, so the features equal the extractor's own
    output on that array."""
    wav = _wave_form(random.Random(3), 12345)
    path = write_wav(tmp_path / "x.wav", wav)
    pcm = np.clip(np.round(wav * 32767), -32768, 32767).astype(np.int16) / 32768.0

    def rec(src: Any) -> dict[str, Any]:
        return {"sample_id": 1, "conversation": [
            {"role": "user", "content": [{"type": "audio", "audio": src},
                                         {"type": "text", "text": "hear"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a tone"}]}]}  # fmt: skip

    a = tokenize_qwen_omni(rec(str(path)), omni)
    b = tokenize_qwen_omni(rec(pcm.astype(np.float32)), omni)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["input_features"], b["input_features"])
    direct = omni.feature_extractor(
        [pcm.astype(np.float32)], sampling_rate=RATE, padding="max_length",
        return_attention_mask=True, return_tensors="pt",
    )  # fmt: skip
    assert torch.equal(a["input_features"], direct["input_features"])


@pytest.mark.parametrize(
    ("width", "dtype", "offset"), [(1, "u1", 128), (2, "<i2", 0), (4, "<i4", 0)]
)
def test_wav_reader_scales_every_pcm_width(
    tmp_path: Path, width: int, dtype: str, offset: int
) -> None:
    from neatpack.pipes.family_qwen_omni import load_audio

    full = 2 ** (8 * width - 1)
    ints = np.array([-full, -full // 2, 0, 1, full // 2, full - 1], dtype=np.int64)
    with wave.open(str(tmp_path / "w.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(RATE)
        w.writeframes((ints + offset).astype(dtype).tobytes())
    got = load_audio(str(tmp_path / "w.wav"), sample_id=0, sampling_rate=RATE, max_samples=RATE)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ints / full, rtol=0, atol=1e-7)


def test_length_estimate_against_the_real_length(omni: Any, tmp_path: Path) -> None:
    """exact mode == real length (after the shift), with ``audios_meta`` / ``images_meta`` and
    without them (WAV header / array length, image size); estimate mode (text chars / 3 on this
    Python-trained vocabulary, media exact) within 30 % of the real length (observed -3 % to
    +25 % over 60 samples)."""
    worst = 0.0
    for rec in _records(20, seed=4, tmp=tmp_path):
        real = len(tokenize_with_handler(rec, omni)["input_ids"]) - 1
        assert qwen_omni_estimate(rec, omni) == real, rec["sample_id"]
        bare = {k: v for k, v in rec.items() if k not in ("audios_meta", "images_meta")}
        assert qwen_omni_estimate(bare, omni) == real, rec["sample_id"]
        rough = qwen_omni_estimate(rec, omni, mode="estimate")
        worst = max(worst, abs(rough - real) / real)
    assert worst <= 0.30, worst


# -- bad input -------------------------------------------------------------------------------


def _audio_rec(sid: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"sample_id": sid, "conversation": [
        {"role": "user", "content": [block, {"type": "text", "text": "listen"}]},
        {"role": "assistant", "content": "ok"}]}  # fmt: skip


@pytest.mark.badinput
@pytest.mark.parametrize("handler", [None, "chat_template"])
def test_audio_to_a_family_without_audio_names_the_sample(handler: str | None) -> None:
    from neatpack.pipes.tiny import load_tiny_processor
    from neatpack.pipes.tokenize import tokenize_conversation

    qwen = load_tiny_processor("qwen2_vl")
    rec = _audio_rec(41, {"type": "audio", "audio": np.zeros(RATE, np.float32)})
    with pytest.raises(SampleError, match=r"sample_id=41 \[bad_media\].*'audio'.*Qwen2VLProcessor"):
        tokenize_with_handler(rec, qwen, handler=handler)
    with pytest.raises(SampleError, match=r"sample_id=41 \[bad_block\].*'audio'"):
        tokenize_conversation(rec, qwen)  # the pipeline's Qwen-VL tokenizer, called directly


@pytest.mark.badinput
def test_bad_audio_is_refused_naming_the_sample(omni: Any, tmp_path: Path) -> None:
    tone = _wave_form(random.Random(5), RATE)
    write_wav(tmp_path / "8k.wav", tone[:8000], rate=8000)
    write_wav(tmp_path / "stereo.wav", np.stack([tone, tone], 1), channels=2)
    write_wav(tmp_path / "silent.wav", tone[:0])
    (tmp_path / "zero.wav").write_bytes(b"")
    (tmp_path / "junk.wav").write_bytes(b"RIFF not really a wave file")
    k8 = str(tmp_path / "8k.wav")
    cases = [
        ({"audio": k8}, "bad_media", r"8000 Hz but .* needs 16000"),
        ({"audio": tone, "sampling_rate": 44100}, "bad_media", r"44100 Hz but .* needs 16000"),
        ({"audio": k8, "sampling_rate": RATE}, "bad_media", r"8000 Hz but its block says"),
        ({"audio": str(tmp_path / "nope.wav")}, "missing_file", r"nope\.wav' does not exist"),
        ({"audio": str(tmp_path / "zero.wav")}, "empty_file", r"zero\.wav' is 0 bytes"),
        ({"audio": str(tmp_path / "silent.wav")}, "empty_file", r"has no samples"),
        ({"audio": np.zeros(0, np.float32)}, "empty_file", r"has no samples"),
        ({"audio": str(tmp_path / "junk.wav")}, "bad_media", r"not a readable PCM WAV"),
        ({"audio": str(tmp_path / "stereo.wav")}, "bad_media", r"2 channels; convert it to mono"),
        ({"audio": np.zeros((2, 100), np.float32)}, "bad_media", r"expected a 1-D float"),
        ({"audio": np.zeros(RATE, np.int16)}, "bad_media", r"expected a 1-D float"),
        ({"audio": np.full(RATE, np.nan, np.float32)}, "bad_media", r"NaN or infinite"),
        ({"audio": np.zeros(31 * RATE, np.float32)}, "bad_media", r"31\.00 s, longer than .* 30 s"),
        ({"audio": np.zeros(300, np.float32)}, "bad_media", r"too short for one audio token"),
        ({"audio": [0.0] * 100}, "bad_media", r"is a list; expected a \.wav path"),
        ({"audio": tone, "sampling_rate": "16k"}, "bad_media", r"sampling_rate='16k'"),
    ]  # fmt: skip
    for sid, (block, reason, pattern) in enumerate(cases, start=100):
        rec = _audio_rec(sid, {"type": "audio", **block})  # type: ignore[dict-item]
        with pytest.raises(SampleError, match=rf"sample_id={sid} \[{reason}\]: .*{pattern}"):
            tokenize_with_handler(rec, omni)
    video = _audio_rec(7, {"type": "video", "video": []})
    with pytest.raises(SampleError, match=r"sample_id=7 \[bad_media\].*non-empty frame list"):
        tokenize_with_handler(video, omni)
    own = _audio_rec(5, {"type": "video", "video": _frames(2), "use_audio_in_video": True})
    with pytest.raises(SampleError, match=r"sample_id=5 \[bad_media\]: use_audio_in_video=True"):
        tokenize_with_handler(own, omni)
    two = _audio_rec(6, {"type": "video", "video": _frames(2), "fps": 2.0})
    two["conversation"][0]["content"].append({"type": "video", "video": _frames(2), "fps": 3.0})
    with pytest.raises(SampleError, match=r"sample_id=6 \[bad_media\].*fps \[2\.0, 3\.0\]"):
        tokenize_with_handler(two, omni)
    text = _audio_rec(8, {"type": "text", "text": "sneaky <|audio_bos|>"})
    with pytest.raises(SampleError, match=r"sample_id=8 \[special_token_in_text\]"):
        tokenize_with_handler(text, omni)


# -- positions and packing parity ------------------------------------------------------------


def _parity_samples(omni: Any, tmp_path: Path) -> list[dict[str, Any]]:
    rng = random.Random(6)
    a = str(write_wav(tmp_path / "p.wav", _wave_form(rng, 2 * RATE)))
    red, green = Image.new("RGB", (56, 84), (200, 9, 9)), Image.new("RGB", (112, 56), (9, 200, 9))
    recs = [
        {"sample_id": 0, "conversation": [
            {"role": "user", "content": [{"type": "audio", "audio": a},
                                         {"type": "image", "image": red},
                                         {"type": "text", "text": "what do you hear and see?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a tone and red"}]}]},
        {"sample_id": 1, "conversation": [
            {"role": "user", "content": [{"type": "text", "text": "just words here"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "fine"}]}]},
        {"sample_id": 2, "conversation": [
            {"role": "user", "content": [{"type": "image", "image": green},
                                         {"type": "audio", "audio": _wave_form(rng, 7000)},
                                         {"type": "text", "text": "and these?"},
                                         {"type": "audio", "audio": _wave_form(rng, 23456)}]},
            {"role": "assistant", "content": [{"type": "text", "text": "two more sounds"}]}]},
    ]  # fmt: skip
    return [tokenize_qwen_omni(r, omni) for r in recs]


def test_positions_put_audio_in_time(omni: Any, tmp_path: Path) -> None:
    """``get_rope_index`` per document: all three rows advance by one per audio token (audio is
    1-D time), image tokens share t and spread over h/w, text resumes after the image's largest
    position; without images the rows are 0..L-1."""
    model = tiny_qwen_omni_model(omni)
    s0, s1, s2 = _parity_samples(omni, tmp_path)
    for s in (s0, s2):
        pos = qwen_omni_position_ids(s, model)
        assert pos.shape == (3, len(s["input_ids"]))
        audio = s["mm_token_type_ids"] == 3
        a_pos = pos[:, audio]
        assert bool((a_pos[0] == a_pos[1]).all() and (a_pos[1] == a_pos[2]).all())
        image = (s["mm_token_type_ids"] == 1).nonzero()[:, 0]
        i_pos = pos[:, image]
        assert int(i_pos[0].unique().numel()) == 1  # one temporal slot per image
        h, w = (s["image_grid_thw"][0, 1:] // 2).tolist()
        assert int(i_pos[1].max() - i_pos[1].min()) == h - 1
        assert int(i_pos[2].max() - i_pos[2].min()) == w - 1
        after = int(image[-1]) + 1
        assert bool((pos[:, after] == pos[:, :after].max() + 1).all())
    assert torch.equal(
        qwen_omni_position_ids(s1, model), torch.arange(len(s1["input_ids"])).expand(3, -1)
    )


def test_model_free_positions_equal_get_rope_index(omni: Any, tmp_path: Path) -> None:
    """``qwen_omni_mrope`` (no model) == the model's ``get_rope_index`` on random samples with
    images and audio, on the parity samples, and on videos at many frame rates."""
    model = tiny_qwen_omni_model(omni)
    samples = [tokenize_with_handler(r, omni) for r in _records(12, seed=7, tmp=tmp_path)]
    samples += _parity_samples(omni, tmp_path)
    assert sum("image_grid_thw" in s and "input_features" in s for s in samples) >= 3
    samples += [tokenize_qwen_omni(r, omni) for r in video_records()]
    for s in samples:
        assert torch.equal(qwen_omni_mrope(s, omni), qwen_omni_position_ids(s, model))
    with pytest.raises(ValueError, match="more video blocks than grids"):
        qwen_omni_mrope(
            dict(samples[0], mm_token_type_ids=torch.full_like(samples[0]["input_ids"], 2)), omni
        )


@pytest.mark.parity
def test_packed_equals_separate(omni: Any, tmp_path: Path) -> None:
    """A packed row of 3 documents (image + audio, text only, image + 2 audio clips) with
    per-document mRoPE from the model's own ``get_rope_index``, the 4D additive block-causal mask
    and ``qwen_omni_pack_media`` == each document alone (the model computing its own positions),
    max abs diff <= 1e-5 fp32 (observed <= 3e-7). Controls, each must differ: a one-document
    mask, 1-D positions instead of mRoPE, zeroed audio features."""
    model = tiny_qwen_omni_model(omni)
    samples = _parity_samples(omni, tmp_path)
    docs = [dict(s, position_ids=qwen_omni_position_ids(s, model)) for s in samples]
    pack = build_pack(docs, mrope=True)
    media = qwen_omni_pack_media(samples)
    assert media["input_features"].shape[0] == 3
    assert media["image_grid_thw"].shape[0] == 2
    doc = pack["attention_mask"][None]

    def run(mask: torch.Tensor, **over: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(  # type: ignore[no-any-return]
                input_ids=pack["input_ids"][None], attention_mask=mask,
                **{"position_ids": pack["position_ids"][:, None], **media, **over},
            ).logits[0]  # fmt: skip

    packed = run(to_4d_additive_mask(doc))
    worst, start = 0.0, 0
    for s, n in zip(samples, pack["seq_lens"], strict=True):
        kw = {k: s[k] for k in ("pixel_values", "image_grid_thw", "input_features",
                                "feature_attention_mask") if k in s}  # fmt: skip
        ids = s["input_ids"][:-1][None]
        with torch.no_grad():  # the mask makes the model compute mRoPE itself (else 0..L-1)
            alone = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits[0]
        worst = max(worst, float((packed[start : start + n] - alone).abs().max()))
        start += n
    assert worst <= 1e-5, worst
    assert float((run(to_4d_additive_mask((doc > 0).long())) - packed).abs().max()) > 1e-3
    flat = pack["text_position_ids"][None, None].expand(3, 1, -1)  # 1-D positions: not Omni's
    assert float((run(to_4d_additive_mask(doc), position_ids=flat) - packed).abs().max()) > 1e-3
    zeroed = run(to_4d_additive_mask(doc), input_features=torch.zeros_like(media["input_features"]))
    assert float((zeroed - packed).abs().max()) > 1e-3


def check_videos(
    proc: Any, tokenize: Any, estimate: Any, default_fps: float, refused: tuple[float, ...] = ()
) -> None:
    """Video tokens == grid / merge**2 == the processor's ``_get_num_multimodal_tokens``;
    ``video_second_per_grid`` == 2 / fps; labels == the assistant turn; exact estimate == real
    length with ``videos_meta`` and from the frames; the token types == the processor's.
    Videos at an fps in ``refused`` must be a SampleError naming the sample."""
    for rec in video_records():
        if _blocks(rec, "video")[0].get("fps") in refused:
            with pytest.raises(SampleError, match=rf"sample_id={rec['sample_id']} \[bad_media\]"):
                tokenize(rec, proc)
            continue
        s = tokenize(rec, proc)
        videos = _blocks(rec, "video")
        sizes = [[len(v["video"]), v["video"][0].height, v["video"][0].width] for v in videos]
        want = proc._get_num_multimodal_tokens(video_sizes=sizes).num_video_tokens
        assert _runs(s, 2) == list(want) == (s["video_grid_thw"].prod(-1) // 4).tolist()
        fps = videos[0].get("fps", default_fps)
        assert s["video_second_per_grid"].tolist() == pytest.approx([2 / fps])
        want_text = [rec["conversation"][1]["content"][0]["text"] + "<|im_end|>"]
        assert _spans(proc.tokenizer, s) == want_text
        real = len(s["input_ids"]) - 1
        assert estimate(rec, proc) == real
        meta = {**rec, "videos_meta": [[*size, fps] for size in sizes]}
        meta["conversation"] = [dict(m, content=[dict(b, video="clip.mp4") if b["type"] == "video"
                                                 else b for b in m["content"]])
                                for m in rec["conversation"]]  # fmt: skip
        assert estimate(meta, proc) == real
        theirs = proc.create_mm_token_type_ids(s["input_ids"][None].tolist())
        assert torch.equal(torch.as_tensor(theirs)[0].long(), s["mm_token_type_ids"])


def test_videos_match_the_processor(omni: Any) -> None:
    check_videos(omni, tokenize_qwen_omni, qwen_omni_estimate, default_fps=2.0)


def packed_vs_separate(model: Any, samples: list[dict[str, Any]], positions: Any) -> float:
    """Max abs logit diff between one packed row (``positions(sample)`` per document, 4D
    block-causal mask, ``qwen_omni_pack_media``) and each document alone (the model computing
    its own positions from a 2-D mask)."""
    docs = [dict(s, position_ids=positions(s)) for s in samples]
    pack = build_pack(docs, mrope=True)
    media = qwen_omni_pack_media(samples)
    with torch.no_grad():
        packed = model(
            input_ids=pack["input_ids"][None],
            attention_mask=to_4d_additive_mask(pack["attention_mask"][None]),
            position_ids=pack["position_ids"][:, None],
            **media,
        ).logits[0]
    worst, start = 0.0, 0
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
            "video_second_per_grid", "input_features", "feature_attention_mask")  # fmt: skip
    for s, n in zip(samples, pack["seq_lens"], strict=True):
        ids = s["input_ids"][:-1][None]
        kw = {k: s[k] for k in keys if k in s}
        with torch.no_grad():
            alone = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits[0]
        worst = max(worst, float((packed[start : start + n] - alone).abs().max()))
        start += n
    return worst


@pytest.mark.parity
def test_packed_with_videos_equals_separate(omni: Any) -> None:
    """Videos (4 frames at fps 2 beside an image and audio, 4 at fps 3, 2 at fps 0.5 beside
    audio) in one packed row with
    the model-free ``qwen_omni_mrope`` positions == each document alone, <= 1e-5 fp32 (observed
    about 3e-7); packed positions that ignore the videos' time scale (second_per_grid 0)
    differ."""
    model = tiny_qwen_omni_model(omni)
    recs = video_records()
    samples = [tokenize_qwen_omni(r, omni) for r in (recs[3], recs[4], recs[1])]
    assert {2.0, 3.0} <= {b.get("fps") for r in (recs[3], recs[4]) for b in _blocks(r, "video")}
    worst = packed_vs_separate(model, samples, lambda s: qwen_omni_mrope(s, omni))
    assert worst <= 1e-5, worst
    assert samples[0]["video_grid_thw"][0, 0] == 2  # several time steps
    still = {"video_second_per_grid": torch.zeros(1)}
    timeless = packed_vs_separate(model, samples, lambda s: qwen_omni_mrope({**s, **still}, omni))
    assert timeless > 1e-3


@pytest.mark.slow
def test_the_processor_rebuilds_byte_for_byte(tmp_path: Path) -> None:
    """``scripts/build_tiny_omni_processor.py`` reproduces the committed files exactly."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "build_tiny_omni_processor.py"
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True)
    names = sorted(p.name for p in _FOLDER.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "qwen2_5_omni").iterdir())
    for name in names:
        assert (tmp_path / "qwen2_5_omni" / name).read_bytes() == (_FOLDER / name).read_bytes()
