"""Step3 crops with the real ``Step3p7Processor`` (tiny, offline) and a tiny real
``Step3p7ForConditionalGeneration``.

Labels = exactly the assistant turns (decoded), ``<im_patch>`` per image == crops x crop features
+ global-view features (and == what the model scatters), the length estimate against the real
length, bad input naming the sample, packed-vs-separate parity through
``registry.packed_model_inputs``, and the PP media split (``pp_media.chunk_step3_media`` via
``step3_pp_media``): each micro-batch's media belong to its own text rows, checked by token counts
and by running every micro-batch alone through the model.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from PIL import Image
from support.family_checks import check_packed_equals_separate, label_spans
from support.family_records import conversation_records, random_text, with_images_meta
from support.tiny import ASSETS, load_tiny_step3_processor
from support.tiny_family_models import tiny_step3_model

from neatpack.pipes.collating.collate import neat_packed_vlm_collater
from neatpack.pipes.families import get_handler, tokenize_with_handler
from neatpack.pipes.families.step3 import (
    step3_batch_media,
    step3_estimate,
    step3_image_block_tokens,
    step3_image_tokens,
    step3_pp_media,
)
from neatpack.pipes.materializing.pack import build_pack
from neatpack.pipes.parallel.pp_media import microbatch_bounds
from neatpack.pipes.reading.media import SampleError

_FOLDER = ASSETS / "step3"


@pytest.fixture(scope="module")
def step3() -> Any:
    return load_tiny_step3_processor()


@pytest.fixture(scope="module")
def model(step3: Any) -> Any:
    return tiny_step3_model(step3)


def _crop_records(n: int, seed: int) -> list[dict[str, Any]]:
    """Like ``test_families._records`` but with images of 40..260 px a side (0 to 20 crops)."""
    rng = random.Random(seed)
    out = []
    for sid in range(n):
        conv: list[dict[str, Any]] = []
        for _ in range(rng.randint(1, 2)):
            user: list[dict[str, Any]] = []
            for _ in range(rng.randint(0, 2)):
                size = (rng.randint(40, 260), rng.randint(40, 260))
                image = Image.new("RGB", size, (rng.randint(0, 255), 9, 70))
                user.append({"type": "image", "image": image})
            user.append({"type": "text", "text": random_text(rng, 3, 20)})
            conv.append({"role": "user", "content": user})
            answer = [{"type": "text", "text": random_text(rng, 1, 25)}]
            conv.append({"role": "assistant", "content": answer})
        out.append({"sample_id": sid, "conversation": conv})
    return with_images_meta(out)


def test_step3_uses_its_registered_handler(step3: Any) -> None:
    assert type(step3).__name__ == "Step3p7Processor"
    assert get_handler(step3).name == "step3"
    assert sum(p.stat().st_size for p in _FOLDER.iterdir()) < 300 * 1024


def test_step3_labels_crop_tokens_and_estimate(step3: Any, model: Any) -> None:
    """Labels decoded = the assistant turns; ``<im_patch>`` == crops x 1 + 4 per image ==
    ``step3_image_tokens`` == the features the model makes; ``step3_estimate`` exact mode ==
    real length, chars/3 mode within 25 %."""
    worst_rel, crops_seen = 0.0, set()
    for rec in [*_crop_records(10, seed=41), *with_images_meta(conversation_records(4, seed=42))]:
        s = tokenize_with_handler(rec, step3)
        answers = [m["content"][0]["text"] + "<|EOT|>" for m in rec["conversation"]
                   if m["role"] == "assistant"]  # fmt: skip
        assert label_spans(step3.tokenizer, s) == answers, rec["sample_id"]
        sizes = [tuple(m) for m in rec["images_meta"]]
        n_patch = int((s["input_ids"] == step3.image_token_id).sum())
        assert n_patch == int((s["mm_token_type_ids"] == 1).sum())
        assert n_patch == sum(step3_image_tokens(step3, sizes))
        if sizes:
            crops = s["num_local_patches"].tolist()
            crops_seen.update(crops)
            assert (
                n_patch
                == sum(crops) * step3.num_patch_feature_size
                + len(sizes) * step3.num_image_feature_size
            )
            assert s["pixel_values"].shape[0] == len(sizes)
            kw = {k: s[k] for k in ("pixel_values_local",) if k in s}
            with torch.no_grad():
                feats = model.model.get_image_features(
                    s["pixel_values"], num_local_patches=crops, **kw
                ).pooler_output
            assert sum(int(f.shape[0]) for f in feats) == n_patch
        real = len(s["input_ids"]) - 1
        assert step3_estimate(rec, step3) == real, rec["sample_id"]
        rough = step3_estimate(rec, step3, mode="estimate")
        worst_rel = max(worst_rel, abs(rough - real) / real)
    assert 0 in crops_seen, crops_seen
    assert max(crops_seen) >= 6, crops_seen
    assert worst_rel <= 0.25, worst_rel
    assert step3_image_block_tokens(step3, [(90, 200)]) == [31]  # module docstring example


@pytest.mark.badinput
def test_step3_bad_input_names_the_sample(step3: Any) -> None:
    frames = [Image.new("RGB", (28, 28))] * 2
    rec = {"sample_id": 11, "conversation": [
        {"role": "user", "content": [{"type": "video", "video": frames}]},
        {"role": "assistant", "content": "noise"}]}  # fmt: skip
    with pytest.raises(SampleError, match=r"sample_id=11 \[bad_media\].*'video'.*\['image'\]"):
        tokenize_with_handler(rec, step3)
    rec = {"sample_id": 12, "conversation": [
        {"role": "user", "content": "look <im_patch> here"},
        {"role": "assistant", "content": "x"}]}  # fmt: skip
    with pytest.raises(SampleError, match=r"sample_id=12"):
        tokenize_with_handler(rec, step3)


STEP3_KEYS = ("pixel_values", "pixel_values_local", "num_local_patches")


@pytest.mark.parity
def test_step3_packed_equals_separate(step3: Any, model: Any) -> None:
    """``registry.packed_model_inputs`` (block-causal mask, reset positions, views + crops +
    counts concatenated) == each sample alone (<= 1e-5 fp32); a one-document mask differs."""
    samples = [tokenize_with_handler(r, step3) for r in _crop_records(3, seed=43)]
    assert sum(int(s.get("num_local_patches", torch.zeros(1)).sum()) > 0 for s in samples) >= 2
    check_packed_equals_separate(model, step3, samples, STEP3_KEYS)


@pytest.mark.parity
@pytest.mark.parametrize("n_microbatches", [2, 5])
def test_step3_pp_media_follows_the_packed_rows(
    step3: Any, model: Any, n_microbatches: int
) -> None:
    """5 packed rows (one without images, rows of several images with and without crops),
    padded to one fixed length and split for PP: micro-batch ``i`` gets the text rows
    ``torch.tensor_split`` gives it and media whose ``<im_patch>`` count equals those rows';
    running each micro-batch alone with its media chunk gives the full batch's logits
    (<= 1e-5 fp32)."""
    recs = _crop_records(9, seed=44)
    samples = [tokenize_with_handler(r, step3) for r in recs]
    rows = [samples[0:2], samples[2:3], samples[3:6], samples[6:8], samples[8:9]]
    text_only = {
        "sample_id": 99,
        "conversation": [
            {"role": "user", "content": "just text"},
            {"role": "assistant", "content": "fine"},
        ],
    }
    rows[1] = [tokenize_with_handler(text_only, step3)]
    packs = [build_pack(r) for r in rows]
    fixed = max(sum(p["seq_lens"]) for p in packs) + 3  # fixed-length rows, as PP wants
    batch = neat_packed_vlm_collater(
        packs, max_length=fixed, mask_format="eager", check_media=False
    )
    assert batch["input_ids"].shape == (len(rows), fixed)
    media = step3_batch_media(rows)
    assert media["images_per_row"].tolist()[1] == 0
    assert len(set(media["images_per_row"].tolist())) >= 3
    pp = step3_pp_media(media, len(rows), n_microbatches)
    bounds = microbatch_bounds(len(rows), n_microbatches)
    feats_per_view = step3.num_image_feature_size
    with torch.no_grad():
        full = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"], pixel_values=media["pixel_values"],
            pixel_values_local=media.get("pixel_values_local"),
            num_local_patches=media["num_local_patches"],
        ).logits  # fmt: skip
    worst = 0.0
    for i, (a, b) in enumerate(bounds):
        ids = torch.tensor_split(batch["input_ids"], n_microbatches)[i]
        assert ids.shape[0] == b - a
        views, counts = pp["pixel_values"][i], pp["num_local_patches"][i]
        local = pp["pixel_values_local"][i]
        assert views.shape[0] == counts.shape[0] == int(media["images_per_row"][a:b].sum())
        assert local.shape[0] == int(counts.sum())
        want = int(counts.sum()) * step3.num_patch_feature_size + len(counts) * feats_per_view
        assert int((ids == step3.image_token_id).sum()) == want
        kw: dict[str, Any] = {}
        if len(counts):
            kw = {"pixel_values": views, "num_local_patches": counts}
            if len(local):
                kw["pixel_values_local"] = local
        with torch.no_grad():
            part = model(
                input_ids=ids, attention_mask=batch["attention_mask"][a:b],
                position_ids=batch["position_ids"][a:b], **kw,
            ).logits  # fmt: skip
        worst = max(worst, float((part - full[a:b]).abs().max()))
    assert worst <= 1e-5, worst
