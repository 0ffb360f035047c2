"""Length estimates of the registered families, in the form the length index takes
(``lengths.build_length_index``): the planner packs by these numbers, so they should be close to
the real row length after the shift and rarely above it.

``handler_estimator(processor, handler, mode, source=...)`` asks the handler
(``families.Handler``): for "estimate" / "exact" its ``estimator(processor, mode)`` when it has
one (Qwen-VL's ``LengthEstimator``, Gemma 3's ``Gemma3LengthEstimator``), else a
``HandlerEstimator`` over its ``estimate(record, processor, mode=mode)`` (every other family;
the function lives in the family's module, e.g. ``families/step3.py``). For "calibrated" its
``calibrate(source, processor)`` (Qwen-VL), else ``HandlerEstimator.calibrated``: the text part
of the "estimate" mode fitted by least squares to the "exact" mode on records of the source
(the media tokens are counted exactly in both modes). A mode the handler does not offer
(``Handler.estimate_modes``) is refused naming the handler, the modes it offers and the fix.

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
from jinja2 import TemplateError

from neatpack.pipes.families import EstimateFn, Handler, resolve_handler
from neatpack.pipes.indexing._media_meta import EstimateError, image_hw, record_media
from neatpack.pipes.indexing.estimate import FallbackCounter, LengthEstimator, SampleEstimate

__all__ = [
    "CALIBRATION_RECORDS",
    "HANDLER_ESTIMATE_MODES",
    "STAND_IN",
    "HandlerEstimator",
    "check_estimate_mode",
    "handler_estimator",
    "stand_in_tokens",
    "text_record",
]

#: The estimate modes a ``HandlerEstimator`` takes ("calibrated": ``HandlerEstimator.calibrated``).
HANDLER_ESTIMATE_MODES: tuple[str, ...] = ("estimate", "calibrated", "exact")
#: Records ``HandlerEstimator.calibrated`` fits on (as ``LengthEstimator.calibrate``).
CALIBRATION_RECORDS = 200
#: The text of a turn that held only media in ``text_record`` (its tokens come off the count).
STAND_IN = "x"


@dataclass
class HandlerEstimator:
    """A ``LengthEstimator``-shaped estimator (``estimate``, ``estimate_sample``,
    ``estimate_raw_batch``, ``config_key``, ``fallbacks``) over a family's ``Handler.estimate``.

    ``handler``: a registered name (what the graph passes: the estimator travels to the loader
    workers by name, as the materializer's handler does) or a ``Handler``. ``mode="calibrated"``
    runs the "estimate" mode and maps its text tokens ``t`` to ``text_scale * t +
    text_offset`` (rounded; ``calibrated`` fits the two on records of a source)."""

    handler: str | Handler
    processor: Any
    mode: str = "exact"
    fallbacks: FallbackCounter = field(default_factory=FallbackCounter, repr=False)
    text_scale: float = 1.0
    text_offset: float = 0.0
    # Supervised (label) tokens as well (``supervised.py``, ``balance="supervised"``): the
    # formula with ``label_marks`` template tokens a turn, or in ``exact`` mode this handler's
    # own tokenize when ``label_handler`` names it (``family_labels.py``).
    supervised: bool = False
    label_marks: int = 1
    label_handler: str | None = None

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
        fit = ""
        if self.mode == "calibrated":  # the fit changes every length: the index cache must see it
            fit = f", text_scale={self.text_scale!r}, text_offset={self.text_offset!r}"
        if self.supervised:  # only then: indexes cached before the option keep their key
            fit += f", supervised=True, label_marks={self.label_marks}"
            fit += f", label_handler={self.label_handler!r}" if self.label_handler else ""
        return f"HandlerEstimator({name!r}, {self.mode!r}, {tokenizer_id(self.processor)}{fit})"

    @property
    def chars_per_token(self) -> float:
        """Characters a text token in the non-exact modes: the family estimates' own
        ``LengthEstimator`` ratio, over ``text_scale`` when calibrated."""
        return LengthEstimator.chars_per_token / self.text_scale

    @classmethod
    def calibrated(
        cls,
        handler: str | Handler,
        processor: Any,
        source: Any,
        n: int = CALIBRATION_RECORDS,
        seed: int = 0,
    ) -> HandlerEstimator:
        """The "calibrated" estimator: on ``n`` records of ``source`` sampled with ``seed``, the
        least-squares line from the text tokens of the "estimate" mode to those of the "exact"
        mode (each record without its media). Records that cannot be estimated are left out."""
        rough = cls(handler, processor, "estimate")
        exact = cls(handler, processor, "exact")
        rng = np.random.default_rng(seed)
        ids = np.sort(rng.choice(len(source), size=min(n, len(source)), replace=False))
        xs, ys = [], []
        for sid in ids:
            record = source[int(sid)]
            if not record.get("conversation"):
                continue
            text = text_record(record)[0]  # a stand-in in both counts: the fit is unchanged
            try:
                x, y = rough._count(text, int(sid)), exact._count(text, int(sid))
            except EstimateError:
                continue
            xs.append((float(x), 1.0))
            ys.append(float(y))
        name = resolve_handler(handler).name
        if len(xs) < 2:
            raise ValueError(
                f"estimate_mode='calibrated' for handler {name!r} needs at least 2 records that "
                f"can be estimated; the source has {len(source)} ({len(xs)} usable)"
            )
        (a, b), *_ = np.linalg.lstsq(np.asarray(xs, float), np.asarray(ys, float), rcond=None)
        if not a > 0:
            raise ValueError(
                f"calibrating handler {name!r} gave text_scale={a}; use records with more text "
                "variety, or estimate_mode='exact'"
            )
        return cls(handler, processor, "calibrated", text_scale=float(a), text_offset=float(b))

    def _count(self, record: Mapping[str, Any], sid: int) -> int:
        fn: EstimateFn | None = resolve_handler(self.handler).estimate
        if fn is None:
            raise EstimateError(
                f"sample_id={sid}: handler {self.handler!r} was registered again without an "
                "estimate; give it Handler(..., estimate=...)"
            )
        mode = "estimate" if self.mode == "calibrated" else self.mode
        try:
            return int(fn(record, self.processor, mode=mode))
        except (ValueError, TypeError, KeyError, IndexError, TemplateError) as exc:
            # a chat template that cannot render the record (jinja's UndefinedError: e.g.
            # Idefics3's reads content[0] of a turn with no blocks) is this record's error too,
            # so on_bad_sample="skip" counts it like any other
            raise EstimateError(
                f"sample_id={sid}: {type(exc).__name__}: {exc} (the {self.handler!r} chat "
                "template cannot render this record; fix the record, or skip it with "
                "on_bad_sample='skip')"
            ) from exc

    def estimate_raw_batch(
        self, raws: Sequence[Any]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], list[int]]:
        """No raw fast path: every record goes through ``estimate_sample``."""
        n = len(raws)
        return np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64), list(range(n))

    def estimate(self, record: Mapping[str, Any]) -> tuple[int, int]:
        out = self.estimate_sample(record)
        return out.total, out.visual

    def estimate_sample(self, record: Mapping[str, Any]) -> SampleEstimate:
        sid = int(record.get("sample_id", -1))
        if not record.get("conversation"):
            raise EstimateError(f"sample_id={sid}: empty conversation; nothing to estimate")
        record = _with_image_sizes(record, sid)
        total = self._count(record, sid)
        text_rec, filled = text_record(record)
        text = self._count(text_rec, sid)
        if filled and self.mode == "exact":  # the stand-ins' own tokens are no text of it
            text -= len(filled) * stand_in_tokens(self.processor)
        visual = max(total - text, 0)
        if self.mode == "calibrated":
            text = max(round(self.text_scale * text + self.text_offset), 0)
            total = text + visual
        return SampleEstimate(total, visual, ())


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


def text_record(record: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(record without its media, the roles of the turns that held only media)``; each such
    turn gets the text ``STAND_IN`` (a template may read an empty turn's first block:
    Idefics3's ``content[0]`` fails on ``[]``; a family's tokenize refuses an empty turn)."""
    out = _text_only(record)
    filled = []
    for k, msg in enumerate(out["conversation"]):
        content = msg.get("content")
        if isinstance(content, list) and not content:
            out["conversation"][k] = {**msg, "content": [{"type": "text", "text": STAND_IN}]}
            filled.append(str(msg.get("role")))
    return out, filled


def stand_in_tokens(processor: Any) -> int:
    """How many tokens ``STAND_IN`` (a media-only turn's text in ``text_record``) takes: what
    a count over ``text_record`` subtracts for each turn it filled."""
    from neatpack.pipes.indexing._template_probe import encode_ids, tokenizer_of

    return len(encode_ids(tokenizer_of(processor), [STAND_IN])[0])


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


def handler_estimator(
    processor: Any,
    handler: str | Handler,
    mode: str,
    *,
    source: Any = None,
    **options: Any,
) -> Any:
    """The length estimator of ``handler``'s family in ``mode`` (module docstring): a
    ``LengthEstimator``-shaped object. ``source``: the records "calibrated" fits on;
    ``options`` (``missing_media_fix``) go to the handler's own ``estimator`` / ``calibrate``."""
    h = resolve_handler(handler)
    check_estimate_mode(h, mode)
    if mode == "calibrated":
        if source is None:
            raise ValueError(
                f"estimate_mode='calibrated' for handler {h.name!r} fits on records: pass "
                "source= (the graph passes its data)"
            )
        if h.calibrate is not None:
            return h.calibrate(source, processor, **options)
        return HandlerEstimator.calibrated(handler, processor, source)
    if h.estimator is not None:
        return h.estimator(processor, mode, **options)
    return HandlerEstimator(handler, processor, mode)


def check_estimate_mode(handler: str | Handler, mode: str) -> None:
    """ValueError when ``handler`` does not offer ``mode`` (``Handler.estimate_modes``), naming
    the handler, the modes it offers and the fix."""
    h = resolve_handler(handler)
    if mode in h.estimate_modes:
        return
    if not h.estimate_modes:
        raise ValueError(
            f"handler {h.name!r} has no length estimate: register it with "
            "Handler(..., estimate=<fn(record, processor, *, mode) -> int>) "
            "(docs/families.md, 'Adding a family'), or pass lengths= (a LengthIndex) to "
            "the graph"
        )
    why = (
        " (its estimator has no calibrated mode: give the handler calibrate=<fn(source, "
        "processor) -> estimator>, or an estimate= function that HandlerEstimator calibrates)"
        if mode == "calibrated"
        else ""
    )
    raise ValueError(
        f"estimate_mode={mode!r} is not available for handler {h.name!r}{why}; it offers "
        f"{h.estimate_modes}: set estimate_mode to one of them"
    )
