"""Video files decode only the frames the processor keeps (``pipes/reading/video.py`` ``keep=``,
picked
in ``pipes/materializing/tokenize.py`` by the video processor's own ``sample_frames``). The
reference is the
old path written out: every frame decoded, then the real processor samples them itself
(``do_sample_frames=True`` with the file's metadata). Real mp4 / webm files encoded here with
PyAV (constant and variable frame rate), the real tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL
processors; outputs compared with ``torch.equal``."""

from __future__ import annotations

import doctest
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers.video_utils import VideoMetadata

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes import SequenceSource
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.materializing.tokenize import prepare_conversation, tokenize_conversation
from neatpack.pipes.reading.media import SampleError
from neatpack.pipes.testing.tiny import load_tiny_processor

av = pytest.importorskip("av")

from support.video_files import encode, truncated_mp4  # noqa: E402

from neatpack.pipes import video  # noqa: E402
from neatpack.pipes.reading.video import decode_video, probe_video  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kept")
    paths = {
        "90f_30fps": encode(root / "a.mp4", 90, 30),
        "50f_24fps": encode(root / "b.mp4", 50, 24),
        "20f_8fps": encode(root / "c.mp4", 20, 8),
        "3f_30fps": encode(root / "short.mp4", 3, 30),  # fewer than min_frames=4
        "60f_vfr": encode(root / "vfr.mp4", 60, 30, vfr=True),
        "40f_10fps_webm": encode(root / "d.webm", 40, 10),  # no frame count in the container
    }
    return {k: str(v) for k, v in paths.items()}


def processor(family: str) -> Any:
    """The tiny processor, sampling at 2 fps: Qwen3-VL's default; Qwen2/2.5-VL's processors
    keep every frame by default (``do_sample_frames=False``), so they are set as a user sets
    them to sample."""
    proc = load_tiny_processor(family)
    if family != "qwen3_vl":
        proc.video_processor.fps, proc.video_processor.do_sample_frames = 2.0, True
    return proc


def record(*videos: Any, sid: int = 0, **extra: Any) -> dict[str, Any]:
    blocks = [{"type": "video", "video": v} for v in videos]
    user = [*blocks, {"type": "text", "text": "what happens?"}]
    answer = {"role": "assistant", "content": [{"type": "text", "text": "a bar moves"}]}
    return {"sample_id": sid, **extra, "conversation": [{"role": "user", "content": user}, answer]}


def full_decode_reference(rec: dict[str, Any], proc: Any, fps: list[float]) -> Any:
    """The old path: every frame decoded, the processor samples them at the file's rate."""
    text = prepare_conversation(rec, proc).text
    frames = [decode_video(b["video"]) for b in rec["conversation"][0]["content"][:-1]]
    assert all(f.frames_indices is None for f in frames)  # no picker: every frame
    meta = [{"fps": r, "total_num_frames": len(f), "frames_indices": list(range(len(f)))}
            for f, r in zip(frames, fps, strict=True)]  # fmt: skip
    return proc(text=[text], videos=frames, video_metadata=meta, do_sample_frames=True,
                return_tensors="pt")  # fmt: skip


def assert_same(sample: dict[str, Any], ref: Any) -> None:
    assert torch.equal(sample["input_ids"], ref["input_ids"][0])
    assert torch.equal(sample["pixel_values_videos"], ref["pixel_values_videos"])
    assert torch.equal(sample["video_grid_thw"], ref["video_grid_thw"])
    if "second_per_grid_ts" in ref:  # Qwen2.5-VL: from the sampled fps
        assert torch.equal(torch.as_tensor(sample["second_per_grid_ts"]),
                           torch.as_tensor(ref["second_per_grid_ts"]))  # fmt: skip


@pytest.mark.parametrize("clip", ["90f_30fps", "50f_24fps", "20f_8fps", "3f_30fps", "60f_vfr",
                                  "40f_10fps_webm"])  # fmt: skip
