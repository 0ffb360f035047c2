"""Length estimates for the families of ``registry`` handlers, in the form the length index
takes (``lengths.build_length_index``): the planner packs by these numbers, so they should be
close to the real row length after the shift and rarely above it.

``handler_estimator(processor, handler, mode)`` returns, per handler name:

=================  ===========================================================================
gemma3             ``family_gemma3.gemma3_estimator`` (a ``LengthEstimator``)
gemma4             ``family_default.default_estimate`` + the thinking prefix per model turn
llava_onevision    ``family_llava_onevision.llava_onevision_estimate``
idefics3           ``family_idefics3.idefics3_estimate``
chat_template      ``family_default.default_estimate`` (InternVL and any template processor)
qwen_omni          ``family_qwen_omni.qwen_omni_estimate`` (audio from ``audios_meta`` / WAV)
qwen3_omni         ``family_qwen3_omni.qwen3_omni_estimate`` (Qwen3-Omni's audio rule)
kimi_k25           ``family_default.default_estimate`` (images pre-expanded from the grid)
step3              ``family_step3.step3_estimate`` (global view + crops per image)
smolvlm            ``family_smolvlm.smolvlm_estimate`` (Idefics3 tiles, SmolVLM's layout)
phi4               ``family_phi4.phi4_estimate`` (``family_audio.estimate_audio_family``)
nemotron_omni      ``family_nemotron_omni.nemotron_omni_estimate`` (same shared audio flow)
prompt_answer      ``family_prompt.prompt_answer_length`` (chars / 3 outside exact mode)
=================  ===========================================================================

The family functions read image sizes from ``images_meta``; a record without it gets the sizes
from its image headers (``_media_meta.image_hw``, no decode), so every image is counted. An
image that cannot be read is an ``EstimateError`` naming the sample (the graph's
``on_bad_sample`` then decides). ``visual`` (the planner's media balance) is the estimate minus
the same record's estimate without media, per sample.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ._media_meta import EstimateError, image_hw, record_media
from .estimate import FallbackCounter, LengthEstimator, SampleEstimate

__all__ = ["HANDLER_ESTIMATE_MODES", "HandlerEstimator", "handler_estimator"]

#: The estimate modes a family estimator takes ("calibrated" is Qwen-VL's LengthEstimator only).
HANDLER_ESTIMATE_MODES: tuple[str, ...] = ("estimate", "exact")
EstimateFn = Callable[[Mapping[str, Any], Any, str], int]


def _default(record: Mapping[str, Any], processor: Any, mode: str) -> int:
    from .family_default import default_estimate

    return default_estimate(record, processor, mode=mode)


def _gemma4(record: Mapping[str, Any], processor: Any, mode: str) -> int:
    from .family_gemma4 import GEMMA4_THINKING_PREFIX

    tok = processor.tokenizer
    per_turn = len(tok(GEMMA4_THINKING_PREFIX, add_special_tokens=False)["input_ids"])
    turns = sum(m.get("role") == "assistant" for m in record["conversation"])
    return int(_default(record, processor, mode) + per_turn * turns)


def _family(module: str, name: str) -> EstimateFn:
    """``neatpack.pipes.<module>.<name>(record, processor, mode=mode)``, imported at the first
    call, as the other estimates here import their family module (importing them all up front
    would load every family's transformers classes)."""

    def estimate(record: Mapping[str, Any], processor: Any, mode: str) -> int:
        fn = getattr(importlib.import_module(f".{module}", __package__), name)
        return int(fn(record, processor, mode=mode))

    return estimate


def _prompt(record: Mapping[str, Any], processor: Any, mode: str) -> int:
    from .family_prompt import prompt_answer_length

    return prompt_answer_length(record, processor, chars_per_token=None if mode == "exact" else 3.0)


_ESTIMATES: dict[str, EstimateFn] = {
    "gemma4": _gemma4,
    "llava_onevision": _family("family_llava_onevision", "llava_onevision_estimate"),
    "idefics3": _family("family_idefics3", "idefics3_estimate"),
    "chat_template": _default,
    "qwen_omni": _family("family_qwen_omni", "qwen_omni_estimate"),
    "qwen3_omni": _family("family_qwen3_omni", "qwen3_omni_estimate"),
    "kimi_k25": _default,
    "step3": _family("family_step3", "step3_estimate"),
    "smolvlm": _family("family_smolvlm", "smolvlm_estimate"),
    "phi4": _family("family_phi4", "phi4_estimate"),
    "nemotron_omni": _family("family_nemotron_omni", "nemotron_omni_estimate"),
    "prompt_answer": _prompt,
}


@dataclass
class HandlerEstimator:
    """A ``LengthEstimator``-shaped estimator (``estimate``, ``estimate_sample``,
    ``estimate_raw_batch``, ``config_key``, ``fallbacks``) over a family estimate function."""

    handler: str
    processor: Any
    mode: str = "exact"
    fallbacks: FallbackCounter = field(default_factory=FallbackCounter, repr=False)

    def __post_init__(self) -> None:
        if self.handler not in _ESTIMATES:
            raise ValueError(
                f"no length estimate for handler {self.handler!r}; known: "
                f"{sorted([*_ESTIMATES, 'gemma3'])}. Pass lengths= (a LengthIndex) to the graph"
            )
        if self.mode not in HANDLER_ESTIMATE_MODES:
            raise ValueError(f"{self.mode=} is not one of {HANDLER_ESTIMATE_MODES}")

    def config_key(self) -> str:
        from ._template_probe import tokenizer_id

        return f"HandlerEstimator({self.handler!r}, {self.mode!r}, {tokenizer_id(self.processor)})"

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
        fn = _ESTIMATES[self.handler]
        try:
            total = int(fn(record, self.processor, self.mode))
            text = int(fn(_text_only(record), self.processor, self.mode))
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


def handler_estimator(
    processor: Any, handler: str, mode: str
) -> LengthEstimator | HandlerEstimator:
    """The length estimator of ``handler``'s family (module docstring)."""
    if mode not in HANDLER_ESTIMATE_MODES:
        raise ValueError(
            f"estimate_mode={mode!r} is not available for handler {handler!r}; valid: "
            f"{HANDLER_ESTIMATE_MODES} ('calibrated' fits Qwen-VL's LengthEstimator only)"
        )
    if handler == "gemma3":
        from .family_gemma3 import gemma3_estimator

        return gemma3_estimator(processor, mode=mode)
    return HandlerEstimator(handler, processor, mode)
