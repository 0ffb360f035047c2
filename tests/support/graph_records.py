"""Records with audio for the graph tests (``test_graph_families``, ``test_graph_more_families``),
written as a JSONL file with media paths relative to the media root and read back through the
real reader (``JsonlSource``), as a user's dataset would be."""

from __future__ import annotations

import json
import random
import wave
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from neatpack.pipes.reading.read import JsonlSource

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


def jsonl_source(root: Path, records: list[dict[str, Any]]) -> JsonlSource:
    """Write ``records`` (media named by absolute paths under ``root``) to a new
    ``root/records<k>.jsonl`` with the paths made relative to ``root``, and open it with ``root``
    as the media root."""
    for record in records:
        for message in record["conversation"]:
            for block in message["content"]:
                kind = block["type"]
                if kind != "text":
                    block[kind] = str(Path(block[kind]).relative_to(root))
    path = root / f"records{len(list(root.glob('records*.jsonl')))}.jsonl"  # never overwritten
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return JsonlSource(path, media_root=root)


def omni_corpus(root: Path, n: int = 8) -> JsonlSource:
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
    return jsonl_source(root, records)
