"""Assistant-only labels on the real tiny processors: fast path, derived markers, templates."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from neatpack.pipes.materializing.labels import (
    IGNORE_INDEX,
    RoleMarkers,
    assistant_spans,
    build_labels,
    build_labels_from_template,
    derive_role_markers,
    qwen_role_markers,
    resolve_role_markers,
)
from neatpack.pipes.testing.tiny import FAMILIES, load_tiny_processor

END = "<|im_end|>"


@pytest.fixture(scope="module")
def proc() -> Any:
    return load_tiny_processor("qwen2_vl")


def _ids(p: Any, conv: list[dict[str, Any]]) -> torch.Tensor:
    text = p.apply_chat_template(conv, tokenize=False)
    return torch.tensor(p.tokenizer(text, add_special_tokens=False)["input_ids"])


def _labelled_turns(p: Any, ids: torch.Tensor, labels: torch.Tensor) -> list[str]:
    """Decode each contiguous labelled run separately."""
    keep = (labels != IGNORE_INDEX).tolist()
    runs: list[list[int]] = []
    for k, on in enumerate(keep):
        if on and (k == 0 or not keep[k - 1]):
            runs.append([])
        if on:
            runs[-1].append(int(ids[k]))
    return [getattr(p, "tokenizer", p).decode(r) for r in runs]


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_equals_general_path(family: str) -> None:
    p = load_tiny_processor(family)
    fast = qwen_role_markers(p)
    assert fast is not None
    assert derive_role_markers(p) == fast
    assert derive_role_markers(p.tokenizer) == fast
    tok = p.tokenizer
    assert fast.end == (tok.convert_tokens_to_ids(END),)
    assert tok.decode(list(fast.start)) == "<|im_start|>assistant\n"


def test_multi_turn_with_system_prompt(proc: Any) -> None:
    conv = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "one?"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": [{"type": "text", "text": "two?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Second, longer answer!"}]},
    ]
    ids = _ids(proc, conv)
    labels = build_labels(ids, proc)
    assert labels.shape == ids.shape
    assert labels.dtype == torch.long
    assert _labelled_turns(proc, ids, labels) == [
        f"First answer.{END}",
        f"Second, longer answer!{END}",
    ]
    # the header, the system prompt and user turns are never labelled
    on = labels != IGNORE_INDEX
    assert torch.equal(labels[on], ids[on])
    text_off = proc.tokenizer.decode(ids[~on])
    assert "Be terse." in text_off
    assert "one?" in text_off
    assert "assistant\n" in text_off


def test_default_system_prompt_not_labelled(proc: Any) -> None:
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b c"}]
    ids = _ids(proc, conv)
    assert "You are a helpful assistant." in proc.tokenizer.decode(ids)
    assert _labelled_turns(proc, ids, build_labels(ids, proc)) == [f"a b c{END}"]


def test_batch_and_seed_signature(proc: Any) -> None:
    convs = [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "short"}],
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "longer one"},
        ],
    ]
    rows = [_ids(proc, c) for c in convs]
    width = max(len(r) for r in rows)
    pad = proc.tokenizer.pad_token_id
    batch = torch.full((2, width), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        batch[b, : len(r)] = r
    labels = build_labels_from_template(batch, convs, proc)
    assert torch.equal(labels, build_labels(batch, proc))
    assert (labels[0, len(rows[0]) :] == IGNORE_INDEX).all()  # padding never labelled
    assert _labelled_turns(proc, batch[1], labels[1]) == [f"x{END}", f"longer one{END}"]
    with pytest.raises(ValueError, match="row 0: found 1 assistant turn"):
        build_labels_from_template(batch, [convs[1], convs[1]], proc)


def test_leading_newline_merge_is_labelled_not_lost(proc: Any) -> None:
    """'\\n' of the header + '\\n' of the content merge into one BPE token."""
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\nindented"}]
    ids = _ids(proc, conv)
    markers = resolve_role_markers(proc)
    exact_only = RoleMarkers(markers.start, markers.end)  # the seed's exact match
    assert assistant_spans(ids.tolist(), exact_only) == []  # the seed silently loses the turn
    assert _labelled_turns(proc, ids, build_labels(ids, proc)) == [f"\n\nindented{END}"]


def test_truncated_turn_runs_to_row_end() -> None:
    m = RoleMarkers((1, 2), (9,))
    assert assistant_spans([5, 1, 2, 7, 7], m) == [(3, 5)]
    assert assistant_spans([1, 2, 9], m) == [(2, 3)]  # empty content: only the end marker
    assert assistant_spans([1, 2], m) == []  # generation prompt only: nothing to label


def test_bad_shapes_and_markers(proc: Any) -> None:
    with pytest.raises(ValueError, match=r"\[L\] or \[B, L\]"):
        build_labels(torch.zeros(1, 1, 3, dtype=torch.long), proc)
    with pytest.raises(ValueError, match="non-empty"):
        RoleMarkers((), (1,))


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "specials", "end", "header"),
    [
        (
            GEMMA_TEMPLATE,
            ["<start_of_turn>", "<end_of_turn>"],
            "<end_of_turn>",
            "<start_of_turn>model\n",
        ),
        (
            LLAMA_TEMPLATE,
            ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            "<|eot_id|>",
            "<|end_header_id|>\n\n",
        ),
    ],
)
def test_general_path_on_other_templates(
    proc: Any, template: str, specials: list[str], end: str, header: str
) -> None:
    tok = copy.deepcopy(proc.tokenizer)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    assert qwen_role_markers(tok) is None  # no <|im_start|> in this template
    markers = resolve_role_markers(tok)
    assert markers.end == (tok.convert_tokens_to_ids(end),)
    assert tok.decode(list(markers.start)).endswith(header)
    conv = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "General answer."},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "Two."},
    ]
    text = tok.apply_chat_template(conv, tokenize=False)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    labels = build_labels(ids, tok)
    assert _labelled_turns(tok, ids, labels) == [f"General answer.{end}", f"Two.{end}"]


_TEXT = st.text(alphabet="ab xyz.,!?\n\t0123é", min_size=1, max_size=24).filter(
    lambda s: bool(s.strip())
)


@given(st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=4))
def test_labels_cover_exactly_assistant_content(turns: list[tuple[str, str]]) -> None:
    p = load_tiny_processor("qwen2_vl")
    conv: list[dict[str, Any]] = []
    for user, answer in turns:
        conv += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    ids = _ids(p, conv)
    got = _labelled_turns(p, ids, build_labels(ids, p))
    assert len(got) == len(turns)
    for text, (_, answer) in zip(got, turns, strict=True):
        assert text.endswith(answer + END)
        assert text[: len(text) - len(answer + END)] in ("", "\n")  # merged header newline only


IM_START_CAPITALISED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] | capitalize }}: "
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>Assistant: {% endif %}"
)


def test_im_start_template_with_other_role_text_takes_the_general_path(proc: Any) -> None:
    """``<|im_start|>`` in a template is not enough for the fast path: this one renders
    ``<|im_start|>Assistant: ``, which the fast path's ``<|im_start|>assistant\\n`` never matches
    (every label would be -100, silently)."""
    tok = copy.deepcopy(proc.tokenizer)
    tok.chat_template = IM_START_CAPITALISED
    assert qwen_role_markers(tok) is None
    markers = resolve_role_markers(tok)
    assert tok.decode(list(markers.start)) == "<|im_start|>Assistant: "
    conv = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "First reply."},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "Second."},
    ]
    text = tok.apply_chat_template(conv, tokenize=False)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    turns = [t.strip() for t in _labelled_turns(tok, ids, build_labels(ids, tok))]
    assert turns == [f"First reply.{END}", f"Second.{END}"]
