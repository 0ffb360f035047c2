"""A sample's supervised (label) tokens without tokenizing: what ``balance="supervised"`` makes
the ranks of a step alike on.

The materializer labels (``pipes/materializing/labels.py``) every assistant turn's content and
the template tokens that close it (Qwen's ``<|im_end|>``: the model must learn to stop), never
the ``<|im_start|>assistant\\n`` header, a system or user token, or a media token inside the
turn. The shift (``labels[t]`` scores token ``t + 1``) drops only the first position, which is
never labelled, so the count after the shift is the same. The estimate counts the same pieces:

    supervised = sum over assistant turns of (text tokens of its content + label_marks)

with the text tokens ``floor(chars / chars_per_token)`` in the ``estimate`` and
``calibrated`` modes (the estimator's own ratio), the tokenizer's count of each turn's text in
``exact`` mode, and ``label_marks`` the end marker's length read from the processor's template
(``label_marks``: 1 for Qwen's). Clipped to the sample's total.

Every family counts (``supervised_estimator``): the marks are probed through the family's
handler (``family_labels.family_label_marks``), and in ``exact`` mode a family whose labels the
formula does not reproduce on probe answers (Gemma 3 / 4 trim the answer, Idefics3 / SmolVLM
merge the space before it) counts through its handler's own tokenize of the record's text
(``family_labels.family_supervised``): the materializer's labels by construction, at the cost
of the processor call (``benchmarks/bench_supervised_families.py``).

>>> from neatpack.pipes.indexing.estimate import LengthEstimator
>>> est = LengthEstimator(supervised=True)
>>> rec = {"conversation": [{"role": "user", "content": [{"type": "text", "text": "x" * 30}]},
...     {"role": "assistant", "content": [{"type": "text", "text": "y" * 31}]}]}
>>> supervised_tokens(est, rec)  # 31 // 3 + 1 end marker
11

Stored as ``LengthIndex.supervised`` (uint16, saturating at 65,535: see ``lengths.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "assistant_texts",
    "label_marks",
    "raw_assistant_chars",
    "supervised_estimator",
    "supervised_raw_batch",
    "supervised_tokens",
    "supervised_tokens_batch",
]

_LLAVA_ASSISTANT = ("gpt", "assistant")


def assistant_texts(conversation: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each assistant turn's text of a Record's conversation (its text blocks joined: the
    template renders them one after the other); media blocks are never labelled."""
    out = []
    for msg in conversation:
        if msg.get("role") != "assistant":
            continue
        content = msg.get("content")
        if isinstance(content, str):
            out.append(content)
            continue
        out.append(
            "".join(
                str(b.get("text", "")) if isinstance(b, Mapping) else str(b)
                for b in content or ()
                if isinstance(b, str) or (isinstance(b, Mapping) and b.get("type") == "text")
            )
        )
    return out


def raw_assistant_chars(raw: Any) -> tuple[int, int] | None:
    """``(characters of assistant text, assistant turns)`` straight from a raw record in the
    ``conversation`` / ``messages`` (content a string or a list of blocks) or LLaVA
    ``conversations`` form; None for anything else (the Record path decides)."""
    if not isinstance(raw, dict):
        return None
    turns = raw.get("conversation", raw.get("messages"))
    llava = turns is None
    if llava:
        turns = raw.get("conversations")
    if type(turns) is not list:
        return None
    chars = n = 0
    for msg in turns:
        if type(msg) is not dict:
            return None
        if llava:
            if msg.get("from") not in _LLAVA_ASSISTANT:
                continue
            value = msg.get("value")
            if type(value) is not str or "<" in value:
                return None  # a placeholder in an answer: the Record path strips it
            chars += len(value.strip("\n"))
            n += 1
            continue
        if msg.get("role") != "assistant":
            continue
        n += 1
        content = msg.get("content")
        if type(content) is str:
            chars += len(content)
        elif type(content) is list:
            for item in content:
                if type(item) is str:
                    chars += len(item)
                elif type(item) is dict and item.get("type") == "text":
                    text = item.get("text")
                    if type(text) is not str:
                        return None
                    chars += len(text)
                elif type(item) is not dict:
                    return None
        elif content is not None:
            return None
    return chars, n


def supervised_tokens(est: Any, record: Mapping[str, Any]) -> int:
    """One Record's supervised tokens under ``est`` (module docstring), before clipping."""
    return supervised_tokens_batch(est, [record])[0]


