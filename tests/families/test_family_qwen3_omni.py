"""Qwen3-Omni: text, images and audio through the real ``Qwen3OmniMoeProcessor`` (tiny, offline).

Labels = exactly the assistant turns (decoded), image tokens = the processor's count, audio tokens
= the processor's own expansion and ``_get_num_multimodal_tokens`` (13 per 100-frame chunk, no
30 s window), the length estimate against the real length, positions without the model equal to
the thinker's ``get_rope_index``, and packed-vs-separate parity on a tiny real mixture-of-experts
``Qwen3OmniMoeThinkerForConditionalGeneration``. Records come from the Qwen2.5-Omni test's
generator (the same conversations, another processor).
"""

from __future__ import annotations

import random
import sys
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
from support.tiny import ASSETS, load_tiny_qwen3_omni_processor
from support.tiny_family_models import tiny_qwen3_omni_model
from support.versions import counts_tokens, knows_its_media_ids

from neatpack.pipes.families import get_handler, tokenize_with_handler
from neatpack.pipes.families.processor_compat import image_token_counts
from neatpack.pipes.families.qwen3_omni import (
    QWEN3_OMNI,
    qwen3_omni_audio_tokens,
    qwen3_omni_estimate,
    tokenize_qwen3_omni,
)
from neatpack.pipes.families.qwen_omni import (
    omni_tokenize,
    qwen_omni_mrope,
    qwen_omni_pack_media,
    qwen_omni_position_ids,
)
from neatpack.pipes.reading.media import SampleError

_FOLDER = ASSETS / "qwen3_omni"


@pytest.fixture(scope="module")
def omni3() -> Any:
    return load_tiny_qwen3_omni_processor()


@pytest.fixture(scope="module")
def thinker(omni3: Any) -> Any:
    return tiny_qwen3_omni_model(omni3)


