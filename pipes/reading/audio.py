"""Audio blocks for any audio family: find them in a conversation, read and check the waveform.

An audio block is ``{"type": "audio", "audio": <path to a .wav file | 1-D float numpy array>}``
(``"path"`` is accepted for ``"audio"``), optionally with ``"sampling_rate"``. The rate must equal
the one the family's feature extractor needs: a WAV file's header rate, or the block's
``sampling_rate`` (an array without one is taken to be at the extractor's rate, the convention
of the processors' ``audio=`` argument). Any other rate is a ``SampleError``: neatpack never
resamples, because a silent resample (or none) changes what the model hears; resample the data
beforehand. WAV files: mono PCM, 8/16/32-bit, read with the stdlib ``wave`` module and scaled to
[-1, 1] (int16 ``x`` -> ``x / 32768``; 8-bit is unsigned, centred on 128), so a file and the
array it was written from give the same features. Also refused, naming the sample: a missing or
empty file, a stereo file (no silent down-mix), an empty or non-finite array, and audio longer
than ``max_samples`` (the extractor's window, which the processor would cut without a word).

Family rules (how many tokens an audio gives, a minimum length) stay in the family module; this
module is only about getting a correct float32 mono waveform and knowing where the blocks are.

>>> rec = {"sample_id": 3, "conversation": [{"role": "user", "content": [
...     {"type": "audio", "audio": np.zeros(8000, np.float32)}, {"type": "text", "text": "hi"}]}]}
>>> stand_in, where, blocks = split_audio_blocks(rec)
>>> where, stand_in["conversation"][0]["content"][0]
([(0, 0)], {'type': 'text', 'text': 'audio'})
>>> load_audio_block(blocks[0], sample_id=3, sampling_rate=16000).shape
(8000,)
"""

from __future__ import annotations

import os
import wave
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from neatpack.pipes.reading.media import SampleError, existing_media_file, non_regular_file

__all__ = [
    "AUDIO_STAND_IN",
    "audio_num_samples",
    "is_audio_block",
    "load_audio",
    "load_audio_block",
    "read_wav",
    "split_audio_blocks",
]

AUDIO_STAND_IN: Final = "audio"
"""Text that stands in for an audio block while ``parse_conversation`` (which knows only text,
image and video) validates the rest of the conversation."""

_PCM_DTYPES: Final = {1: np.uint8, 2: np.int16, 4: np.int32}


