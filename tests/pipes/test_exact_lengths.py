"""The default ``exact`` length index: batched, equal to the one-record path and to the real
materialized lengths, so the default graph fills packs without cutting a sample."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.indexing._media_meta import image_hw
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.reading.read import JsonlSource, SequenceSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


def _video_record(i: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": "Watch closely."},
            {"role": "user", "content": [{"type": "video", "video": f"v{i}.mp4"}, "What moves?"]},
            {"role": "assistant", "content": "A red ball rolls to the left " * (i + 1)},
        ],
        "videos_meta": [[16 + 8 * i, 64, 96, 4.0, (16 + 8 * i) / 4.0]],
    }


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_batched_exact_equals_one_record_path(family: str, tmp_path: Path) -> None:
    """Images (with and without images_meta, PNG and JPEG), videos, several turns: the
    batched block path gives every record exactly what ``estimate_sample`` gives it."""
    proc = load_tiny_processor(family)
    data = write_corpus(tmp_path, num_samples=24, seed=3, max_images=3)
    est = LengthEstimator.from_processor(proc, mode="exact")
    for src in (
        JsonlSource(data, media_root=tmp_path / "media"),
        SequenceSource([_video_record(i) for i in range(4)]),
    ):
        one = [est.estimate_sample(src[i]) for i in range(len(src))]
        assert est.estimate_samples([src[i] for i in range(len(src))]) == one
        index = build_length_index(src, est, progress=False)
        assert index.total.tolist() == [s.total for s in one]
        assert index.visual.tolist() == [s.visual for s in one]


def test_bad_record_in_a_batch_is_named_or_skipped_as_one_by_one(tmp_path: Path) -> None:
    proc = load_tiny_processor("qwen2_vl")
    good = {"messages": [{"role": "user", "content": "hello there"}]}
    bad = {**good, "images_meta": [[10, 10]]}  # metadata for an image the record lacks
    src = SequenceSource([good, good, bad, good])
    est = LengthEstimator.from_processor(proc, mode="exact")
    with pytest.raises(ValueError, match="sample_id=2"):
        build_length_index(src, est, progress=False)
    index = build_length_index(src, est, progress=False, on_error="skip")
    assert index.fallback_ids.tolist() == [2]
    assert index.total[2] == 0
    assert index.total[[0, 1, 3]].tolist() == [est.estimate_sample(src[i]).total for i in (0, 1, 3)]


def test_default_graph_plans_real_lengths_and_cuts_nothing(tmp_path: Path) -> None:
    """Through the graph as a user calls it, with the default config: every pack's planned
    (estimated) tokens equal its real tokens and no sample is truncated or dropped. With the
    former default (``estimate``) the planned lengths differ from the real ones."""
    data = write_corpus(tmp_path, num_samples=30, seed=11, max_images=3)
    proc = load_tiny_processor("qwen2_vl")
    assert NeatVLMConfig().estimate_mode == "exact"
    cfg = NeatVLMConfig(pack_size=2048, media_root=str(tmp_path / "media"), shuffle=False)
    loader = neat_vlm_graph(data, proc, config=cfg)
    metas = [m for batch in loader for m in batch["packs"]]
    assert [m["real_tokens"] for m in metas] == [m["estimated_tokens"] for m in metas]
    ledger = loader.ledgers[0]
    assert (len(ledger.truncated), len(ledger.dropped), len(ledger.consumed)) == (0, 0, 30)
    old = neat_vlm_graph(
        data, proc, config=NeatVLMConfig(pack_size=2048, media_root=str(tmp_path / "media"),
                                         shuffle=False, estimate_mode="estimate"),
    )  # fmt: skip
    old_metas = [m for batch in old for m in batch["packs"]]
    assert any(m["real_tokens"] != m["estimated_tokens"] for m in old_metas)


def _png_with_late_exif(path: Path, h: int, w: int, orientation: int) -> None:
    """A PNG whose eXIf chunk comes after the pixel data (PIL writes it before)."""
    Image.new("RGB", (w, h), (200, 30, 30)).save(path, format="PNG")
    data = path.read_bytes()
    exif = Image.Exif()
    exif[0x0112] = orientation
    payload = exif.tobytes()
    chunk = struct.pack(">I", len(payload)) + b"eXIf" + payload
    chunk += struct.pack(">I", zlib.crc32(b"eXIf" + payload) & 0xFFFFFFFF)
    end = data.rindex(b"IEND") - 4
    path.write_bytes(data[:end] + chunk + data[end:])


def test_png_header_read_decodes_no_pixels_and_keeps_late_exif(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PIL's PNG ``getexif()`` decodes the whole image looking for an eXIf chunk (~12 ms a
    0.5 MP image, a fifth of an exact index build): the size read must not, yet a rotation
    stored after the pixels still swaps height and width as transformers' loader does."""
    plain, rotated = tmp_path / "plain.png", tmp_path / "rotated.png"
    Image.new("RGB", (90, 30)).save(plain, format="PNG")
    _png_with_late_exif(rotated, 30, 90, orientation=6)
    with Image.open(rotated) as im:
        assert "exif" not in im.info  # PIL only finds it by decoding
    loads: list[str] = []
    real_load = PngImagePlugin.PngImageFile.load

    def counting_load(self: Any) -> Any:
        loads.append(self.filename)
        return real_load(self)

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", counting_load)
    assert image_hw(str(plain), 0) == (30, 90)
    assert loads == []
    assert image_hw(str(rotated), 1) == (90, 30)
    with Image.open(rotated) as im:  # what the materializer sees after exif_transpose
        from PIL import ImageOps

        assert ImageOps.exif_transpose(im).size == (30, 90)
    assert np.array_equal(np.asarray(Image.open(plain)).shape, (30, 90, 3))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_backend_encode_equals_the_tokenizer_call(family: str, tmp_path: Path) -> None:
    """``encode_ids`` takes the Rust backend's ``encode_batch_fast`` and gives exactly the ids
    of ``tokenizer(texts, add_special_tokens=False)``, for templated conversations with image
    placeholders and special tokens; a backend set to truncate, pad or split special tokens
    goes through the transformers call instead (its own result, not the raw backend's)."""
    import copy

    from neatpack.pipes.indexing._template_probe import encode_ids

    proc = load_tiny_processor(family)
    src = JsonlSource(write_corpus(tmp_path, num_samples=40, seed=9), media_root=tmp_path / "media")
    texts = list(proc.apply_chat_template([src[i]["conversation"] for i in range(40)],
                                          tokenize=False))  # fmt: skip
    texts += ["", "<|im_start|>user\n<|image_pad|><|image_pad|>x<|im_end|>", "é 漢字 \t\n  a"]
    tok = proc.tokenizer
    want = tok(texts, add_special_tokens=False)["input_ids"]
    backend = tok.backend_tokenizer
    calls: list[int] = []
    real = backend.encode_batch_fast

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(backend, name)

        def encode_batch_fast(self, *a: Any, **k: Any) -> Any:
            calls.append(len(a[0]))
            return real(*a, **k)

    # the fast path, seen through a wrapper that counts its calls
    wrapped = type("Wrapped", (), {"backend_tokenizer": Spy(), "split_special_tokens": False,
                                   "__call__": lambda self, t, **k: tok(t, **k)})()  # fmt: skip
    assert encode_ids(wrapped, texts) == want
    assert calls == [len(texts)]
    assert encode_ids(tok, texts) == want  # the real tokenizer object
    # a backend set to truncate: the transformers call (which switches that off) decides
    trunc = copy.deepcopy(tok)
    trunc.backend_tokenizer.enable_truncation(8)
    assert trunc.backend_tokenizer.encode_batch_fast(texts[:1])[0].ids != want[0]  # it would cut
    assert encode_ids(trunc, texts) == want
