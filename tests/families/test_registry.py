"""The handler registry, the processor-agnostic default and the prompt -> answer handler."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from PIL import Image

from neatpack.pipes.families import (
    HANDLERS,
    PROCESSOR_HANDLERS,
    Handler,
    get_handler,
    register_handler,
    tokenize_with_handler,
)
from neatpack.pipes.materializing.tokenize import tokenize_conversation
from neatpack.pipes.reading.media import SampleError
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture(scope="module")
def proc() -> Any:
    return load_tiny_processor("qwen2_vl")


@pytest.fixture(scope="module")
def bare_tokenizer(proc: Any) -> Any:
    tok = copy.deepcopy(proc.tokenizer)
    tok.chat_template = None
    return tok


def _record(sid: int = 0, image: Any = None, extra: list[Any] | None = None) -> dict[str, Any]:
    user: list[dict[str, Any]] = [{"type": "text", "text": "Describe the picture."}]
    if image is not None:
        user.insert(0, {"type": "image", "image": image})
    return {
        "sample_id": sid,
        "conversation": [
            {"role": "user", "content": user + (extra or [])},
            {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
            {"role": "user", "content": "And the colour?"},
            {"role": "assistant", "content": "Red, mostly."},
        ],
    }


def _labelled_spans(tok: Any, sample: dict[str, Any]) -> list[str]:
    keep = (sample["labels"] != -100).tolist()
    spans, cur = [], []
    for k, t in zip(keep, sample["input_ids"].tolist(), strict=True):
        if k:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


def test_lookup_by_class_name_default_and_explicit(proc: Any) -> None:
    assert get_handler(proc).name == "qwen_vl"
    assert PROCESSOR_HANDLERS["Qwen2_5_VLProcessor"] == "qwen_vl"
    assert get_handler(proc, "chat_template").name == "chat_template"
    assert get_handler(proc.tokenizer).name == "chat_template"  # unregistered class, has template


def test_default_handler_matches_the_qwen_handler_on_a_qwen_processor(proc: Any) -> None:
    """The processor-agnostic path (no Qwen code) gives the same ids, labels and media."""
    rec = _record(image=Image.new("RGB", (90, 60), (200, 10, 10)))
    generic = tokenize_with_handler(rec, proc, handler="chat_template")
    qwen = tokenize_conversation(rec, proc)
    for key in ("input_ids", "labels", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        assert torch.equal(generic[key], qwen[key]), key
    assert torch.equal(generic["pixel_values"], qwen["pixel_values"])
    assert _labelled_spans(proc.tokenizer, generic) == ["A red square.<|im_end|>",
                                                        "Red, mostly.<|im_end|>"]  # fmt: skip


def test_default_handler_on_a_text_only_tokenizer(proc: Any) -> None:
    s = tokenize_with_handler(_record(), proc.tokenizer)
    assert _labelled_spans(proc.tokenizer, s) == [
        "A red square.<|im_end|>",
        "Red, mostly.<|im_end|>",
    ]
    assert int(s["mm_token_type_ids"].sum()) == 0
    last = tokenize_with_handler(_record(), proc.tokenizer, label_policy="last_assistant")
    assert _labelled_spans(proc.tokenizer, last) == ["Red, mostly.<|im_end|>"]


@pytest.mark.badinput
def test_template_less_processor_error_names_the_registry(bare_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="has no chat template") as err:
        tokenize_with_handler(_record(), bare_tokenizer)
    msg = str(err.value)
    assert "Qwen2Tokenizer has no chat template" in msg
    assert "neatpack.pipes.families" in msg
    assert "register_handler(Handler(" in msg
    assert "processor_classes=('Qwen2Tokenizer',)" in msg


@pytest.mark.badinput
def test_audio_to_a_family_without_audio_names_the_sample(proc: Any) -> None:
    rec = _record(sid=41, extra=[{"type": "audio", "audio": [0.0] * 160}])
    for handler in ("qwen_vl", "chat_template"):
        with pytest.raises(SampleError, match=r"sample_id=41 \[bad_media\].*'audio'") as err:
            tokenize_with_handler(rec, proc, handler=handler)
        assert err.value.sample_id == 41


@pytest.mark.badinput
def test_unknown_handler_and_conflicting_registration(proc: Any) -> None:
    with pytest.raises(ValueError, match="unknown handler name='nope'; registered: "):
        get_handler(proc, "nope")
    with pytest.raises(ValueError, match="'Qwen2VLProcessor' already maps to handler 'qwen_vl'"):
        register_handler(
            Handler("other", HANDLERS["chat_template"].tokenize), ("Qwen2VLProcessor",)
        )
    with pytest.raises(ValueError, match="'chat_template' is already registered"):
        register_handler(Handler("chat_template", HANDLERS["qwen_vl"].tokenize))
    assert "other" not in HANDLERS


def test_registering_a_template_free_handler_for_a_class(bare_tokenizer: Any) -> None:
    h = Handler("my_prompt", HANDLERS["prompt_answer"].tokenize, needs_chat_template=False)
    register_handler(h, ("Qwen2Tokenizer",))
    try:
        s = tokenize_with_handler(_one_turn("Parse:", "ok"), bare_tokenizer)
        assert bare_tokenizer.decode(s["input_ids"][s["labels"] != -100]) == "ok<|im_end|>"
    finally:
        PROCESSOR_HANDLERS.pop("Qwen2Tokenizer")
        HANDLERS.pop("my_prompt")


def _one_turn(prompt: str, answer: str, image: Any = None) -> dict[str, Any]:
    user: list[dict[str, Any]] = [{"type": "text", "text": prompt}]
    if image is not None:
        user.insert(0, {"type": "image", "image": image})
    return {
        "sample_id": 7,
        "conversation": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
    }


def test_prompt_answer_masks_the_prompt_and_labels_answer_and_eos(
    proc: Any, bare_tokenizer: Any
) -> None:
    """Nemotron-Parse style: task prompt masked, answer + eos labelled, image to the encoder."""
    task = "<predict_bbox><output_markdown>"
    answer = " | a | b |\n|---|---|"
    img = Image.new("RGB", (64, 48), (0, 0, 255))
    s = tokenize_with_handler(
        _one_turn("ignored", answer, img), proc, handler="prompt_answer", task_prompt=task
    )
    tok = proc.tokenizer
    assert tok.decode(s["input_ids"][s["labels"] == -100]) == task
    assert tok.decode(s["input_ids"][s["labels"] != -100]) == answer + "<|im_end|>"
    assert s["n_images"] == 1
    assert s["pixel_values"].shape[0] == int(s["image_grid_thw"].prod())
    # no chat template needed when the handler is selected explicitly
    t = tokenize_with_handler(_one_turn("Parse:", answer), bare_tokenizer, handler="prompt_answer")
    assert t["labels"].tolist()[: len(tok("Parse:")["input_ids"])] == [-100] * len(
        tok("Parse:")["input_ids"]
    )


@pytest.mark.badinput
def test_prompt_answer_bad_input(proc: Any) -> None:
    two = _record(sid=5)
    with pytest.raises(SampleError, match=r"sample_id=5 \[bad_record\].*exactly one assistant"):
        tokenize_with_handler(two, proc, handler="prompt_answer")
    rec = _one_turn("p", "a")
    rec["conversation"][0]["content"].append({"type": "video", "video": [Image.new("RGB", (8, 8))]})
    with pytest.raises(SampleError, match=r"sample_id=7 \[bad_media\].*'video'"):
        tokenize_with_handler(rec, proc, handler="prompt_answer")


def test_materialize_pack_selects_a_handler(proc: Any) -> None:
    """``MaterializeConfig(handler=...)``: the pipeline's pack step goes through the registry;
    the processor-agnostic path gives the same pack as the Qwen path on a Qwen processor."""
    from neatpack.pipes.materializing.materialize import MaterializeConfig, materialize_pack

    source = [dict(_record(sid), sample_id=sid) for sid in range(3)]
    base = MaterializeConfig(pack_size=512, mrope=False)
    want, _ = materialize_pack(source, [0, 2], proc, base)
    got, report = materialize_pack(
        source, [0, 2], proc, MaterializeConfig(pack_size=512, mrope=False, handler="chat_template")
    )
    assert report.packed == (0, 2)
    for key in ("input_ids", "labels", "attention_mask", "position_ids"):
        assert torch.equal(got[key], want[key]), key
    # the handler's declaration (Handler.fake_image) decides, naming the handlers that inject one
    with pytest.raises(
        ValueError, match=r"fake_image=True needs a handler .*\['qwen_vl'\].*gemma3"
    ):
        MaterializeConfig(pack_size=8, fake_image=True, handler="gemma3")


def test_prompt_answer_length_exact_and_estimated(proc: Any) -> None:
    """Exact: == the real row length after the shift; chars/3: within 50 % on these records
    (observed 43 % on the shortest rows: the tiny vocabulary is trained on Python sources)."""
    import random

    from neatpack.pipes.families.prompt_answer import prompt_answer_length

    rng = random.Random(0)
    words = [
        "cell",
        "table",
        "header",
        "row",
        "value",
        "total",
        "the",
        "of",
        "and",
        "markdown",
        "bbox",
    ]
    worst = 0.0
    for k in range(20):
        answer = " ".join(rng.choices(words, k=rng.randint(1, 60)))
        rec = _one_turn(" ".join(rng.choices(words, k=rng.randint(1, 8))), answer)
        task = "<predict_bbox>" if k % 2 else None
        s = tokenize_with_handler(rec, proc, handler="prompt_answer", task_prompt=task)
        real = len(s["input_ids"]) - 1
        assert prompt_answer_length(rec, proc, task_prompt=task) == real
        rough = prompt_answer_length(rec, proc, task_prompt=task, chars_per_token=3.0)
        worst = max(worst, abs(rough - real) / real)
    assert worst <= 0.5, worst
