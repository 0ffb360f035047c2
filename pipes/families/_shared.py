"""Helpers the family modules share; no family fact lives here (each family's rules are on its
``Handler`` in its own module).

* ``has_chat_template`` / ``processor_modalities`` / ``check_modalities``: what a processor can
  take, asked by the registry (``families/__init__.py``) before a handler runs.
* ``images_meta_estimate``: the length estimate of an image-only family whose blocks come from
  ``images_meta``.

Idefics3, SmolVLM, Step3 and LLaVA-OneVision estimate a record the same way and differ only in
how long one image's block is: the text is ``LengthEstimator``'s (``mode="exact"`` tokenizes
the templated text, any other mode adds the template overhead probed from the processor), the
one placeholder token per image excluded, plus each image's whole block from
``record["images_meta"]`` (``[height, width]`` per image) through the family's rule::

    smolvlm_estimate(r, p) == images_meta_estimate(r, p, smolvlm_image_block_tokens)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.materializing.labels import template_text
from neatpack.pipes.reading.media import SampleError

__all__ = [
    "MEDIA_KINDS",
    "BlockTokens",
    "check_modalities",
    "has_chat_template",
    "images_meta_estimate",
    "processor_modalities",
]

MEDIA_KINDS: Final = ("image", "video", "audio")


def has_chat_template(processor: Any) -> bool:
    """True when the processor or its tokenizer carries a chat template string."""
    return bool(template_text(processor))


_AUDIO_SUBPROCESSORS: Final = ("feature_extractor", "audio_processor")


def processor_modalities(processor: Any) -> frozenset[str]:
    """Media kinds the processor can take: from its ``image_processor`` / ``video_processor`` /
    ``feature_extractor`` or ``audio_processor`` (audio) sub-processors. Both audio names are
    in use: Qwen-Omni / Gemma 4 say ``feature_extractor``, Phi-4-multimodal ``audio_processor``
    (a ``Phi4MultimodalFeatureExtractor``), so a check on one name alone refuses Phi-4's audio."""
    kinds = {"image"} if getattr(processor, "image_processor", None) is not None else set()
    if getattr(processor, "video_processor", None) is not None:
        kinds.add("video")
    if any(getattr(processor, a, None) is not None for a in _AUDIO_SUBPROCESSORS):
        kinds.add("audio")
    return frozenset(kinds)


def check_modalities(record: Mapping[str, Any], processor: Any, allowed: frozenset[str]) -> None:
    """SampleError naming the sample when a block's media kind is one the family cannot take
    (the handler's ``allowed`` kinds intersected with the processor's sub-processors)."""
    conv = record.get("conversation") if isinstance(record, Mapping) else None
    if not isinstance(conv, list):
        return  # parse_conversation reports it
    can = allowed & processor_modalities(processor)
    for k, msg in enumerate(conv):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            if not isinstance(block, Mapping):
                continue
            kind = block.get("type") or next((m for m in MEDIA_KINDS if m in block), None)
            if kind in MEDIA_KINDS and kind not in can:
                raise SampleError(
                    record.get("sample_id"),
                    "bad_media",
                    f"message {k} block {j} is {kind!r} but {type(processor).__name__} takes "
                    f"only {sorted(can) or 'text'}; drop the {kind} or use a family with {kind}",
                )


#: ``(processor, [(height, width), ...]) -> tokens of each image's whole block``
BlockTokens = Callable[[Any, Sequence[tuple[int, int]]], Sequence[int]]


def images_meta_estimate(
    record: Mapping[str, Any], processor: Any, block_tokens: BlockTokens, *, mode: str = "exact"
) -> int:
    """Length after the shift: the text (``LengthEstimator`` in ``mode``, the image
    placeholder excluded) plus ``sum(block_tokens(processor, sizes))`` over the record's
    ``images_meta`` (``block_tokens`` is not called for a record without images)."""
    kw: dict[str, Any] = {}
    if mode != "exact":
        from neatpack.pipes.indexing._template_probe import probe_overhead

        kw["overhead"] = probe_overhead(processor)
    est = LengthEstimator(
        mode=mode, processor=processor, media_fallback=0, on_missing_media="fallback", **kw
    )
    sizes = [(int(m[0]), int(m[1])) for m in record.get("images_meta") or []]
    blocks = sum(int(b) for b in block_tokens(processor, sizes)) if sizes else 0
    return int(est.estimate(record)[0]) + blocks
