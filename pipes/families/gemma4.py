"""Gemma 4 (``Gemma4Processor``): the thinking-channel prefix after every model turn.

Gemma 4 trains historic model turns with an (empty) thinking channel: after each
``<|turn>model\\n`` header comes ``<|channel>thought\\n<channel|>``, then the answer. The seed's
``gemma4_inject_thinking_prefix`` inserts those tokens after tokenization, but its labels start
right after ``<|turn>model\\n``, so the injected prefix IS labelled (peer note B9), contrary to
its docstring. Here the prefix is injected into the templated text before the processor runs
(no token surgery, media tokens untouched), and the assistant start marker is the header PLUS
the prefix, so the labels are exactly the answer and its ``<turn|>``::

    <|turn>model\\n <|channel>thought\\n<channel|> A cat. <turn|> \\n
    -100 ...        -100 ...                      A cat. <turn|> -100

A model turn whose text already opens a channel (the template emitted one) is left alone.

Video: a frame list (pre-sampled: the tiny processor keeps every frame, ``do_sample_frames`` off)
becomes, per frame, ``"mm:ss <|image>" + <|video|> * k + "<image|>"`` joined by spaces, the
timestamps at the block's ``fps`` (or ``videos_meta[k][3]``; without either, the processor's
default 24 fps, as it does for frames without metadata); ``k`` is checked
against the processor's ``_get_num_multimodal_tokens(video_sizes=...)`` and against the real
patches of ``video_position_ids`` (what the vision tower will return).
``gemma4_estimate`` gives the length (exact mode == real); it is the handler's estimate.

Audio (``neatpack.pipes.reading.audio``: a .wav path or a float array at the extractor's 16 kHz,
never
resampled, at most ``audio_seq_length`` tokens = 30 s): each block becomes
``<|audio>`` + ``<|audio|>`` * k + ``<audio|>`` with k = the processor's duration rule (25 per
second), checked against the runs in the text; the Sample carries ``input_features [n, T, 128]``
and ``input_features_mask [n, T]``. The default tokenizer knows no audio blocks, so each one is
replaced by a private-use stand-in text that the text hook turns into ``<|audio|>`` and the
processor call gets ``audio=[...]`` (and the videos' ``video_metadata``) through ``_ExtraCall``.

Packing: positions are 1-D. With ``use_bidirectional_attention="vision"`` the model lets the
tokens of one image / video run see each other on the SLIDING layers only (full layers stay
causal); ``gemma4_packed_masks`` builds that pair for a packed row. With the default (None) both
are block-causal.

>>> inject_thinking_prefix("<|turn>user\\nhi<turn|>\\n<|turn>model\\nyo<turn|>\\n")
'<|turn>user\\nhi<turn|>\\n<|turn>model\\n<|channel>thought\\n<channel|>yo<turn|>\\n'
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import torch
from torch import Tensor

from neatpack.pipes.indexing._media_meta import (
    EstimateError,
    aligned_meta,
    image_hw,
    positive_meta,
    record_media,
)
from neatpack.pipes.materializing.labels import RoleMarkers, tail_alternatives
from neatpack.pipes.reading.audio import audio_num_samples, load_audio_block, split_audio_blocks
from neatpack.pipes.reading.media import SampleError

from .chat_template import tokenize_default
from .gemma3 import gemma3_packed_mask
from .registry import Handler, register_handler

__all__ = [
    "GEMMA4_HANDLER",
    "GEMMA4_MODALITIES",
    "GEMMA4_MODEL_TURN",
    "GEMMA4_THINKING_PREFIX",
    "gemma4_estimate",
    "gemma4_markers",
    "gemma4_pack_media",
    "gemma4_packed_masks",
    "gemma4_video_metadata",
    "gemma4_video_tokens",
    "inject_thinking_prefix",
    "tokenize_gemma4",
]

GEMMA4_MODEL_TURN: Final = "<|turn>model\n"
GEMMA4_THINKING_PREFIX: Final = "<|channel>thought\n<channel|>"
GEMMA4_END_OF_TURN: Final = "<turn|>"
GEMMA4_MODALITIES: Final = frozenset({"image", "video", "audio"})
_AUDIO_STAND_IN: Final = "\ue000audio\ue000"  # private use: no real text contains it


def inject_thinking_prefix(
    text: str, turn: str = GEMMA4_MODEL_TURN, prefix: str = GEMMA4_THINKING_PREFIX
) -> str:
    """Insert ``prefix`` after every ``turn`` header not already followed by a channel."""
    opener = prefix.split("thought", 1)[0]
    parts = text.split(turn)
    out = [parts[0]]
    for part in parts[1:]:
        out.append(turn)
        out.append(part if part.startswith(opener) else prefix + part)
    return "".join(out)


def gemma4_markers(processor: Any) -> RoleMarkers:
    """Start = tokens of header + prefix (not labelled), end = ``<turn|>`` (labelled).

    Raises ValueError when the tokenizer lacks the Gemma 4 turn / channel specials.
    """
    tok = getattr(processor, "tokenizer", processor)
    unk = getattr(tok, "unk_token_id", None)
    for special in ("<|turn>", "<|channel>", "<channel|>", GEMMA4_END_OF_TURN):
        tid = tok.convert_tokens_to_ids(special)
        if tid is None or tid == unk:
            raise ValueError(
                f"tokenizer {type(tok).__name__} has no {special!r}; not a Gemma 4 tokenizer "
                "(select another handler)"
            )
    start = tuple(int(i) for i in tok(GEMMA4_MODEL_TURN + GEMMA4_THINKING_PREFIX,
                                      add_special_tokens=False)["input_ids"])  # fmt: skip
    end = (int(tok.convert_tokens_to_ids(GEMMA4_END_OF_TURN)),)
    return RoleMarkers(start, end, tail_alternatives(tok, start[-1]))


def tokenize_gemma4(
    record: Mapping[str, Any], processor: Any, *, thinking_prefix: bool = True, **options: Any
) -> dict[str, Any]:
    """The default path with the thinking prefix injected and kept out of the labels; images,
    videos and audio, their token counts checked (module docstring).

    ``thinking_prefix=False``: the plain default path (markers derived from the template)."""
    hooks: list[Callable[[str], str]] = [inject_thinking_prefix] if thinking_prefix else []
    if thinking_prefix:
        options["markers"] = options.get("markers") or gemma4_markers(processor)
    stand_in, _, blocks = split_audio_blocks(record, _AUDIO_STAND_IN)
    sid = record.get("sample_id")
    audio, extra = [], {}
    if blocks:
        audio = _load_audio(blocks, sid, processor)
        hooks.append(lambda t: _place_audio(t, len(audio), processor, sid))
        extra["audio"] = audio
    metadata = gemma4_video_metadata(record)
    if metadata is not None:
        extra["video_metadata"] = metadata
    proc = _ExtraCall(processor, extra) if extra else processor
    if hooks:
        options["text_hook"] = lambda t: _chain(hooks, t)
    sample = tokenize_default(stand_in, proc, modalities=GEMMA4_MODALITIES, **options)
    if "pixel_values_videos" in sample:
        _check_video_tokens(sample, record, processor)
    if audio:
        _check_audio_tokens(sample, audio, processor)
        sample["input_features_mask"] = sample["input_features_mask"].reshape(len(audio), -1)
    return sample


class _ExtraCall:
    """The processor, with ``extra`` inputs added to its call (``audio=``, ``video_metadata=``);
    every attribute is the processor's."""

    def __init__(self, processor: Any, extra: dict[str, Any]) -> None:
        self._processor, self._extra = processor, extra

    def __getattr__(self, name: str) -> Any:
        return getattr(self._processor, name)

    def __call__(self, **kwargs: Any) -> Any:
        return self._processor(**self._extra, **kwargs)


