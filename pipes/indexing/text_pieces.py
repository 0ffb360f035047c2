"""A long text cut into pieces the tokenizer encodes to exactly the ids of the whole text.

Tokenizing one text costs ~200 bytes of memory per character (the Rust tokenizer keeps
alignments for every byte of the normalized string): a 2 MB record +400 MB in the exact length
index, a 20 MB one 2.9 GB. Cut at pre-token boundaries, the pieces encode one after another to
the same ids with the memory of one piece.

Exact only where the cut is provably a boundary, so only for a tokenizer of this shape (Qwen2 /
Qwen2.5 / Qwen3 and their VL processors): normalizer none or NFC, the Qwen2 split regex then
byte-level without a prefix space, BPE without dropout, added tokens with no whitespace and no
strip rules. Its cut is a space between two letters: no pre-token of that regex holds a letter
followed by a space (only ``[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`` holds letters, and its one
non-letter comes first), so a pre-token ends before the space and the next one starts at it,
whatever follows; NFC composes nothing across a space. Any other tokenizer gets the whole text.

>>> list(pieces("one two three four", 9))
['one two', ' three', ' four']
>>> "".join(pieces("one two three four", 9)) == "one two three four"
True
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

__all__ = ["PIECE_CHARS", "cuts_exactly", "pieces"]

#: Texts longer than this many characters are encoded in pieces of about this size: ~13 MB
#: of tokenizer memory a piece, and no record of ordinary length is cut at all.
PIECE_CHARS = 1 << 16

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _state(component: Any) -> Any:
    return None if component is None else json.loads(component.__getstate__())


def cuts_exactly(backend: Any) -> bool:
    """Whether ``pieces`` keeps the ids of this Rust tokenizer (``tokenizer.backend_tokenizer``)
    exact: the shape described in the module docstring, checked from its own serialized parts."""
    try:
        normalizer = _state(backend.normalizer)
        pre = _state(backend.pre_tokenizer)
        model = backend.model
        added = backend.get_added_tokens_decoder().values()
    except (AttributeError, TypeError, ValueError):
        return False
    if normalizer not in (None, {"type": "NFC"}) or type(model).__name__ != "BPE":
        return False
    if getattr(model, "dropout", None) is not None:
        return False
    steps = pre.get("pretokenizers") if isinstance(pre, dict) else None
    if not isinstance(steps, list) or len(steps) != 2:
        return False
    split, byte_level = steps
    if split != {"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated",
                 "invert": False}:  # fmt: skip
        return False
    want = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
    if {k: byte_level.get(k) for k in want} != want:  # trim_offsets: offsets only, not ids
        return False
    return all(
        not (t.lstrip or t.rstrip or t.single_word or any(c.isspace() for c in t.content))
        for t in added
    )


def _cut(text: str, lo: int, hi: int) -> int:
    """The last space in ``text[lo:hi]`` between two letters (after ``lo``), else -1."""
    i = text.rfind(" ", lo + 1, hi)
    while i > lo:
        if text[i - 1].isalpha() and i + 1 < len(text) and text[i + 1].isalpha():
            return i
        i = text.rfind(" ", lo + 1, i)
    return -1


def pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``size`` characters where a cut exists (a
    space between two letters); a stretch without one stays whole (longer than ``size``)."""
    start = 0
    while len(text) - start > size:
        cut = _cut(text, start, start + size + 1)
        if cut < 0:  # none in this window: the next one further on
            nxt = start + size
            while (cut := _cut(text, nxt, min(len(text), nxt + size))) < 0 and nxt < len(text):
                nxt += size
            if cut < 0:
                break
        yield text[start:cut]
        start = cut
    yield text[start:]
