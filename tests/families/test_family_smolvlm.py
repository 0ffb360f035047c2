"""SmolVLM with the real ``SmolVLMProcessor`` (tiny, offline; needs the ``num2words`` test extra)
and a tiny real ``SmolVLMForConditionalGeneration``.

Same token layout as Idefics3 (checked: identical ids, labels and pixels for the same records),
labels = exactly the assistant turns, ``<image>`` == ``image_seq_len`` x tiles, the length
estimate against the real length, bad input naming the sample, packed-vs-separate parity through
``registry.packed_model_inputs``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from PIL import Image
from support.family_checks import check_packed_equals_separate, label_spans
from support.family_records import conversation_records, with_images_meta

pytest.importorskip("num2words", reason="SmolVLMProcessor imports num2words (test extra)")

from support.tiny import ASSETS, load_tiny_idefics3_processor, load_tiny_smolvlm_processor
from support.tiny_family_models import tiny_smolvlm_model

from neatpack.pipes.families import (
    get_handler,
    tokenize_with_handler,
)
from neatpack.pipes.families.smolvlm import (
    smolvlm_estimate,
    smolvlm_image_block_tokens,
    smolvlm_image_tokens,
)
from neatpack.pipes.reading.media import SampleError

_FOLDER = ASSETS / "smolvlm"


@pytest.fixture(scope="module")
def smol() -> Any:
    return load_tiny_smolvlm_processor()


def test_smolvlm_uses_its_registered_handler(smol: Any) -> None:
    assert type(smol).__name__ == "SmolVLMProcessor"
    assert get_handler(smol).name == "smolvlm"
    assert sum(p.stat().st_size for p in _FOLDER.iterdir()) < 300 * 1024
    assert not hasattr(smol, "_get_num_multimodal_tokens")  # why the idefics3 handler can't
    assert smolvlm_image_block_tokens(smol, [(40, 60)]) == [33]  # module docstring example


def test_smolvlm_labels_tokens_and_estimate(smol: Any) -> None:
    """Labels = the assistant turns (the space after "Assistant:" rides in the first labelled
    token); ``<image>`` == image_seq_len x tiles; ids, labels and pixels equal the Idefics3
    processor's; estimate exact mode == real length, chars/3 mode within 25 %."""
    idefics3 = load_tiny_idefics3_processor()
    worst_rel = 0.0
    for rec in with_images_meta(conversation_records(12, seed=51)):
        s = tokenize_with_handler(rec, smol)
        answers = [m["content"][0]["text"] + "<end_of_utterance>" for m in rec["conversation"]
                   if m["role"] == "assistant"]  # fmt: skip
        assert [x.lstrip(" ") for x in label_spans(smol.tokenizer, s)] == answers, rec["sample_id"]
        sizes = [tuple(m) for m in rec["images_meta"]]
        n_img = int((s["input_ids"] == smol.image_token_id).sum())
        assert n_img == sum(smolvlm_image_tokens(smol, sizes))
        assert n_img == int((s["mm_token_type_ids"] == 1).sum())
        if sizes:
            assert n_img == smol.image_seq_len * s["pixel_values"].shape[1]
        twin = tokenize_with_handler(rec, idefics3)
        for key in ("input_ids", "labels", "mm_token_type_ids", "pixel_values"):
            assert (key in s) == (key in twin), key
            if key in s:
                assert torch.equal(s[key], twin[key]), (rec["sample_id"], key)
        real = len(s["input_ids"]) - 1
        assert smolvlm_estimate(rec, smol) == real, rec["sample_id"]
        rough = smolvlm_estimate(rec, smol, mode="estimate")
        worst_rel = max(worst_rel, abs(rough - real) / real)
    assert worst_rel <= 0.25, worst_rel


@pytest.mark.badinput
def test_smolvlm_rejects_video_and_audio_naming_the_sample(smol: Any) -> None:
    frames = [Image.new("RGB", (28, 28))] * 2
    for sid, block in ((21, {"type": "video", "video": frames}),
                       (22, {"type": "audio", "audio": [0.0] * 16})):  # fmt: skip
        rec = {"sample_id": sid, "conversation": [
            {"role": "user", "content": [block, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": "noise"}]}  # fmt: skip
        with pytest.raises(SampleError, match=rf"sample_id={sid} \[bad_media\].*\['image'\]"):
            tokenize_with_handler(rec, smol)


@pytest.mark.parity
def test_smolvlm_packed_equals_separate(smol: Any) -> None:
    """Packed row from ``registry.packed_model_inputs`` (tiles concatenated on axis 1,
    block-causal mask, reset positions) == each sample alone (<= 1e-5 fp32); a one-document mask
    over the same row differs."""
    model = tiny_smolvlm_model(smol)
    samples = [tokenize_with_handler(r, smol) for r in conversation_records(4, seed=52)]
    assert sum("pixel_values" in s for s in samples) >= 2
    check_packed_equals_separate(model, smol, samples, ("pixel_values", "pixel_attention_mask"))
