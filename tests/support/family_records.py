"""Generated conversations for the family tests: random text, PIL images of random sizes,
system / user / assistant turns, and ``images_meta`` taken from the pictures."""

from __future__ import annotations

import random
from typing import Any

from PIL import Image

WORDS = (
    "the", "cat", "sat", "on", "a", "mat", "while", "data", "flows", "through", "every",
    "packed", "row", "of", "tokens", "and", "images", "return", "value",
)  # fmt: skip


def random_text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def conversation_record(sid: int, rng: random.Random, max_images: int = 2) -> dict[str, Any]:
    conv: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        conv.append(
            {"role": "system", "content": [{"type": "text", "text": random_text(rng, 2, 8)}]}
        )
    for _ in range(rng.randint(1, 3)):
        user: list[dict[str, Any]] = [
            {"type": "image", "image": Image.new(
                "RGB", (rng.randint(20, 90), rng.randint(20, 90)), (rng.randint(0, 255), 90, 30))}
            for _ in range(rng.randint(0, max_images))
        ]  # fmt: skip
        user.append({"type": "text", "text": random_text(rng, 3, 30)})
        conv.append({"role": "user", "content": user})
        conv.append(
            {"role": "assistant", "content": [{"type": "text", "text": random_text(rng, 1, 40)}]}
        )
    return {"sample_id": sid, "conversation": conv}


def conversation_records(n: int, seed: int = 0, max_images: int = 2) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [conversation_record(i, rng, max_images) for i in range(n)]


def with_images_meta(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for r in recs:
        r["images_meta"] = [[b["image"].height, b["image"].width] for m in r["conversation"]
                            for b in m["content"] if b.get("type") == "image"]  # fmt: skip
    return recs
