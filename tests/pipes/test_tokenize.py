"""tokenize_conversation through the real tiny processors, real image files, and bad input."""

from __future__ import annotations

import copy
import io
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from neatpack.pipes.materializing.labels import IGNORE_INDEX
from neatpack.pipes.materializing.tokenize import FAKE_IMAGE_SIZE, tokenize_conversation
from neatpack.pipes.reading.media import SampleError, load_image, to_rgb
from neatpack.pipes.testing.tiny import FAMILIES, load_tiny_processor

END = "<|im_end|>"
IMAGE_PAD, VIDEO_PAD = 4108, 4109


@pytest.fixture(scope="module")
def proc() -> Any:
    return load_tiny_processor("qwen2_vl")


def _rec(*messages: dict[str, Any], sid: int = 11) -> dict[str, Any]:
    return {"sample_id": sid, "conversation": list(messages)}


def _user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def _asst(text: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _img(value: Any) -> dict[str, Any]:
    return {"type": "image", "image": value}


def _txt(text: Any) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _png(path: Path, img: Image.Image, fmt: str = "PNG") -> str:
    img.save(path, format=fmt)
    return str(path)


def _check_sample(p: Any, s: dict[str, Any], n_images: int) -> None:
    ids = s["input_ids"]
    assert ids.dim() == 1
    assert ids.dtype == torch.long
    for key in ("labels", "attention_mask", "mm_token_type_ids"):
        assert s[key].shape == ids.shape, key
        assert s[key].dtype == torch.long, key
    merge = p.image_processor.merge_size
    if n_images:
        grid = s["image_grid_thw"]
        assert grid.shape == (n_images, 3)
        assert int((ids == IMAGE_PAD).sum()) == int(grid.prod(-1).sum()) // merge**2
        patch = p.image_processor.patch_size
        assert s["pixel_values"].shape == (int(grid.prod(-1).sum()), 3 * 2 * patch * patch)
        assert torch.equal(s["mm_token_type_ids"] == 1, ids == IMAGE_PAD)
    else:
        assert "pixel_values" not in s
        assert "image_grid_thw" not in s
        assert int(s["mm_token_type_ids"].sum()) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_image_sample_matches_contract(family: str, tmp_path: Path) -> None:
    p = load_tiny_processor(family)
    path = _png(tmp_path / "a.png", Image.new("RGB", (100, 70), (10, 200, 30)))
    rec = _rec(_user(_img(path), _txt("What colour?")), _asst("Green."), sid=42)
    before = copy.deepcopy(rec)
    s = tokenize_conversation(rec, p)
    assert rec == before  # the record is not mutated
    assert s["sample_id"] == 42
    _check_sample(p, s, 1)
    assert bool((s["attention_mask"] == 1).all())
    assert p.tokenizer.decode(s["input_ids"][s["labels"] != IGNORE_INDEX]) == f"Green.{END}"
    # same ids as the processor's own one-call path
    ref = p.apply_chat_template(
        [{"role": "user", "content": [_img(Image.open(path)), _txt("What colour?")]},
         {"role": "assistant", "content": [_txt("Green.")]}],
        tokenize=True, return_dict=True, return_tensors="pt",
    )  # fmt: skip
    assert torch.equal(ref["input_ids"][0], s["input_ids"])
    assert torch.equal(ref["image_grid_thw"], s["image_grid_thw"])
    assert torch.allclose(ref["pixel_values"], s["pixel_values"])


def test_multi_image_multi_turn_and_policies(proc: Any) -> None:
    rec = _rec(
        {"role": "system", "content": "Sys."},
        _user(_img(Image.new("RGB", (56, 112))), _txt("a?")),
        _asst("One."),
        _user(_txt("b?"), _img(Image.new("RGB", (140, 56)))),
        _asst("Two."),
    )
    s = tokenize_conversation(rec, proc)
    _check_sample(proc, s, 2)
    assert s["image_grid_thw"].tolist() == [[1, 8, 4], [1, 4, 10]]
    labelled = proc.tokenizer.decode(s["input_ids"][s["labels"] != IGNORE_INDEX])
    assert labelled == f"One.{END}Two.{END}"
    last = tokenize_conversation(rec, proc, label_policy="last_assistant")
    assert proc.tokenizer.decode(last["input_ids"][last["labels"] != IGNORE_INDEX]) == f"Two.{END}"
    with pytest.raises(ValueError, match="label_policy='everything'"):
        tokenize_conversation(rec, proc, label_policy="everything")


def test_text_only_and_fake_image(proc: Any) -> None:
    rec = _rec({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"})
    plain = tokenize_conversation(rec, proc)
    _check_sample(proc, plain, 0)
    fake = tokenize_conversation(rec, proc, fake_image=True)
    _check_sample(proc, fake, 1)
    side = FAKE_IMAGE_SIZE // 14
    assert fake["image_grid_thw"].tolist() == [[1, side, side]]
    masked = fake["input_ids"][fake["attention_mask"] == 0]
    n_pad = side * side // 4
    assert (
        proc.tokenizer.decode(masked)
        == "<|vision_start|>" + "<|image_pad|>" * n_pad + "<|vision_end|>"
    )
    assert len(fake["input_ids"]) == len(plain["input_ids"]) + n_pad + 2
    assert bool((fake["labels"][fake["attention_mask"] == 0] == IGNORE_INDEX).all())
    assert torch.equal(
        fake["labels"][fake["labels"] != IGNORE_INDEX],
        plain["labels"][plain["labels"] != IGNORE_INDEX],
    )
    # a sample that already has an image gets no fake one
    real = _rec(_user(_img(Image.new("RGB", (56, 56))), _txt("x")), _asst("y"))
    s = tokenize_conversation(real, proc, fake_image=True)
    assert bool((s["attention_mask"] == 1).all())


def test_video_frames(proc: Any) -> None:
    frames = [Image.new("L", (64, 48), 40 * i) for i in range(4)]
    s = tokenize_conversation(
        _rec(_user({"type": "video", "video": frames}, _txt("?")), _asst("ok")), proc
    )
    grid = s["video_grid_thw"]
    assert grid.tolist() == [[2, 4, 4]]
    assert int((s["input_ids"] == VIDEO_PAD).sum()) == math.prod(grid[0].tolist()) // 4
    assert int((s["mm_token_type_ids"] == 2).sum()) == 8
    assert s["pixel_values_videos"].shape[0] == math.prod(grid[0].tolist())
    assert "pixel_values" not in s


def test_video_frame_rate_reaches_the_processor() -> None:
    """fps from the block (or from videos_meta) sets Qwen2.5's second_per_grid_ts and Qwen3's
    frame timestamps; without it the processor falls back to 24 fps."""
    frames = [Image.new("RGB", (64, 48), (9 * i, 0, 0)) for i in range(4)]
    p25 = load_tiny_processor("qwen2_5_vl")

    def video(**extra: Any) -> dict[str, Any]:
        return {"type": "video", "video": frames, **extra}

    s = tokenize_conversation(_rec(_user(video(fps=2.0), _txt("?")), _asst("ok")), p25)
    assert s["second_per_grid_ts"].tolist() == [1.0]  # temporal patch 2 / 2 fps
    meta = _rec(_user(video(), _txt("?")), _asst("ok"))
    meta["videos_meta"] = [[4, 48, 64, 4.0, 1.0]]
    assert tokenize_conversation(meta, p25)["second_per_grid_ts"].tolist() == [0.5]
    meta["videos_meta"] = [[99, 48, 64, 4.0, 1.0]]  # counts other frames: not this list's rate
    default = tokenize_conversation(meta, p25)["second_per_grid_ts"].tolist()
    assert default == pytest.approx([2 / 24])
    p3 = load_tiny_processor("qwen3_vl")
    s3 = tokenize_conversation(_rec(_user(video(fps=2), _txt("?")), _asst("ok")), p3)
    text = p3.tokenizer.decode(s3["input_ids"])
    assert "<0.2 seconds>" in text
    assert "<1.2 seconds>" in text
    _raises("bad_media", _rec(_user(video(fps=-1)), _asst("a")), p25)


def _grey_ramp_16() -> Image.Image:
    return Image.fromarray(np.array([[0, 257, 32896, 65535]], dtype=np.uint16))


@pytest.mark.parametrize(
    ("img", "pixel", "expected"),
    [
        (Image.new("RGBA", (4, 4), (255, 0, 0, 0)), (0, 0), (255, 255, 255)),  # transparent->white
        (Image.new("RGBA", (4, 4), (255, 0, 0, 255)), (0, 0), (255, 0, 0)),
        (Image.new("LA", (4, 4), (0, 128)), (0, 0), (127, 127, 127)),  # half black on white
        (Image.new("L", (4, 4), 77), (1, 1), (77, 77, 77)),
        (Image.new("1", (4, 4), 1), (0, 0), (255, 255, 255)),
        (Image.new("CMYK", (4, 4), (0, 0, 0, 0)), (0, 0), (255, 255, 255)),
        (Image.new("CMYK", (4, 4), (0, 255, 255, 0)), (0, 0), (255, 0, 0)),
        (_grey_ramp_16(), (3, 0), (255, 255, 255)),
        (_grey_ramp_16(), (2, 0), (128, 128, 128)),
        (_grey_ramp_16(), (1, 0), (1, 1, 1)),
        (Image.new("F", (4, 4), 0.5), (0, 0), (128, 128, 128)),
    ],
)
def test_to_rgb_modes(img: Image.Image, pixel: tuple[int, int], expected: tuple[int, ...]) -> None:
    out = to_rgb(img)
    assert out.mode == "RGB"
    assert out.size == img.size
    assert out.getpixel(pixel) == expected


@pytest.mark.parametrize(("mode", "key"), [("RGB", (10, 20, 30)), ("L", 5)])
def test_colour_key_transparency(mode: str, key: Any) -> None:
    img = Image.new(mode, (2, 2), key)
    img.putpixel((1, 1), (1, 2, 3) if mode == "RGB" else 9)
    img.info["transparency"] = key
    out = to_rgb(img)
    assert out.getpixel((0, 0)) == (255, 255, 255)
    assert out.getpixel((1, 1)) == ((1, 2, 3) if mode == "RGB" else (9, 9, 9))


def test_palette_with_transparency_composites_on_white() -> None:
    p = Image.new("P", (4, 4), 0)
    p.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    p.info["transparency"] = 0
    p.putpixel((1, 1), 1)
    out = to_rgb(p)
    assert out.getpixel((0, 0)) == (255, 255, 255)
    assert out.getpixel((1, 1)) == (255, 0, 0)


@pytest.mark.parametrize(
    ("mode", "fmt"),
    [("RGBA", "PNG"), ("L", "PNG"), ("P", "PNG"), ("I;16", "PNG"), ("CMYK", "JPEG"), ("LA", "PNG")],
)
def test_files_in_every_mode_tokenize(proc: Any, tmp_path: Path, mode: str, fmt: str) -> None:
    base = Image.new("RGB", (84, 56), (200, 100, 50))
    img = _grey_ramp_16().resize((84, 56)) if mode == "I;16" else base.convert(mode)
    path = _png(tmp_path / f"x.{fmt.lower()}", img, fmt)
    assert Image.open(path).mode == mode
    s = tokenize_conversation(_rec(_user(_img(path), _txt("?")), _asst("ok")), proc)
    _check_sample(proc, s, 1)
    assert s["image_grid_thw"].tolist() == [[1, 4, 6]]


# --------------------------------------------------------------------------- bad input


def _raises(reason: str, rec: dict[str, Any], p: Any, **kw: Any) -> SampleError:
    with pytest.raises(SampleError) as info:
        tokenize_conversation(rec, p, **kw)
    err = info.value
    assert err.reason == reason, str(err)
    assert err.sample_id == rec.get("sample_id")
    assert f"sample_id={rec.get('sample_id')}" in str(err)
    return err


@pytest.mark.badinput
def test_corrupt_image_bytes(proc: Any, tmp_path: Path) -> None:
    path = tmp_path / "bad.jpg"
    path.write_bytes(b"this is not an image at all" * 10)
    err = _raises("corrupt_image", _rec(_user(_img(str(path))), _asst("a")), proc)
    assert "bad.jpg" in str(err)
    assert "drop it" in str(err)


@pytest.mark.badinput
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image(proc: Any, tmp_path: Path, fmt: str) -> None:
    buf = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buf, format=fmt)
    path = tmp_path / f"cut.{fmt.lower()}"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    err = _raises("truncated_image", _rec(_user(_img(str(path))), _asst("a")), proc)
    assert f"cut.{fmt.lower()}" in str(err)


@pytest.mark.badinput
def test_zero_byte_file(proc: Any, tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    path.write_bytes(b"")
    assert "empty.png" in str(_raises("empty_file", _rec(_user(_img(str(path))), _asst("a")), proc))


@pytest.mark.badinput
def test_zero_size_pil_image(proc: Any) -> None:
    _raises("empty_image", _rec(_user(_img(Image.new("RGB", (0, 0)))), _asst("a")), proc)


@pytest.mark.badinput
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decompression_bomb_limit(
    proc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _png(tmp_path / "big.png", Image.new("RGB", (200, 100)))
    rec = _rec(_user(_img(path)), _asst("a"))
    err = _raises("decompression_bomb", rec, proc, max_image_pixels=10_000)
    assert "200x100=20000" in str(err)
    assert "big.png" in str(err)
    s = tokenize_conversation(rec, proc, max_image_pixels=None)  # explicit opt-out
    assert s["image_grid_thw"].shape == (1, 3)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 15_000)  # PIL's global limit is the default
    _raises("decompression_bomb", rec, proc)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000)  # PIL's own hard stop (2x) also named
    assert "MAX_IMAGE_PIXELS" in str(
        _raises("decompression_bomb", rec, proc, max_image_pixels=None)
    )
    with pytest.raises(SampleError, match="decompression_bomb"):
        load_image(Image.new("RGB", (200, 100)), sample_id=1, max_image_pixels=100)


@pytest.mark.badinput
def test_missing_file(proc: Any, tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere.png")
    err = _raises("missing_file", _rec(_user(_img(missing), _txt("?")), _asst("a")), proc)
    assert "nowhere.png" in str(err)
    assert "media root" in str(err)


@pytest.mark.badinput
def test_no_assistant_turn(proc: Any) -> None:
    _raises("no_assistant", _rec(_user(_txt("hello")), {"role": "system", "content": "s"}), proc)


@pytest.mark.badinput
def test_unknown_role(proc: Any) -> None:
    err = _raises("unknown_role", _rec({"role": "gpt", "content": "x"}, _asst("a")), proc)
    assert "'gpt'" in str(err)
    assert "'assistant'" in str(err)


@pytest.mark.badinput
def test_more_image_blocks_than_images(proc: Any) -> None:
    """LLaVA-style mismatch built directly: two image blocks, one image."""
    rec = _rec(_user(_img(Image.new("RGB", (56, 56))), {"type": "image"}, _txt("?")), _asst("a"))
    _raises("media_count_mismatch", rec, proc)


@pytest.mark.badinput
def test_llava_placeholder_left_in_text(proc: Any) -> None:
    rec = _rec(_user(_img(Image.new("RGB", (56, 56))), _txt("<image>\nWhat is it?")), _asst("a"))
    assert "'<image>'" in str(_raises("placeholder_in_text", rec, proc))


@pytest.mark.badinput
@pytest.mark.parametrize("token", ["<|image_pad|>", "<|im_end|>", "<|vision_start|>"])
def test_structural_special_token_in_text(proc: Any, token: str) -> None:
    _raises("special_token_in_text", _rec(_user(_txt(f"a {token} b")), _asst("c")), proc)


def test_grounding_special_tokens_allowed(proc: Any) -> None:
    rec = _rec(_user(_txt("where?")), _asst("<|box_start|>(1,2),(3,4)<|box_end|>"))
    s = tokenize_conversation(rec, proc)
    assert "<|box_start|>" in proc.tokenizer.decode(s["input_ids"][s["labels"] != IGNORE_INDEX])


@pytest.mark.badinput
@pytest.mark.parametrize("bad", [None, 5, ["a"], {"t": 1}])
def test_non_string_text(proc: Any, bad: Any) -> None:
    _raises("bad_text", _rec(_user(_txt(bad)), _asst("a")), proc)


@pytest.mark.badinput
def test_empty_text(proc: Any) -> None:
    _raises("empty_text", _rec(_user(_txt("q")), _asst("")), proc)
    _raises("empty_text", _rec(_user(_txt("  \n")), _asst("a")), proc)
    _raises("empty_conversation", _rec(), proc)
    # empty text next to an image, and an empty system prompt, are fine
    ok = _rec(
        {"role": "system", "content": ""},
        _user(_img(Image.new("RGB", (56, 56))), _txt("")),
        _asst("a"),
    )
    _check_sample(proc, tokenize_conversation(ok, proc), 1)


@pytest.mark.badinput
def test_bad_record_and_blocks(proc: Any) -> None:
    _raises("bad_record", {"sample_id": 3, "messages": []}, proc)
    _raises("bad_block", _rec(_user({"type": "audio", "audio": "x.wav"}), _asst("a")), proc)
    _raises("bad_block", _rec({"role": "user", "content": 7}, _asst("a")), proc)
    _raises("bad_media", _rec(_user(_img(123)), _asst("a")), proc)


@pytest.mark.badinput
def test_sample_error_pickles() -> None:
    err = SampleError(9, "missing_file", "file 'x' does not exist")
    back = pickle.loads(pickle.dumps(err))
    assert (back.sample_id, back.reason, str(back)) == (9, "missing_file", str(err))
    with pytest.raises(ValueError, match="not one of"):
        SampleError(1, "whatever", "m")


def test_synth_corpus_through_reader(tmp_path: Path) -> None:
    """Records from the real reader (relative media paths resolved) tokenize end to end."""
    from neatpack.pipes.reading.read import JsonlSource
    from neatpack.pipes.testing.synth import write_corpus

    path = write_corpus(tmp_path, num_samples=10, seed=3)
    source = JsonlSource(path, media_root=tmp_path / "media")
    p = load_tiny_processor("qwen3_vl")
    for sid in range(len(source)):
        rec = source[sid]
        s = tokenize_conversation(rec, p)
        images = [b for m in rec["conversation"] for b in m["content"] if b["type"] == "image"]
        answers = [
            "".join(b["text"] for b in m["content"] if b["type"] == "text")
            for m in rec["conversation"]
            if m["role"] == "assistant"
        ]
        assert s["sample_id"] == sid
        _check_sample(p, s, len(images))
        labelled = p.tokenizer.decode(s["input_ids"][s["labels"] != IGNORE_INDEX])
        assert labelled == "".join(a + END for a in answers)


@pytest.mark.badinput
def test_missing_sample_id(proc: Any) -> None:
    with pytest.raises(SampleError, match="without 'sample_id'"):
        tokenize_conversation({"conversation": [_user(_txt("q")), _asst("a")]}, proc)


@pytest.mark.badinput
def test_wrong_markers_is_label_mismatch(proc: Any) -> None:
    from neatpack.pipes.materializing.labels import RoleMarkers

    rec = _rec(_user(_txt("q")), _asst("a"))
    _raises("label_mismatch", rec, proc, markers=RoleMarkers((1, 2, 3), (4,)))


@pytest.mark.badinput
def test_processor_rejection_is_wrapped(proc: Any) -> None:
    """Qwen's smart_resize refuses aspect ratios over 200: a SampleError, not a crash."""
    err = _raises(
        "processor_error", _rec(_user(_img(Image.new("RGB", (6000, 28)))), _asst("a")), proc
    )
    assert "aspect ratio" in str(err)


@pytest.mark.badinput
def test_video_files(proc: Any, tmp_path: Path) -> None:
    missing = _rec(_user({"type": "video", "video": str(tmp_path / "v.mp4")}), _asst("a"))
    _raises("missing_file", missing, proc)
    _raises("bad_media", _rec(_user({"type": "video", "video": []}), _asst("a")), proc)
    pytest.importorskip(
        "av"
    )  # video files decode with PyAV (neatpack[video]; tests/pipes/test_video.py)
    garbage = tmp_path / "g.mp4"
    garbage.write_bytes(b"\x00" * 64)
    _raises("video_error", _rec(_user({"type": "video", "video": str(garbage)}), _asst("a")), proc)


class _DropOnePad:
    """A real processor whose output loses one image-pad token (a template/processor desync)."""

    def __init__(self, p: Any) -> None:
        self._p = p

    def __getattr__(self, name: str) -> Any:
        return getattr(self._p, name)

    def __call__(self, **kw: Any) -> Any:
        out = self._p(**kw)
        keep = torch.ones(out["input_ids"].shape[1], dtype=torch.bool)
        keep[int(torch.nonzero(out["input_ids"][0] == IMAGE_PAD)[0])] = False
        for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            out[key] = out[key][:, keep]
        return out


@pytest.mark.badinput
def test_pad_count_disagreeing_with_grid(proc: Any) -> None:
    rec = _rec(_user(_img(Image.new("RGB", (56, 56))), _txt("q")), _asst("a"))
    err = _raises("media_token_mismatch", rec, _DropOnePad(proc))
    assert "need 4" in str(err)
