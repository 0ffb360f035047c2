"""The shared flow of the audio families (Phi-4-multimodal, Nemotron-H Omni): one Record with
text, image and audio blocks -> one Sample, and its length estimate without running the feature
extractor or the image processor.

The flow: audio blocks are cut out (``audio.split_audio_blocks``) so the rest of the
conversation is validated as any family's, read and checked (``audio.load_audio_block``: rate,
empty, missing file, non-finite), counted with the family's pure rule, and given to the real
processor as ``audio=[...]`` beside ``images``; the tokens each placeholder expanded to are
checked against the rule (text runs and the processor's own per-clip figures), labels come from
the family's role markers, and the processor's media tensors are kept under their own names.
What differs per family is an ``AudioFamily`` value (``phi4.PHI4``,
``nemotron_omni.NEMOTRON_OMNI``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

from neatpack.pipes.indexing._media_meta import image_hw
from neatpack.pipes.materializing.labels import RoleMarkers, conversation_labels, template_text
from neatpack.pipes.reading._conversation import parse_conversation
from neatpack.pipes.reading.audio import audio_num_samples, load_audio_block, split_audio_blocks
from neatpack.pipes.reading.media import SampleError, load_image

from ._shared import check_modalities
from .chat_template import (
    check_media_counts,
    forbidden_names,
    media_token_types,
    processor_failure,
)

__all__ = [
    "AUDIO_FAMILY_MODALITIES",
    "AudioFamily",
    "audio_conversation",
    "audio_lengths",
    "audio_processor",
    "estimate_audio_family",
    "image_sizes",
    "render_template",
    "text_estimate",
    "tokenize_audio_family",
]

AUDIO_FAMILY_MODALITIES: Final = frozenset({"image", "audio"})


def render_template(processor: Any, conv: list[dict[str, Any]]) -> str:
    """The templated text, from the processor's template or its tokenizer's (a processor whose
    ``__init__`` does not name ``chat_template`` loses it in ``from_pretrained``: Phi-4)."""
    text: str = processor.apply_chat_template(
        conv, tokenize=False, chat_template=template_text(processor)
    )
    return text


@dataclass(frozen=True)
class AudioFamily:
    """What one audio family's tokenizer needs beyond the shared flow of
    ``tokenize_audio_family`` (``phi4``, ``nemotron_omni``).

    ``audio_tokens(processor, n_samples)``: tokens of one clip (< 1: too short, refused);
    ``clip_tokens(processor, out)``: tokens per clip as the processor's own outputs say;
    ``image_tokens(processor, images)``: expected image-token total; ``markers(processor)``:
    the assistant role markers; ``keys``: the processor outputs the Sample keeps;
    ``image_expansion(processor, [(h, w), ...])`` / ``audio_expansion(processor, n_samples)``:
    the whole run each placeholder becomes, wrapper tokens included (length estimates)."""

    audio_tokens: Callable[[Any, int], int]
    clip_tokens: Callable[[Any, Mapping[str, Any]], list[int]]
    image_tokens: Callable[[Any, list[Any]], int | None]
    markers: Callable[[Any], RoleMarkers]
    keys: tuple[str, ...]
    image_expansion: Callable[[Any, list[tuple[int, int]]], list[int]]
    audio_expansion: Callable[[Any, int], int]
    modalities: frozenset[str] = AUDIO_FAMILY_MODALITIES


def audio_processor(processor: Any) -> Any:
    """The audio sub-processor: ``audio_processor`` (Phi-4) or ``feature_extractor``."""
    return getattr(processor, "audio_processor", None) or processor.feature_extractor


def tokenize_audio_family(
    record: Mapping[str, Any],
    processor: Any,
    family: AudioFamily,
    *,
    label_policy: str = "assistant",
    markers: RoleMarkers | None = None,
    max_image_pixels: int | str | None = "pil",
) -> dict[str, Any]:
    """One Record with text, image and audio blocks -> one Sample, for a processor that takes
    ``audio=[...]`` and expands one audio placeholder per clip (module docstring)."""
    if label_policy not in ("assistant", "last_assistant"):
        raise ValueError(f"{label_policy=} is not one of ('assistant', 'last_assistant')")
    stand_in, where, audio_blocks = split_audio_blocks(record)
    # audio is the family's by construction; the other blocks are checked as any family's
    check_modalities(stand_in, processor, family.modalities)
    markers = markers or family.markers(processor)
    sid, conv, image_src, _videos, _fps = parse_conversation(
        stand_in, forbidden_names(processor, processor.tokenizer, markers)
    )
    for k, j in where:
        conv[k]["content"][j] = {"type": "audio"}
    fe = audio_processor(processor)
    rate = int(fe.sampling_rate)
    audio = [load_audio_block(b, sample_id=sid, sampling_rate=rate) for b in audio_blocks]
    want_audio = [family.audio_tokens(processor, a.shape[0]) for a in audio]
    for n, (a, want) in enumerate(zip(audio, want_audio, strict=True)):
        if want < 1:
            raise SampleError(
                sid,
                "bad_media",
                f"audio {n} has {a.shape[0]} samples ({a.shape[0] / rate * 1000:.1f} ms), shorter "
                f"than one {fe.win_length}-sample window; drop or pad it",
            )
    images = [load_image(s, sample_id=sid, max_image_pixels=max_image_pixels) for s in image_src]
    kwargs: dict[str, Any] = {"return_tensors": "pt"}
    if images:
        kwargs["images"] = images
    if audio:
        kwargs.update(audio=audio, sampling_rate=rate)
    try:
        out = processor(text=[render_template(processor, conv)], **kwargs)
    except Exception as exc:
        raise processor_failure(sid, exc) from exc
    ids = out["input_ids"][0].long()
    mm = media_token_types(ids, processor)
    check_media_counts(sid, processor, out, mm, images, family.image_tokens)
    got = int((mm == 3).sum())
    clips = family.clip_tokens(processor, out) if audio else []
    if got != sum(want_audio) or clips != want_audio:
        raise SampleError(
            sid,
            "media_token_mismatch",
            f"{got} audio token(s) in the text, {clips} per clip from the processor's features, "
            f"but the durations give {want_audio}",
        )
    labels = conversation_labels(
        ids, conv, markers, sample_id=sid, mm_token_type_ids=mm, label_policy=label_policy
    )
    sample: dict[str, Any] = {"sample_id": sid, "input_ids": ids}
    for key in family.keys:
        if out.get(key) is not None:
            sample[key] = torch.as_tensor(out[key])
    sample.update(
        labels=labels, attention_mask=out["attention_mask"][0].long(), mm_token_type_ids=mm
    )
    return sample


def estimate_audio_family(
    record: Mapping[str, Any], processor: Any, family: AudioFamily, *, mode: str = "exact"
) -> int:
    """Length after the shift without running the feature extractor or the image processor.

    Text: ``mode="exact"`` tokenizes the templated text (media reduced to their placeholders);
    ``mode="estimate"`` is ``LengthEstimator``'s chars-per-token rule with the template overhead
    probed from the processor. Images: ``images_meta`` ``[height, width]`` (else the PIL image or
    the file header); audio: ``audios_meta`` seconds (else the WAV header or the array length);
    each through the family's ``image_expansion`` / ``audio_expansion``."""
    if mode not in ("exact", "estimate"):
        raise ValueError(f"{mode=} is not one of ('exact', 'estimate')")
    sid: Any = record.get("sample_id")
    conv, where, blocks = audio_conversation(record)
    rate = int(audio_processor(processor).sampling_rate)
    lengths = audio_lengths(record, blocks, rate)
    audio = [family.audio_expansion(processor, n) for n in lengths]
    sizes = [(h, w) for h, w in image_sizes(conv, record.get("images_meta"), sid)]
    image = family.image_expansion(processor, sizes) if sizes else []
    media = sum(image) + sum(audio)
    if mode == "exact":
        text = render_template(processor, conv)
        n_text = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        # each media placeholder is one token of n_text and expands to its whole run
        return int(n_text - len(image) - len(audio) + media - 1)
    return text_estimate(record, conv, where, processor) + media


# -- the pieces of an audio family's length estimate that do not depend on the family -------------


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
    file header (``_media_meta._image_size``); an unreadable image is a ValueError."""
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
    from neatpack.pipes.indexing._template_probe import probe_overhead
    from neatpack.pipes.indexing.estimate import LengthEstimator

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
