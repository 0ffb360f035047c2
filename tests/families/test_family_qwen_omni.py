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
from support.family_checks import assert_script_rebuilds, estimate_error
from support.omni_records import (
    RATE,
    _audio_rec,
    _blocks,
    _frames,
    _records,
    _runs,
    _wave_form,
    check_assistant_labels,
    check_videos,
    packed_vs_separate,
    parity_records,
    video_records,
    write_wav,
)
from support.tiny import ASSETS, load_tiny_qwen_omni_processor
from support.tiny_family_models import tiny_qwen_omni_model
from support.versions import counts_tokens, knows_its_media_ids

from neatpack.pipes.families import get_handler, tokenize_with_handler
from neatpack.pipes.families.qwen_omni import (
    qwen_omni_audio_tokens,
    qwen_omni_estimate,
    qwen_omni_mrope,
    qwen_omni_pack_media,
    qwen_omni_position_ids,
    tokenize_qwen_omni,
)
from neatpack.pipes.reading.media import SampleError

_FOLDER = ASSETS / "qwen2_5_omni"


@pytest.fixture(scope="module")
def omni() -> Any:
    return load_tiny_qwen_omni_processor()


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
    recs = _records(10, seed=1, tmp=tmp_path)
    assert sum(len(_blocks(r, "audio")) for r in recs) >= 5
    check_assistant_labels(omni, recs)


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
            want = (
                omni._get_num_multimodal_tokens(audio_lengths=lengths).num_audio_tokens
                if counts_tokens(omni)
                else [qwen_omni_audio_tokens(omni, n) for n in lengths]  # transformers 5.17
            )
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
        if not knows_its_media_ids(omni):  # transformers 5.17: it marks nothing
            continue
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
    from neatpack.pipes.families.qwen_omni import load_audio

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
    worst = estimate_error(_records(20, seed=4, tmp=tmp_path), omni, qwen_omni_estimate)
    assert worst <= 0.30, worst


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.badinput
@pytest.mark.parametrize("handler", [None, "chat_template"])
def test_audio_to_a_family_without_audio_names_the_sample(handler: str | None) -> None:
    from neatpack.pipes.materializing.tokenize import tokenize_conversation
    from neatpack.pipes.testing.tiny import load_tiny_processor

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
    recs = parity_records(tmp_path, 2 * RATE, (56, 84), (112, 56))
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
    media = qwen_omni_pack_media(samples)
    assert media["input_features"].shape[0] == 3
    assert media["image_grid_thw"].shape[0] == 2
    worst = packed_vs_separate(
        model, samples, lambda s: qwen_omni_position_ids(s, model), controls=True
    )
    assert worst <= 1e-5, worst


def test_videos_match_the_processor(omni: Any) -> None:
    check_videos(omni, tokenize_qwen_omni, qwen_omni_estimate, default_fps=2.0)


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
    assert_script_rebuilds("build_tiny_omni_processor.py", tmp_path, ["qwen2_5_omni"])