def gemma4_video_metadata(record: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """``video_metadata`` for the record's frame-list videos when every one has a frame rate
    (block ``fps`` or ``videos_meta[k][3]``: ``tokenize._video_metadata``, the Qwen-VL rule),
    else None (the processor's default 24 fps)."""
    from neatpack.pipes.materializing.tokenize import video_metadata_of

    blocks: list[Mapping[str, Any]] = []
    for msg in record.get("conversation") or []:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        blocks += [b for b in content or [] if isinstance(b, Mapping) and b.get("type") == "video"]
    if not blocks:
        return None
    fps = [f if isinstance(f, int | float) and not isinstance(f, bool) and f > 0 else None
           for f in (b.get("fps") for b in blocks)]  # fmt: skip
    meta: list[dict[str, Any]] | None = video_metadata_of(
        record, [b.get("video") for b in blocks], fps
    )
    return meta


def _chain(hooks: list[Callable[[str], str]], text: str) -> str:
    for hook in hooks:
        text = hook(text)
    return text


def _place_audio(text: str, n: int, proc: Any, sid: Any) -> str:
    if text.count(_AUDIO_STAND_IN) != n:
        raise SampleError(sid, "bad_media", f"the template dropped some of the {n} audio blocks")
    return text.replace(_AUDIO_STAND_IN, str(proc.audio_token))


def _max_audio_samples(proc: Any) -> int:
    """The longest audio whose tokens the processor does not cap (``audio_seq_length`` tokens
    of ``audio_ms_per_token`` ms): 750 * 40 ms = 30 s."""
    rate = int(proc.feature_extractor.sampling_rate)
    return int(proc.audio_seq_length) * int(proc.audio_ms_per_token) * rate // 1000


def _load_audio(blocks: list[Mapping[str, Any]], sid: Any, proc: Any) -> list[Any]:
    rate = int(proc.feature_extractor.sampling_rate)
    out = []
    for k, block in enumerate(blocks):
        wav = load_audio_block(
            block, sample_id=sid, sampling_rate=rate, max_samples=_max_audio_samples(proc)
        )
        if proc._get_num_multimodal_tokens(audio_lengths=[len(wav)]).num_audio_tokens[0] < 1:
            raise SampleError(
                sid, "bad_media", f"audio {k} ({len(wav)} samples) is too short for one token"
            )
        out.append(wav)
    return out


def _check_audio_tokens(sample: Mapping[str, Any], audio: list[Any], proc: Any) -> None:
    """Each audio's run of ``<|audio|>`` == the processor's duration rule for its length."""
    mm = sample["mm_token_type_ids"]
    starts = (mm == 3) & ~torch.nn.functional.pad(mm == 3, (1, 0))[:-1]
    runs = torch.cumsum(starts.long(), 0)[mm == 3].bincount().tolist()[1:]
    want = proc._get_num_multimodal_tokens(audio_lengths=[len(a) for a in audio]).num_audio_tokens
    if runs != list(want):
        raise SampleError(
            sample["sample_id"],
            "media_token_mismatch",
            f"audio tokens per audio {runs} in the text, but the durations give {list(want)}",
        )


def _video_frames(record: Mapping[str, Any]) -> list[Any]:
    videos: list[Any]
    _, videos = record_media(record)
    return videos


def gemma4_video_tokens(proc: Any, frames: int, height: int, width: int) -> int:
    """Soft tokens of a ``frames``-frame ``height`` x ``width`` video (all its frames).

    ``_get_num_multimodal_tokens(video_sizes=...)`` where the processor takes ``video_sizes``
    (transformers 5.2x). transformers 5.17's takes none, and calling it with one anyway writes
    the keyword into the class-wide image defaults, breaking every later call: there the video
    processor runs on ONE blank frame of that size (its ``num_soft_tokens_per_video`` is per
    frame), times ``frames``."""
    fn = proc._get_num_multimodal_tokens
    if "video_sizes" in inspect.signature(fn).parameters:
        counts = fn(video_sizes=[(frames, height, width)]).num_video_tokens
        if counts is not None:
            return int(counts[0])
    from PIL import Image

    frame = Image.new("RGB", (int(width), int(height)))
    out = proc.video_processor(videos=[[frame]], return_tensors="pt")
    return int(out["num_soft_tokens_per_video"].reshape(-1)[0]) * int(frames)


def _check_video_tokens(sample: Mapping[str, Any], record: Mapping[str, Any], proc: Any) -> None:
    """Video tokens in the text == the real patches of ``video_position_ids`` / pooling**2 (what
    the tower returns) == ``_get_num_multimodal_tokens`` for frame lists."""
    sid = sample["sample_id"]
    found = int((sample["mm_token_type_ids"] == 2).sum())
    real = (sample["video_position_ids"] != -1).all(dim=-1).sum()
    pool = int(proc.video_processor.pooling_kernel_size) ** 2
    from_patches = int(real) // pool
    sizes = [
        (len(v), int(v[0].height), int(v[0].width))
        for v in _video_frames(record)
        if isinstance(v, Sequence) and not isinstance(v, str) and hasattr(v[0], "height")
    ]
    want = None
    if sizes and len(sizes) == len(_video_frames(record)):
        want = sum(gemma4_video_tokens(proc, *size) for size in sizes)
    if found != from_patches or (want is not None and found != want):
        raise SampleError(
            sid,
            "media_token_mismatch",
            f"{found} video token(s) in the text, {from_patches} from video_position_ids, "
            f"{want} from _get_num_multimodal_tokens for videos {sizes}",
        )


def gemma4_packed_masks(
    doc_ids: Tensor,
    mm_token_type_ids: Tensor,
    *,
    bidirectional_vision: bool = False,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """``{"full_attention", "sliding_attention"}`` additive masks for a packed Gemma 4 row."""
    from neatpack.pipes.collating.mask import to_4d_additive_mask

    full = to_4d_additive_mask(doc_ids, dtype)
    if not bidirectional_vision:
        return {"full_attention": full, "sliding_attention": full}
    sliding = gemma3_packed_mask(
        doc_ids, mm_token_type_ids, dtype, sliding_window=sliding_window, vision_codes=(1, 2)
    )
    return {"full_attention": full, "sliding_attention": sliding}


def gemma4_pack_media(samples: Any) -> dict[str, Tensor]:
    """The pack's media in document order: ``pixel_values`` / ``image_position_ids`` of its
    images, ``pixel_values_videos`` / ``video_position_ids`` / ``num_frames_per_video`` of its
    videos, ``input_features`` / ``input_features_mask`` of its audio, right-padded in time to
    the longest (mask False: the audio tower reads only masked-in frames). With explicit masks
    the model needs no ``mm_token_type_ids``. Video frames are ``[frames, patches, dim]``
    (transformers 5.2x) or ``[videos, frames, patches, dim]`` (5.17, joined as
    ``[frames, 1, patches, dim]``)."""
    out: dict[str, Tensor] = {}
    frames = max((int(s["input_features"].shape[1]) for s in samples
                  if s.get("input_features") is not None), default=0)  # fmt: skip
    for key in ("pixel_values", "image_position_ids", "pixel_values_videos",
                "video_position_ids", "num_frames_per_video", "input_features",
                "input_features_mask"):  # fmt: skip
        parts = [s[key] for s in samples if s.get(key) is not None]
        if key == "input_features":
            parts = [torch.nn.functional.pad(p, (0, 0, 0, frames - p.shape[1])) for p in parts]
        elif key == "input_features_mask":
            parts = [torch.nn.functional.pad(p, (0, frames - p.shape[1])) for p in parts]
        elif key in ("pixel_values_videos", "video_position_ids") and parts[:1]:
            _join_video_frames(out, key, parts)
            continue
        if parts:
            out[key] = torch.cat(parts, dim=0)
    return out


def _join_video_frames(out: dict[str, Tensor], key: str, parts: list[Tensor]) -> None:
    if parts[0].dim() == 4:  # transformers 5.17: [videos, frames, ...], frame counts may differ
        # as [frames, 1, ...]: the model flattens dims 0-1 and concatenates every item's tokens
        # in order, so one-frame "videos" give the same embeddings, and frames stay on dim 0
        # (the pipeline-parallel split counts them there, as for 5.2x)
        out[key] = torch.cat([p.reshape(-1, 1, *p.shape[2:]) for p in parts], dim=0)
    else:  # 5.2x: [frames, ...]
        out[key] = torch.cat(parts, dim=0)


# -- the length estimate (Handler.estimate): exact mode == the real length ------------------------


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
        total = gemma4_video_tokens(proc, n, h, w)
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
    from neatpack.pipes.indexing._template_probe import probe_overhead
    from neatpack.pipes.indexing.estimate import LengthEstimator

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


GEMMA4_HANDLER = register_handler(
    Handler(
        "gemma4",
        tokenize_gemma4,
        min_transformers="5.5",  # Gemma4Processor is new in 5.5
        modalities=GEMMA4_MODALITIES,
        pack_media=gemma4_pack_media,
        packed_mask=gemma4_packed_masks,
        description="Gemma 4: thinking-channel prefix injected after each model turn and kept "
        "out of the labels (pipes/families/gemma4.py); images, videos (frame lists), audio",
        estimate=gemma4_estimate,
    ),
    ("Gemma4Processor",),
)
