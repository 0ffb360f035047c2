"""A packed row gives the same logits and loss as its samples run one by one.

Tiny random fp32 models (Qwen2 text, Qwen2-VL, Qwen2.5-VL, Qwen3-VL), samples from the real
tiny processors, packs from `build_pack`. Two packed forwards per model: a 4D additive float
block-causal mask with `position_ids` [3,1,T] (VL) / [1,T], and the mask-free form with
`position_ids` [4,1,T] (VL) / [1,T] and `use_cache=False`. The separate runs let the model
compute its own positions (`get_rope_index`), so our mRoPE is checked too.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from support.versions import TRUNCATED_VIDEO_TIME, rope_index_truncates_video_time

from neatpack.pipes.materializing.mrope import MRopeConfig
from neatpack.pipes.materializing.pack import build_pack
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import tiny_model

pytestmark = pytest.mark.parity
TOL = 1e-5
MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
         "second_per_grid_ts")  # fmt: skip
PATCH = {"qwen2_vl": 28, "qwen2_5_vl": 28, "qwen3_vl": 32}  # patch * merge: no resize


def _image(rng: random.Random, h: int, w: int) -> Image.Image:
    arr = np.random.RandomState(rng.randrange(1 << 30)).randint(0, 255, (h, w, 3), np.uint8)
    return Image.fromarray(arr)


def _conv(user: list[dict[str, Any]], answer: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


def _sample(proc: Any, conv: list[dict[str, Any]], sid: int, fake: bool = False) -> dict[str, Any]:
    out = proc.apply_chat_template(
        conv, tokenize=True, return_dict=True, return_tensors="pt",
        return_assistant_tokens_mask=True, do_sample_frames=False,
    )  # fmt: skip
    ids = out["input_ids"][0]
    s: dict[str, Any] = {
        "sample_id": sid,
        "input_ids": ids,
        "labels": ids.masked_fill(out["assistant_masks"][0] == 0, -100),
        "attention_mask": out["attention_mask"][0],
        "mm_token_type_ids": out["mm_token_type_ids"][0],
    }
    for key in MEDIA:
        if key in out:
            s[key] = out[key]
    if "second_per_grid_ts" in s:  # non-trivial temporal spacing: ids 0, 3, 6, ... per frame
        s["second_per_grid_ts"] = torch.full_like(s["second_per_grid_ts"], 1.5)
    if fake:  # what tokenize(fake_image=True) does: the vision tokens are masked out
        s["attention_mask"] = s["attention_mask"].masked_fill(s["mm_token_type_ids"] != 0, 0)
    return s


def _samples(family: str) -> list[dict[str, Any]]:
    rng = random.Random(f"parity-{family}")
    proc = load_tiny_processor("qwen2_vl" if family == "qwen2" else family)
    q = PATCH.get(family, 28)
    text = [{"type": "text", "text": "Say something about parsing a file."}]
    samples = [_sample(proc, _conv(text, "It reads lines and splits them by commas."), 11)]
    if family == "qwen2":
        samples.append(_sample(proc, _conv([{"type": "text", "text": "Hi"}], "OK"), 3))
        samples.append(_sample(proc, _conv(text, "def f(x): return x + 1"), 40))
        return samples
    img = [{"type": "image", "image": _image(rng, 2 * q, 3 * q)}]
    two = [{"type": "image", "image": _image(rng, 4 * q, 2 * q)}, *text,
           {"type": "image", "image": _image(rng, 2 * q, 2 * q)}]  # fmt: skip
    white = Image.new("RGB", (2 * q, 2 * q), (255, 255, 255))
    fake = [{"type": "image", "image": white}, {"type": "text", "text": "Count to three."}]
    samples.append(_sample(proc, _conv([*img, *text], "A noisy picture."), 5))
    samples.append(_sample(proc, _conv(two, "Two noisy pictures, tall then square."), 8))
    samples.append(_sample(proc, _conv(fake, "One two three."), 2, fake=True))
    frames = [_image(rng, 2 * q, 2 * q) for _ in range(6)]  # 3 temporal patches
    video = [{"type": "video", "video": frames}, {"type": "text", "text": "What moves?"}]
    samples.append(_sample(proc, _conv(video, "Only noise."), 21))
    return samples


def _additive_mask(doc: torch.Tensor) -> torch.Tensor:
    t = doc.shape[0]
    q, k = doc[:, None], doc[None, :]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    allowed = ((q == k) & (k > 0) & causal) | torch.eye(t, dtype=torch.bool)
    mask = torch.zeros(t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


def _media(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s[k] for k in MEDIA if s.get(k) is not None}


def _separate(model: Any, s: dict[str, Any], vl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the visible tokens of one shifted sample, and its shifted labels."""
    mask = s["attention_mask"][:-1]
    kw: dict[str, Any] = {"input_ids": s["input_ids"][None, :-1], "use_cache": False}
    if vl:
        kw.update(_media(s), mm_token_type_ids=s["mm_token_type_ids"][None, :-1])
        kw["attention_mask"] = mask[None]
    with torch.no_grad():
        logits = model(**kw).logits[0]
    labels = s["labels"][1:].masked_fill(mask == 0, -100)
    keep = mask.bool()
    return logits[keep], labels[keep]


