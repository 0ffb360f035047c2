"""One processor call per pack: ``tokenize_conversations`` and the pack built from it must equal the
one-sample-at-a-time path exactly, and the pack's pixels must not be copied a second time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from neatpack.pipes.materializing.materialize import MaterializeConfig, materialize_pack
from neatpack.pipes.materializing.mrope import MRopeConfig
from neatpack.pipes.materializing.pack import _cat_media, build_pack
from neatpack.pipes.materializing.tokenize import tokenize_conversation, tokenize_conversations
from neatpack.pipes.reading.media import SampleError
from neatpack.pipes.reading.read import JsonlSource, SequenceSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> JsonlSource:
    d = tmp_path_factory.mktemp("corpus")
    return JsonlSource(write_corpus(d, num_samples=16, seed=11), media_root=d / "media")


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for key, va in a.items():
        if isinstance(va, torch.Tensor):
            assert va.dtype == b[key].dtype, key
            assert torch.equal(va, b[key]), key
        else:
            assert va == b[key], key


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_batched_samples_equal_one_by_one(family: str, corpus: JsonlSource) -> None:
    proc = load_tiny_processor(family)
    records = [corpus[i] for i in range(len(corpus))]
    with_images = sum(bool(r.get("images_meta")) for r in records)
    assert 4 <= with_images < len(records)  # images and text-only both present
    batched = tokenize_conversations(records, proc)
    for rec, got in zip(records, batched, strict=True):
        _same(got, tokenize_conversation(rec, proc))
    with_pixels = [s["pixel_values"] for s in batched if "pixel_values" in s]
    assert len({t.untyped_storage().data_ptr() for t in with_pixels}) == 1  # one call's tensor


def _user_img(img: Image.Image, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image", "image": img},
                                        {"type": "text", "text": text}]}  # fmt: skip


def test_fake_image_video_and_options_in_a_batch() -> None:
    proc = load_tiny_processor("qwen2_5_vl")
    frames = [Image.new("RGB", (64, 48), (9 * i, 0, 0)) for i in range(4)]
    answer = {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}
    records = [
        {"sample_id": 0, "conversation": [_user_img(Image.new("RGB", (90, 70)), "a"), answer]},
        {"sample_id": 1, "conversation": [
            {"role": "user", "content": [{"type": "text", "text": "text only"}]}, answer]},
        {"sample_id": 2, "conversation": [{"role": "user", "content": [
            {"type": "video", "video": frames, "fps": 2.0}, {"type": "text", "text": "?"}]},
            answer]},
        {"sample_id": 3, "conversation": [_user_img(Image.new("RGB", (56, 56)), "b"), answer]},
    ]  # fmt: skip
    for options in ({}, {"fake_image": True}, {"label_policy": "last_assistant"}):
        batched = tokenize_conversations(records, proc, **options)
        for rec, got in zip(records, batched, strict=True):
            _same(got, tokenize_conversation(rec, proc, **options))
    faked = tokenize_conversations(records, proc, fake_image=True)[1]
    assert int((faked["attention_mask"] == 0).sum()) > 0  # the fake block is masked


class _OneAtATime:
    """A real processor that refuses calls with more than one text, as a processor whose batch
    call fails would: the batched path must fall back to one call per sample."""

    def __init__(self, proc: Any) -> None:
        self._proc = proc
        self.batch_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proc, name)

    def __call__(self, *, text: list[str], **kw: Any) -> Any:
        if len(text) > 1:
            self.batch_calls += 1
            raise RuntimeError("no batches here")
        return self._proc(text=text, **kw)


def test_a_failing_batch_call_falls_back_to_one_call_per_sample(corpus: JsonlSource) -> None:
    proc = load_tiny_processor("qwen2_vl")
    wrapped = _OneAtATime(proc)
    records = [corpus[i] for i in range(6)]
    got = tokenize_conversations(records, wrapped)
    assert wrapped.batch_calls == 1
    for rec, s in zip(records, got, strict=True):
        _same(s, tokenize_conversation(rec, proc))


def test_pack_takes_the_batched_pixels_without_a_copy(corpus: JsonlSource) -> None:
    proc = load_tiny_processor("qwen2_vl")
    ids = [i for i in range(len(corpus)) if corpus[i].get("images_meta")][:3]
    pack, _ = materialize_pack(corpus, ids, proc, MaterializeConfig(pack_size=8192))
    samples = [tokenize_conversation(corpus[i], proc) for i in ids]
    ref = build_pack(samples, pack_size=8192, mrope=MRopeConfig.from_processor(proc))
    for key in ("input_ids", "labels", "attention_mask", "position_ids", "pixel_values",
                "image_grid_thw"):  # fmt: skip
        assert torch.equal(pack[key], ref[key]), key
    pv = pack["pixel_values"]
    assert pv.untyped_storage().nbytes() == pv.numel() * pv.element_size()  # the call's tensor


def test_cat_media_joins_adjacent_views_and_copies_otherwise() -> None:
    base = torch.arange(24.0).reshape(6, 4)
    parts = [{"pixel_values": base[0:2]}, {"pixel_values": base[2:6]}]
    joined = _cat_media(parts, "pixel_values")
    assert torch.equal(joined, base)
    assert joined.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    part = _cat_media([*parts[:1], {"pixel_values": base[2:5]}], "pixel_values")  # not all rows
    assert torch.equal(part, base[0:5])
    assert part.untyped_storage().nbytes() == part.numel() * 4  # a copy of just those rows
    gap = [{"pixel_values": base[0:2]}, {"pixel_values": base[3:5]}]
    swapped = [{"pixel_values": base[2:4]}, {"pixel_values": base[0:2]}]
    other = [{"pixel_values": base[0:2]}, {"pixel_values": base[2:4].clone()}]
    for parts, want in ((gap, [0, 1, 3, 4]), (swapped, [2, 3, 0, 1]), (other, [0, 1, 2, 3])):
        out = _cat_media(parts, "pixel_values")
        assert torch.equal(out, base[want])
        assert out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    cols = base[:, :2]  # not contiguous: copied
    assert torch.equal(_cat_media([{"p": cols[0:2]}, {"p": cols[2:3]}], "p"), cols[0:3])


def test_bad_sample_in_a_batched_pack_is_still_named(tmp_path: Path) -> None:
    proc = load_tiny_processor("qwen2_vl")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    good = Image.new("RGB", (64, 64))
    answer = {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}
    recs = [{"conversation": [_user_img(good, "x"), answer]} for _ in range(3)]
    recs[1] = {"conversation": [{"role": "user", "content": [
        {"type": "image", "image": str(tmp_path / "bad.png")}, {"type": "text", "text": "x"}]},
        answer]}  # fmt: skip
    src = SequenceSource(recs, media_root=tmp_path)
    with pytest.raises(SampleError, match=r"sample_id=1 \[corrupt_image\]"):
        materialize_pack(src, [0, 1, 2], proc, MaterializeConfig(pack_size=4096))
    pack, report = materialize_pack(
        src, [0, 1, 2], proc, MaterializeConfig(pack_size=4096, on_bad_sample="skip")
    )
    assert report.skipped == (1,)
    assert pack["sample_ids"] == [0, 2]
    assert pack["n_images"] == 2
