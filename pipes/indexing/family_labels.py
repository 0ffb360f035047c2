"""A sample's supervised (label) tokens counted by its family's own label code, for the families
whose labels the text-only formula of ``supervised.py`` does not reproduce.

The families label differently around the assistant text: Qwen's template writes
``<|im_start|>assistant\\n`` + content + ``<|im_end|>`` (the content's own tokens + 1, what
``supervised.py``'s formula counts); Idefics3 / SmolVLM write ``Assistant: `` + content, and the
space merges into the content's first token (``" the"``: 1 token, where ``"the"`` alone is 1
but ``"a mat"`` then counts ``Ġa Ġmat`` against ``a Ġmat``...); Gemma 3 trims the content
(``"  spaced  "``: 3 tokens fewer in the row than alone); Gemma 4 keeps its thinking prefix out of
the labels; ``prompt_answer`` labels the answer and the eos token. Rather than one rule per
family, ``family_supervised`` runs the family's handler (``Handler.tokenize``: the
materializer's own call) on the record's text, its media blocks removed, and counts
``labels != -100`` after the shift: the materializer's count by construction. Media tokens are
never labelled, so removing them changes the count only where a media block sits inside an
assistant turn and the text on its two sides then tokenizes across the join (a BPE merge: at
most one token per such block).

``family_label_marks``: the template tokens one assistant turn adds to its content's labels
(the end marker: 1 for ``<|im_end|>``, ``<end_of_turn>``, ``<end_of_utterance>``...), probed by
the same call on a one-turn conversation. ``formula_holds``: whether the formula (each assistant
text tokenized alone + those marks) equals the family's labels on probe answers with spaces and
newlines at their ends, so that a ``LengthEstimator`` family keeps its batched count (Qwen-VL)
and one that trims (Gemma 3) counts through its handler.

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
    from neatpack.pipes.indexing.handler_lengths import _text_only

    h = resolve_handler(handler)
    sid = record.get("sample_id", -1)
    try:
        sample = h(_text_only(record), processor)
    except RecordError:
        raise
    except (ValueError, TypeError, KeyError) as exc:  # SampleError is a ValueError
        raise EstimateError(
            f"sample_id={sid}: counting its supervised tokens with handler {h.name!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return int((sample["labels"][1:] != IGNORE_INDEX).sum())


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
    gives ``handler``'s labels on every answer of ``PROBE_ANSWERS``, one probe each."""
    from neatpack.pipes.indexing._template_probe import encode_ids, tokenizer_of

    h = resolve_handler(handler)
    alone = encode_ids(tokenizer_of(processor), list(PROBE_ANSWERS))
    try:
        return all(
            family_supervised(h, processor, _probe((a,))) == len(ids) + marks
            for a, ids in zip(PROBE_ANSWERS, alone, strict=True)
        )
    except EstimateError as exc:
        raise _refused(h, exc) from exc
