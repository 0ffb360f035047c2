"""Length estimates of the registered families, in the form the length index takes
(``lengths.build_length_index``): the planner packs by these numbers, so they should be close to
the real row length after the shift and rarely above it.

``handler_estimator(processor, handler, mode)`` asks the handler (``families.Handler``): its
``estimator(processor, mode)`` when it has one (Gemma 3's ``Gemma3LengthEstimator``), else a
``HandlerEstimator`` over its ``estimate(record, processor, mode=mode)`` (every other family;
the function lives in the family's module, e.g. ``families/step3.py``). A handler with neither
is refused, naming the fix (give it ``estimate=`` or pass ``lengths=`` to the graph).

The family functions read image sizes from ``images_meta``; a record without it gets the sizes
from its image headers (``_media_meta._image_size``, no decode), so every image is counted. An
image that cannot be read is an ``EstimateError`` naming the sample (the graph's
``on_bad_sample`` then decides). ``visual`` (the planner's media balance) is the estimate minus
the same record's estimate without media, per sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from neatpack.pipes.families import EstimateFn, Handler, resolve_handler
from neatpack.pipes.indexing._media_meta import EstimateError, image_hw, record_media
from neatpack.pipes.indexing.estimate import FallbackCounter, SampleEstimate

__all__ = ["HANDLER_ESTIMATE_MODES", "HandlerEstimator", "handler_estimator"]

#: The estimate modes a family estimator takes ("calibrated" is Qwen-VL's LengthEstimator only).
HANDLER_ESTIMATE_MODES: tuple[str, ...] = ("estimate", "exact")


@dataclass
class HandlerEstimator:
    """A ``LengthEstimator``-shaped estimator (``estimate``, ``estimate_sample``,
    ``estimate_raw_batch``, ``config_key``, ``fallbacks``) over a family's ``Handler.estimate``.

    ``handler``: a registered name (what the graph passes: the estimator travels to the loader
    workers by name, as the materializer's handler does) or a ``Handler``."""

    handler: str | Handler
    processor: Any
    mode: str = "exact"
    fallbacks: FallbackCounter = field(default_factory=FallbackCounter, repr=False)

    def __post_init__(self) -> None:
        h = resolve_handler(self.handler)
        if h.estimate is None:
            raise ValueError(
                f"handler {h.name!r} has no length estimate: register it with "
                "Handler(..., estimate=<fn(record, processor, *, mode) -> int>) "
                "(docs/families.md, 'Adding a family'), or pass lengths= (a LengthIndex) to "
                "the graph"
            )
        if self.mode not in HANDLER_ESTIMATE_MODES:
            raise ValueError(f"{self.mode=} is not one of {HANDLER_ESTIMATE_MODES}")

    def config_key(self) -> str:
        from neatpack.pipes.indexing._template_probe import tokenizer_id

        name = resolve_handler(self.handler).name
        return f"HandlerEstimator({name!r}, {self.mode!r}, {tokenizer_id(self.processor)})"

    def estimate_raw_batch(
        self, raws: Sequence[Any]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], list[int]]:
        """No raw fast path: every record goes through ``estimate_sample``."""
        n = len(raws)
        return np.zeros(n, np.int64), np.zeros(n, np.int64), list(range(n))

    def estimate(self, record: Mapping[str, Any]) -> tuple[int, int]:
        out = self.estimate_sample(record)
        return out.total, out.visual

    def estimate_sample(self, record: Mapping[str, Any]) -> SampleEstimate:
        sid = int(record.get("sample_id", -1))
        if not record.get("conversation"):
            raise EstimateError(f"sample_id={sid}: empty conversation; nothing to estimate")
        record = _with_image_sizes(record, sid)
        fn: EstimateFn | None = resolve_handler(self.handler).estimate
        if fn is None:
            raise EstimateError(
                f"sample_id={sid}: handler {self.handler!r} was registered again without an "
                "estimate; give it Handler(..., estimate=...)"
            )
        try:
            total = int(fn(record, self.processor, mode=self.mode))
            text = int(fn(_text_only(record), self.processor, mode=self.mode))
        except (ValueError, TypeError, KeyError) as exc:
            raise EstimateError(f"sample_id={sid}: {type(exc).__name__}: {exc}") from exc
        return SampleEstimate(total, max(total - text, 0), ())


def _with_image_sizes(record: Mapping[str, Any], sid: int) -> Mapping[str, Any]:
    """``record`` with ``images_meta`` filled from the image headers where it is missing."""
    images, _ = record_media(record)
    meta = record.get("images_meta")
    if not images or (isinstance(meta, list) and len(meta) == len(images) and all(meta)):
        return record
    known = meta if isinstance(meta, list) and len(meta) == len(images) else [None] * len(images)
    sizes = []
    for value, m in zip(images, known, strict=True):
        size = m if m else image_hw(value, sid)
        if isinstance(size, str):
            raise EstimateError(
                f"sample_id={sid}: image {value!r:.120}: {size.replace('_', ' ')}; fix the path "
                "or give images_meta [height, width]"
            )
        sizes.append([int(size[0]), int(size[1])])
    return {**record, "images_meta": sizes}


def _text_only(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record with its media blocks (and their metadata) removed."""
    media = ("image", "video", "audio")
    conv = []
    for m in record["conversation"]:
        content = m.get("content")
        if isinstance(content, list):
            content = [
                b for b in content if not (isinstance(b, Mapping) and b.get("type") in media)
            ]
        conv.append({**m, "content": content})
    skip = ("images_meta", "videos_meta", "audios_meta")
    return {**{k: v for k, v in record.items() if k not in skip}, "conversation": conv}


def handler_estimator(processor: Any, handler: str | Handler, mode: str) -> Any:
    """The length estimator of ``handler``'s family (module docstring): a ``LengthEstimator`` or
    a ``HandlerEstimator``."""
    if mode not in HANDLER_ESTIMATE_MODES:
        raise ValueError(
            f"estimate_mode={mode!r} is not available for handler "
            f"{getattr(handler, 'name', handler)!r}; valid: "
            f"{HANDLER_ESTIMATE_MODES} ('calibrated' fits Qwen-VL's LengthEstimator only)"
        )
    h = resolve_handler(handler)
    if h.estimator is not None:
        return h.estimator(processor, mode)
    return HandlerEstimator(handler, processor, mode)
