"""A long text tokenized in pieces (``pipes/indexing/text_pieces.py``, through ``encode_ids``): the
ids
equal the whole text's, for every cut the pieces make; tokenizers whose ids a cut could change
are never cut; and the exact length index counts a long record the same either way."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neatpack.pipes.indexing._template_probe import encode_ids
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.text_pieces import cuts_exactly, pieces
from neatpack.pipes.testing.tiny import load_tiny_processor

QWEN = load_tiny_processor("qwen2_vl")
TOKENIZER = QWEN.tokenizer
# Letters (with accents, combining marks, CJK), spaces, newlines, digits, punctuation,
# contractions, emoji and special tokens: every class the split regex treats differently.
ATOMS = [*"abcxyzéßΩ", "日本", " ", " ", " ", "  ", "\t", "\n", "\n\n", "\r\n", ".", ",",
         "!?", "'s", "'ll", "1", "42", "\u0301", "\u00a0", "😀", "<|im_end|>",
         "<|image_pad|>"]  # fmt: skip


@given(st.lists(st.sampled_from(ATOMS), min_size=1, max_size=300), st.integers(1, 40))
def test_pieces_encode_to_the_ids_of_the_whole_text(atoms: list[str], size: int) -> None:
    text = "".join(atoms)
    whole = TOKENIZER(text, add_special_tokens=False)["input_ids"]
    assert "".join(pieces(text, size)) == text
    assert encode_ids(TOKENIZER, [text, "short"], piece_chars=size)[0] == whole


def test_prose_is_actually_cut_and_stays_exact() -> None:
    text = "The cat sat on the mat, and the dog's bone was 42 cm long.\n" * 400
    cut = list(pieces(text, 1000))
    assert len(cut) >= len(text) // 1000
    assert max(map(len, cut)) <= 1000
    assert cuts_exactly(TOKENIZER.backend_tokenizer)
    whole = TOKENIZER(text, add_special_tokens=False)["input_ids"]
    assert encode_ids(TOKENIZER, [text], piece_chars=1000)[0] == whole


def test_a_tokenizer_a_cut_could_change_is_never_cut() -> None:
    from support.tiny import load_tiny_family_processor

    gemma = load_tiny_family_processor("gemma3").tokenizer  # SentencePiece-style, no regex split
    assert not cuts_exactly(gemma.backend_tokenizer)
    text = "word another word\n" * 50
    assert encode_ids(gemma, [text], piece_chars=10)[0] == gemma(
        text, add_special_tokens=False)["input_ids"]  # fmt: skip


@pytest.mark.parametrize("chars", [200_000])
def test_exact_estimate_of_a_long_record_is_the_whole_count(chars: int) -> None:
    body = ("Some words, then more words; " * (chars // 29 + 1))[:chars]
    conv: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": body}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Fine."}]},
    ]
    est = LengthEstimator.from_processor(QWEN, mode="exact")
    got = est.estimate_sample({"sample_id": 0, "conversation": conv}).total
    text = QWEN.apply_chat_template(conv, tokenize=False)
    assert got == len(TOKENIZER(text, add_special_tokens=False)["input_ids"]) - 1
