"""Record generator shared by the audio-family tests (Phi-4-multimodal, Nemotron-H Omni).

Both tests draw the same kind of conversation (1-2 turns; user turns with images, 0-2 audio
clips given as arrays or WAV files, text; ``images_meta`` / ``audios_meta`` filled in) and
differ only in how many images a turn holds, their side range and the shortest clip, which
each family's rules bound; those are parameters, so each test keeps its own records.
"""

from __future__ import annotations

import random
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

RATE = 16000
WORDS = ("the", "cat", "sat", "on", "a", "mat", "sound", "tone", "red", "blue", "every", "row")


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE) -> str:
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return str(path)


def _tone(n: int, hz: float = 440.0) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * hz * np.arange(n) / RATE)).astype(np.float32)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def audio_family_records(
    n: int,
    seed: int,
    tmp: Path,
    *,
    n_images: Callable[[random.Random], int],
    side: tuple[int, int],
    min_samples: int,
) -> list[dict[str, Any]]:
    """``n`` records: 1-2 turns; user turns with ``n_images(rng)`` images (each side in
    ``side``), 0-2 audio clips of ``min_samples`` to 3 s (array or WAV) and text."""
    rng, out = random.Random(seed), []
    for sid in range(n):
        conv: list[dict[str, Any]] = []
        if rng.random() < 0.3:
            conv.append({"role": "system", "content": _text(rng, 2, 6)})
        images_meta, audios_meta = [], []
        for turn in range(rng.randint(1, 2)):
            user: list[dict[str, Any]] = []
            for _ in range(n_images(rng)):
                h, w = rng.randint(*side), rng.randint(*side)
                user.append({"type": "image", "image": Image.new("RGB", (w, h), (9, 99, 199))})
                images_meta.append([h, w])
            for k in range(rng.randint(0, 2)):
                wav = _tone(rng.randint(min_samples, 48000), rng.uniform(100, 900))
                path = tmp / f"{sid}_{turn}_{k}.wav"
                value: Any = wav if rng.random() < 0.5 else write_wav(path, wav)
                user.append({"type": "audio", "audio": value})
                audios_meta.append(wav.shape[0] / RATE)
            user.append({"type": "text", "text": _text(rng, 1, 10)})
            conv += [{"role": "user", "content": user},
                     {"role": "assistant", "content": _text(rng, 1, 12)}]  # fmt: skip
        out.append({"sample_id": sid, "conversation": conv, "images_meta": images_meta,
                    "audios_meta": audios_meta})  # fmt: skip
    return out


def _audio_rec(sid: int, value: Any, **extra: Any) -> dict[str, Any]:
    """One user turn holding one audio block ``value`` (with ``extra`` keys), answer "ok"."""
    return {"sample_id": sid, "conversation": [
        {"role": "user", "content": [{"type": "audio", "audio": value, **extra}]},
        {"role": "assistant", "content": "ok"}]}  # fmt: skip
