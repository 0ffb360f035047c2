"""The values of a length estimate: the chat template's overhead, the text statistics it is
computed from, and one sample's result with its fallback counter.

Kept apart from ``estimate.py`` so the template probe (``_template_probe.py``) and the batched
paths (``exact_lengths.py``, ``_estimate_raw.py``) can build them without importing the
estimator that imports them.

>>> TemplateOverhead().tokens_of(0, 1, 1, 1, 0, False)  # user + assistant + image + no system
23.0
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["FallbackCounter", "SampleEstimate", "TemplateOverhead", "TextStats"]


@dataclass(frozen=True, kw_only=True)
class TemplateOverhead:
    """Chat-template tokens around the text. Defaults: the Qwen2-VL template with the real Qwen
    vocabulary (``<|im_start|>``, role, newline, ``<|im_end|>``, newline per message; vision
    start/end per media; the default system prompt when the first message is not a system one).
    ``base`` is the constant that ``calibrate`` fits."""

    base: float = 0.0
    per_system: float = 5.0
    per_user: float = 5.0
    per_assistant: float = 5.0
    per_image: float = 2.0
    per_video: float = 2.0
    no_system: float = 11.0
    per_video_frame: float = 8.0  # Qwen3-VL: "<1.5 seconds>" (6) + vision start/end, per patch

    def tokens(self, st: TextStats) -> float:
        return self.tokens_of(
            st.system, st.user, st.assistant, st.images, st.videos, st.first_is_system
        )

    def tokens_of(
        self, system: int, user: int, assistant: int, images: int, videos: int, first_sys: bool
    ) -> float:
        return (
            self.base + self.per_system * system + self.per_user * user
            + self.per_assistant * assistant + self.per_image * images
            + self.per_video * videos + (0.0 if first_sys else self.no_system)
        )  # fmt: skip


class TextStats(NamedTuple):
    """What the text estimate of a Record depends on."""

    chars: int
    system: int
    user: int
    assistant: int
    images: int
    videos: int
    first_is_system: bool


class SampleEstimate(NamedTuple):
    total: int
    visual: int
    fallbacks: tuple[str, ...]  # reasons, e.g. ("image_missing",), empty when none


@dataclass
class FallbackCounter:
    """Counts the media items that used the ``media_fallback`` estimate, with sample ids."""

    counts: Counter[str] = field(default_factory=Counter)
    sample_ids: dict[str, list[int]] = field(default_factory=dict)

    def add(self, sample_id: int, reasons: tuple[str, ...]) -> None:
        for r in reasons:
            self.counts[r] += 1
            ids = self.sample_ids.setdefault(r, [])
            if not ids or ids[-1] != sample_id:
                ids.append(sample_id)
