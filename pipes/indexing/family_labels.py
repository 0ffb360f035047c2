"""A sample's supervised (label) tokens counted by its family's own label code, for the families
whose labels the text-only formula of ``supervised.py`` does not reproduce.

The families label differently around the assistant text: Qwen's template writes
``<|im_start|>assistant\\n`` + content + ``<|im_end|>`` (the content's own tokens + 1, what
``supervised.py``'s formula counts); Idefics3 / SmolVLM write ``Assistant: `` + content, and the
space merges into the content's first token (``"yes"`` alone is 1 token, ``Ġy es`` in the row
2); Gemma 3 trims the content
(``"  spaced  "``: 3 tokens fewer in the row than alone); Gemma 4 keeps its thinking prefix out of
the labels; ``prompt_answer`` labels the answer and the eos token. Rather than one rule per
family, ``family_supervised`` runs the family's handler (``Handler.tokenize``: the
materializer's own call) on the record's text, its media blocks removed, and counts
``labels != -100`` after the shift: the materializer's count by construction. Media tokens are
never labelled, so removing them changes nothing outside the assistant turns (a question that
held only an image gets the text ``handler_lengths.STAND_IN``: a family refuses an empty
turn). Inside an assistant turn (rare in SFT data; not measured here) each media block can
cost the count its template wrapper (Qwen's ``<|vision_start|>`` / ``<|vision_end|>``, which
the materializer labels) and a BPE merge of the text on its two sides, as it does the formula.

``family_label_marks``: the template tokens one assistant turn adds to its content's labels
(the end marker: 1 for ``<|im_end|>``, ``<end_of_turn>``, ``<end_of_utterance>``...), probed by
the same call on a one-turn conversation. ``formula_holds``: whether the formula (each
assistant text tokenized alone + those marks) equals the family's labels on probe answers with
spaces and newlines at their ends (token for token where the answer starts with a letter), so
that a family keeps the formula's cheap count (Qwen-VL, InternVL, LLaVA-OneVision...) and one
that trims (Gemma 3 / 4) or merges (Idefics3, SmolVLM) counts through its handler.

>>> from neatpack.pipes.testing.tiny import load_tiny_processor
>>> proc = load_tiny_processor("qwen2_vl")
>>> family_label_marks("qwen_vl", proc), formula_holds("qwen_vl", proc, 1)
(1, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neatpack.pipes.errors import EstimateError, RecordError
from neatpack.pipes.families import Handler, resolve_handler
from neatpack.pipes.materializing.labels import IGNORE_INDEX

__all__ = ["PROBE_ANSWERS", "family_label_marks", "family_supervised", "formula_holds"]

#: Answers ``formula_holds`` checks: plain words, and the ends a template may trim or merge.
PROBE_ANSWERS: tuple[str, ...] = ("the cat sat", "a", "  spaced  ", "\nnew line", "end\n\n")


def family_supervised(handler: str | Handler, processor: Any, record: Mapping[str, Any]) -> int:
    """``record``'s labelled tokens after the shift, from ``handler``'s own tokenize of its text
    (module docstring). A record the handler refuses is an ``EstimateError`` naming it."""
    return len(_labelled_ids(resolve_handler(handler), processor, record))


def _labelled_ids(h: Handler, processor: Any, record: Mapping[str, Any]) -> list[int]:
    from neatpack.pipes.indexing.handler_lengths import stand_in_tokens, text_record

    sid = record.get("sample_id", -1)
    text, filled = text_record(record)
    emptied = filled.count("assistant")
    try:
        sample = h(text, processor)
    except RecordError:
        raise
    except (ValueError, TypeError, KeyError) as exc:  # SampleError is a ValueError
        raise EstimateError(
            f"sample_id={sid}: counting its supervised tokens with handler {h.name!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    ids, labels = sample["input_ids"][1:], sample["labels"][1:]
    out = [int(i) for i in ids[labels != IGNORE_INDEX]]
    if emptied:  # the stand-ins' tokens were labelled; the media they replace never are
        drop = emptied * stand_in_tokens(processor)
        out = out[: max(len(out) - drop, 0)]
    return out


def _probe(answers: tuple[str, ...]) -> dict[str, Any]:
    conv: list[dict[str, Any]] = []
    for a in answers:
        conv.append({"role": "user", "content": [{"type": "text", "text": "a question"}]})
        conv.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
    return {"sample_id": -1, "conversation": conv}


def _refused(h: Handler, exc: Exception) -> ValueError:
    return ValueError(
        f"balance='supervised' cannot count the supervised tokens of handler {h.name!r}: its "
        f"tokenize failed on a text-only probe conversation ({type(exc).__name__}: {exc}). "
        "Fix: use balance='tokens' (or another policy), or pass lengths= a LengthIndex built "
        "with supervised=... (LengthIndex(supervised=<label tokens per sample>))"
    )


def family_label_marks(handler: str | Handler, processor: Any) -> int:
    """Labelled template tokens per assistant turn of ``handler``'s family (module docstring);
    a ``ValueError`` naming the handler and the fix when its tokenize fails on the probe."""
    from neatpack.pipes.indexing._template_probe import encode_ids, tokenizer_of

    h = resolve_handler(handler)
    try:
        labelled = family_supervised(h, processor, _probe(("a",)))
    except EstimateError as exc:
        raise _refused(h, exc) from exc
    return max(labelled - len(encode_ids(tokenizer_of(processor), ["a"])[0]), 0)


def formula_holds(handler: str | Handler, processor: Any, marks: int) -> bool:
    """Whether ``supervised.py``'s formula (each answer tokenized alone + ``marks`` a turn)
    gives ``handler``'s labels on every answer of ``PROBE_ANSWERS``, one probe each. An answer
    that starts with a letter must be labelled as its own tokens followed by ``marks`` more
    (equal counts can hide a merge: Idefics3 labels ``Ġthe`` where ``the`` alone is also one
    token); one that starts with whitespace only in number (Qwen labels the header's ``\n``
    merged with the answer's, ``ĊĊ new``, against ``Ċ new`` alone)."""
    from neatpack.pipes.indexing._template_probe import encode_ids, tokenizer_of

    h = resolve_handler(handler)
    alone = encode_ids(tokenizer_of(processor), list(PROBE_ANSWERS))
    try:
        for a, ids in zip(PROBE_ANSWERS, alone, strict=True):
            got = _labelled_ids(h, processor, _probe((a,)))
            same = a[:1].isspace() or got[: len(ids)] == list(ids)
            if len(got) != len(ids) + marks or not same:
                return False
    except EstimateError as exc:
        raise _refused(h, exc) from exc
    return True