@pytest.mark.parametrize("family", FAMILIES)
def test_only_kept_frames_are_decoded_and_outputs_equal_the_full_decode(
    family: str, clip: str, clips: dict[str, str]
) -> None:
    proc, path = processor(family), clips[clip]
    total, _, _, fps, _ = probe_video(path)
    rec = record(path)
    prep = prepare_conversation(rec, proc)
    (got,) = prep.videos
    # the frames handed over are exactly those the processor's sampler picks, no more
    md = VideoMetadata(total_num_frames=int(total), fps=fps, frames_indices=list(range(int(total))))
    want_idx = proc.video_processor.sample_frames(metadata=md)
    assert got.frames_indices == [int(i) for i in want_idx]
    assert len(got) == len(want_idx)
    assert got.total_frames == total
    assert prep.processor_kwargs["do_sample_frames"] is False  # not sampled a second time
    if total >= 20:
        assert len(got) < total / 3
    full = decode_video(path)
    assert all(np.array_equal(a, full[i]) for a, i in zip(got, got.frames_indices, strict=True))
    sample = tokenize_conversation(rec, proc)
    assert_same(sample, full_decode_reference(rec, proc, [fps]))
    if family == "qwen3_vl":  # the timestamps in the text are those of the kept frames
        text = proc.tokenizer.decode(sample["input_ids"])
        first = f"<{(want_idx[0] + want_idx[1]) / 2 / fps:.1f} seconds>"
        assert text.count(" seconds>") == int(sample["video_grid_thw"][0, 0])
        assert first in text


@pytest.mark.parametrize("family", FAMILIES)
def test_rate_from_the_record_picks_the_frames(family: str, clips: dict[str, str]) -> None:
    """``videos_meta``'s rate (or the block's ``fps``) overrides the container's for the
    processor; the picker uses the same rate, so the kept frames follow it."""
    proc, path = processor(family), clips["90f_30fps"]
    total, h, w, _, _ = probe_video(path)
    by_meta = record(path, videos_meta=[[total, h, w, 10.0, total / 10.0]])
    by_block = record(path)
    by_block["conversation"][0]["content"][0]["fps"] = 10.0
    plain = len(prepare_conversation(record(path), proc).videos[0])
    for rec in (by_meta, by_block):
        got = prepare_conversation(rec, proc).videos[0]
        assert len(got) > plain  # 90 frames at 10 fps: 9 s, more frames at 2 fps than 3 s
        assert_same(tokenize_conversation(rec, proc), full_decode_reference(rec, proc, [10.0]))