def supervised_tokens_batch(est: Any, records: Sequence[Mapping[str, Any]]) -> list[int]:
    """``supervised_tokens`` of each Record; ``exact`` mode tokenizes every assistant text of
    the list in one tokenizer call, or, for an estimator with a ``label_handler``, runs that
    family's tokenize on each record's text (``family_labels.family_supervised``)."""
    handler = getattr(est, "label_handler", None)
    if est.mode == "exact" and handler is not None:
        from neatpack.pipes.indexing.family_labels import family_supervised

        return [family_supervised(handler, est.processor, r) for r in records]
    texts = [assistant_texts(r.get("conversation") or ()) for r in records]
    marks = int(est.label_marks)
    if est.mode != "exact":
        cpt = float(est.chars_per_token)
        return [math.floor(sum(map(len, t)) / cpt) + marks * len(t) for t in texts]
    from neatpack.pipes.indexing._template_probe import encode_ids, tokenizer_of

    flat = [s for t in texts for s in t]
    ids = encode_ids(tokenizer_of(est.processor), flat) if flat else []
    out, k = [], 0
    for t in texts:
        out.append(sum(len(ids[k + j]) for j in range(len(t))) + marks * len(t))
        k += len(t)
    return out


def supervised_raw_batch(est: Any, raws: Sequence[Any]) -> tuple[npt.NDArray[np.int64], list[int]]:
    """``(supervised, slow)`` for a block of raw records: ``slow`` the positions this path
    leaves to ``supervised_tokens`` on the Record (every one in ``exact`` mode)."""
    n = len(raws)
    out = np.zeros(n, np.int64)
    if est.mode == "exact":
        return out, list(range(n))
    slow = []
    cpt, marks, floor = float(est.chars_per_token), int(est.label_marks), math.floor
    for k, raw in enumerate(raws):
        got = raw_assistant_chars(raw)
        if got is None:
            slow.append(k)
            continue
        out[k] = floor(got[0] / cpt) + marks * got[1]
    return out, slow


def label_marks(processor: Any) -> int:
    """Template tokens the labels keep per assistant turn: the end marker the materializer
    finds (``labels.resolve_role_markers``), 1 for Qwen's ``<|im_end|>``."""
    from neatpack.pipes.materializing.labels import resolve_role_markers

    return len(resolve_role_markers(processor).end)


def supervised_estimator(estimator: Any, processor: Any, handler: Any = None) -> Any:
    """``estimator`` that also counts supervised tokens (its index then has
    ``LengthIndex.supervised``, under another fingerprint).

    ``handler`` (a name or ``Handler``; default: a ``HandlerEstimator``'s own, else the
    processor's, ``get_handler``): the family whose labels are counted. Its ``label_marks``
    are probed through the handler (``family_labels.family_label_marks``); where the formula
    does not give the handler's labels on the probe answers (``family_labels.formula_holds``:
    Gemma trims, Idefics3 merges), ``exact`` mode counts through the handler's own tokenize
    (``label_handler``). The estimator must be a ``LengthEstimator`` or a ``HandlerEstimator``;
    another, or a family whose tokenize fails on a text-only probe, is a ``ValueError`` naming
    it and the fix."""
    from neatpack.pipes.families import get_handler, resolve_handler
    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.indexing.family_labels import family_label_marks, formula_holds
    from neatpack.pipes.indexing.handler_lengths import HandlerEstimator

    if isinstance(estimator, HandlerEstimator):
        handler = estimator.handler if handler is None else handler
        processor = estimator.processor if processor is None else processor
        if processor is None:
            raise ValueError(
                f"balance='supervised' with handler {resolve_handler(handler).name!r} probes "
                "the processor's labels: give the HandlerEstimator its processor"
            )
    elif not isinstance(estimator, LengthEstimator):
        raise ValueError(
            f"balance='supervised' needs supervised-token counts per sample, and this family's "
            f"length estimator ({type(estimator).__name__}) has none: use balance='tokens' (or "
            "another policy), or pass lengths= a LengthIndex built with supervised=..."
        )
    elif processor is None:  # no template to read: the estimator's own marks, the formula
        return replace(estimator, supervised=True, label_marks=estimator.label_marks)
    h = resolve_handler(handler) if handler is not None else get_handler(processor)
    marks = family_label_marks(h, processor)
    by_handler = None if formula_holds(h, processor, marks) else h.name
    return replace(estimator, supervised=True, label_marks=marks, label_handler=by_handler)