def test_the_processor_is_real_and_registered(omni3: Any) -> None:
    assert type(omni3).__name__ == "Qwen3OmniMoeProcessor"
    assert type(omni3.feature_extractor).__name__ == "WhisperFeatureExtractor"
    assert type(omni3.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(omni3.video_processor).__name__ == "Qwen2VLVideoProcessor"
    assert omni3.image_processor.patch_size == 16
    assert (omni3.audio_token, omni3.audio_bos_token) == ("<|audio_pad|>", "<|audio_start|>")
    assert get_handler(omni3).name == "qwen3_omni"
    size = sum(p.stat().st_size for p in _FOLDER.iterdir())
    assert 0 < size < 400 * 1024, size
    rec = {"sample_id": 0, "conversation": [
        {"role": "user", "content": [{"type": "audio", "audio": np.zeros(RATE, np.float32)}]},
        {"role": "assistant", "content": "quiet"}]}  # fmt: skip
    s = tokenize_with_handler(rec, omni3)
    assert int((s["mm_token_type_ids"] == 3).sum()) == 13
    if counts_tokens(omni3):  # transformers 5.2x
        assert omni3._get_num_multimodal_tokens(audio_lengths=[RATE]).num_audio_tokens == [13]
    assert "librosa" not in sys.modules
    assert "torchaudio" not in sys.modules


def test_labels_are_exactly_the_assistant_turns(omni3: Any, tmp_path: Path) -> None:
    recs = _records(10, seed=11, tmp=tmp_path)
    assert sum(len(_blocks(r, "audio")) for r in recs) >= 5
    assert sum(len(_blocks(r, "image")) for r in recs) >= 3
    check_assistant_labels(omni3, recs)


def test_media_token_counts_match_the_processor(omni3: Any, tmp_path: Path) -> None:
    """Image runs == the processor's ``_get_num_multimodal_tokens`` == grid / merge**2. Audio runs
    == the processor's own expansion == ``qwen3_omni_audio_tokens``: the sample's audios are
    padded to the longest, which keeps ``n // 160`` frames, the others ``ceil(n / 160)``
    (``feature_attention_mask``). ``_get_num_multimodal_tokens(audio_lengths)`` floors every
    audio: it agrees for the longest and is at most one token short for the others (its bug,
    not followed). Token types == the processor's ``mm_token_type_ids``."""
    short_by_one = 0
    for rec in _records(12, seed=12, tmp=tmp_path):
        s = tokenize_with_handler(rec, omni3)
        n_aud = len(_blocks(rec, "audio"))
        if rec["images_meta"]:
            want_img = image_token_counts(omni3, rec["images_meta"])
            assert _runs(s, 1) == want_img
            assert _runs(s, 1) == (s["image_grid_thw"].prod(-1) // 4).tolist()
        lengths = [round(d * RATE) for d in rec["audios_meta"]]
        if n_aud:
            got = _runs(s, 3)
            assert got == qwen3_omni_audio_tokens(omni3, lengths)
            longest = max(lengths)
            frames = [n // 160 if n == longest else -(-n // 160) for n in lengths]
            assert s["input_features"].shape == (n_aud, 128, longest // 160)
            assert s["feature_attention_mask"].sum(-1).tolist() == frames
            if not counts_tokens(omni3):  # transformers 5.17: nothing to compare with
                continue
            floor = omni3._get_num_multimodal_tokens(audio_lengths=lengths).num_audio_tokens
            assert got[lengths.index(longest)] == floor[lengths.index(longest)]
            assert all(0 <= g - f <= 1 for g, f in zip(got, floor, strict=True))
            short_by_one += sum(g != f for g, f in zip(got, floor, strict=True))
        else:
            assert "input_features" not in s
        text = omni3.tokenizer.decode(s["input_ids"][s["mm_token_type_ids"] == 0])
        assert text.count("<|audio_start|>") == n_aud
        if not knows_its_media_ids(omni3):
            continue
        theirs = omni3.create_mm_token_type_ids(s["input_ids"][None].tolist())
        assert torch.equal(torch.as_tensor(theirs)[0].long(), s["mm_token_type_ids"])
    # the floor/ceil difference really occurs in these samples (5.17 has no counter to compare)
    assert short_by_one >= 1 or not counts_tokens(omni3)


def test_long_audio_is_kept_whole(omni3: Any) -> None:
    """No 30 s window: 31.5 s gives 31 full chunks (13 tokens each) + 50 frames (-> 7), exactly
    as the processor expands it; Qwen2.5-Omni refuses the same audio."""
    wav = np.zeros(31 * RATE + RATE // 2, np.float32)
    s = tokenize_qwen3_omni(_audio_rec(3, {"type": "audio", "audio": wav}), omni3)
    assert _runs(s, 3) == [31 * 13 + 7]
    assert s["input_features"].shape == (1, 128, 3150)


def test_length_estimate_against_the_real_length(omni3: Any, tmp_path: Path) -> None:
    """exact mode == real length (after the shift) with and without ``audios_meta`` /
    ``images_meta``; estimate mode (text chars / 3, media exact) within 30 % of the real length
    (observed -4 % to +26 %, mean +6 %, over 100 samples of this generator)."""
    worst = estimate_error(_records(20, seed=13, tmp=tmp_path), omni3, qwen3_omni_estimate)
    assert worst <= 0.30, worst


@pytest.mark.badinput
def test_bad_audio_is_refused_naming_the_sample(omni3: Any, tmp_path: Path) -> None:
    tone = _wave_form(random.Random(5), RATE)
    k8 = str(write_wav(tmp_path / "8k.wav", tone[:8000], rate=8000))
    cases = [
        ({"audio": k8}, "bad_media", r"8000 Hz but .* needs 16000"),
        ({"audio": np.zeros(200, np.float32)}, "bad_media", r"200 samples .* too short"),
        ({"audio": str(tmp_path / "nope.wav")}, "missing_file", r"nope\.wav' does not exist"),
        ({"audio": np.zeros(0, np.float32)}, "empty_file", r"has no samples"),
    ]  # fmt: skip
    for sid, (block, reason, pattern) in enumerate(cases, start=300):
        rec = _audio_rec(sid, {"type": "audio", **block})  # type: ignore[dict-item]
        with pytest.raises(SampleError, match=rf"sample_id={sid} \[{reason}\]: .*{pattern}"):
            tokenize_with_handler(rec, omni3)
    assert _runs(tokenize_qwen3_omni(_audio_rec(9, {"audio": np.zeros(201)}), omni3), 3) == [1]
    text = _audio_rec(8, {"type": "text", "text": "sneaky <|audio_start|>"})
    with pytest.raises(SampleError, match=r"sample_id=8 \[special_token_in_text\]"):
        tokenize_with_handler(text, omni3)


# -- positions and packing parity ------------------------------------------------------------


def _parity_samples(omni3: Any, tmp_path: Path) -> list[dict[str, Any]]:
    recs = parity_records(tmp_path, 2 * RATE + 1234, (64, 96), (128, 64))
    return [tokenize_qwen3_omni(r, omni3) for r in recs]


def test_model_free_positions_equal_get_rope_index(
    omni3: Any, thinker: Any, tmp_path: Path
) -> None:
    """``qwen_omni_mrope`` (no model) == the Qwen3-Omni thinker's own ``get_rope_index`` (which
    returns float ids: compared as values) on random samples, the parity samples and videos at
    fps None (1.0) to 29.97, whose fractional time steps stay fractional (float ids)."""
    model = thinker
    samples = [tokenize_with_handler(r, omni3) for r in _records(12, seed=14, tmp=tmp_path)]
    samples += _parity_samples(omni3, tmp_path)
    # through omni_tokenize: fractional time steps (fps 3, 7, ...) are refused by the handler
    samples += [omni_tokenize(r, omni3, QWEN3_OMNI) for r in video_records()]
    assert sum("image_grid_thw" in s and "input_features" in s for s in samples) >= 3
    assert any(qwen_omni_mrope(s, omni3).dtype == torch.float32 for s in samples)
    for s in samples:
        theirs = qwen_omni_position_ids(s, model)
        assert theirs.shape == (3, len(s["input_ids"]))
        assert torch.equal(qwen_omni_mrope(s, omni3).to(theirs.dtype), theirs)


@pytest.mark.parity
def test_packed_equals_separate(omni3: Any, thinker: Any, tmp_path: Path) -> None:
    """A packed row of 3 documents (audio + image, text only, image + 2 audio clips of other
    feature widths) with per-document mRoPE, the 4D additive block-causal mask and
    ``qwen_omni_pack_media`` (features right-padded to the widest) == each document alone (the
    model computing its own positions), max abs diff <= 1e-5 fp32 (observed 2.7e-7). Controls,
    each must differ: a one-document mask, 1-D positions, zeroed audio features."""
    samples = _parity_samples(omni3, tmp_path)
    widths = {int(s["input_features"].shape[-1]) for s in samples if "input_features" in s}
    assert len(widths) == 2  # the padding path is exercised
    media = qwen_omni_pack_media(samples)
    assert media["input_features"].shape == (3, 128, max(widths))
    worst = packed_vs_separate(thinker, samples, lambda s: qwen_omni_mrope(s, omni3), controls=True)
    assert worst <= 1e-5, worst


def test_videos_match_the_processor(omni3: Any) -> None:
    """As Qwen2.5-Omni (default fps 1.0), and frames at fps 3, 7, 24 or 29.97 (fractional time
    steps: 2 / fps * 13) are refused."""
    check_videos(omni3, tokenize_qwen3_omni, qwen3_omni_estimate, 1.0, (3.0, 7.0, 24.0, 29.97))


@pytest.mark.parity
def test_packed_with_videos_equals_separate(omni3: Any, thinker: Any) -> None:
    """Videos at fps 2 (with an image and audio), None (1.0, with an image) and 0.5 (with audio)
    packed with the model-free ``qwen_omni_mrope`` == each alone, <= 1e-5 fp32 (observed
    about 3e-7)."""
    recs = video_records()
    samples = [tokenize_qwen3_omni(r, omni3) for r in (recs[3], recs[0], recs[1])]
    worst = packed_vs_separate(thinker, samples, lambda s: qwen_omni_mrope(s, omni3))
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_the_processor_rebuilds_byte_for_byte(tmp_path: Path) -> None:
    """``scripts/build_tiny_omni_processor.py`` reproduces the committed files exactly."""
    assert_script_rebuilds("build_tiny_omni_processor.py", tmp_path, ["qwen3_omni"])
