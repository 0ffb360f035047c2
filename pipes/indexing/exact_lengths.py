"""Exact lengths of many Records at once: the length index's ``exact`` mode per block.

``estimate_sample`` in ``exact`` mode renders one conversation with the processor's chat
template, tokenizes it and counts the media tokens, one record at a time. Here a block of
records shares ONE ``apply_chat_template`` call (the processor renders a list of
conversations; its per-call set-up is paid once) and ONE batched tokenizer call (the fast
tokenizer encodes the list in Rust, on every core it is allowed). The media tokens are the
same per-record ``visual_tokens`` (``smart_resize`` on ``images_meta`` or the file header).
The result equals ``estimate_sample`` record by record (``tests/pipes/test_exact_lengths.py``
checks every record of a corpus, with images, videos and several turns).

This is what makes ``exact`` cheap enough to be the graph's default (``NeatVLMConfig``):
planned lengths are the real ones, so packs fill to the brim without the ``truncate`` policy
ever cutting a sample (``benchmarks/bench_utilization.py`` measures both).

>>> from neatpack.pipes.testing.tiny import load_tiny_processor
>>> from neatpack.pipes.indexing.estimate import LengthEstimator
>>> est = LengthEstimator.from_processor(load_tiny_processor("qwen2_vl"), mode="exact")
>>> recs = [{"sample_id": i, "conversation": [{"role": "user", "content": [
...     {"type": "text", "text": t}]}]} for i, t in enumerate(["Hi there.", "A longer one."])]
>>> [s.total for s in exact_samples(est, recs)] == [est.estimate_sample(r).total for r in recs]
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from neatpack.pipes.indexing._media_meta import EstimateError

if TYPE_CHECKING:
    from neatpack.pipes.indexing.estimate import LengthEstimator, SampleEstimate

__all__ = ["exact_samples", "templated_text_tokens_batch"]


def templated_text_tokens_batch(
    processor: Any, conversations: Sequence[list[dict[str, Any]]]
) -> list[int]:
    """``templated_text_tokens`` of each conversation, with one template call and one
    tokenizer call for the whole list (same template, same tokenizer call form: the counts are
    those of the one-at-a-time function)."""
    from neatpack.pipes.indexing._template_probe import encode_ids, placeholder_ids, tokenizer_of

    if not conversations:
        return []
    texts = processor.apply_chat_template(list(conversations), tokenize=False)
    if isinstance(texts, str) or len(texts) != len(conversations):
        raise ValueError(
            f"apply_chat_template returned {type(texts).__name__} for {len(conversations)} "
            "conversations; expected one string per conversation"
        )
    ids = encode_ids(tokenizer_of(processor), list(texts))
    placeholders = placeholder_ids(processor)
    if not placeholders:
        return [len(row) for row in ids]
    return [len(row) - sum(row.count(p) for p in placeholders) for row in ids]


def exact_samples(
    est: LengthEstimator, records: Sequence[Mapping[str, Any]]
) -> list[SampleEstimate]:
    """``est.estimate_sample(r)`` for every record (``est.mode == "exact"``), batched.

    A record that is invalid (empty conversation, bad media metadata) raises the same
    ``EstimateError`` naming its sample as the per-record path; if the batched template or
    tokenizer call fails, the block is redone one record at a time so the error names the
    record that caused it.
    """
    from neatpack.pipes.indexing.estimate_types import SampleEstimate

    if est.mode != "exact":
        raise ValueError(f"exact_samples needs an estimator with mode='exact', got {est.mode=!r}")
    media: list[tuple[int, tuple[str, ...], int]] = []
    for record in records:
        if not record.get("conversation"):
            sid = int(record.get("sample_id", -1))
            raise EstimateError(f"sample_id={sid}: empty conversation; nothing to estimate")
        media.append(est.visual_tokens(record))
    try:
        texts = templated_text_tokens_batch(est.processor, [r["conversation"] for r in records])
    except Exception:  # redone one by one: the record at fault raises its own error
        return [est.estimate_sample(r) for r in records]
    return [
        SampleEstimate(max(text + frame_text + visual - 1, 0), visual, reasons)
        for text, (visual, reasons, frame_text) in zip(texts, media, strict=True)
    ]