def read_wav(path: str, sample_id: Any) -> tuple[np.ndarray, int]:
    """``(float32 [n] in [-1, 1], header rate)`` of a mono 8/16/32-bit PCM WAV file; anything
    else (stereo, 24-bit, not a WAV) is a ``SampleError`` naming the sample and the fix."""
    try:
        with wave.open(path, "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError, OSError) as exc:
        raise SampleError(
            sample_id, "bad_media", f"audio file {path!r} is not a readable PCM WAV: {exc}"
        ) from exc
    if channels != 1:
        raise SampleError(
            sample_id,
            "bad_media",
            f"audio file {path!r} has {channels} channels; convert it to mono first",
        )
    if width not in _PCM_DTYPES:
        raise SampleError(
            sample_id,
            "bad_media",
            f"audio file {path!r} has {8 * width}-bit samples; valid: 8, 16 or 32-bit PCM",
        )
    ints = np.frombuffer(raw, dtype=_PCM_DTYPES[width]).astype(np.float64)
    if width == 1:
        ints -= 128.0
    scale = float(2 ** (8 * width - 1))
    return (ints / scale).astype(np.float32), rate


def _check_block_rate(block_rate: Any, sample_id: Any) -> None:
    if block_rate is not None and (
        isinstance(block_rate, bool) or not isinstance(block_rate, int) or block_rate <= 0
    ):
        raise SampleError(
            sample_id, "bad_media", f"audio sampling_rate={block_rate!r}; expected a positive int"
        )


def load_audio(
    src: Any,
    *,
    sample_id: Any,
    sampling_rate: int,
    block_rate: Any = None,
    max_samples: int | None = None,
) -> np.ndarray:
    """One audio value's waveform: float32 ``[n]`` at ``sampling_rate``, checked (module
    docstring). ``src``: a .wav path or a 1-D float array; ``block_rate``: the block's
    ``sampling_rate`` key (None when absent); ``max_samples``: the longest accepted (None: no
    limit). Every refusal is a ``SampleError`` naming ``sample_id``."""
    _check_block_rate(block_rate, sample_id)
    if isinstance(src, str | os.PathLike):
        path = existing_media_file(src, "audio", sample_id)
        wav, rate = read_wav(path, sample_id)
        what = f"audio file {path!r}"
        if block_rate is not None and block_rate != rate:
            raise SampleError(
                sample_id,
                "bad_media",
                f"{what} is {rate} Hz but its block says sampling_rate={block_rate}",
            )
    elif isinstance(src, np.ndarray):
        if src.ndim != 1 or not np.issubdtype(src.dtype, np.floating):
            raise SampleError(
                sample_id,
                "bad_media",
                f"audio array has shape {src.shape} and dtype {src.dtype}; expected a 1-D float "
                "array (mono, values in [-1, 1])",
            )
        wav, rate = src.astype(np.float32, copy=False), block_rate or sampling_rate
        what = f"audio array of {src.shape[0]} samples"
    else:
        raise SampleError(
            sample_id,
            "bad_media",
            f"audio value {src!r:.80} is a {type(src).__name__}; expected a .wav path or a 1-D "
            "float numpy array",
        )
    if rate != sampling_rate:
        raise SampleError(
            sample_id,
            "bad_media",
            f"{what} is sampled at {rate} Hz but the feature extractor needs {sampling_rate} Hz; "
            "resample it beforehand (neatpack never resamples silently)",
        )
    if wav.shape[0] == 0:
        raise SampleError(sample_id, "empty_file", f"{what} has no samples")
    if not bool(np.isfinite(wav).all()):
        raise SampleError(sample_id, "bad_media", f"{what} contains NaN or infinite values")
    if max_samples is not None and wav.shape[0] > max_samples:
        raise SampleError(
            sample_id,
            "bad_media",
            f"{what} lasts {wav.shape[0] / rate:.2f} s, longer than the feature extractor's "
            f"{max_samples / rate:.0f} s window, which would drop the rest silently; split it",
        )
    return wav


def load_audio_block(
    block: Mapping[str, Any], *, sample_id: Any, sampling_rate: int, max_samples: int | None = None
) -> np.ndarray:
    """``load_audio`` on an audio block: its ``"audio"`` (or ``"path"``) value and its
    ``"sampling_rate"`` key."""
    return load_audio(
        block.get("audio", block.get("path")),
        sample_id=sample_id,
        sampling_rate=sampling_rate,
        block_rate=block.get("sampling_rate"),
        max_samples=max_samples,
    )


def is_audio_block(block: Any) -> bool:
    """``{"type": "audio", ...}``, or an untyped block with an ``"audio"`` key."""
    return isinstance(block, Mapping) and (
        block.get("type") == "audio" or (block.get("type") is None and "audio" in block)
    )


def split_audio_blocks(
    record: Mapping[str, Any], stand_in: str = AUDIO_STAND_IN
) -> tuple[dict[str, Any], list[tuple[int, int]], list[Mapping[str, Any]]]:
    """``(record with each audio block replaced by a text block of stand_in, where they were as
    (message, block) indices, the audio blocks in conversation order)``. The record itself is
    not modified; a record without a conversation list comes back as a copy, with no audio."""
    conv = record.get("conversation")
    if not isinstance(conv, list):
        return dict(record), [], []
    where: list[tuple[int, int]] = []
    blocks: list[Mapping[str, Any]] = []
    out_conv: list[Any] = []
    for k, msg in enumerate(conv):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            out_conv.append(msg)
            continue
        new = []
        for j, b in enumerate(content):
            if is_audio_block(b):
                where.append((k, j))
                blocks.append(b)
                new.append({"type": "text", "text": stand_in})
            else:
                new.append(b)
        out_conv.append({**msg, "content": new})
    return {**record, "conversation": out_conv}, where, blocks


def audio_num_samples(value: Any, seconds: Any, rate: int, sample_id: Any) -> int:
    """Sample count at ``rate`` of one audio value WITHOUT decoding it (for length estimates):
    ``seconds`` (an ``audios_meta`` entry) when given, else the array length or the WAV header's
    frame count scaled to ``rate``. An unreadable header is a ValueError asking for
    ``audios_meta``."""
    if seconds is not None:
        return round(float(seconds) * rate)
    if isinstance(value, np.ndarray):
        return int(value.shape[0])
    if isinstance(value, str | os.PathLike) and (what := non_regular_file(value)):
        raise ValueError(  # before wave.open: a FIFO would block it forever
            f"sample_id={sample_id}: audio {value!r:.80} is {what}, not a regular file; point "
            "the record at a regular file or drop it"
        )
    try:
        with wave.open(os.fspath(value), "rb") as w:
            return round(w.getnframes() * rate / w.getframerate())
    except (wave.Error, EOFError, OSError, TypeError) as exc:
        raise ValueError(
            f"sample_id={sample_id}: cannot read the duration of audio {value!r:.80} ({exc}); "
            "give audios_meta (seconds per audio block)"
        ) from exc
