"""Labels on assistant content only, found from the chat template's role markers.

Convention (Qwen's): an assistant turn renders as ``<|im_start|>assistant\\n`` + content +
``<|im_end|>`` + ``\\n``. Labelled: the content **and the closing ``<|im_end|>``** (the model must
learn to stop). Not labelled: the ``<|im_start|>assistant\\n`` header, the ``\\n`` after the end
marker, and every system / user token. Labels are NOT shifted (``labels[i] = input_ids[i]``);
the pack builder shifts. Worked example with the tiny processor (ids shortened)::

    <|im_start|> user \\n hi <|im_end|> \\n <|im_start|> assistant \\n yo <|im_end|> \\n
    -100         -100 ...            -100 -100        -100      -100 yo <|im_end|> -100

Two ways to find the markers:

* fast path, any template that renders an assistant turn as ``<|im_start|>assistant\\n`` content
  ``<|im_end|>`` (checked by rendering a sentinel turn, not by the processor's class name):
  ``start = [<|im_start|>] + encode("assistant\\n")``, ``end = [<|im_end|>]``;
* general path, ``derive_role_markers``: render a conversation with unique sentinel contents and
  read the tokens between the user turn and the first assistant sentinel (start marker) and the
  first token after it (end marker). Works for any template with fixed turn wrappers.

BPE context: content that begins with whitespace may merge with the last marker token (Qwen's
``"\\n"`` + ``"\\n..."`` -> one ``"\\n\\n"`` token). The seed's exact match then misses the whole
turn silently; here a token whose text *starts with* the last marker token's text also closes the
marker, and that token (it carries content) is labelled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from neatpack.pipes.materializing.loss import CROSS_ENTROPY_IGNORE_IDX
from neatpack.pipes.reading.media import SampleError

__all__ = [
    "IGNORE_INDEX",
    "RoleMarkers",
    "assistant_spans",
    "build_labels",
    "build_labels_from_template",
    "conversation_labels",
    "derive_role_markers",
    "qwen_role_markers",
    "resolve_role_markers",
]

IGNORE_INDEX = (
    CROSS_ENTROPY_IGNORE_IDX  # one value for the whole package (pipes/materializing/loss.py)
)
_SENTINELS = ("QZXUSERONEQZX", "QZXASSISTONEQZX", "QZXUSERTWOQZX", "QZXASSISTTWOQZX")
_CACHE: dict[tuple[int, str], tuple[Any, RoleMarkers]] = {}


@dataclass(frozen=True)
class RoleMarkers:
    """Token ids that open (not labelled) and close (labelled) an assistant turn.

    ``start_tail_alternatives``: ids whose token text starts with the text of ``start[-1]`` and is
    longer (BPE merges of the marker's last token with the first content characters).
    """

    start: tuple[int, ...]
    end: tuple[int, ...]
    start_tail_alternatives: frozenset[int] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError(
                f"RoleMarkers needs non-empty start and end, got {self.start=}, {self.end=}"
            )


def _tokenizer(processor_or_tokenizer: Any) -> Any:
    return getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)


def tail_alternatives(tokenizer: Any, last_id: int) -> frozenset[int]:
    """Ids whose raw token string extends the raw string of ``last_id`` (e.g. 'ĊĊ' for 'Ċ')."""
    last = tokenizer.convert_ids_to_tokens(last_id)
    if not isinstance(last, str) or not last:
        return frozenset()
    vocab: Mapping[str, int] = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_ids", ()))
    return frozenset(
        i
        for t, i in vocab.items()
        if len(t) > len(last) and t.startswith(last) and i not in special
    )


def template_text(processor_or_tokenizer: Any) -> str:
    for obj in (processor_or_tokenizer, _tokenizer(processor_or_tokenizer)):
        template = getattr(obj, "chat_template", None)
        if isinstance(template, str):
            return template
        if isinstance(template, Mapping) and isinstance(template.get("default"), str):
            return str(template["default"])
    return ""


def qwen_role_markers(processor_or_tokenizer: Any) -> RoleMarkers | None:
    """Fast path for ``<|im_start|>`` templates, or ``None`` when the template is not one."""
    tok = _tokenizer(processor_or_tokenizer)
    if "<|im_start|>" not in template_text(processor_or_tokenizer):
        return None
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    unk = getattr(tok, "unk_token_id", None)
    if any(i is None or i == unk for i in ids):
        return None
    role = list(tok.encode("assistant\n", add_special_tokens=False))
    if not role or not _renders_qwen_turns(processor_or_tokenizer):
        return None
    start = (int(ids[0]), *map(int, role))
    return RoleMarkers(start, (int(ids[1]),), tail_alternatives(tok, start[-1]))


def _renders_qwen_turns(processor_or_tokenizer: Any) -> bool:
    """Whether the template really opens assistant turns with ``<|im_start|>assistant\\n`` and
    closes them with ``<|im_end|>`` (a template can use ``<|im_start|>`` with other role text,
    e.g. ``<|im_start|>Assistant:``; the general path handles those)."""
    u1, a1 = _SENTINELS[:2]
    try:
        text = _render(processor_or_tokenizer, [("user", u1), ("assistant", a1)])
    except ValueError:
        return False
    return f"<|im_start|>assistant\n{a1}<|im_end|>" in text


def _render(processor_or_tokenizer: Any, turns: Sequence[tuple[str, str]]) -> str:
    """Render with content lists and with plain strings; keep the shortest rendering that holds
    every sentinel (a text-only template prints a content list's repr around the sentinel)."""
    rendered: list[str] = []
    last_error: Exception | None = None
    for as_list in (True, False):
        conv = [
            {"role": r, "content": [{"type": "text", "text": t}] if as_list else t}
            for r, t in turns
        ]
        try:
            text = processor_or_tokenizer.apply_chat_template(conv, tokenize=False)
        except Exception as exc:  # a template may accept only one of the two content forms
            last_error = exc
            continue
        text = str(text[0] if isinstance(text, list) else text)
        if all(t in text for _, t in turns):
            rendered.append(text)
    if not rendered:
        raise ValueError(
            "derive_role_markers: the chat template did not render the sentinel contents "
            f"{[t for _, t in turns]} (last error: {last_error!r}); pass markers=RoleMarkers(...) "
            "explicitly for this template"
        )
    return min(rendered, key=len)


def derive_role_markers(processor_or_tokenizer: Any) -> RoleMarkers:
    """Derive the assistant start/end markers of ANY chat template by rendering sentinels.

    Renders ``[user U1]`` and ``[user U1, assistant A1, user U2, assistant A2]``; the start marker
    is the tokens between the end of their common prefix and ``A1``, the end marker the first
    token after ``A1``. The start marker must open both assistant turns, and no token may straddle
    a sentinel boundary, else ``ValueError`` (pass explicit ``RoleMarkers`` then).

    >>> from neatpack.pipes.testing.tiny import load_tiny_processor
    >>> proc = load_tiny_processor()
    >>> derive_role_markers(proc) == qwen_role_markers(proc)
    True
    """
    tok = _tokenizer(processor_or_tokenizer)
    u1, a1, u2, a2 = _SENTINELS
    text_u = _render(processor_or_tokenizer, [("user", u1)])
    full = _render(
        processor_or_tokenizer, [("user", u1), ("assistant", a1), ("user", u2), ("assistant", a2)]
    )
    s1 = full.index(a1)
    prefix = 0
    while prefix < min(len(text_u), s1) and text_u[prefix] == full[prefix]:
        prefix += 1
    prefix = max(prefix, full.index(u1) + len(u1))
    try:
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError) as exc:
        raise ValueError(
            "derive_role_markers needs a fast tokenizer (offset mapping); pass markers explicitly"
        ) from exc
    ids = [int(i) for i in enc["input_ids"]]
    offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    starts = {a: k for k, (a, b) in enumerate(offsets) if b > a}
    e1 = s1 + len(a1)
    if prefix not in starts or s1 not in starts or e1 not in starts:
        raise ValueError(
            f"derive_role_markers: a token straddles the assistant marker boundaries in {full!r}; "
            "pass markers=RoleMarkers(start=..., end=...) explicitly"
        )
    start = tuple(ids[starts[prefix] : starts[s1]])
    end = (ids[starts[e1]],)
    if not start:
        raise ValueError(f"derive_role_markers: empty assistant start marker in {full!r}")
    markers = RoleMarkers(start, end, tail_alternatives(tok, start[-1]))
    found = assistant_spans(ids, markers)
    if len(found) != 2:
        raise ValueError(
            f"derive_role_markers: marker {start} opens {len(found)} of the 2 assistant turns in "
            f"{full!r}; the template renders assistant turns inconsistently: pass markers="
        )
    return markers


def resolve_role_markers(processor_or_tokenizer: Any) -> RoleMarkers:
    """The fast path if it applies, else ``derive_role_markers``; cached per tokenizer+template."""
    key = (id(_tokenizer(processor_or_tokenizer)), template_text(processor_or_tokenizer))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is _tokenizer(processor_or_tokenizer):
        return hit[1]
    markers = qwen_role_markers(processor_or_tokenizer) or derive_role_markers(
        processor_or_tokenizer
    )
    if len(_CACHE) >= 64:  # bounded: the cache keeps its tokenizers alive
        _CACHE.clear()
    _CACHE[key] = (_tokenizer(processor_or_tokenizer), markers)
    return markers


def _match_start(ids: Sequence[int], i: int, markers: RoleMarkers) -> tuple[int, int] | None:
    """If a start marker begins at ``i``: ``(content_start, labelled_from)``, else ``None``."""
    start = markers.start
    n = len(start)
    if i + n > len(ids) or list(ids[i : i + n - 1]) != list(start[:-1]):
        return None
    last = ids[i + n - 1]
    if last == start[-1]:
        return i + n, i + n
    if last in markers.start_tail_alternatives:
        return i + n - 1, i + n - 1  # the merged token carries content: label it
    return None


def assistant_spans(ids: Sequence[int], markers: RoleMarkers) -> list[tuple[int, int]]:
    """``[begin, end)`` of each assistant turn's labelled tokens: content + end marker.

    A turn with no end marker (truncated) runs to the end of ``ids``; callers label unpadded rows.

    >>> assistant_spans([7, 1, 2, 5, 6, 9, 7, 1, 2, 8, 9], RoleMarkers((1, 2), (9,)))
    [(3, 6), (9, 11)]
    """
    ids = list(ids)
    n_ids = len(ids)
    end, m = list(markers.end), len(markers.end)
    first = markers.start[0]
    spans: list[tuple[int, int]] = []
    pos = 0
    for i in [k for k, t in enumerate(ids) if t == first]:  # O(L): markers are rare
        if i < pos:
            continue
        hit = _match_start(ids, i, markers)
        if hit is None:
            continue
        begin = hit[1]
        j = _find(ids, end, begin)
        stop = n_ids if j < 0 else j + m
        if stop > begin:  # a bare header at the row end (generation prompt) labels nothing
            spans.append((begin, stop))
        pos = max(stop, begin + 1)
    return spans


def conversation_labels(
    ids: torch.Tensor,
    conversation: Sequence[Mapping[str, Any]],
    markers: RoleMarkers,
    *,
    sample_id: int,
    mm_token_type_ids: torch.Tensor,
    label_policy: str = "assistant",
) -> torch.Tensor:
    """Labels for one tokenized conversation: ids inside assistant spans, -100 elsewhere.

    Every assistant turn of ``conversation`` must be found in ``ids`` (else a ``SampleError``
    naming the sample: the markers do not fit the template). ``label_policy="last_assistant"``
    labels only the final turn. Media tokens are never labelled.
    """
    spans = assistant_spans(ids.tolist(), markers)
    n_assistant = sum(m["role"] == "assistant" for m in conversation)
    if len(spans) != n_assistant:
        raise SampleError(
            sample_id,
            "label_mismatch",
            f"found {len(spans)} assistant turn(s) in the tokens but the "
            f"conversation has {n_assistant}; pass markers= for this template",
        )
    labels = torch.full_like(ids, IGNORE_INDEX)
    for a, b in spans[-1:] if label_policy == "last_assistant" else spans:
        labels[a:b] = ids[a:b]
    labels[mm_token_type_ids != 0] = IGNORE_INDEX
    return labels


def _find(ids: list[int], pattern: list[int], start: int) -> int:
    """First index >= start where ``pattern`` occurs in ``ids``, or -1."""
    k = start
    while True:
        try:
            k = ids.index(pattern[0], k)
        except ValueError:
            return -1
        if ids[k : k + len(pattern)] == pattern:
            return k
        k += 1


def _real_length(row: Sequence[int], pad_id: int | None, markers: RoleMarkers) -> int:
    """Tokens before the trailing run of ``pad_id`` (right padding). A pad id that is also the
    end marker cannot be told apart from a real end of turn, so nothing is cut then (a span
    closes at the first such token anyway)."""
    n = len(row)
    if pad_id is None or pad_id in markers.end:
        return n
    while n and row[n - 1] == pad_id:
        n -= 1
    return n


def _pad_token_id(processor_or_tokenizer: Any) -> int | None:
    pad = getattr(_tokenizer(processor_or_tokenizer), "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else None


def build_labels(
    input_ids: Tensor,
    processor_or_tokenizer: Any,
    *,
    markers: RoleMarkers | None = None,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """Labels for ``input_ids`` ([L] or [B, L]): ids on assistant spans, ``-100`` elsewhere.

    Padding is never labelled, also after a turn cut before its end marker (truncated): with
    ``attention_mask`` (same shape, 0 = padding) the masked positions are ``-100``; without it
    a row's trailing run of the tokenizer's ``pad_token_id`` is taken as padding.
    """
    if input_ids.dim() not in (1, 2):
        raise ValueError(f"input_ids must be [L] or [B, L], got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
            f"{tuple(input_ids.shape)}; pass the mask the tokenizer returned with these ids"
        )
    markers = markers or resolve_role_markers(processor_or_tokenizer)
    pad_id = None if attention_mask is not None else _pad_token_id(processor_or_tokenizer)
    rows = input_ids.reshape(-1, input_ids.shape[-1])
    labels = torch.full_like(rows, IGNORE_INDEX, dtype=torch.long)
    for r, row in enumerate(rows.tolist()):
        real = row[: _real_length(row, pad_id, markers)]
        for a, b in assistant_spans(real, markers):
            labels[r, a:b] = rows[r, a:b]
    if attention_mask is not None:
        labels[attention_mask.reshape(rows.shape) == 0] = IGNORE_INDEX
    return labels.reshape(input_ids.shape)


def build_labels_from_template(
    input_ids_batch: Tensor,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    processor: Any,
    *,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """The seed's signature: labels for a ``[B, L]`` batch from the template's role markers.

    Unlike the seed, there is no silent fallback to BPE re-matching of assistant texts: the number
    of assistant turns found in row ``b`` must equal the assistant messages of
    ``conversations[b]`` (a truncated final turn still counts), else ``ValueError`` naming the row.

    Labels stop at a row's real tokens (the seed labelled the padding after an answer truncated
    before its stop token, peer bug B11): pass ``attention_mask`` (the tokenizer's, 0 on
    padding) to say exactly which tokens are real; without it (the seed's call) a row's trailing
    run of the tokenizer's ``pad_token_id`` is padding. Rows ``[.. <|im_start|> assistant \\n
    7 8 <pad> <pad>]`` get labels ``[.. -100 -100 -100 7 8 -100 -100]``.
    """
    if input_ids_batch.dim() != 2 or input_ids_batch.shape[0] != len(conversations):
        raise ValueError(
            f"input_ids_batch shape {tuple(input_ids_batch.shape)} does not match "
            f"{len(conversations)} conversations; expected [B, L] with B == len(conversations)"
        )
    markers = resolve_role_markers(processor)
    for b, (row, conv) in enumerate(zip(input_ids_batch.tolist(), conversations, strict=True)):
        want = sum(1 for m in conv if m.get("role") == "assistant")
        got = len(assistant_spans(row, markers))
        if got != want:
            raise ValueError(
                f"row {b}: found {got} assistant turn(s) in input_ids but the conversation has "
                f"{want}; the ids were not rendered with this processor's template"
            )
    return build_labels(input_ids_batch, processor, markers=markers, attention_mask=attention_mask)