def _packed(model: Any, pack: dict[str, Any], vl: bool, mask_free: bool) -> torch.Tensor:
    pos = pack["position_ids"]
    kw: dict[str, Any] = {"input_ids": pack["input_ids"][None], "use_cache": False}
    if vl:
        kw["mm_token_type_ids"] = pack["mm_token_type_ids"][None]
        kw.update(_media(pack))
        if mask_free:
            pos = torch.cat([pack["text_position_ids"][None], pos])
        kw["position_ids"] = pos[:, None]
    else:
        kw["position_ids"] = pos[None]
    kw["attention_mask"] = None if mask_free else _additive_mask(pack["attention_mask"])
    with torch.no_grad():
        logits: torch.Tensor = model(**kw).logits[0]
    return logits


def _skip_if_reference_truncates_time(model: Any, samples: list[dict[str, Any]]) -> None:
    seconds = [s["second_per_grid_ts"] for s in samples if s.get("second_per_grid_ts") is not None]
    fractional = any(bool((t != t.round()).any()) for t in seconds)
    if fractional and rope_index_truncates_video_time(model):
        pytest.skip(TRUNCATED_VIDEO_TIME)  # the model's own (reference) positions are wrong


CASES = [
    (family, attn, mask_free)
    for family in ("qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    for attn, mask_free in (("sdpa", False), ("eager", False), ("sdpa", True))
]


@pytest.fixture(scope="module")
def samples_by_family() -> dict[str, list[dict[str, Any]]]:
    return {f: _samples(f) for f in ("qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")}


@pytest.mark.parametrize(("family", "attn", "mask_free"), CASES)
def test_packed_equals_separate(
    samples_by_family: dict[str, list[dict[str, Any]]], family: str, attn: str, mask_free: bool
) -> None:
    vl = family != "qwen2"
    samples = samples_by_family[family]
    model = tiny_model(family, processor=load_tiny_processor("qwen2_vl"), attn_implementation=attn)
    _skip_if_reference_truncates_time(model, samples)
    mrope = MRopeConfig.from_model_config(model.config) if vl else False
    total = sum(len(s["input_ids"]) - 1 for s in samples)
    pack = build_pack(samples, mrope=mrope, pack_size=total + 5, padding_idx=4096)
    logits = _packed(model, pack, vl, mask_free)
    assert pack["sample_ids"] == [s["sample_id"] for s in samples]

    start, worst, ce_sum, count = 0, 0.0, 0.0, 0
    for s, n in zip(samples, pack["seq_lens"], strict=True):
        ref, labels = _separate(model, s, vl)
        got = logits[start : start + ref.shape[0]]  # visible tokens lead their document
        worst = max(worst, float((got - ref).abs().max()))
        assert torch.equal(pack["labels"][start : start + ref.shape[0]], labels)
        ce_sum += float(F.cross_entropy(ref, labels, ignore_index=-100, reduction="sum"))
        count += int((labels != -100).sum())
        start += n
    assert worst <= TOL, f"{family} {attn} mask_free={mask_free}: max |diff| {worst:.3g}"
    packed_loss = F.cross_entropy(logits, pack["labels"], ignore_index=-100)
    assert abs(float(packed_loss) - ce_sum / count) <= TOL
    assert count == int((pack["labels"] != -100).sum()) > 0


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_wrong_packing_is_detected(
    samples_by_family: dict[str, list[dict[str, Any]]], family: str
) -> None:
    """Control: [3,1,T] mRoPE with no mask leaks across documents, so the check can fail."""
    samples = samples_by_family[family]
    model = tiny_model(family)
    pack = build_pack(samples, mrope=MRopeConfig.from_model_config(model.config))
    kw = _media(pack)
    with torch.no_grad():
        logits = model(
            input_ids=pack["input_ids"][None], mm_token_type_ids=pack["mm_token_type_ids"][None],
            position_ids=pack["position_ids"][:, None], use_cache=False, **kw,
        ).logits[0]  # fmt: skip
    n0 = pack["seq_lens"][0]
    ref, _ = _separate(model, samples[1], True)
    got = logits[n0 : n0 + ref.shape[0]]
    assert float((got - ref).abs().max()) > 1e-3


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_real_pack_invariants(
    samples_by_family: dict[str, list[dict[str, Any]]], family: str
) -> None:
    samples = samples_by_family[family]
    model = tiny_model(family)
    _skip_if_reference_truncates_time(model, samples)
    cfg = MRopeConfig.from_processor(load_tiny_processor(family))
    pack = build_pack(samples, mrope=cfg, alignment=8, pack_size=512)
    # the model's own get_rope_index gives the same pack
    ref = build_pack(samples, mrope=model.model.get_rope_index, alignment=8, pack_size=512)
    assert torch.equal(pack["position_ids"], ref["position_ids"])
    doc, labels = pack["attention_mask"], pack["labels"]
    assert pack["sample_ids"] == [s["sample_id"] for s in samples]
    assert labels[doc == 0].eq(-100).all()
    start = 0
    for k, (s, n, lp) in enumerate(
        zip(samples, pack["seq_lens"], pack["seq_lens_padded"], strict=True), start=1
    ):
        assert lp % 8 == 0
        assert n == len(s["input_ids"]) - 1
        assert doc[start : start + lp].eq(k).all()
        assert pack["position_ids"][:, start].eq(0).all()
        assert pack["text_position_ids"][start].item() == 0
        # every label is a token of the same sample (never the next document's first token)
        real = labels[start : start + lp]
        assert set(real[real != -100].tolist()) <= set(s["input_ids"].tolist())
        start += lp
    grid = pack["image_grid_thw"]
    n_tokens = int((pack["mm_token_type_ids"] == 1).sum())
    assert n_tokens == int(grid.prod(dim=1).sum()) // 4
    assert (
        pack["n_images"]
        == grid.shape[0]
        == sum(s["image_grid_thw"].shape[0] for s in samples if "image_grid_thw" in s)
    )
    assert pack["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())


def test_materialized_pack_with_fake_images_equals_separate() -> None:
    """End to end: materialize_pack (tokenize with fake_image=True) vs separate masked runs."""
    from neatpack.pipes.materializing.materialize import MaterializeConfig, materialize_pack
    from neatpack.pipes.materializing.tokenize import tokenize_conversation
    from neatpack.pipes.reading.read import SequenceSource

    proc = load_tiny_processor("qwen2_vl")
    rng = random.Random(1)
    img = _image(rng, 56, 84)
    records = [
        {"messages": [{"role": "user", "content": "Name a prime."},
                      {"role": "assistant", "content": "Seven."}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": img},
                                                   {"type": "text", "text": "Colour?"}]},
                      {"role": "assistant", "content": "Mostly grey."}]},
        {"messages": [{"role": "user", "content": "Two words?"},
                      {"role": "assistant", "content": "Yes indeed, two."}]},
    ]  # fmt: skip
    source = SequenceSource(records)
    cfg = MaterializeConfig(pack_size=256, fake_image=True)
    pack, report = materialize_pack(source, [0, 1, 2], proc, cfg)
    assert report.packed == (0, 1, 2)
    assert pack["n_images"] == 3  # two injected fake images + one real
    model = tiny_model("qwen2_vl", processor=proc)
    for mask_free in (False, True):
        logits = _packed(model, pack, True, mask_free)
        start = 0
        for i, n in enumerate(pack["seq_lens"]):
            s = tokenize_conversation(source[i], proc, fake_image=True)
            ref, labels = _separate(model, s, True)
            got = logits[start : start + ref.shape[0]]
            assert float((got - ref).abs().max()) <= TOL, (i, mask_free)
            assert torch.equal(pack["labels"][start : start + ref.shape[0]], labels)
            start += n
