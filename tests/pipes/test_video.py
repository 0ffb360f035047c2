"""Video files (pipes/reading/video.py): mp4 / webm / mkv encoded here with PyAV, planned from the
container's metadata (no decode) and decoded in the workers; through ``neat_vlm_graph`` the
estimated lengths equal the real ones. Needs PyAV (``neatpack[video]``, in the test extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.versions import TRUNCATED_VIDEO_TIME, rope_index_truncates_video_time

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes import SequenceSource
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.materializing.tokenize import tokenize_conversation
from neatpack.pipes.reading.media import SampleError
from neatpack.pipes.testing.tiny import load_tiny_processor

av = pytest.importorskip("av")

from support.video_files import CODECS, encode, truncated_mp4  # noqa: E402

from neatpack.pipes.reading.video import decode_video, probe_video  # noqa: E402


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("video")
    out = {ext: encode(root / f"v.{ext}", n=12 + 4 * k) for k, ext in enumerate(CODECS)}
    out["long"] = encode(root / "long.mp4", n=40, fps=10)
    return out


def record(path: Any, q: str = "what happens?") -> dict[str, Any]:
    user = [{"type": "video", "video": path}, {"type": "text", "text": q}]
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": "a bar moves right"}]}  # fmt: skip


@pytest.mark.parametrize("ext", sorted(CODECS))
def test_probe_reads_the_container_without_decoding(ext: str, videos: dict[str, Path]) -> None:
    frames, h, w, fps, duration = probe_video(str(videos[ext]))
    decoded = decode_video(str(videos[ext]))
    assert (frames, h, w, fps) == (len(decoded), 56, 64, 8.0)
    assert duration == pytest.approx(frames / 8)
    assert decoded[0].shape == (56, 64, 3)
    assert not np.array_equal(decoded[0], decoded[-1])
    assert len(decode_video(videos[ext].read_bytes())) == frames  # encoded bytes too


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_video_files_plan_exactly_and_batch(family: str, videos: dict[str, Path]) -> None:
    proc = load_tiny_processor(family)
    source = SequenceSource([record(str(videos[k])) for k in ("mp4", "webm", "mkv", "long")])
    est = LengthEstimator.from_processor(proc, mode="exact")
    index = build_length_index(source, est, progress=False)
    assert index.fallback_counts == {}  # every video planned from its container metadata
    real = {}
    for sid in range(len(source)):
        s = tokenize_conversation(source[sid], proc)
        real[sid] = s
        assert int(index.total[sid]) == len(s["input_ids"]) - 1, (family, sid)
        assert int(index.visual[sid]) == int((s["mm_token_type_ids"] == 2).sum()), (family, sid)
    cfg = NeatVLMConfig(pack_size=4096, batch_size=1, shuffle=False, estimate_mode="exact")
    seen = []
    for batch in neat_vlm_graph(source, proc, config=cfg):
        ids = [i for row in batch["sample_ids"] for i in row]
        seen += ids
        want = torch.cat([real[i]["video_grid_thw"] for i in ids])
        assert torch.equal(batch["video_grid_thw"], want)
        assert torch.equal(
            batch["pixel_values_videos"], torch.cat([real[i]["pixel_values_videos"] for i in ids])
        )
    assert set(seen) == set(range(len(source)))


def test_hf_videos_column_with_bytes(videos: dict[str, Path]) -> None:
    proc = load_tiny_processor("qwen2_vl")
    raw = {"messages": [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens?"}]},
        {"role": "assistant", "content": "a bar moves right"}],
        "videos": [{"bytes": videos["webm"].read_bytes(), "path": None}]}  # fmt: skip
    s = tokenize_conversation(SequenceSource([raw])[0], proc)
    want = tokenize_conversation(SequenceSource([record(str(videos["webm"]))])[0], proc)
    assert torch.equal(s["input_ids"], want["input_ids"])
    assert torch.equal(s["pixel_values_videos"], want["pixel_values_videos"])


def test_bad_videos_are_named_errors(
    videos: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = videos["mp4"].read_bytes()
    (tmp_path / "junk.mp4").write_bytes(b"\x00" * 500)
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) * 2 // 3])
    # planning counts a fallback; the worker's decode refuses the file, naming the sample
    source = SequenceSource([record(str(tmp_path / n)) for n in ("junk.mp4", "cut.mp4")])
    assert "videos_meta" not in source[0]
    proc = load_tiny_processor()
    with pytest.raises(SampleError, match=r"sample_id=0 \[video_error\]: video file .*junk"):
        tokenize_conversation(source[0], proc)
    with pytest.raises(SampleError, match=r"sample_id=1 \[video_error\]: video file .*cut"):
        tokenize_conversation(source[1], proc)
    import neatpack.pipes.reading.video as video_mod

    monkeypatch.setattr(video_mod, "MAX_VIDEO_BYTES", 1000)
    with pytest.raises(SampleError, match=r"sample_id=5 \[video_error\].*too large"):
        decode_video(str(videos["mp4"]), 5)


def test_zero_frame_video_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.mkv"
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=8)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
    with pytest.raises(SampleError, match=r"sample_id=2 \[video_error\].*(empty|unreadable)"):
        probe_video(str(path), 2)


@pytest.mark.parametrize("workers", [0, 1])
def test_bad_video_is_counted_by_the_skip_policy(
    workers: int, videos: dict[str, Path], tmp_path: Path
) -> None:
    # workers=1: decoded in a forked worker (PyAV opens each container there, after the fork)
    proc = load_tiny_processor()
    (tmp_path / "junk.mkv").write_bytes(b"\x1a\x45\xdf\xa3" + b"\x00" * 300)
    recs = [record(str(videos["mp4"])), record(str(tmp_path / "junk.mkv"))]
    cfg = NeatVLMConfig(pack_size=4096, shuffle=False, on_bad_sample="skip", num_workers=workers)
    loader = neat_vlm_graph(recs, proc, config=cfg)
    batches = list(loader)
    got = [i for b in batches for row in b["sample_ids"] for i in row]
    assert set(got) == {0}
    assert loader.ledgers[0].failed == [1]  # counted, by id
    assert any(b.get("video_grid_thw") is not None for b in batches)


def test_missing_decoder_names_the_extra(videos: dict[str, Path], monkeypatch: Any) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed
    source = SequenceSource([record(str(videos["mp4"]))])
    assert "videos_meta" not in source[0]  # planning falls back (counted), nothing raised
    with pytest.raises(ImportError, match=r"pip install 'neatpack\[video\]'"):
        tokenize_conversation(source[0], load_tiny_processor())


def test_datasets_video_feature_is_read_undecoded(videos: dict[str, Path]) -> None:
    datasets = pytest.importorskip("datasets")
    text = datasets.Value("string")
    features = datasets.Features({
        "messages": [{"role": text, "content": [{"type": text, "text": text}]}],
        "videos": datasets.List(datasets.Video())})  # fmt: skip
    rows = [{"messages": [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a bar moves right"}]}],
        "videos": [{"bytes": videos[ext].read_bytes(), "path": None}]}
        for ext in ("mp4", "webm")]  # fmt: skip
    ds = datasets.Dataset.from_list(rows, features=features)
    proc = load_tiny_processor("qwen2_5_vl")
    cfg = NeatVLMConfig(pack_size=4096, shuffle=False, estimate_mode="exact")
    got = list(neat_vlm_graph(ds, proc, config=cfg))
    want = [tokenize_conversation(SequenceSource([record(str(videos[e]))])[0], proc)
            for e in ("mp4", "webm")]  # fmt: skip
    ids = [i for b in got for row in b["sample_ids"] for i in row]
    assert sorted(ids) == [0, 1]
    grids = torch.cat([b["video_grid_thw"] for b in got])
    assert torch.equal(grids, torch.cat([want[i]["video_grid_thw"] for i in ids]))
    pixels = torch.cat([b["pixel_values_videos"] for b in got])
    assert torch.equal(pixels, torch.cat([want[i]["pixel_values_videos"] for i in ids]))


def test_truncated_video_is_refused_naming_the_sample(tmp_path: Path) -> None:
    cut = truncated_mp4(tmp_path)
    assert probe_video(str(cut))[0] == 30  # the index still lists every frame
    with pytest.raises(SampleError, match=r"sample_id=3 \[video_error\].*truncated: \d+ frames"):
        decode_video(str(cut), 3)


def test_videos_meta_overrides_the_container_rate(videos: dict[str, Path]) -> None:
    proc = load_tiny_processor("qwen3_vl")  # samples frames by fps: the rate changes the count
    frames, h, w, _, _ = probe_video(str(videos["long"]))
    plain = record(str(videos["long"]))
    slow = {**plain, "videos_meta": [[frames, h, w, 2.5, frames / 2.5]]}  # the user's rate
    source = SequenceSource([plain, slow])
    index = build_length_index(
        source, LengthEstimator.from_processor(proc, mode="exact"), progress=False
    )
    lengths = [len(tokenize_conversation(source[i], proc)["input_ids"]) - 1 for i in (0, 1)]
    assert index.total.tolist() == lengths
    assert lengths[0] != lengths[1]


@pytest.mark.parity
def test_video_file_pack_equals_separate_runs_on_tiny_qwen2_5_vl(videos: dict[str, Path]) -> None:
    """A packed row holding a decoded video file and text samples gives, per document, the
    logits of that document run alone on a tiny real Qwen2.5-VL (fp32, <= 1e-5)."""
    from neatpack.pipes.testing.tiny_models import tiny_model

    proc = load_tiny_processor("qwen2_5_vl")
    text = {"messages": [{"role": "user", "content": "name a colour"},
                         {"role": "assistant", "content": "red"}]}  # fmt: skip
    source = SequenceSource([record(str(videos["webm"])), text, text])
    cfg = NeatVLMConfig(pack_size=512, batch_size=1, shuffle=False, estimate_mode="exact",
                        attn_implementation="eager")  # fmt: skip
    batch = next(iter(neat_vlm_graph(source, proc, config=cfg)))
    assert sorted(batch["sample_ids"][0]) == [0, 1, 2]  # one row: the video and both texts
    model = tiny_model("qwen2_5_vl", processor=proc)
    if rope_index_truncates_video_time(model) and bool(
        (batch["second_per_grid_ts"] != batch["second_per_grid_ts"].round()).any()
    ):
        pytest.skip(TRUNCATED_VIDEO_TIME)  # the run-alone reference is wrong on that release
    media = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")

    def run_packed(**over: Any) -> torch.Tensor:
        kw = {k: batch[k] for k in (*media, "attention_mask", "position_ids", "mm_token_type_ids")}
        with torch.no_grad():
            return model(input_ids=batch["input_ids"], **{**kw, **over}).logits[0]  # type: ignore[no-any-return]

    packed = run_packed()
    worst = 0.0
    for k, sid in enumerate(batch["sample_ids"][0], start=1):
        s = tokenize_conversation(source[sid], proc)
        kw = {key: s[key] for key in media if key in s}
        with torch.no_grad():
            types = s["mm_token_type_ids"][:-1][None]
            alone = model(input_ids=s["input_ids"][:-1][None], mm_token_type_ids=types, **kw)
        alone = alone.logits[0]
        where = batch["doc_ids"][0] == k
        worst = max(worst, float((packed[where] - alone[: int(where.sum())]).abs().max()))
    assert worst <= 1e-5
    halved = run_packed(pixel_values_videos=batch["pixel_values_videos"] * 0.5)
    assert float((halved - packed).abs().max()) > 1e-4
