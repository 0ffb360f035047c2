"""Length of a Qwen-Omni sample (after the shift) without running the feature extractor, the
image processor or the video processor: ``omni_estimate`` for both generations (their audio
rule given), behind ``qwen_omni_estimate`` / ``qwen3_omni_estimate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .audio_estimate import audio_conversation, audio_lengths, image_sizes, text_estimate

if TYPE_CHECKING:
    from .family_qwen_omni import OmniRule

__all__ = ["omni_estimate"]


def _video_sizes(conv: list[dict[str, Any]], meta: Any, sid: Any) -> list[list[int]]:
    """``[frames, height, width]`` per video block: ``videos_meta`` entries (``[frames, height,
    width, fps]`` as for Qwen-VL), else the frame list itself (its length and first frame); a
    video file without ``videos_meta`` is a ValueError (its frame count needs a decoder)."""
    values = [b.get("video", b.get("path")) for m in conv for b in m["content"]
              if b.get("type") == "video" or (b.get("type") is None and "video" in b)]  # fmt: skip
    meta = list(meta) if meta else [None] * len(values)
    if len(meta) != len(values):
        raise ValueError(
            f"sample_id={sid}: videos_meta has {len(meta)} entries for {len(values)} video blocks"
        )
    sizes = []
    for value, m in zip(values, meta, strict=True):
        if m is not None:
            sizes.append([int(m[0]), int(m[1]), int(m[2])])
        elif isinstance(value, list | tuple) and value:
            first = value[0]
            h, w = (first.height, first.width) if hasattr(first, "height") else first.shape[:2]
            sizes.append([len(value), int(h), int(w)])
        else:
            raise ValueError(
                f"sample_id={sid}: cannot size video {value!r:.80} without decoding it; give "
                "videos_meta ([frames, height, width, fps] per video block)"
            )
    return sizes


def omni_estimate(
    record: Mapping[str, Any], processor: Any, rule: OmniRule, *, mode: str = "exact"
) -> int:
    """Length after the shift without running the feature extractor or the image processor.

    Text: ``mode="exact"`` tokenizes the templated text (media reduced to their placeholders);
    ``mode="estimate"`` is ``LengthEstimator``'s chars-per-token rule with the template overhead
    probed from the processor. Images: ``images_meta`` ``[height, width]`` (None: the PIL image
    or the file header) through the image processor's config (``_get_num_multimodal_tokens``);
    videos: ``videos_meta`` ``[frames, height, width, fps]`` (None: the frame list) through the
    video processor's config, every given frame kept (as ``omni_tokenize`` does).
    Audio: ``record["audios_meta"]``, one duration in seconds per audio block (None: the WAV
    header or the array length), through the extractor's hop and the two stride-2 convolutions.
    Exact mode equals the real length when the durations are exact (a test checks it); a
    duration off by ``d`` samples moves an audio's count by at most ``ceil(d / 640) + 1``."""
    if mode not in ("exact", "estimate"):
        raise ValueError(f"{mode=} is not one of ('exact', 'estimate')")
    sid = record.get("sample_id")
    conv, where, blocks = audio_conversation(record)
    rate = int(processor.feature_extractor.sampling_rate)
    lengths = audio_lengths(record, blocks, rate)
    audio = rule.audio_tokens(processor, lengths)
    sizes = image_sizes(conv, record.get("images_meta"), sid)
    image = (
        processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens if sizes else []
    )
    vsizes = _video_sizes(conv, record.get("videos_meta"), sid)
    video = (
        processor._get_num_multimodal_tokens(video_sizes=vsizes).num_video_tokens if vsizes else []
    )
    image = [*image, *video]  # both: one placeholder in the text, expanded to its count
    if mode == "exact":
        text = processor.apply_chat_template(conv, tokenize=False)
        n_text = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        # each placeholder (image / video / audio) is one token of n_text, expanded to its count
        return int(n_text - len(image) - len(audio) + sum(image) + sum(audio) - 1)
    n_text = text_estimate(record, conv, where, processor)
    # + <|audio_bos|> / <|audio_eos|> per audio (the estimator sees no audio blocks)
    return int(n_text + sum(image) + sum(audio) + 2 * len(audio))
