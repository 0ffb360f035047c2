"""Token-length estimation of one Record without tokenizing (``estimate``), with a fit against
the real tokenizer (``calibrated``), or by tokenizing the templated text once (``exact``).

``estimate(record) -> (total, visual)``: ``total`` is the sample's length after the shift
(``L - 1``) and includes the ``visual`` (image + video) tokens. Text is ``_text_tokens`` when
present, else ``floor(chars / chars_per_token)``; the chat template's own tokens are added
from ``TemplateOverhead`` (the peer left them out, so its packs overflowed), also to a
``_text_tokens`` unless ``text_tokens_include_template=True`` says the count already holds
them. Visual tokens are a precomputed ``_media_tokens`` when present, else each image or video
sized from ``images_meta`` / ``videos_meta`` (or the image file's header); a placeholder block
(``{"type": "image"}``) with neither counts ``media_fallback``, listed in ``fallbacks``.

>>> est = LengthEstimator(image=ImageTokenConfig())
>>> rec = {"sample_id": 0, "images_meta": [[280, 560]], "conversation": [
...     {"role": "user", "content": [{"type": "image", "image": "x.jpg"},
...                                  {"type": "text", "text": "What is this?"}]}]}
>>> est.estimate(rec)  # 13 chars // 3 = 4, + 200 image + 2 vision marks + 5 + 11 template - 1
(221, 200)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

from neatpack.pipes.indexing._media_meta import (
    MAX_TEXT_TOKENS,
    EstimateError,
    aligned_meta,
    frames_fps,
    image_hw,
    positive_meta,
    record_media,
    video_tokens,
)
from neatpack.pipes.indexing.estimate_types import (
    FallbackCounter,
    SampleEstimate,
    TemplateOverhead,
    TextStats,
)
from neatpack.pipes.indexing.media_tokens import ImageTokenConfig, VideoTokenConfig

__all__ = [
    "MODES",
    "ON_MISSING_MEDIA",
    "EstimateError",
    "EstimateMode",
    "FallbackCounter",
    "LengthEstimator",
    "SampleEstimate",
    "TemplateOverhead",
    "TextStats",
    "text_stats",
]

#: How a length is found: estimated from text statistics, estimated and calibrated on a
#: sample of real tokenizations, or exact (one batched tokenizer call per block).
EstimateMode = Literal["estimate", "calibrated", "exact"]
MODES: tuple[str, ...] = get_args(EstimateMode)
# Fallback reasons that on_missing_media="raise" does not refuse: there is no file to fix (an
# in-memory value, or a placeholder block whose size is not in images_meta).
_NOTHING_TO_READ = ("image_not_a_path", "image_no_meta")
ON_MISSING_MEDIA = ("raise", "fallback")


@dataclass(frozen=True, kw_only=True)
class LengthEstimator:
    """Frozen length-estimation config plus a (non-compared) fallback counter.

    Build it with ``LengthEstimator.from_processor(processor)`` (token configs and template
    overhead from the real processor) or ``LengthEstimator.calibrate(source, processor)``.
    Without an image/video config, media items use ``media_fallback`` (counted).
    """

    image: ImageTokenConfig | None = None
    video: VideoTokenConfig | None = None
    mode: str = "estimate"
    chars_per_token: float = 3.0
    overhead: TemplateOverhead = TemplateOverhead()  # noqa: RUF009 (frozen: one shared value is safe)
    media_fallback: int = 500
    on_missing_media: str = "raise"
    processor: Any = field(default=None, repr=False, compare=False)
    tokenizer_id: str = ""
    fallbacks: FallbackCounter = field(default_factory=FallbackCounter, repr=False, compare=False)
    # Out of the repr (config_key adds it when set), so indexes cached before it existed keep
    # their fingerprint.
    text_tokens_include_template: bool = field(default=False, repr=False)
    # What a missing media file's error tells the user to do besides fixing the path: the
    # caller's own option (a graph's on_bad_sample, the CLI's --missing-media), since a graph
    # user cannot pass on_missing_media. Empty: this estimator's on_missing_media. Not a result.
    missing_media_fix: str = field(default="", repr=False, compare=False)
    # Supervised (label) tokens per sample as well (``supervised.py``): only when a plan balances
    # on them (``balance="supervised"``), so an index without them pays nothing. Out of the
    # repr like text_tokens_include_template: config_key adds them when set. ``label_marks``:
    # the template tokens the labels keep per assistant turn (Qwen's closing ``<|im_end|>``).
    supervised: bool = field(default=False, repr=False)
    label_marks: int = field(default=1, repr=False)
    # ``exact`` mode's supervised counts from this handler's own tokenize instead of the
    # formula (``family_labels.py``: Gemma 3 trims its answers); None: the formula (Qwen-VL).
    label_handler: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"{self.mode=!r} is not one of {MODES}")
        if self.on_missing_media not in ON_MISSING_MEDIA:
            raise ValueError(f"{self.on_missing_media=!r} is not one of {ON_MISSING_MEDIA}")
        if not self.chars_per_token > 0:
            raise ValueError(f"{self.chars_per_token=} must be > 0")
        if self.label_marks < 0:
            raise ValueError(f"{self.label_marks=} must be >= 0 (labelled template tokens a turn)")
        if self.mode == "exact" and self.processor is None:
            raise ValueError("mode='exact' needs processor=<a transformers processor>")

    def config_key(self) -> str:
        """What the length-index fingerprint covers: every field that changes a result."""
        extra = ", text_tokens_include_template=True" if self.text_tokens_include_template else ""
        if self.supervised:
            extra += f", supervised=True, label_marks={self.label_marks}"
            if self.label_handler is not None:
                extra += f", label_handler={self.label_handler!r}"
        return repr(self) + extra

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_processor(
        cls, processor: Any, *, mode: str = "estimate", **kw: Any
    ) -> LengthEstimator:
        from neatpack.pipes.indexing._template_probe import probe_overhead, tokenizer_id

        image = ImageTokenConfig.from_processor(processor) if hasattr(
            processor, "image_processor") else None  # fmt: skip
        video = VideoTokenConfig.from_processor(processor) if getattr(
            processor, "video_processor", None) is not None else None  # fmt: skip
        kw.setdefault("overhead", probe_overhead(processor))
        return cls(
            image=image, video=video, mode=mode, processor=processor,
            tokenizer_id=tokenizer_id(processor), **kw,
        )  # fmt: skip

    @classmethod
    def calibrate(
        cls, source: Any, processor: Any, n: int = 200, seed: int = 0, **kw: Any
    ) -> LengthEstimator:
        """Fit ``chars_per_token`` and a constant overhead correction by least squares on the
        real tokenizer's count of the templated text of ``n`` records sampled with ``seed``
        (media placeholders removed from the count: they are replaced by visual tokens)."""
        from neatpack.pipes.indexing._template_probe import templated_text_tokens

        base = cls.from_processor(processor, **kw)
        rng = np.random.default_rng(seed)
        ids = np.sort(rng.choice(len(source), size=min(n, len(source)), replace=False))
        xs, ys = [], []
        for sid in ids:
            rec = source[int(sid)]
            st = text_stats(rec)
            ys.append(
                templated_text_tokens(processor, rec["conversation"]) - base.overhead.tokens(st)
            )
            xs.append((st.chars, 1.0))
        if len(xs) < 2:
            raise ValueError(f"calibrate needs at least 2 records; the source has {len(source)}")
        (a, b), *_ = np.linalg.lstsq(np.asarray(xs, float), np.asarray(ys, float), rcond=None)
        if not a > 0:
            raise ValueError(
                f"calibration gave tokens-per-char {a=}; use records with more text variety"
            )
        overhead = replace(base.overhead, base=base.overhead.base + float(b))
        return replace(base, mode="calibrated", chars_per_token=float(1 / a), overhead=overhead)

    # -- estimation -----------------------------------------------------------------------
    def estimate(self, record: Mapping[str, Any]) -> tuple[int, int]:
        """``(total, visual)`` for one Record; fallbacks are counted in ``self.fallbacks``."""
        out = self.estimate_sample(record)
        if out.fallbacks:
            self.fallbacks.add(int(record.get("sample_id", -1)), out.fallbacks)
        return out.total, out.visual

    def estimate_sample(self, record: Mapping[str, Any]) -> SampleEstimate:
        sid = int(record.get("sample_id", -1))
        conv = record.get("conversation")
        if not conv:
            raise EstimateError(f"sample_id={sid}: empty conversation; nothing to estimate")
        visual, reasons, frame_text = self.visual_tokens(record)
        if self.mode == "exact":
            from neatpack.pipes.indexing._template_probe import templated_text_tokens

            text = templated_text_tokens(self.processor, conv)
        else:
            st = text_stats(record)
            tt = record.get("_text_tokens")
            if tt is None:
                body = math.floor(st.chars / self.chars_per_token)
            elif type(tt) in (int, float) and 0 <= tt < MAX_TEXT_TOKENS and tt == int(tt):
                body = int(tt)  # 7.0 is 7 (e.g. written from a float column)
            else:
                raise EstimateError(
                    f"sample_id={sid}: _text_tokens={tt!r} is not a token count (an integer in "
                    f"[0, 2**40)); fix the field or delete it to estimate from the characters"
                )
            whole = tt is not None and self.text_tokens_include_template
            text = body if whole else body + round(self.overhead.tokens(st))
        return SampleEstimate(max(text + frame_text + visual - 1, 0), visual, reasons)

    def estimate_samples(self, records: Sequence[Mapping[str, Any]]) -> list[SampleEstimate]:
        """``estimate_sample`` of each record; ``exact`` mode renders and tokenizes the whole
        list in one template call and one tokenizer call (``exact_lengths.exact_samples``)."""
        if self.mode == "exact":
            from neatpack.pipes.indexing.exact_lengths import exact_samples

            return exact_samples(self, records)
        return [self.estimate_sample(r) for r in records]

    def estimate_raw_batch(
        self, raws: Sequence[Any]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], list[int]]:
        """Fast path over raw (unconverted) records: ``(total, visual, items, slow)``, where
        ``items`` counts each record's media items and ``slow`` lists the positions it leaves
        undecided (see ``_estimate_raw.estimate_raw_batch``)."""
        from neatpack.pipes.indexing._estimate_raw import estimate_raw_batch

        return estimate_raw_batch(self, raws)

    def visual_tokens(self, record: Mapping[str, Any]) -> tuple[int, tuple[str, ...], int]:
        """``(visual tokens, fallback reasons, text tokens the video frames add)``.

        A precomputed ``_media_tokens`` (the seed's sampler field) is the visual count as
        given: no media is sized and nothing falls back; video metadata, where present, still
        gives Qwen3-VL's per-frame timestamp text."""
        sid = int(record.get("sample_id", -1))
        images, videos = record_media(record)
        images_meta = aligned_meta(record, "images_meta", len(images), sid)
        videos_meta = aligned_meta(record, "videos_meta", len(videos), sid)
        given = _media_tokens(record, sid)
        if given is not None:
            images = images_meta = []  # nothing to size
        total, reasons, frame_patches, frame_text = 0, [], 0, 0
        for value, meta in zip(images, images_meta, strict=True):
            if self.image is None:
                reasons.append("image_no_config")
                total += self.media_fallback
                continue
            if meta is not None:
                h, w = positive_meta(sid, "images", meta, 2)
                if not (0 < h < 1e9 and 0 < w < 1e9) or h != int(h) or w != int(w):
                    raise EstimateError(
                        f"sample_id={sid}: images_meta {meta!r} must be positive integers "
                        "[height, width]; fix the metadata or drop it to read the file header"
                    )
                size: tuple[int, int] | str = (int(h), int(w))
            else:
                size = image_hw(value, sid)
            if isinstance(size, str):
                if self.on_missing_media == "raise" and size not in _NOTHING_TO_READ:
                    fix = self.missing_media_fix or (
                        "or build the LengthEstimator with on_missing_media='fallback' to count "
                        f"it as {self.media_fallback} tokens"
                    )
                    raise EstimateError(
                        f"sample_id={sid}: {size.replace('_', ' ')}: {value!r}; fix the path {fix}"
                    )
                reasons.append(size)
                total += self.media_fallback
                continue
            try:
                total += self.image.tokens(*size)
            except ValueError as e:
                raise EstimateError(f"sample_id={sid}: image {value!r} size {size}: {e}") from e
        for value, meta in zip(videos, videos_meta, strict=True):
            if given is not None and (self.video is None or meta is None):
                continue  # the count is given; no timestamps without metadata
            if self.video is None or meta is None:
                reasons.append("video_no_config" if self.video is None else "video_no_meta")
                total += self.media_fallback
                continue
            tokens, grid_t = video_tokens(self.video, sid, value, meta)
            total += tokens
            frame_patches += grid_t
            if self.video.timestamps and self.mode == "exact":
                frame_text += self._exact_timestamp_tokens(self.video, meta)
        timestamps = self.video is not None and self.video.timestamps
        if frame_patches and timestamps and self.mode != "exact":
            frame_text = round(frame_patches * self.overhead.per_video_frame)
        return (total if given is None else given), tuple(reasons), frame_text

    def _exact_timestamp_tokens(self, cfg: VideoTokenConfig, meta: Any) -> int:
        from neatpack.pipes.indexing._template_probe import text_tokens

        frames, fps = frames_fps(meta)
        texts = cfg.timestamp_texts(frames, fps)
        return 2 * len(texts) + sum(text_tokens(self.processor, t) for t in texts)


def _media_tokens(record: Mapping[str, Any], sid: int) -> int | None:
    """A record's precomputed ``_media_tokens``, validated, or None."""
    mt = record.get("_media_tokens")
    if mt is None:
        return None
    if type(mt) in (int, float) and 0 <= mt < MAX_TEXT_TOKENS and mt == int(mt):
        return int(mt)
    raise EstimateError(
        f"sample_id={sid}: _media_tokens={mt!r:.80} is not a token count (an integer in "
        "[0, 2**40)); fix the field or delete it to estimate the media from their sizes"
    )


def text_stats(record: Mapping[str, Any]) -> TextStats:
    """Characters of text, messages per role, media blocks, first role of a Record."""
    chars = n_img = n_vid = 0
    roles = dict.fromkeys(("system", "user", "assistant"), 0)
    conv = record["conversation"]
    for msg in conv:
        roles[msg["role"]] += 1
        for block in msg["content"]:
            kind = block.get("type")
            if kind == "text":
                chars += len(block["text"])
            elif kind == "image":
                n_img += 1
            elif kind == "video":
                n_vid += 1
    return TextStats(
        chars, roles["system"], roles["user"], roles["assistant"], n_img, n_vid,
        bool(conv) and conv[0]["role"] == "system",
    )  # fmt: skip
