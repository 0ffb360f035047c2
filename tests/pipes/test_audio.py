"""``neatpack.pipes.reading.audio``: the family-agnostic audio contract (WAV / array reading, rate
check,
length limit, refusals naming the sample, finding the audio blocks of a conversation).

WAV files are written with the stdlib ``wave`` module (and one IEEE-float file by hand, which
the stdlib reader does not support: it must be refused, not misread).
"""

from __future__ import annotations

import pickle
import struct
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from neatpack.pipes.reading.audio import (
    audio_num_samples,
    is_audio_block,
    load_audio,
    load_audio_block,
    read_wav,
    split_audio_blocks,
)
from neatpack.pipes.reading.media import SampleError

RATE = 16000


def write_pcm(path: Path, ints: np.ndarray, *, width: int = 2, rate: int = RATE,
              channels: int = 1) -> str:  # fmt: skip
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(ints.tobytes())
    return str(path)


def write_float_wav(path: Path, x: np.ndarray, rate: int = RATE) -> str:
    """A 32-bit IEEE-float WAV (format tag 3), byte by byte."""
    data = x.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return str(path)


def tone(n: int) -> np.ndarray:
    out: np.ndarray = (0.5 * np.sin(np.arange(n) * 0.05)).astype(np.float32)
    return out


def test_int16_wav_is_scaled_exactly_and_equals_its_array(tmp_path: Path) -> None:
    ints = np.round(tone(1000) * 32767).astype("<i2")
    path = write_pcm(tmp_path / "a.wav", ints)
    got = load_audio(path, sample_id=1, sampling_rate=RATE)
    assert got.dtype == np.float32
    assert got.shape == (1000,)
    np.testing.assert_array_equal(got, (ints / 32768.0).astype(np.float32))
    same = load_audio((ints / 32768.0).astype(np.float32), sample_id=1, sampling_rate=RATE)
    np.testing.assert_array_equal(got, same)
    wav, rate = read_wav(path, 1)
    assert rate == RATE
    np.testing.assert_array_equal(wav, got)


@pytest.mark.parametrize(("width", "dtype", "offset"), [(1, "u1", 128), (4, "<i4", 0)])
def test_8_and_32_bit_pcm_reach_the_full_range(
    tmp_path: Path, width: int, dtype: str, offset: int
) -> None:
    full = 2 ** (8 * width - 1)
    ints = np.array([-full, 0, full - 1], dtype=np.int64)
    path = write_pcm(tmp_path / "w.wav", (ints + offset).astype(dtype), width=width)
    got = load_audio(path, sample_id=0, sampling_rate=RATE)
    np.testing.assert_allclose(got, ints / full, rtol=0, atol=1e-7)
    assert got[0] == -1.0
    assert got[1] == 0.0


def test_float_arrays_keep_their_values_and_any_float_dtype(tmp_path: Path) -> None:
    x = tone(500).astype(np.float64)
    got = load_audio(x, sample_id=0, sampling_rate=RATE)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, x.astype(np.float32))
    # an array at another rate is fine when the block says so and the family wants that rate
    assert load_audio(x, sample_id=0, sampling_rate=8000, block_rate=8000).shape == (500,)


def test_length_limit_is_optional_and_inclusive() -> None:
    x = np.zeros(RATE, np.float32)
    assert load_audio(x, sample_id=0, sampling_rate=RATE, max_samples=RATE).shape == (RATE,)
    assert load_audio(np.zeros(40 * RATE, np.float32), sample_id=0, sampling_rate=RATE).size
    with pytest.raises(SampleError, match=r"sample_id=9 \[bad_media\]: .*1\.00 s, longer .* 1 s"):
        load_audio(np.zeros(RATE + 1, np.float32), sample_id=9, sampling_rate=RATE,
                   max_samples=RATE)  # fmt: skip


@pytest.mark.badinput
def test_bad_audio_is_refused_naming_the_sample_and_the_fix(tmp_path: Path) -> None:
    pcm = np.round(tone(RATE) * 32767).astype("<i2")
    k8 = write_pcm(tmp_path / "8k.wav", pcm[:8000], rate=8000)
    stereo = write_pcm(tmp_path / "st.wav", np.stack([pcm, pcm], 1), channels=2)
    b24 = write_pcm(tmp_path / "24.wav", np.zeros(30, "u1"), width=3)
    silent = write_pcm(tmp_path / "silent.wav", pcm[:0])
    fl = write_float_wav(tmp_path / "float.wav", tone(100))
    (tmp_path / "zero.wav").write_bytes(b"")
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"audio": k8}, "bad_media", r"8000 Hz but the feature extractor needs 16000 Hz; resample"),
        ({"audio": tone(9), "sampling_rate": 44100}, "bad_media", r"44100 Hz but .* needs 16000"),
        ({"audio": k8, "sampling_rate": RATE}, "bad_media", r"8000 Hz but its block says"),
        ({"audio": tone(9), "sampling_rate": True}, "bad_media", r"sampling_rate=True"),
        ({"audio": tone(9), "sampling_rate": -5}, "bad_media", r"sampling_rate=-5; expected"),
        ({"audio": stereo}, "bad_media", r"2 channels; convert it to mono first"),
        ({"audio": b24}, "bad_media", r"24-bit samples; valid: 8, 16 or 32-bit PCM"),
        ({"audio": fl}, "bad_media", r"float\.wav' is not a readable PCM WAV"),
        ({"audio": str(tmp_path / "no.wav")}, "missing_file", r"no\.wav' does not exist; fix"),
        ({"path": str(tmp_path / "zero.wav")}, "empty_file", r"zero\.wav' is 0 bytes"),
        ({"audio": silent}, "empty_file", r"silent\.wav' has no samples"),
        ({"audio": np.zeros(0, np.float32)}, "empty_file", r"array of 0 samples has no samples"),
        ({"audio": np.array([0.0, np.inf])}, "bad_media", r"NaN or infinite"),
        ({"audio": np.zeros((100, 2), np.float32)}, "bad_media", r"shape \(100, 2\)"),
        ({"audio": np.zeros(9, np.int16)}, "bad_media", r"dtype int16; expected a 1-D float"),
        ({"audio": None}, "bad_media", r"is a NoneType; expected a \.wav path"),
    ]  # fmt: skip
    for sid, (block, reason, pattern) in enumerate(cases, start=200):
        with pytest.raises(SampleError, match=rf"^sample_id={sid} \[{reason}\]: .*{pattern}") as e:
            load_audio_block({"type": "audio", **block}, sample_id=sid, sampling_rate=RATE)
        back = pickle.loads(pickle.dumps(e.value))  # crosses worker processes intact
        assert (back.sample_id, back.reason, str(back)) == (sid, reason, str(e.value))


