"""A generated multimodal corpus on disk, for the demo, tests and benchmarks.

Images are drawn with PIL (varied sizes and aspect ratios: photos, documents, banners, icons);
conversations mix text-only, one image, several images and multi-turn exchanges. Everything is
a pure function of ``seed``: the same call writes byte-identical files.

>>> import tempfile
>>> path = write_corpus(tempfile.mkdtemp(), num_samples=4, seed=0)
>>> path.name
'data.jsonl'
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

__all__ = ["IMAGE_SHAPES", "write_corpus"]

# (height, width) families seen in VLM training data, scaled down to keep the demo quick.
IMAGE_SHAPES = (
    (480, 640),  # photo, landscape
    (640, 480),  # photo, portrait
    (224, 224),  # icon / thumbnail
    (880, 680),  # document page
    (120, 900),  # banner, extreme aspect ratio
    (720, 1280),  # screenshot
    (300, 400),
)

_WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "chart",
    "table",
    "shows",
    "red",
    "blue",
    "green",
    "large",
    "small",
    "document",
    "invoice",
    "total",
    "page",
    "photo",
    "left",
    "right",
    "top",
    "bottom",
    "number",
    "value",
    "line",
    "bar",
    "figure",
    "street",
    "car",
    "person",
    "tree",
    "house",
]


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def _draw(rng: random.Random, height: int, width: int, path: Path) -> None:
    bg = tuple(rng.randint(0, 255) for _ in range(3))
    image = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 12)):
        x0, y0 = rng.randint(0, width - 1), rng.randint(0, height - 1)
        x1, y1 = rng.randint(x0, width), rng.randint(y0, height)
        color = tuple(rng.randint(0, 255) for _ in range(3))
        if rng.random() < 0.5:
            draw.rectangle((x0, y0, x1, y1), fill=color)
        else:
            draw.ellipse((x0, y0, x1, y1), outline=color, width=3)
    image.save(path, format="PNG" if rng.random() < 0.3 else "JPEG")


def write_corpus(
    directory: str | Path,
    *,
    num_samples: int = 64,
    seed: int = 0,
    with_meta: float = 0.7,
    max_images: int = 3,
) -> Path:
    """Write ``data.jsonl`` and ``media/*.img`` under ``directory``; return the JSONL path.

    ``with_meta`` is the fraction of records that store ``images_meta`` ([height, width]); the
    others leave the estimator to read the image header. Media paths are relative to
    ``directory / "media"``, the media root to pass to the reader.
    """
    root = Path(directory)
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(num_samples):
        kind = rng.random()
        n_images = 0 if kind < 0.25 else (1 if kind < 0.7 else rng.randint(2, max_images))
        images, meta = [], []
        for j in range(n_images):
            h, w = rng.choice(IMAGE_SHAPES)
            scale = rng.uniform(0.5, 1.2)
            h, w = max(28, int(h * scale)), max(28, int(w * scale))
            name = f"{i:06d}_{j}.img"
            _draw(rng, h, w, media / name)
            images.append(name)
            meta.append([h, w])
        user: list[dict[str, Any]] = [{"type": "image", "image": p} for p in images]
        user.append({"type": "text", "text": _sentence(rng, 4, 30)})
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": _sentence(rng, 3, 80)}]},
        ]
        for _ in range(rng.choice((0, 0, 1, 2))):
            messages.append({"role": "user", "content": _sentence(rng, 3, 15)})
            messages.append({"role": "assistant", "content": _sentence(rng, 3, 40)})
        record: dict[str, Any] = {"id": f"demo-{i}", "messages": messages}
        if images and rng.random() < with_meta:
            record["images_meta"] = meta
        lines.append(json.dumps(record))
    path = root / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
