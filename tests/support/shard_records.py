"""Shard fixtures shared by the shard, remote, tar-index, index-split and media-policy tests:
generated samples written as WebDataset-style tar shards or Parquet files, and the exactly-once
resume check they all run."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.testing.resume import assert_exactly_once, same_item

N = 10
WORDS = ("red", "cat", "sits", "on", "a", "mat", "blue", "sky", "the", "dog")
CFG = NeatVLMConfig(pack_size=384, batch_size=2, shuffle=False, estimate_mode="exact")


def shard_samples(n: int = N, seed: int = 8) -> list[dict[str, Any]]:
    """``n`` generated samples (a question of 3-8 words, an answer of 2-8, sample ``i`` with
    ``i % 3`` images): seed 8 gives the records the shard, remote, stream-source, offset-index
    and index-split tests all read."""
    rng = random.Random(seed)
    return [{"q": " ".join(rng.choices(WORDS, k=rng.randint(3, 8))),
             "a": " ".join(rng.choices(WORDS, k=rng.randint(2, 8))),
             "images": [png_bytes(rng) for _ in range(i % 3)]} for i in range(n)]  # fmt: skip


def png_bytes(rng: random.Random) -> bytes:
    buf = io.BytesIO()
    size = (rng.randint(30, 80), rng.randint(30, 80))
    Image.new("RGB", size, (rng.randint(0, 255), 60, 90)).save(buf, "PNG")
    return buf.getvalue()


def trl(s: dict[str, Any]) -> dict[str, Any]:
    user: list[dict[str, Any]] = [{"type": "image"} for _ in s["images"]]
    user.append({"type": "text", "text": s["q"]})
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": s["a"]}]}  # fmt: skip


def canonical(s: dict[str, Any]) -> dict[str, Any]:
    return {**trl(s), "images": [{"bytes": b, "path": None} for b in s["images"]]}


def write_tars(root: Path, samples: list[dict[str, Any]], per: int = 4) -> list[Path]:
    paths = []
    for k in range(0, len(samples), per):
        path = root / f"shard-{k // per:03d}.tar"
        with tarfile.open(path, "w") as tf:
            for i in range(k, min(k + per, len(samples))):
                s, key = samples[i], f"{i:06d}"
                rec = trl(s)
                members = {f"{key}.{j}.png": b for j, b in enumerate(s["images"])}
                if i % 4 == 3:  # explicit references instead of member order
                    rec["images"] = list(members)
                members[f"{key}.json"] = json.dumps(rec).encode()
                for name in sorted(members, key=lambda n: not n.endswith(".json")):
                    info = tarfile.TarInfo(name)
                    info.size = len(members[name])
                    tf.addfile(info, io.BytesIO(members[name]))
        paths.append(path)
    return paths


def write_parquet(root: Path, samples: list[dict[str, Any]]) -> list[Path]:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    # Nested as the hub stores it: every block a {type, text} struct (text null on images).
    rows = [{"messages": [{"role": m["role"], "content": m["content"] if isinstance(
                 m["content"], list) else [{"type": "text", "text": m["content"]}]}
                 for m in trl(s)["messages"]],
             "images": [{"bytes": b, "path": None} for b in s["images"]]}
            for s in samples]  # fmt: skip
    paths = []
    for k, part in enumerate((rows[:6], rows[6:])):
        path = root / f"part-{k}.parquet"
        pq.write_table(pa.Table.from_pylist(part), path, row_group_size=3)
        paths.append(path)
    return paths


def without_meta(bs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k != "meta"} for b in bs]


def batch_ids(bs: list[dict[str, Any]]) -> list[int]:
    return [i for b in bs for row in b["sample_ids"] for i in row]


def assert_resume_is_exactly_once(source: Any, processor: Any) -> None:
    """Two batches, a checkpoint, a fresh loader resumed from it: the batches equal the
    uninterrupted run's and every sample is consumed once (``tail="drop"`` excused)."""
    cfg = NeatVLMConfig(pack_size=256, batch_size=1, seed=3, num_workers=1, tail="drop")
    reference = list(neat_vlm_graph(source, processor, config=cfg))
    first = neat_vlm_graph(source, processor, config=cfg)
    it = iter(first)
    head = [next(it) for _ in range(2)]
    resumed = neat_vlm_graph(source, processor, config=cfg)
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    assert same_item(without_meta(head + rest), without_meta(reference))
    assert_exactly_once(batch_ids(head + rest), range(N), excused=resumed.ledgers[0].tail_dropped)