def test_split_audio_blocks_finds_every_audio_block_in_order() -> None:
    a, b, c = (np.zeros(n, np.float32) for n in (1, 2, 3))
    rec: dict[str, Any] = {"sample_id": 5, "conversation": [
        {"role": "system", "content": "plain text content stays as it is"},
        {"role": "user", "content": [{"type": "audio", "audio": a}, {"type": "text", "text": "x"},
                                     {"audio": b}, {"type": "image", "image": "i.png"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "y"}]},
        {"role": "user", "content": [{"type": "audio", "path": "c.wav"}, {"audio": c,
                                                                          "type": "video"}]},
    ]}  # fmt: skip
    stand_in, where, blocks = split_audio_blocks(rec, stand_in="<sound>")
    assert where == [(1, 0), (1, 2), (3, 0)]
    assert [blk.get("audio", blk.get("path")) for blk in blocks][2] == "c.wav"
    assert blocks[0]["audio"] is a
    assert blocks[1]["audio"] is b
    conv = stand_in["conversation"]
    assert conv[1]["content"][0] == conv[1]["content"][2] == {"type": "text", "text": "<sound>"}
    assert conv[1]["content"][3] == {"type": "image", "image": "i.png"}
    assert conv[3]["content"][1]["type"] == "video"  # typed video with an audio key: not audio
    assert conv[0] is rec["conversation"][0]
    assert rec["conversation"][1]["content"][0]["type"] == "audio"  # the input is not modified
    assert split_audio_blocks({"sample_id": 1}) == ({"sample_id": 1}, [], [])
    assert not is_audio_block("audio")
    assert is_audio_block({"audio": 1})


def test_audio_num_samples_without_decoding(tmp_path: Path) -> None:
    path = write_pcm(tmp_path / "h.wav", np.zeros(8000, "<i2"), rate=8000)
    assert audio_num_samples(path, None, RATE, 0) == RATE  # 1 s header at 8 kHz -> 16k samples
    assert audio_num_samples(path, 0.25, RATE, 0) == 4000  # audios_meta wins
    assert audio_num_samples(np.zeros(123, np.float32), None, RATE, 0) == 123
    with pytest.raises(ValueError, match=r"sample_id=4: cannot read the duration .* audios_meta"):
        audio_num_samples(str(tmp_path / "missing.wav"), None, RATE, 4)


# -- which processors take audio (families._shared.processor_modalities) -------------------------


def test_an_audio_processor_counts_as_audio_like_a_feature_extractor() -> None:
    """Phi-4-multimodal names its audio part ``audio_processor`` (no ``feature_extractor``); the
    generic check sees it, so the plain registry Handler (its modality check first) takes
    Phi-4 audio exactly as the ``phi4`` handler does. Qwen-Omni's ``feature_extractor`` and
    Qwen2-VL (neither) keep their answers."""
    from support.tiny import load_tiny_phi4_processor, load_tiny_qwen_omni_processor

    from neatpack.pipes.families import HANDLERS, Handler
    from neatpack.pipes.families._shared import processor_modalities
    from neatpack.pipes.families.phi4 import PHI4_MODALITIES, tokenize_phi4
    from neatpack.pipes.testing.tiny import load_tiny_processor

    phi4 = load_tiny_phi4_processor()
    assert getattr(phi4, "feature_extractor", None) is None
    assert type(phi4.audio_processor).__name__ == "Phi4MultimodalFeatureExtractor"
    assert processor_modalities(phi4) == {"image", "audio"}
    assert "audio" in processor_modalities(load_tiny_qwen_omni_processor())
    assert "audio" not in processor_modalities(load_tiny_processor("qwen2_vl"))

    tone = (0.2 * np.sin(np.arange(RATE) / 7)).astype(np.float32)
    rec = {"sample_id": 12, "conversation": [
        {"role": "user", "content": [{"type": "audio", "audio": tone},
                                     {"type": "text", "text": "what is it"}]},
        {"role": "assistant", "content": "a tone"}]}  # fmt: skip
    plain = Handler("phi4_plain", tokenize_phi4, modalities=PHI4_MODALITIES)
    got, want = plain(rec, phi4), HANDLERS["phi4"](rec, phi4)
    assert got.keys() == want.keys()
    for key in ("input_ids", "labels", "audio_input_features", "audio_embed_sizes"):
        assert torch.equal(got[key], want[key]), key
    with pytest.raises(SampleError, match=r"sample_id=12 \[bad_media\].*'audio'.*only \['image'\]"):
        Handler("phi4_images", tokenize_phi4, modalities=frozenset({"image"}))(rec, phi4)
