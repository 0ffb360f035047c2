"""Length of a Gemma 4 Sample (``family_gemma4.tokenize_gemma4``) before tokenizing it.

Every image, video and audio expands to a text the processor itself writes
(``replace_image_token`` / ``replace_video_token``, ``<|audio>`` + k * ``<|audio|>`` +
``<audio|>``), with k from the processor's ``_get_num_multimodal_tokens``; ``exact`` mode
renders the template with the thinking prefix, puts those texts in place of the placeholders and
tokenizes once, so it equals the real length. Sizes: ``images_meta`` ``[height, width]`` or the
image; videos as frame lists (count and frame size); audio from ``audios_meta`` (seconds) or the
array / WAV header.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ._media_meta import EstimateError, aligned_meta, image_hw, positive_meta, record_media
from .audio import audio_num_samples, split_audio_blocks
from .family_gemma4 import GEMMA4_THINKING_PREFIX, gemma4_video_metadata, inject_thinking_prefix

__all__ = ["gemma4_estimate"]


def _video_text(proc: Any, frames: int, tokens_per_frame: int, fps: float | None) -> str:
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=frames, fps=fps, frames_indices=list(range(frames)))
    return str(
        proc.replace_video_token(
            {"num_soft_tokens_per_video": [tokens_per_frame], "video_metadata": [meta]}, 0
        )
    )


def _media_texts(record: Mapping[str, Any], proc: Any) -> dict[str, list[str]]:
    """The text each image / video / audio of ``record`` expands to, per placeholder token, in
    order (images: ``images_meta`` ``[h, w]`` or the image; videos: frame lists; audio:
    ``audios_meta`` seconds or the array / WAV header)."""
    sid = int(record.get("sample_id", -1))
    images, videos = record_media(record)
    image_texts = []
    for value, meta in zip(images, aligned_meta(record, "images_meta", len(images), sid),
                           strict=True):  # fmt: skip
        size = positive_meta(sid, "images", meta, 2) if meta is not None else None
        hw = (int(size[0]), int(size[1])) if size else image_hw(value, sid)
        if isinstance(hw, str):
            raise EstimateError(
                f"sample_id={sid}: no size for image {value!r:.60} ({hw}); give images_meta"
            )
        k = proc._get_num_multimodal_tokens(image_sizes=[hw]).num_image_tokens[0]
        image_texts.append(str(proc.replace_image_token({"num_soft_tokens_per_image": [k]}, 0)))
    video_texts = []
    metadata = gemma4_video_metadata(record) or [{"fps": None}] * len(videos)
    for v, vmeta in zip(videos, metadata, strict=True):
        if isinstance(v, str) or not isinstance(v, Sequence) or not v:
            raise EstimateError(
                f"sample_id={sid}: video {v!r:.60} is not a frame list; the Gemma 4 estimate "
                "needs the frames (their count and size)"
            )
        n, h, w = len(v), int(v[0].height), int(v[0].width)
        total = proc._get_num_multimodal_tokens(video_sizes=[(n, h, w)]).num_video_tokens[0]
        video_texts.append(_video_text(proc, n, total // n, vmeta["fps"]))
    _, _, blocks = split_audio_blocks(record)
    seconds = record.get("audios_meta") or [None] * len(blocks)
    if len(seconds) != len(blocks):
        raise EstimateError(
            f"sample_id={sid}: audios_meta has {len(seconds)} entries for {len(blocks)} audio "
            "blocks; give one duration in seconds per block"
        )
    rate = int(proc.feature_extractor.sampling_rate)
    audio_texts = []
    for b, sec in zip(blocks, seconds, strict=True):
        try:
            n = audio_num_samples(b.get("audio", b.get("path")), sec, rate, sid)
        except ValueError as exc:
            raise EstimateError(str(exc)) from exc
        k = proc._get_num_multimodal_tokens(audio_lengths=[n]).num_audio_tokens[0]
        audio_texts.append(f"{proc.boa_token}{proc.audio_token * k}{proc.eoa_token}")
    return {
        str(proc.image_token): image_texts,
        str(proc.video_token): video_texts,
        str(proc.audio_token): audio_texts,
    }


def gemma4_estimate(record: Mapping[str, Any], processor: Any, *, mode: str = "exact") -> int:
    """Length after the shift of ``tokenize_gemma4(record)``.

    ``exact``: the template with the thinking prefix, each ``<|image|>`` / ``<|video|>`` /
    ``<|audio|>`` replaced by the processor's own expansion, tokenized once (== real).
    ``estimate``: ``LengthEstimator`` text (chars / 3 + template overhead) plus the expansions'
    and the prefixes' exact tokens."""
    from ._template_probe import probe_overhead
    from .estimate import LengthEstimator

    tok = processor.tokenizer
    texts = _media_texts(record, processor)
    if mode == "exact":
        stand_in, _, _ = split_audio_blocks(record, str(processor.audio_token))
        text = inject_thinking_prefix(
            processor.apply_chat_template(stand_in["conversation"], tokenize=False)
        )
        pieces = re.split("(" + "|".join(re.escape(t) for t in texts) + ")", text)
        queues = {k: iter(v) for k, v in texts.items()}
        full = "".join(next(queues[p]) if p in queues else p for p in pieces)
        return len(tok(full)["input_ids"]) - 1
    stand_in, _, _ = split_audio_blocks(record, "")
    est = LengthEstimator(
        mode=mode,
        processor=processor,
        media_fallback=0,
        on_missing_media="fallback",
        overhead=probe_overhead(processor),
    )
    turns = int(sum(m.get("role") == "assistant" for m in record["conversation"]))
    prefix = len(tok(GEMMA4_THINKING_PREFIX, add_special_tokens=False)["input_ids"])
    media = sum(len(tok(t, add_special_tokens=False)["input_ids"]) - 1
                for v in texts.values() for t in v)  # fmt: skip
    return int(est.estimate(stand_in)[0]) + media + turns * prefix
