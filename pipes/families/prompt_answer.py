"""Prompt -> answer models with no chat template (Nemotron-Parse style).

The row is ``prompt + answer + eos``: the prompt (``task_prompt`` if given, else the user text) is
masked, the answer and the eos token are labelled. The prompt and the answer are tokenized
separately and concatenated, so no BPE merge crosses the boundary and the labelled span is
exactly the answer's tokens. Images (the first user turn's) go through the processor's
``image_processor`` to an encoder: the text carries no image tokens, so ``mm_token_type_ids`` is
all 0 and ``n_images`` counts the encoder inputs.

The seed (``nemotron_parse_collate_fn``) also builds ``decoder_input_ids`` for its
encoder-decoder model; here the Sample keeps the library's contract (unshifted ``input_ids`` /
``labels``) and the pack builder shifts.

>>> from neatpack.pipes.testing.tiny import load_tiny_processor
>>> tok = load_tiny_processor("qwen2_vl").tokenizer
>>> s = tokenize_prompt_answer({"sample_id": 0, "conversation": [
...     {"role": "user", "content": "Parse:"}, {"role": "assistant", "content": "A table"}]}, tok)
>>> tok.decode(s["input_ids"][s["labels"] == -100]), tok.decode(s["input_ids"][s["labels"] != -100])
('Parse:', 'A table<|im_end|>')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from neatpack.pipes.materializing.labels import IGNORE_INDEX
from neatpack.pipes.reading.media import SampleError, load_image

from ._shared import check_modalities
from .registry import Handler, register_handler

__all__ = [
    "PROMPT_ANSWER_HANDLER",
    "prompt_answer_estimate",
    "prompt_answer_length",
    "tokenize_prompt_answer",
]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(b.get("text", "")) for b in content if isinstance(b, Mapping) and "text" in b
        )
    return ""


def _images(content: Any) -> list[Any]:
    if not isinstance(content, list):
        return []
    return [
        b.get("image", b.get("path"))
        for b in content
        if isinstance(b, Mapping) and (b.get("type") == "image" or "image" in b)
    ]


def _prompt_answer(record: Mapping[str, Any], task_prompt: str | None) -> tuple[str, str]:
    conv = record.get("conversation") or []
    users = [m for m in conv if isinstance(m, Mapping) and m.get("role") == "user"]
    answers = [m for m in conv if isinstance(m, Mapping) and m.get("role") == "assistant"]
    prompt = task_prompt if task_prompt is not None else _text(users[0]["content"] if users else "")
    return prompt, _text(answers[0].get("content")) if answers else ""


def prompt_answer_length(
    record: Mapping[str, Any],
    processor: Any,
    *,
    task_prompt: str | None = None,
    chars_per_token: float | None = None,
) -> int:
    """Row length after the shift. ``chars_per_token=None``: exact (tokenizes prompt and answer,
    as ``tokenize_prompt_answer`` does); a number: ``floor(chars / chars_per_token)`` for each
    part plus the special tokens (bos when the tokenizer adds one, eos), no tokenization."""
    tok = getattr(processor, "tokenizer", processor)
    prompt, answer = _prompt_answer(record, task_prompt)
    specials = len(tok("", add_special_tokens=True)["input_ids"]) if prompt else 0
    if chars_per_token is None:
        p = len(tok(prompt, add_special_tokens=True)["input_ids"]) if prompt else 0
        a = len(tok(answer, add_special_tokens=False)["input_ids"])
    else:
        if not chars_per_token > 0:
            raise ValueError(f"{chars_per_token=} must be > 0")
        p = int(len(prompt) / chars_per_token) + specials if prompt else 0
        a = int(len(answer) / chars_per_token)
    return p + a + 1 - 1  # + eos, - the shift


def tokenize_prompt_answer(
    record: Mapping[str, Any],
    processor: Any,
    *,
    task_prompt: str | None = None,
    max_image_pixels: int | str | None = "pil",
) -> dict[str, Any]:
    """One Record (a user prompt, optionally with images, and ONE assistant answer) -> Sample."""
    check_modalities(record, processor, frozenset({"image"}))
    sid = record.get("sample_id") if isinstance(record, Mapping) else None
    conv = record.get("conversation") if isinstance(record, Mapping) else None
    if not isinstance(conv, list):
        raise SampleError(sid, "bad_record", f"'conversation' is {conv!r:.80}; expected a list")
    users = [m for m in conv if isinstance(m, Mapping) and m.get("role") == "user"]
    answers = [m for m in conv if isinstance(m, Mapping) and m.get("role") == "assistant"]
    if len(answers) != 1:
        raise SampleError(
            sid,
            "no_assistant" if not answers else "bad_record",
            f"a prompt -> answer model needs exactly one assistant turn, got {len(answers)}; "
            "split multi-turn records or use a chat-template handler",
        )
    answer = _text(answers[0].get("content"))
    if not answer.strip():
        raise SampleError(sid, "empty_text", "the assistant answer is empty; drop the sample")
    prompt = task_prompt if task_prompt is not None else _text(users[0]["content"] if users else "")
    tok = getattr(processor, "tokenizer", processor)
    eos = tok.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {type(tok).__name__} has no eos token; set eos_token")
    p_ids = list(tok(prompt, add_special_tokens=True)["input_ids"]) if prompt else []
    a_ids = [*tok(answer, add_special_tokens=False)["input_ids"], int(eos)]
    ids = torch.tensor(p_ids + a_ids, dtype=torch.long)
    labels = ids.clone()
    labels[: len(p_ids)] = IGNORE_INDEX
    sample: dict[str, Any] = {
        "sample_id": sid,
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": torch.zeros_like(ids),
    }
    srcs = _images(users[0].get("content")) if users else []
    if srcs:
        images = [load_image(s, sample_id=sid, max_image_pixels=max_image_pixels) for s in srcs]
        out = processor.image_processor(images, return_tensors="pt")
        sample.update({k: v for k, v in out.items() if isinstance(v, torch.Tensor)})
        sample["n_images"] = len(images)
    return sample


def prompt_answer_estimate(
    record: Mapping[str, Any], processor: Any, *, mode: str = "exact"
) -> int:
    """``prompt_answer_length`` for the graph: tokenized in ``mode="exact"``, else chars / 3."""
    return prompt_answer_length(record, processor, chars_per_token=None if mode == "exact" else 3.0)


PROMPT_ANSWER_HANDLER = register_handler(
    Handler(
        "prompt_answer",
        tokenize_prompt_answer,
        modalities=frozenset({"image"}),
        needs_chat_template=False,
        description="no chat template: prompt masked, answer + eos labelled "
        "(Nemotron-Parse style, pipes/families/prompt_answer.py)",
        estimate=prompt_answer_estimate,
    )
)
