"""Chat-template facts read from a real processor: the template's own token overhead (a tiny
probe conversation) and the exact token count of a templated conversation.

For the Qwen2-VL template with the real Qwen vocabulary the probe gives 5 tokens per message
(``<|im_start|>``, role, newline, ``<|im_end|>``, newline; a role word that the vocabulary
splits costs more, hence one constant per role), ``per_image=2`` (vision start and end
around the one placeholder) and ``no_system`` = the default system prompt block.
"""

from __future__ import annotations

import hashlib
from typing import Any

from neatpack.pipes.indexing.estimate_types import TemplateOverhead
from neatpack.pipes.indexing.text_pieces import PIECE_CHARS, cuts_exactly, pieces

__all__ = [
    "encode_ids",
    "placeholder_tokens",
    "probe_overhead",
    "templated_text_tokens",
    "tokenizer_id",
]


def tokenizer_of(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def encode_ids(
    tokenizer: Any, texts: list[str], *, piece_chars: int = PIECE_CHARS
) -> list[list[int]]:
    """``tokenizer(texts, add_special_tokens=False)["input_ids"]``.

    For a fast tokenizer this goes straight to its Rust backend's ``encode_batch_fast``. That
    gives the same ids without the offsets, the attention masks and the BatchEncoding the
    transformers call builds around them: 123 -> 55 µs a record here, most of an exact-mode
    index build. It is taken only when the backend is in the state that call leaves it in: no
    truncation, no padding, special tokens kept whole. Anything else goes through the
    transformers call.

    A text over ``piece_chars`` characters is encoded piece by piece where the tokenizer keeps
    that exact (``text_pieces.py``: Qwen-style BPE), so its memory is one piece's (~200 bytes
    a character: a 2 MB text +400 MB whole, ~+20 MB in 64 KiB pieces).
    """
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if (
        fast is None
        or backend.truncation is not None
        or backend.padding is not None
        or getattr(backend, "encode_special_tokens", False)
        or getattr(tokenizer, "split_special_tokens", False)
    ):

        def encode(batch: list[str]) -> list[list[int]]:
            ids: list[list[int]] = tokenizer(batch, add_special_tokens=False)["input_ids"]
            return ids
    else:

        def encode(batch: list[str]) -> list[list[int]]:
            return [e.ids for e in fast(batch, add_special_tokens=False)]

    long = [k for k, t in enumerate(texts) if len(t) > piece_chars]
    if not long or backend is None or not cuts_exactly(backend):
        return encode(texts)
    out = encode([t if len(t) <= piece_chars else "" for t in texts])
    for k in long:
        ids: list[int] = []
        for piece in pieces(texts[k], piece_chars):
            ids.extend(encode([piece])[0])
        out[k] = ids
    return out


def placeholder_tokens(processor: Any) -> tuple[dict[str, int], list[str]]:
    """``(declared placeholder -> its id, declared placeholders the vocabulary lacks)`` for the
    processor's ``image_token`` / ``video_token``.

    A processor may declare a token its tokenizer does not have: SmolVLM's processor falls back
    to ``video_token="<video>"`` whatever the vocabulary, and SmolVLM's vocabulary has no
    ``<video>``. Such a token is never one id in the text (the tokenizer splits it into pieces,
    which the processor also sees), so there is no placeholder id to leave out of the count; it
    is reported here instead of being looked up as ``int(None)`` or as the unknown token's id
    (which would drop every real unknown token from the count).

    >>> from neatpack.pipes.testing.tiny import load_tiny_processor
    >>> placeholder_tokens(load_tiny_processor("qwen2_vl"))[1]
    []
    """
    tok = tokenizer_of(processor)
    unk = getattr(tok, "unk_token", None)
    found: dict[str, int] = {}
    missing: list[str] = []
    for attr in ("image_token", "video_token"):
        token = getattr(processor, attr, None)
        if not isinstance(token, str):
            continue
        tid = tok.convert_tokens_to_ids(token)
        if tid is None or (token != unk and tid == getattr(tok, "unk_token_id", None)):
            missing.append(token)
        else:
            found[token] = int(tid)
    return found, missing


def placeholder_ids(processor: Any) -> set[int]:
    return set(placeholder_tokens(processor)[0].values())


def text_tokens(processor: Any, text: str) -> int:
    return len(tokenizer_of(processor)(text, add_special_tokens=False)["input_ids"])


def templated_text_tokens(processor: Any, conversation: list[dict[str, Any]]) -> int:
    """Tokens of ``apply_chat_template(conversation)`` minus the media placeholders (each is
    replaced by the media's visual tokens when the processor expands it)."""
    text = processor.apply_chat_template(conversation, tokenize=False)
    ids = encode_ids(tokenizer_of(processor), [text])[0]
    placeholders = placeholder_ids(processor)
    return sum(1 for i in ids if i not in placeholders)


def probe_overhead(processor: Any) -> TemplateOverhead:
    """Template overhead from five probe conversations (text "a" is one token)."""

    def n(*msgs: tuple[str, list[dict[str, Any]]]) -> int:
        return templated_text_tokens(processor, [{"role": r, "content": c} for r, c in msgs])

    a = [{"type": "text", "text": "a"}]
    t_a = len(tokenizer_of(processor)("a", add_special_tokens=False)["input_ids"])
    one = n(("user", a))
    user = n(("system", a), ("user", a), ("user", a)) - n(("system", a), ("user", a)) - t_a
    assistant = n(("user", a), ("assistant", a)) - one - t_a
    system = n(("system", a), ("user", a)) - user - 2 * t_a
    image = n(("user", [{"type": "image", "image": "probe.jpg"}, *a])) - one
    video = n(("user", [{"type": "video", "video": "probe.mp4"}, *a])) - one
    vp = getattr(processor, "video_processor", None)
    timestamps = vp is not None and "qwen3" in type(vp).__name__.lower()
    per_frame = 2 + text_tokens(processor, "<1.5 seconds>") if timestamps else 0
    return TemplateOverhead(
        per_video_frame=float(per_frame),
        per_system=float(system), per_user=float(user), per_assistant=float(assistant),
        per_image=float(image), per_video=float(video), no_system=float(one - user - t_a),
    )  # fmt: skip


def tokenizer_id(processor: Any) -> str:
    """A short content id of the tokenizer and chat template (part of the cache fingerprint)."""
    if processor is None:
        return ""
    tok = tokenizer_of(processor)
    h = hashlib.sha256()
    h.update(type(processor).__name__.encode())
    h.update(str(len(tok)).encode())
    h.update(str(getattr(processor, "chat_template", None) or "").encode())
    for t in ("a", "Hello world", "<|im_start|>"):
        h.update(repr(tok(t, add_special_tokens=False)["input_ids"]).encode())
    return h.hexdigest()[:16]
