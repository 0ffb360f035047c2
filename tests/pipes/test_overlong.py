"""Overlong samples are reported when the graph is built: by modality, with the fixes."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.indexing.overlong import OverlongError, overlong_summary, record_modality
from neatpack.pipes.reading.read import SequenceSource
from neatpack.pipes.testing.tiny import load_tiny_processor

PACK = 1024


def _records(root: Path) -> list[dict[str, Any]]:
    """Short text, two long videos (2 fps over 30 / 60 s), five large images (the tiny
    processor caps one image at 256 tokens), one long text."""
    Image.new("RGB", (1400, 1000), (10, 200, 30)).save(root / "big.png")
    Image.new("RGB", (64, 48), (200, 10, 30)).save(root / "small.png")

    def video(seconds: int) -> dict[str, Any]:
        return {
            "messages": [
                {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, "What?"]},
                {"role": "assistant", "content": "A ball."},
            ],
            "videos_meta": [[seconds * 25, 224, 224, 25.0, float(seconds)]],
        }

    short = {
        "messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    }
    return [
        short,
        video(30),
        {"messages": [{"role": "user", "content": [*[{"type": "image", "image": "big.png"}] * 5,
                                                   "Hm?"]},
                      {"role": "assistant", "content": "Green."}]},
        short,
        video(60),
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "small.png"}, "Hm?"]},
                      {"role": "assistant", "content": "Red."}]},
        {"messages": [{"role": "user", "content": "Tell me. " * 500},
                      {"role": "assistant", "content": "No."}]},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("overlong")
    return _records(root), root


def test_graph_raises_at_build_with_the_summary_by_modality(
    data: tuple[list[dict[str, Any]], Path],
) -> None:
    records, root = data
    proc = load_tiny_processor("qwen2_vl")
    cfg = NeatVLMConfig(pack_size=PACK, media_root=str(root), shuffle=False)
    index = build_length_index(
        SequenceSource(records, media_root=root),
        LengthEstimator.from_processor(proc, mode="exact"), progress=False,
    )  # fmt: skip
    over = np.flatnonzero(index.total > PACK).tolist()
    assert over == [1, 2, 4, 6]  # two videos, the five images, the long text
    with pytest.raises(OverlongError) as info:
        neat_vlm_graph(records, proc, config=cfg)  # the build raises: no batch was asked for
    summary = info.value.summary
    assert summary.count == 4
    assert {k: g.first_ids for k, g in summary.groups.items()} == {
        "video": (1, 4), "image": (2,), "text": (6,)
    }  # fmt: skip
    video = summary.groups["video"]
    assert (video.min_tokens, video.max_tokens) == (int(index.total[1]), int(index.total[4]))
    assert video.max_visual == int(index.visual[4])
    msg = str(info.value)
    assert f"4 sample(s) are longer than pack_size={PACK} tokens" in msg
    assert f"video: 2 samples, {index.total[1]}-{index.total[4]} tokens" in msg
    assert "image: 1 sample" in msg
    assert "text: 1 sample" in msg
    assert "overlong='drop'" in msg
    assert f"pack_size >= {int(index.total.max())}" in msg
    assert "fps / max_frames" in msg
    assert "max_pixels" in msg


def test_graph_drop_warns_once_at_build_and_counts_them(
    data: tuple[list[dict[str, Any]], Path],
) -> None:
    records, root = data
    proc = load_tiny_processor("qwen2_vl")
    cfg = NeatVLMConfig(pack_size=PACK, media_root=str(root), shuffle=False, overlong="drop")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loader = neat_vlm_graph(records, proc, config=cfg)
    texts = [str(w.message) for w in seen if "longer than pack_size" in str(w.message)]
    assert len(texts) == 1
    assert "video: 2 samples" in texts[0]
    assert "(the policy in use)" in texts[0]
    list(loader)
    assert sorted(loader.ledgers[0].overlong) == [1, 2, 4, 6]
    assert sorted(loader.ledgers[0].consumed) == [0, 3, 5]


def test_no_overlong_no_warning(data: tuple[list[dict[str, Any]], Path]) -> None:
    records, root = data
    proc = load_tiny_processor("qwen2_vl")
    cfg = NeatVLMConfig(pack_size=PACK, media_root=str(root), shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        neat_vlm_graph([records[0], records[3], records[5]], proc, config=cfg)


def test_summary_literal_and_modality() -> None:
    s = overlong_summary([5, 70, 90, 80, 3], [0, 60, 0, 75, 0], 50, {1: "image", 3: "video"})
    assert [(k, g.count, g.min_tokens, g.max_tokens) for k, g in s.groups.items()] == [
        ("video", 1, 80, 80), ("image", 1, 70, 70), ("text", 1, 90, 90)
    ]  # fmt: skip
    assert s.max_tokens == 90
    assert overlong_summary([1, 2], [0, 0], 50, {}).count == 0
    rec = {"conversation": [{"role": "user", "content": [
        {"type": "image", "image": "a"}, {"type": "audio", "audio": "b"}]}]}  # fmt: skip
    assert record_modality(rec) == "audio"
    assert record_modality({"conversation": [{"role": "user", "content": []}]}) == "text"