def test_two_files_and_a_file_beside_a_frame_list(
    clips: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = processor("qwen3_vl")
    a, b = clips["90f_30fps"], clips["60f_vfr"]
    rec = record(a, b)
    prep = prepare_conversation(rec, proc)
    assert [v.frames_indices is not None for v in prep.videos] == [True, True]
    fps = [probe_video(p)[3] for p in (a, b)]
    assert_same(tokenize_conversation(rec, proc), full_decode_reference(rec, proc, fps))
    # a frame list in the same record: the processor samples it, so the file is decoded in full
    # (one do_sample_frames per call) and the outputs are as before
    frames = list(decode_video(a))
    mixed = record(a, frames)
    prep = prepare_conversation(mixed, proc)
    assert prep.videos[0].frames_indices is None
    assert len(prep.videos[0]) == 90
    with monkeypatch.context() as m:
        m.setattr(video, "DECODE_ONLY_KEPT", False)
        before = tokenize_conversation(mixed, proc)
    after = tokenize_conversation(mixed, proc)
    assert torch.equal(after["input_ids"], before["input_ids"])
    assert torch.equal(after["pixel_values_videos"], before["pixel_values_videos"])


def test_without_sampling_every_frame_is_kept(clips: dict[str, str]) -> None:
    proc = load_tiny_processor("qwen2_vl")  # do_sample_frames=False: the model sees every frame
    (got,) = prepare_conversation(record(clips["20f_8fps"]), proc).videos
    assert got.frames_indices is None
    assert len(got) == 20


@pytest.mark.parametrize("family", FAMILIES)
def test_a_clip_too_short_to_sample_fails_as_before(family: str, tmp_path: Path) -> None:
    one = str(encode(tmp_path / "one.mp4", 1, 30))
    proc = processor(family)
    errors = []
    for kept_only in (True, False):
        with pytest.MonkeyPatch().context() as m:
            m.setattr(video, "DECODE_ONLY_KEPT", kept_only)
            with pytest.raises(SampleError, match=r"sample_id=7 \[video_error\]") as e:
                tokenize_conversation(record(one, sid=7), proc)
            errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_decode_video_keep(clips: dict[str, str]) -> None:
    path = clips["40f_10fps_webm"]
    full = decode_video(path)
    got = decode_video(path, keep=lambda total, fps: [0, 13, 13, 39, 2])  # repeats, any order
    assert (got.total_frames, got.fps, got.frames_indices) == (40, 10.0, [0, 13, 13, 39, 2])
    assert all(np.array_equal(a, full[i]) for a, i in zip(got, [0, 13, 13, 39, 2], strict=True))
    with pytest.raises(ValueError, match=r"out of range: \[40\]"):
        decode_video(path, keep=lambda total, fps: [0, total])
    with pytest.MonkeyPatch().context() as m:  # the switch back to the full decode
        m.setattr(video, "DECODE_ONLY_KEPT", False)
        every = decode_video(path, keep=lambda total, fps: [0])
    assert every.frames_indices is None
    assert len(every) == 40


def test_kept_frames_are_still_counted_and_sized(clips: dict[str, str], tmp_path: Path) -> None:
    path = Path(clips["90f_30fps"])
    cut = truncated_mp4(tmp_path)
    with pytest.raises(SampleError, match=r"sample_id=3 \[video_error\].*truncated"):
        decode_video(str(cut), 3, keep=lambda total, fps: [0])  # the first frame is there
    one_frame = 56 * 64 * 3
    with pytest.MonkeyPatch().context() as m:  # MAX_VIDEO_BYTES bounds what is held
        m.setattr(video, "MAX_VIDEO_BYTES", 10 * one_frame)
        assert len(decode_video(str(path), keep=lambda total, fps: [0, 5, 5, 9])) == 4
        with pytest.raises(SampleError, match=r"too large: 90 frames"):
            decode_video(str(path))


@pytest.mark.parametrize("workers", [0, 1])
def test_graph_batches_equal_the_full_decode(workers: int, clips: dict[str, str]) -> None:
    proc = processor("qwen3_vl")
    names = ("90f_30fps", "3f_30fps", "60f_vfr", "40f_10fps_webm")
    recs = [{"messages": record(clips[n])["conversation"]} for n in names]
    source = SequenceSource(recs)
    index = build_length_index(
        source, LengthEstimator.from_processor(proc, mode="exact"), progress=False
    )
    cfg = NeatVLMConfig(pack_size=4096, batch_size=1, shuffle=False, num_workers=workers)
    runs = []
    for kept_only in (False, True):
        with pytest.MonkeyPatch().context() as m:  # set before the workers fork
            m.setattr(video, "DECODE_ONLY_KEPT", kept_only)
            runs.append(list(neat_vlm_graph(source, proc, config=cfg, lengths=index)))
    before, after = runs
    assert len(before) == len(after) > 0
    for a, b in zip(before, after, strict=True):
        assert a["sample_ids"] == b["sample_ids"]
        for key in ("input_ids", "labels", "position_ids", "pixel_values_videos",
                    "video_grid_thw"):  # fmt: skip
            assert torch.equal(a[key], b[key]), key


def test_the_module_example_runs() -> None:
    result = doctest.testmod(video)
    assert result.failed == 0
    assert result.attempted >= 4
