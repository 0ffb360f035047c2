"""Length estimation against the real transformers processors: image tokens equal
``image_grid_thw.prod() // merge**2``, video tokens equal the video processors' grids, exact
mode equals the processor's real input length, and the fast path equals the full path."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image
from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_resize_video
from transformers.video_utils import VideoMetadata

from neatpack.pipes.indexing.estimate import (
    EstimateError,
    LengthEstimator,
    TemplateOverhead,
    text_stats,
)
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.indexing.media_tokens import (
    ImageTokenConfig,
    VideoTokenConfig,
    smart_resize,
    smart_resize_video,
)
from neatpack.pipes.reading._record import to_record
from neatpack.pipes.reading.read import JsonlSource, SequenceSource

SIZES = [
    (28, 4000), (4000, 28), (10, 10), (8000, 6000), (1, 1), (27, 29), (100, 70), (1080, 1920),
    (224, 224), (14, 2800), (2800, 14), (3000, 15), (333, 777), (57, 4444), (512, 31),
]  # fmt: skip
QWEN2 = {"patch_size": 14, "merge_size": 2, "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 256}
QWEN3 = {"patch_size": 16, "merge_size": 2, "min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 256}


@functools.cache
def tiny(family: str) -> Any:
    from neatpack.pipes.testing.tiny import load_tiny_processor

    return load_tiny_processor(family)


def real_image_tokens(ip: Any, h: int, w: int) -> int | None:
    try:
        grid = ip(images=[torch.zeros(3, h, w, dtype=torch.uint8)], return_tensors="pt")
    except ValueError:
        return None  # aspect ratio > 200
    return int(grid["image_grid_thw"].prod()) // ip.merge_size**2


@pytest.mark.parametrize("cfg", [QWEN2, QWEN3], ids=["qwen2_vl_patch14", "qwen3_vl_patch16"])
def test_image_tokens_equal_real_image_processor(cfg: dict[str, int]) -> None:
    ip = Qwen2VLImageProcessor(**cfg)
    ours = ImageTokenConfig.from_processor(ip)
    assert ours == ImageTokenConfig(**cfg)
    for h, w in SIZES:
        real = real_image_tokens(ip, h, w)
        if real is None:
            with pytest.raises(ValueError, match="aspect ratio"):
                ours.tokens(h, w)
        else:
            assert ours.tokens(h, w) == real, (h, w)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_from_processor_reads_tiny_processors(family: str) -> None:
    proc = tiny(family)
    est = LengthEstimator.from_processor(proc)
    ip = proc.image_processor
    assert est.image == ImageTokenConfig(
        patch_size=ip.patch_size, merge_size=ip.merge_size,
        min_pixels=ip.size.shortest_edge, max_pixels=ip.size.longest_edge,
    )  # fmt: skip
    assert est.image.patch_size == (16 if family == "qwen3_vl" else 14)
    assert est.video is not None
    assert est.video.sampler == ("qwen3_vl" if family == "qwen3_vl" else "qwen2_vl")
    for h, w in SIZES[:6]:
        real = real_image_tokens(ip, h, w)
        assert real is None or est.image.tokens(h, w) == real


@given(st.integers(1, 20000), st.integers(1, 20000), st.sampled_from([28, 32]))
def test_smart_resize_equals_transformers(h: int, w: int, factor: int) -> None:
    lo, hi = factor * factor * 4, factor * factor * 1280
    try:
        expected: tuple[int, int] | None = hf_resize(h, w, factor, lo, hi)
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(h, w, factor, lo, hi)
    else:
        assert smart_resize(h, w, factor, lo, hi) == expected


@given(st.integers(2, 400), st.integers(1, 5000), st.integers(1, 5000))
def test_smart_resize_video_equals_transformers(t: int, h: int, w: int) -> None:
    args = (t, h, w, 2, 32, 32 * 32 * 4, 32 * 32 * 2 * 256)
    try:
        expected: tuple[int, int] | None = hf_resize_video(*args)
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize_video(*args)
    else:
        assert smart_resize_video(*args) == expected


@given(st.lists(st.tuples(st.integers(1, 30000), st.integers(1, 30000)), min_size=1, max_size=50))
def test_vectorized_tokens_equal_scalar(sizes: list[tuple[int, int]]) -> None:
    cfg = ImageTokenConfig(**QWEN3)
    hw = np.asarray(sizes, np.int64)
    got = cfg.tokens_array(hw[:, 0], hw[:, 1])
    for (h, w), g in zip(sizes, got.tolist(), strict=True):
        try:
            assert g == cfg.tokens(h, w)
        except ValueError:
            assert g == -1


VIDEO_CASES = [(8, 64, 96, 4.0), (30, 50, 120, 10.0), (5, 20, 40, 24.0), (97, 100, 33, 30.0),
               (3, 64, 64, 30.0), (200, 40, 40, 25.0), (2, 300, 30, 1.0)]  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (Qwen3VLVideoProcessor, {}),
        (Qwen3VLVideoProcessor, {"cap_pixels_per_frame": True, "max_video_tokens": 16}),
        (Qwen2VLVideoProcessor, {}),
        (Qwen2VLVideoProcessor, {"do_sample_frames": True, "fps": 2.0}),
    ],
    ids=["qwen3", "qwen3_capped", "qwen2_all_frames", "qwen2_fps"],
)
def test_video_tokens_equal_real_video_processor(cls: Any, kw: dict[str, Any]) -> None:
    vp = cls(size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64}, **kw)
    cfg = VideoTokenConfig.from_processor(vp)
    for frames, h, w, fps in VIDEO_CASES:
        meta = VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps)
        video = torch.zeros(frames, 3, h, w, dtype=torch.uint8)
        try:
            out = vp(videos=[video], video_metadata=[meta], return_tensors="pt")
            real: int | None = int(out["video_grid_thw"].prod()) // vp.merge_size**2
        except ValueError:
            real = None
        if real is None:
            with pytest.raises(ValueError, match=r"t:|aspect|sample"):
                cfg.tokens(frames, h, w, fps)
        else:
            assert cfg.tokens(frames, h, w, fps) == real, (frames, h, w, fps)


def test_peer_video_examples_and_min_frames_clamp() -> None:
    cfg = VideoTokenConfig(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=100, max_pixels=10**8,
        fps=2.0, min_frames=4, max_frames=128,
    )  # fmt: skip
    assert cfg.tokens(100, 320, 640, 25.0) == 800  # the peer's literal example
    # 3 frames: the peer clamps to min_frames=4 last (4 frames); transformers keeps 3.
    assert cfg.frames(3, 30.0) == 3


def rec(content: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    raw = {"messages": [{"role": "user", "content": content},
                        {"role": "assistant", "content": "A cat on a mat."}], **extra}  # fmt: skip
    return to_record(raw, 7, None)


def write_png(path: Path, h: int, w: int) -> Path:
    Image.new("RGB", (w, h), (200, 10, 10)).save(path)
    return path


def test_estimate_literal_and_text_tokens_override() -> None:
    est = LengthEstimator(image=ImageTokenConfig(**QWEN2))
    r = rec([{"type": "image", "image": "nowhere.jpg"}, {"type": "text", "text": "What is it?"}],
            images_meta=[[280, 560]])  # fmt: skip
    # text 11 + 15 chars -> 26 // 3 = 8; 2 messages * 5 + no-system 11 + 2 vision marks = 23;
    # image 280x560 -> 10 x 20 merged = 200; minus the shift.
    assert est.estimate(r) == (8 + 23 + 200 - 1, 200)
    r["_text_tokens"] = 100
    assert est.estimate(r) == (100 + 23 + 200 - 1, 200)


@pytest.mark.parametrize("bad", [-1, 2**40, 2**70, 12.5, float("nan"), "12", True, [3]])
def test_bad_text_tokens_are_refused_naming_the_sample(tmp_path: Path, bad: Any) -> None:
    """A ``_text_tokens`` that is not a token count is an error naming the sample, on both the
    full path and the length index (2**70 used to crash the index build with OverflowError)."""
    est = LengthEstimator(image=ImageTokenConfig(**QWEN2))
    r = rec([{"type": "text", "text": "What is it?"}], _text_tokens=bad)
    with pytest.raises(EstimateError, match=r"sample_id=\d+: _text_tokens=.* is not a token count"):
        est.estimate(r)
    raw = {"messages": [{"role": "user", "content": "Hi"}], "_text_tokens": bad}
    _, _, _, slow = est.estimate_raw_batch([raw])
    assert slow == [0]  # the fast path leaves it to the full path, which raises
    path = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi"}], "_text_tokens": 5}
    path.write_text(json.dumps(good) + "\n" + json.dumps(raw) + "\n")
    with pytest.raises(EstimateError, match=r"sample_id=1: _text_tokens="):
        build_length_index(JsonlSource(path), est, progress=False)


def test_header_fallback_when_meta_missing(tmp_path: Path) -> None:
    est = LengthEstimator(image=ImageTokenConfig(**QWEN2))
    png = write_png(tmp_path / "a.png", 300, 500)
    with_meta = rec([{"type": "image", "image": str(png)}], images_meta=[[300, 500]])
    no_meta = rec([{"type": "image", "image": str(png)}])
    null_meta = rec([{"type": "image", "image": str(png)}], images_meta=[None])
    assert est.estimate(no_meta) == est.estimate(with_meta) == est.estimate(null_meta)
    assert not est.fallbacks.counts
    pil = rec([{"type": "image", "image": Image.new("RGB", (500, 300))}])
    assert est.estimate(pil) == est.estimate(with_meta)


def test_exif_rotation_swaps_header_size(tmp_path: Path) -> None:
    im = Image.new("RGB", (400, 100))
    exif = im.getexif()
    exif[0x0112] = 6  # rotate 90: transformers' load_image gives a 400 x 100 (h x w) image
    im.save(tmp_path / "r.jpg", exif=exif)
    est = LengthEstimator(image=ImageTokenConfig(**QWEN2))
    got = est.estimate(rec([{"type": "image", "image": str(tmp_path / "r.jpg")}]))
    assert got == est.estimate(rec([{"type": "image", "image": "x"}], images_meta=[[400, 100]]))
    with Image.open(tmp_path / "r.jpg") as opened:  # a PIL image is transposed the same way
        assert est.estimate(rec([{"type": "image", "image": opened}])) == got
    from transformers.image_utils import load_image

    ip = Qwen2VLImageProcessor(**QWEN2)
    grid = ip(images=[load_image(str(tmp_path / "r.jpg"))], return_tensors="pt")["image_grid_thw"]
    assert got[1] == int(grid.prod()) // 4
    assert grid[0].tolist() == [1, 28, 8]  # transformers sees it 392 x 112 (h x w)


@pytest.mark.badinput
def test_missing_image_file_raises_or_counts(tmp_path: Path) -> None:
    missing = str(tmp_path / "gone.jpg")
    r = rec([{"type": "image", "image": missing}])
    with pytest.raises(EstimateError, match=f"sample_id=7: image missing: '{missing}'"):
        LengthEstimator(image=ImageTokenConfig()).estimate(r)
    est = LengthEstimator(image=ImageTokenConfig(), on_missing_media="fallback")
    assert est.estimate(r)[1] == 500
    assert est.fallbacks.counts == {"image_missing": 1}
    assert est.fallbacks.sample_ids == {"image_missing": [7]}


@pytest.mark.badinput
def test_unreadable_image_header(tmp_path: Path) -> None:
    (tmp_path / "bad.jpg").write_bytes(b"this is not an image at all")
    r = rec([{"type": "image", "image": str(tmp_path / "bad.jpg")}])
    with pytest.raises(EstimateError, match=r"sample_id=7: image unreadable: .*bad\.jpg"):
        LengthEstimator(image=ImageTokenConfig()).estimate(r)


@pytest.mark.badinput
@pytest.mark.parametrize("meta", [[0, 100], [-5, 100], [100, 0], [10.5, 20], ["a", 3], [5]])
def test_bad_image_meta_names_sample(meta: list[Any]) -> None:
    r = rec([{"type": "image", "image": "x"}], images_meta=[meta])
    with pytest.raises(EstimateError, match="sample_id=7"):
        LengthEstimator(image=ImageTokenConfig()).estimate(r)


@pytest.mark.badinput
@pytest.mark.parametrize(
    "meta", [[-1, 64, 64, 2.0, 1.0], [8, 0, 64, 2.0, 1.0], [8, 64, -3, 2.0, 1.0], [0, 64, 64, 0, 0]]
)
def test_bad_video_meta_names_sample(meta: list[Any]) -> None:
    r = rec([{"type": "video", "video": "v.mp4"}], videos_meta=[meta])
    with pytest.raises(EstimateError, match="sample_id=7"):
        LengthEstimator(video=VideoTokenConfig()).estimate(r)


@pytest.mark.badinput
def test_extreme_aspect_ratio_and_meta_count_mismatch() -> None:
    est = LengthEstimator(image=ImageTokenConfig())
    with pytest.raises(EstimateError, match=r"sample_id=7.*aspect ratio"):
        est.estimate(rec([{"type": "image", "image": "x"}], images_meta=[[10, 2500]]))
    with pytest.raises(EstimateError, match="sample_id=7: images_meta has 2 entries"):
        est.estimate(rec([{"type": "image", "image": "x"}], images_meta=[[10, 20], [1, 2]]))
    with pytest.raises(EstimateError, match="sample_id=3: empty conversation"):
        est.estimate({"sample_id": 3, "conversation": []})


def test_counted_fallbacks_without_config_or_video_meta() -> None:
    est = LengthEstimator()
    r = rec([{"type": "image", "image": "x"}, {"type": "video", "video": "v"}])
    assert est.estimate(r)[1] == 1000
    assert est.fallbacks.counts == {"image_no_config": 1, "video_no_config": 1}
    est2 = LengthEstimator(video=VideoTokenConfig())
    assert est2.estimate(rec([{"type": "video", "video": "v"}]))[1] == 500
    assert est2.fallbacks.sample_ids == {"video_no_meta": [7]}


@pytest.mark.badinput
def test_invalid_config_values() -> None:
    with pytest.raises(ValueError, match=r"mode='fast'.*estimate"):
        LengthEstimator(mode="fast")
    with pytest.raises(ValueError, match="on_missing_media"):
        LengthEstimator(on_missing_media="skip")
    with pytest.raises(ValueError, match="patch_size=0"):
        ImageTokenConfig(patch_size=0)
    with pytest.raises(ValueError, match="needs processor"):
        LengthEstimator(mode="exact")


# -- fast path == full path ------------------------------------------------------------------
texts = st.text(alphabet=st.sampled_from("ab \n<>émage"), max_size=40)
sizes = st.one_of(st.none(), st.lists(st.integers(-3, 5000), min_size=2, max_size=2))


@st.composite
def raw_records(draw: st.DrawFn) -> dict[str, Any]:
    n_img = draw(st.integers(0, 2))
    meta = [draw(sizes) for _ in range(n_img)]
    if draw(st.booleans()):  # LLaVA
        q = draw(texts) + "<image>" * n_img + draw(texts)
        turns = [{"from": "human", "value": q}, {"from": "gpt", "value": draw(texts)}]
        if draw(st.booleans()):
            turns.insert(0, {"from": "system", "value": draw(texts)})
        raw: dict[str, Any] = {"conversations": turns, "images": [f"{i}.jpg" for i in range(n_img)]}
    else:
        content: list[Any] = [{"type": "image", "image": f"{i}.jpg"} for i in range(n_img)]
        content.append(draw(st.sampled_from([{"type": "text", "text": draw(texts)}, draw(texts)])))
        raw = {"messages": [{"role": "user", "content": content},
                            {"role": "assistant", "content": draw(texts)}]}  # fmt: skip
    if n_img and draw(st.booleans()):
        raw["images_meta"] = meta
    if draw(st.booleans()):
        raw["_text_tokens"] = draw(st.integers(0, 99))
    return raw


@given(st.lists(raw_records(), min_size=1, max_size=8))
def test_fast_path_equals_full_path(raws: list[dict[str, Any]]) -> None:
    est = LengthEstimator(image=ImageTokenConfig(**QWEN3), on_missing_media="fallback")
    total, visual, _, slow = est.estimate_raw_batch(raws)
    for k, raw in enumerate(raws):
        try:
            expected: tuple[int, int] | None = est.estimate(to_record(raw, k, None))
        except ValueError:
            expected = None
        if k not in slow:
            assert expected == (int(total[k]), int(visual[k])), raw
            continue
        # Undecided only for a reason: bad input, or metadata missing / invalid.
        meta = raw.get("images_meta")
        n_img = len(raw.get("images", [])) or sum(
            1 for m in raw.get("messages", [{}])[0].get("content", []) if isinstance(m, dict)
            and m.get("type") == "image")  # fmt: skip
        complete = n_img == 0 or (
            meta is not None and all(m is not None and min(m) > 0 for m in meta)
            and all(max(m) / min(m) <= 200 for m in meta)
        )  # fmt: skip
        assert expected is None or not complete, raw


# -- calibrated and exact modes against the real tokenizer -----------------------------------
def corpus(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "import",
        "numpy",
        "as",
        "np",
        "def",
        "return",
        "self",
        "x",
        "y",
        "z",
        "42",
        "über",
    ]
    out = []
    for i in range(n):
        turns: list[dict[str, Any]] = []
        if i % 4 == 0:
            turns.append({"role": "system", "content": " ".join(rng.choice(words, 5))})
        for _ in range(int(rng.integers(1, 3))):
            turns.append(
                {"role": "user", "content": " ".join(rng.choice(words, rng.integers(1, 40)))}
            )
            turns.append(
                {"role": "assistant", "content": " ".join(rng.choice(words, rng.integers(1, 90)))}
            )
        out.append({"messages": turns})
    return out


def real_length(proc: Any, record: dict[str, Any], images: list[Image.Image]) -> int:
    text = proc.apply_chat_template(record["conversation"], tokenize=False)
    out = proc(text=[text], images=images or None, return_tensors="pt")
    return int(out["input_ids"].shape[1])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_exact_mode_equals_processor_length(family: str, tmp_path: Path) -> None:
    proc = tiny(family)
    est = LengthEstimator.from_processor(proc, mode="exact")
    assert est.overhead.per_image == 2
    for i, (h, w) in enumerate([(100, 70), (28, 900), (300, 300)]):
        png = write_png(tmp_path / f"{i}.png", h, w)
        r = to_record({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image", "image": str(png)}, f"Image {i}?"]},
            {"role": "assistant", "content": "A red square, I think."}]}, i, None)  # fmt: skip
        total, visual = est.estimate(r)
        assert total == real_length(proc, r, [Image.open(png)]) - 1
        assert visual == ImageTokenConfig.from_processor(proc).tokens(h, w)
    r = SequenceSource(corpus(5))[3]
    assert est.estimate(r)[0] == real_length(proc, r, []) - 1


def test_estimate_mode_template_overhead_is_exact_for_empty_text() -> None:
    proc = tiny("qwen2_vl")
    est = LengthEstimator.from_processor(proc)
    exact = LengthEstimator.from_processor(proc, mode="exact")
    r = to_record({"messages": [{"role": "user", "content": [{"type": "image", "image": "x"}]},
                                {"role": "assistant", "content": ""}],
                   "images_meta": [[64, 64]]}, 0, None)  # fmt: skip
    assert est.estimate(r) == exact.estimate(r)


def test_calibrated_mode_fits_better_than_default() -> None:
    proc = tiny("qwen2_vl")
    src = SequenceSource(corpus(120))
    cal = LengthEstimator.calibrate(src, proc, n=60, seed=0)
    assert cal.mode == "calibrated"
    assert cal.chars_per_token != 3.0
    exact = LengthEstimator.from_processor(proc, mode="exact")
    default = LengthEstimator.from_processor(proc)
    truth = np.array([exact.estimate(src[i])[0] for i in range(len(src))])
    err_cal = np.abs([cal.estimate(src[i])[0] for i in range(len(src))] - truth).mean()
    err_def = np.abs([default.estimate(src[i])[0] for i in range(len(src))] - truth).mean()
    assert err_cal < err_def
    # deterministic: same seed, same fit
    assert LengthEstimator.calibrate(src, proc, n=60, seed=0) == cal


def test_text_stats_counts_roles_and_media() -> None:
    r = rec([{"type": "image", "image": "x"}, {"type": "text", "text": "abc"}])
    assert text_stats(r) == (3 + 15, 0, 1, 1, 1, 0, False)
    assert TemplateOverhead().tokens(text_stats(r)) == 5 + 5 + 2 + 11


def test_seed_named_functions() -> None:
    from neatpack.pipes import (
        _estimate_image_tokens,
        _estimate_sample_length,
        _estimate_video_tokens,
        _smart_resize_image,
        _smart_resize_video,
    )

    assert _smart_resize_image(1080, 1920) == (728, 1316)  # the peer notes' examples
    assert _smart_resize_image(10, 10) == (56, 56)
    with pytest.raises(ValueError, match="aspect ratio"):
        _smart_resize_image(10, 2500)  # the seed returned a size here
    assert _smart_resize_video(8, 20, 40) == hf_resize_video(
        8, 20, 40, 2, 32, 128 * 128, 16 * 16 * 2 * 2 * 2 * 6144
    )
    assert _estimate_image_tokens([280, 560], {"patch_size": 14, "merge_size": 2}) == 200
    cfg = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 100,
           "max_pixels": 10**8, "fps": 2, "min_frames": 4, "max_frames": 128}  # fmt: skip
    assert _estimate_video_tokens([100, 320, 640, 25, 4], cfg) == 800
    with pytest.raises(ValueError, match="t:0"):  # no frame count at all (the seed said 200)
        _estimate_video_tokens([0, 320, 320, 0, 5], cfg)
    r = rec([{"type": "image", "image": "x"}, {"type": "video", "video": "v"}],
            images_meta=[[280, 560]])  # fmt: skip
    # 15 chars // 3 = 5 text; 200 image; the video has no config: 500 fallback (seed: 0)
    assert _estimate_sample_length(r, {"patch_size": 14}, return_media_tokens=True) == (705, 700)
    assert _estimate_sample_length({"conversation": r["conversation"]}) == 5 + 1000


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_exact_mode_video_equals_processor_length(family: str) -> None:
    """Qwen3-VL writes "<t seconds>" + vision start/end per temporal patch: exact mode counts
    them from the sampled frame times; estimate mode uses the probed per-patch constant."""
    proc = tiny(family)
    exact = LengthEstimator.from_processor(proc, mode="exact")
    est = LengthEstimator.from_processor(proc)
    assert est.overhead.per_video_frame == (8 if family == "qwen3_vl" else 0)
    for frames, h, w, fps in [(8, 64, 96, 4.0), (30, 50, 120, 10.0), (97, 100, 33, 30.0)]:
        raw = {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]},
                            {"role": "assistant", "content": ""}],
               "videos_meta": [[frames, h, w, fps, frames / fps]]}  # fmt: skip
        r = to_record(raw, 0, None)
        text = proc.apply_chat_template(r["conversation"], tokenize=False)
        meta = VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps)
        out = proc(text=[text], videos=[torch.zeros(frames, 3, h, w, dtype=torch.uint8)],
                   video_metadata=[meta], return_tensors="pt")  # fmt: skip
        visual = int(out["video_grid_thw"].prod()) // 4
        assert exact.estimate(r) == (out["input_ids"].shape[1] - 1, visual)
        assert est.estimate(r) == exact.estimate(r)  # no free text: the template is exact
        fast_total, fast_visual, _, slow = est.estimate_raw_batch([raw])
        assert slow == []
        assert (int(fast_total[0]), int(fast_visual[0])) == est.estimate(r)
