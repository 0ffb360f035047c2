"""Qwen3-Omni (``Qwen3OmniMoeProcessor`` / ``Qwen3OmniMoeThinkerForConditionalGeneration``): the
Qwen2.5-Omni path (``qwen_omni``) with Qwen3-Omni's audio rule. Only the differences live
here; tokenization, labels, image checks, the estimate, media packing and positions are the
shared ``qwen_omni`` code.

What differs from Qwen2.5-Omni (transformers 5.23 sources):

* token names: ``<|audio_start|><|audio_pad|>...<|audio_end|>`` and
  ``<|vision_start|><|image_pad|>...<|vision_end|>`` (read from the processor, nothing here);
* audio frames: the processor pads a call to its longest audio (not to 30 s), so the longest
  keeps ``samples // hop`` frames and the others ``ceil(samples / hop)``; the encoder works on
  100-frame chunks (``n_window = 50``): a full chunk gives 13 tokens, the remainder ``r``
  gives ``conv3(r)`` (three stride-2 steps), so

      tokens(frames) = 13 * (frames // 100) + conv3(frames % 100)

  (``qwen3_omni_audio_tokens``, equal to the processor's own text expansion and mask; its
  ``_get_num_multimodal_tokens`` agrees for the longest audio of a sample but floors the
  others, up to one token short: tests check both facts);
* no 30 s window: the processor does not truncate, so no length limit is applied; an audio of
  200 samples or fewer (12.5 ms) is refused naming the sample (the STFT's reflect padding
  fails on it when it is the longest of its sample);
* ``input_features`` are ``[n_audio, 128, longest frames]`` instead of the fixed 3000, so
  ``qwen_omni_pack_media`` right-pads them (zeros, mask 0) to the widest in the pack;
* positions: the thinker's ``get_rope_index`` follows the same rule for text, images (temporal
  index 0) and audio (in time, +1 per token), so ``qwen_omni_position_ids`` /
  ``qwen_omni_mrope`` serve both generations (the model returns float ids, same values);
* videos: ``video_second_per_grid`` defaults to 2 s (fps 1.0, not 2.0) and a video's time
  stays fractional in ``get_rope_index``; videos with a fractional step are refused
  (``tokenize_qwen3_omni``);
* the thinker is a mixture of experts with deepstack visual features: per-token routing and
  per-token feature injection, so a block-causal packed row is still exact.

>>> from types import SimpleNamespace  # the extractor fields the rule reads (Whisper's)
>>> proc = SimpleNamespace(feature_extractor=SimpleNamespace(hop_length=160, n_samples=480000,
...                                                          n_fft=400))
>>> qwen3_omni_audio_tokens(proc, [16000])  # 1 s: 100 frames = one full chunk -> 13 tokens
[13]
>>> qwen3_omni_audio_tokens(proc, [12345, 16000])  # ceil(77.2) = 78 frames -> 39 -> 20 -> 10
[10, 13]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from neatpack.pipes.materializing.labels import RoleMarkers
from neatpack.pipes.reading.media import SampleError

from .processor_compat import processor_default
from .qwen_omni import (
    OMNI_MODALITIES,
    OmniRule,
    omni_estimate,
    omni_tokenize,
    qwen_omni_mrope,
    qwen_omni_pack_media,
)
from .registry import Handler, register_handler

__all__ = [
    "QWEN3_OMNI",
    "QWEN3_OMNI_HANDLER",
    "qwen3_omni_audio_tokens",
    "qwen3_omni_estimate",
    "tokenize_qwen3_omni",
]

_CHUNK_TOKENS: Final = 13  # tokens of one full 2 * n_window-frame chunk (conv3(100))


def _tokens(processor: Any, frames: int) -> int:
    """Audio tokens for ``frames`` mel frames: 13 per full chunk plus the remainder's three
    stride-2 convolutions (``(n - 1) // 2 + 1`` each; 0 frames give 0)."""
    chunk = 2 * int(processor_default(processor, "n_window", 50))
    rest = frames % chunk
    for _ in range(3):
        rest = (rest - 1) // 2 + 1
    return _CHUNK_TOKENS * (frames // chunk) + rest


QWEN3_OMNI: Final = OmniRule("Qwen3-Omni", _tokens, pad_to_longest=True)
"""Qwen3-Omni's audio rule (module docstring)."""


def qwen3_omni_audio_tokens(processor: Any, lengths: Sequence[int]) -> list[int]:
    """Audio tokens of the audios of ONE sample, ``lengths`` in samples at the extractor's rate.

    A list, not one length at a time, because the processor pads a sample's audios to the
    longest: the longest keeps ``n // 160`` frames, the others ``ceil(n / 160)`` (``OmniRule``).
    The processor's own ``_get_num_multimodal_tokens`` uses ``n // 160`` for every audio, so
    it undercounts a shorter audio by up to one token; this follows what its call does."""
    return QWEN3_OMNI.audio_tokens(processor, lengths)


def tokenize_qwen3_omni(
    record: Mapping[str, Any],
    processor: Any,
    *,
    label_policy: str = "assistant",
    markers: RoleMarkers | None = None,
    max_image_pixels: int | str | None = "pil",
) -> dict[str, Any]:
    """One Record with text, image, video and audio blocks -> one Sample (``qwen_omni``'s
    path with Qwen3-Omni's audio rule).

    A video whose time step ``video_second_per_grid * position_id_per_seconds`` (``2 / fps *
    13``) is not a whole number is refused: Qwen3-Omni keeps such positions fractional, but a
    packed row (``pack.build_pack``) stores integer positions, which would shift them silently
    (max logit error 1e-2 on the tiny model). Frames at fps 0.5, 1 or 2 work."""
    sample = omni_tokenize(
        record,
        processor,
        QWEN3_OMNI,
        label_policy=label_policy,
        markers=markers,
        max_image_pixels=max_image_pixels,
    )
    seconds = sample.get("video_second_per_grid")
    if seconds is not None:
        pps = processor_default(processor, "position_id_per_seconds")
        steps = seconds.float() * float(pps)
        if not bool((steps == steps.round()).all()):
            raise SampleError(
                sample["sample_id"],
                "bad_media",
                f"video time step {steps.tolist()} position ids per frame pair "
                f"(video_second_per_grid {seconds.tolist()} x position_id_per_seconds "
                f"{pps}) is fractional; packed rows hold integer "
                "positions: give the frames at fps 0.5, 1 or 2 (resample them beforehand)",
            )
    return sample


def qwen3_omni_estimate(record: Mapping[str, Any], processor: Any, *, mode: str = "exact") -> int:
    """Length after the shift without the feature extractor or the image processor
    (``qwen_omni.omni_estimate`` with Qwen3-Omni's audio rule)."""
    return omni_estimate(record, processor, QWEN3_OMNI, mode=mode)


QWEN3_OMNI_HANDLER = register_handler(
    Handler(
        "qwen3_omni",
        tokenize_qwen3_omni,
        modalities=OMNI_MODALITIES,
        pack_media=qwen_omni_pack_media,
        mrope=True,
        description="Qwen3-Omni: the Qwen2.5-Omni path with 13 audio tokens per 100-frame chunk "
        "and no 30 s window; features padded per pack (pipes/families/qwen3_omni.py)",
        estimate=qwen3_omni_estimate,
        positions=qwen_omni_mrope,
    ),
    ("Qwen3OmniMoeProcessor",),
)
