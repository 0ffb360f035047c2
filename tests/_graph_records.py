"""In-memory records with audio for the graph tests (``test_graph_families``,
``test_graph_more_families``): the JSONL reader (``pipes/_record.py``, ``MEDIA_TYPES``) does not
accept audio blocks yet, so these tests read through ``Records``, a ``RecordSource`` over
records with absolute media paths."""

from __future__ import annotations

import hashlib
import json
import random
import wave
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

RATE = 16000


def _wav(path: Path, rng: random.Random, n: int) -> str:
    t = np.arange(n) / RATE
    wave_form = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 900) * t)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(np.round(wave_form * 32767).astype("<i2").tobytes())
    return str(path)


class Records:
    """A ``RecordSource`` over in-memory records with absolute media paths: the JSONL reader
    (``pipes/_record.py``, ``MEDIA_TYPES``) does not accept audio blocks yet."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, sample_id: int) -> dict[str, Any]:
        return {"sample_id": int(sample_id), **self.records[sample_id]}

    def content_fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.records).encode()).hexdigest()


def omni_corpus(root: Path, n: int = 8) -> Records:
    """n records: 0-2 WAV clips (0.1-2 s) and 0-1 PNG image per record."""
    rng = random.Random(4)
    words = ("tone", "red", "green", "sound", "the", "cat", "hears", "a", "loud", "note")
    records: list[dict[str, Any]] = []
    for i in range(n):
        user: list[dict[str, Any]] = []
        for k in range(i % 3):
            clip = _wav(root / f"a{i}_{k}.wav", rng, rng.randint(1600, 2 * RATE))
            user.append({"type": "audio", "audio": clip})
        if i % 2 == 0:
            name = str(root / f"i{i}.png")
            Image.new("RGB", (rng.randint(28, 100), rng.randint(28, 100)), (200, 9, 9)).save(name)
            user.append({"type": "image", "image": name})
        user.append({"type": "text", "text": " ".join(rng.choices(words, k=rng.randint(3, 12)))})
        answer = " ".join(rng.choices(words, k=rng.randint(2, 15)))
        records.append({"conversation": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})  # fmt: skip
    return Records(records)
