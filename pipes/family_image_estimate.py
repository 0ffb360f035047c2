"""The length estimate of an image-only family whose blocks come from ``images_meta``.

Idefics3, SmolVLM, Step3 and LLaVA-OneVision estimate a record the same way and differ only in
how long one image's block is: the text is ``LengthEstimator``'s (``mode="exact"`` tokenizes
the templated text, any other mode adds the template overhead probed from the processor), the
one placeholder token per image excluded, plus each image's whole block from
``record["images_meta"]`` (``[height, width]`` per image) through the family's rule::

    smolvlm_estimate(r, p) == images_meta_estimate(r, p, smolvlm_image_block_tokens)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .estimate import LengthEstimator

__all__ = ["BlockTokens", "images_meta_estimate"]

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
        from ._template_probe import probe_overhead

        kw["overhead"] = probe_overhead(processor)
    est = LengthEstimator(
        mode=mode, processor=processor, media_fallback=0, on_missing_media="fallback", **kw
    )
    sizes = [(int(m[0]), int(m[1])) for m in record.get("images_meta") or []]
    blocks = sum(int(b) for b in block_tokens(processor, sizes)) if sizes else 0
    return int(est.estimate(record)[0]) + blocks
