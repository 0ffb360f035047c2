"""The pieces of an audio family's length estimate that do not depend on the family.

``family_audio.estimate_audio_family`` (Phi-4-multimodal, Nemotron-H Omni) and
``omni_estimate.omni_estimate`` (Qwen2.5-Omni, Qwen3-Omni) size a record the same way and
differ only in their per-clip and per-image rules: the conversation with each audio block
reduced to its placeholder (``audio_conversation``), each clip's samples from ``audios_meta``
or the file (``audio_lengths``), each image's ``[height, width]`` from ``images_meta`` or the
file (``image_sizes``), and in ``mode="estimate"`` the text without the audio blocks through
``LengthEstimator`` (``text_estimate``)::

    conv, where, blocks = audio_conversation(record)
    lengths = audio_lengths(record, blocks, 16000)   # audios_meta [1.5] -> [24000]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._media_meta import image_hw
from .audio import audio_num_samples, split_audio_blocks

__all__ = ["audio_conversation", "audio_lengths", "image_sizes", "text_estimate"]


def audio_conversation(
    record: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], list[tuple[int, int]], list[Mapping[str, Any]]]:
    """``(conversation with block-list contents and each audio block as {"type": "audio"},
    where the audio blocks were as (message, block), the audio blocks in order)``."""
    stand_in, where, blocks = split_audio_blocks(record)
    conv = [
        dict(m, content=[{"type": "text", "text": c}] if isinstance(c, str) else list(c))
        for m in stand_in["conversation"]
        for c in (m["content"],)
    ]
    for k, j in where:
        conv[k]["content"][j] = {"type": "audio"}
    return conv, where, blocks


def audio_lengths(
    record: Mapping[str, Any], blocks: list[Mapping[str, Any]], rate: int
) -> list[int]:
    """Samples at ``rate`` per audio block: ``record["audios_meta"]`` seconds, else the WAV
    header or the array length (``audio.audio_num_samples``); a count mismatch is a
    ValueError naming the sample."""
    sid = record.get("sample_id")
    meta = record.get("audios_meta") or [None] * len(blocks)
    if len(meta) != len(blocks):
        raise ValueError(
            f"sample_id={sid}: audios_meta has {len(meta)} entries for {len(blocks)} audio blocks"
        )
    return [
        audio_num_samples(b.get("audio", b.get("path")), m, rate, sid)
        for b, m in zip(blocks, meta, strict=True)
    ]


def image_sizes(conv: list[dict[str, Any]], meta: Any, sid: Any) -> list[list[int]]:
    """``[height, width]`` per image block: ``images_meta`` entries, else the PIL image or the
    file header (``_media_meta.image_hw``); an unreadable image is a ValueError."""
    values = [b.get("image", b.get("path")) for m in conv for b in m["content"]
              if b.get("type") == "image" or (b.get("type") is None and "image" in b)]  # fmt: skip
    meta = list(meta) if meta else [None] * len(values)
    if len(meta) != len(values):
        raise ValueError(
            f"sample_id={sid}: images_meta has {len(meta)} entries for {len(values)} image blocks"
        )
    sizes = []
    for value, m in zip(values, meta, strict=True):
        size = (int(m[0]), int(m[1])) if m is not None else image_hw(value, sid)
        if isinstance(size, str):
            raise ValueError(f"sample_id={sid}: {size.replace('_', ' ')}: {value!r:.80}")
        sizes.append([size[0], size[1]])
    return sizes


def text_estimate(
    record: Mapping[str, Any],
    conv: list[dict[str, Any]],
    where: list[tuple[int, int]],
    processor: Any,
) -> int:
    """``LengthEstimator``'s ``mode="estimate"`` count of the record's text, the audio blocks
    (at ``where`` in ``conv``) left out and the template overhead probed from the processor."""
    from ._template_probe import probe_overhead
    from .estimate import LengthEstimator

    text_only = {**record, "conversation": [
        {**m, "content": [b for j, b in enumerate(m["content"]) if (k, j) not in where]}
        for k, m in enumerate(conv)
    ]}  # fmt: skip
    est = LengthEstimator(
        mode="estimate",
        processor=processor,
        media_fallback=0,
        on_missing_media="fallback",
        overhead=probe_overhead(processor),
    )
    return int(est.estimate(text_only)[0])
