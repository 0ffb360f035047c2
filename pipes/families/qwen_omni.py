"""Qwen2.5-Omni (``Qwen2_5OmniProcessor`` / ``Qwen2_5OmniThinkerForConditionalGeneration``):
text, images, videos and AUDIO in one conversation; the path Qwen3-Omni shares
(``qwen3_omni``: ``OmniRule`` holds the audio differences).

Audio blocks (``{"type": "audio", "audio": <.wav path | 1-D float array>}``, optional
``"sampling_rate"``) are found and read by ``neatpack.pipes.reading.audio`` (rate must equal the
extractor's 16000 Hz, never resampled; mono PCM WAV; missing / empty / non-finite / longer than
the extractor's 30 s window refused naming the sample). This family adds one refusal: audio too
short to give one token (< 3 mel frames, about 30 ms).

What differs from the default path:

* the processor takes ``audio=[...]`` beside ``images``; each ``<|AUDIO|>`` placeholder becomes
  ``conv(ceil(samples / hop))`` tokens (two stride-2 convolutions: ``(n - 1) // 2 + 1`` then
  ``(n - 2) // 2 + 1``), checked per audio against both the processor's duration rule
  (``_get_num_audio_tokens``) and ``feature_attention_mask`` (what the encoder will produce);
* ``mm_token_type_ids`` is 0 text, 1 image, 2 video, 3 audio; media tokens are never labelled;
* the Sample carries the processor's ``input_features`` ``[n_audio, 128, 3000]`` and
  ``feature_attention_mask`` ``[n_audio, 3000]`` as returned (padded to the 30 s window), plus
  ``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` / ``video_grid_thw`` /
  ``video_second_per_grid`` (``temporal_patch_size / fps``: the block's ``fps`` or
  ``videos_meta``, else the processor's default; see ``_video_kwargs``);
* positions are 3-D mRoPE with audio in time and videos in scaled time:
  ``qwen_omni_position_ids`` takes them from the model's own ``get_rope_index`` per document,
  ``qwen_omni_mrope`` computes the same ``[3, L]`` without the model (``qwen_omni.py``); a
  packed row concatenates them and needs the block-causal 4D mask
  (``mask.to_4d_additive_mask``); ``qwen_omni_pack_media`` concatenates the media in document
  order.

Videos are frame lists (or files, decoded by the processor's backend) as for Qwen-VL. Audio
taken from a video's own track (the processors' ``use_audio_in_video``, audio interleaved with
the video in time) is not supported: neatpack never asks for it, so a video's sound is ignored,
and a record or video block asking for it (``use_audio_in_video``) is a ``SampleError``; give
the track as a separate audio block instead.

>>> QWEN2_5_OMNI.tokens(None, 100)  # 1 s at hop 160: 100 mel frames -> 50 -> 25 tokens
25
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import Tensor

from neatpack.pipes.materializing.labels import (
    RoleMarkers,
    conversation_labels,
    resolve_role_markers,
)
from neatpack.pipes.reading._conversation import parse_conversation
from neatpack.pipes.reading.audio import load_audio, load_audio_block, split_audio_blocks
from neatpack.pipes.reading.media import SampleError, load_image, load_video

from ._shared import check_modalities
from .audio import audio_conversation, audio_lengths, image_sizes, text_estimate
from .chat_template import (
    check_media_counts,
    forbidden_names,
    media_token_types,
    processor_failure,
)
from .processor_compat import image_token_counts, processor_default, video_token_counts
from .registry import Handler, register_handler

__all__ = [
    "OMNI_MODALITIES",
    "QWEN2_5_OMNI",
    "QWEN_OMNI_HANDLER",
    "OmniRule",
    "load_audio",
    "omni_estimate",
    "omni_tokenize",
    "qwen_omni_audio_tokens",
    "qwen_omni_estimate",
    "qwen_omni_mrope",
    "qwen_omni_pack_media",
    "qwen_omni_position_ids",
    "tokenize_qwen_omni",
]

OMNI_MODALITIES: Final = frozenset({"image", "video", "audio"})
_STRUCTURAL: Final = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
_MEDIA_KEYS: Final = (
    "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
    "video_second_per_grid", "input_features", "feature_attention_mask",
)  # fmt: skip
_MEDIA_ATTRS: Final = (
    "vision_bos_token", "vision_eos_token", "audio_bos_token", "audio_eos_token",
)  # fmt: skip


def _conv_out(frames: int) -> int:
    """Tokens from mel frames: the audio encoder's two stride-2 convolutions."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


@dataclass(frozen=True)
class OmniRule:
    """What one Qwen-Omni generation does differently with audio; everything else (template,
    labels, images, token types, positions for images and audio) is shared.

    ``tokens(processor, frames)``: audio tokens for ``frames`` mel frames. ``pad_to_longest``:
    how the processor pads the audios of one call, which sets the frames each one keeps:
    Whisper's mask is ``ceil(samples / hop)`` long, cut to the padded length ``// hop``. Padded
    to the 30 s window (Qwen2.5-Omni, False) that is ``min(ceil(n / hop), 3000)`` and longer
    audio is refused; padded to the longest audio of the call (Qwen3-Omni, True) the longest
    keeps ``n // hop`` and the others ``ceil(n / hop)``, and nothing is cut."""

    name: str
    tokens: Callable[[Any, int], int]
    pad_to_longest: bool

    def max_samples(self, processor: Any) -> int | None:
        """The longest audio accepted (None: the processor cuts nothing)."""
        return None if self.pad_to_longest else int(processor.feature_extractor.n_samples)

    def min_samples(self, processor: Any) -> int:
        """The shortest audio accepted: padded to the longest, an audio is itself the STFT's
        input, whose reflect padding needs more than ``n_fft // 2`` samples (201: 12.6 ms)."""
        return int(processor.feature_extractor.n_fft) // 2 + 1 if self.pad_to_longest else 1

    def frames(self, processor: Any, lengths: Sequence[int]) -> list[int]:
        """Mel frames kept (``feature_attention_mask`` sums) for the audios of ONE sample."""
        fe = processor.feature_extractor
        hop = int(fe.hop_length)
        padded = max(lengths, default=0) if self.pad_to_longest else int(fe.n_samples)
        return [min(-(-n // hop), padded // hop) for n in lengths]

    def audio_tokens(self, processor: Any, lengths: Sequence[int]) -> list[int]:
        """Audio tokens for the audios of ONE sample (``lengths`` in samples, in order)."""
        return [self.tokens(processor, f) for f in self.frames(processor, lengths)]


def _tokens_2_5(_processor: Any, frames: int) -> int:
    return _conv_out(frames)


QWEN2_5_OMNI: Final = OmniRule("Qwen2.5-Omni", _tokens_2_5, pad_to_longest=False)
"""Qwen2.5-Omni: ``ceil(samples / hop)`` frames (padded to the 30 s window, longer refused),
two stride-2 convolutions."""


def qwen_omni_audio_tokens(processor: Any, n_samples: int) -> int:
    """Audio tokens for ``n_samples`` samples at the extractor's rate (the processor's rule)."""
    return QWEN2_5_OMNI.audio_tokens(processor, [n_samples])[0]


def _audio_runs(ids: Tensor, mm: Tensor, bos: int) -> list[int]:
    """Lengths of the audio-token runs, in order (each run follows an ``<|audio_bos|>``)."""
    runs: list[int] = []
    ids_l, mm_l = ids.tolist(), mm.tolist()
    for i, t in enumerate(ids_l):
        if t == bos:
            n = 0
            while i + 1 + n < len(mm_l) and mm_l[i + 1 + n] == 3:
                n += 1
            runs.append(n)
    return runs


def tokenize_qwen_omni(
    record: Mapping[str, Any],
    processor: Any,
    *,
    label_policy: str = "assistant",
    markers: RoleMarkers | None = None,
    max_image_pixels: int | str | None = "pil",
) -> dict[str, Any]:
    """One Record with text, image and audio blocks -> one Sample (module docstring)."""
    return omni_tokenize(
        record,
        processor,
        QWEN2_5_OMNI,
        label_policy=label_policy,
        markers=markers,
        max_image_pixels=max_image_pixels,
    )


def omni_tokenize(
    record: Mapping[str, Any],
    processor: Any,
    rule: OmniRule,
    *,
    label_policy: str = "assistant",
    markers: RoleMarkers | None = None,
    max_image_pixels: int | str | None = "pil",
) -> dict[str, Any]:
    """``tokenize_qwen_omni`` for any Qwen-Omni generation, its audio rule given."""
    if label_policy not in ("assistant", "last_assistant"):
        raise ValueError(f"{label_policy=} is not one of ('assistant', 'last_assistant')")
    check_modalities(record, processor, OMNI_MODALITIES)
    tok = processor.tokenizer
    markers = markers or resolve_role_markers(processor)
    forbidden = set(forbidden_names(processor, tok, markers)) | set(_STRUCTURAL)
    forbidden.update(
        str(getattr(processor, a)) for a in _MEDIA_ATTRS if getattr(processor, a, None)
    )
    stand_in, where, audio_blocks = split_audio_blocks(record)
    sid, conv, image_src, video_src, video_fps = parse_conversation(
        stand_in, tuple(sorted(forbidden))
    )
    for k, j in where:
        conv[k]["content"][j] = {"type": "audio"}
    fe = processor.feature_extractor
    audio = [
        load_audio_block(
            b,
            sample_id=sid,
            sampling_rate=int(fe.sampling_rate),
            max_samples=rule.max_samples(processor),
        )
        for b in audio_blocks
    ]
    want_audio = rule.audio_tokens(processor, [a.shape[0] for a in audio])
    for n, (a, want) in enumerate(zip(audio, want_audio, strict=True)):
        if want < 1 or a.shape[0] < rule.min_samples(processor):
            raise SampleError(
                sid,
                "bad_media",
                f"audio {n} has {a.shape[0]} samples ({a.shape[0] / fe.sampling_rate * 1000:.1f} "
                "ms), too short for one audio token; drop it or pad it",
            )
    images = [load_image(s, sample_id=sid, max_image_pixels=max_image_pixels) for s in image_src]
    kwargs: dict[str, Any] = {"return_tensors": "pt"}
    if images:
        kwargs["images"] = images
    if audio:
        kwargs["audio"] = audio
    if video_src:
        kwargs.update(_video_kwargs(stand_in, sid, video_src, video_fps))
    try:
        text = processor.apply_chat_template(conv, tokenize=False)
        out = processor(text=[text], **kwargs)
    except Exception as exc:
        raise processor_failure(
            sid, exc, "video_error" if video_src else "processor_error"
        ) from exc
    ids = out["input_ids"][0].long()
    mm = media_token_types(ids, processor)
    check_media_counts(sid, processor, out, mm, images)
    runs = _audio_runs(ids, mm, int(tok.convert_tokens_to_ids(processor.audio_bos_token)))
    fam = out.get("feature_attention_mask")
    from_features = (
        [] if fam is None else [rule.tokens(processor, int(f)) for f in fam.sum(-1).tolist()]
    )
    if runs != want_audio or (audio and from_features != want_audio):
        raise SampleError(
            sid,
            "media_token_mismatch",
            f"audio tokens per audio {runs} in the text, {from_features} from "
            f"feature_attention_mask, but the durations give {want_audio}",
        )
    labels = conversation_labels(
        ids, conv, markers, sample_id=sid, mm_token_type_ids=mm, label_policy=label_policy
    )
    sample: dict[str, Any] = {"sample_id": sid, "input_ids": ids}
    for key in _MEDIA_KEYS:
        if out.get(key) is not None:
            sample[key] = torch.as_tensor(out[key])
    if "video_second_per_grid" in sample:
        sample["video_second_per_grid"] = sample["video_second_per_grid"].float()
    if "feature_attention_mask" in sample:
        sample["feature_attention_mask"] = sample["feature_attention_mask"].long()
    sample.update(
        labels=labels, attention_mask=out["attention_mask"][0].long(), mm_token_type_ids=mm
    )
    return sample


def _video_kwargs(
    record: Mapping[str, Any], sid: Any, video_src: list[Any], video_fps: list[float | None]
) -> dict[str, Any]:
    """Processor kwargs for a sample's videos: the frames as given (``do_sample_frames=False``)
    and their ``fps`` (the block's, else ``videos_meta``), which the Omni processors turn into
    ``video_second_per_grid = temporal_patch_size / fps``, the videos' time scale in mRoPE. One
    ``fps`` per call: videos of one sample at different rates are refused. Unknown (a file, or
    no rate given): the processor's default (Qwen2.5-Omni 2.0, Qwen3-Omni 1.0). Asking for
    the video's own audio track (``use_audio_in_video`` / ``load_audio_from_video`` on the
    record or a video block) is refused: interleaving it needs a decoder for the track and a
    position rule neatpack does not reproduce."""
    from neatpack.pipes.materializing.tokenize import video_metadata_of

    blocks = [b for m in record["conversation"] for b in m.get("content") or []
              if isinstance(b, Mapping) and b.get("type", "video" if "video" in b else None)
              == "video"]  # fmt: skip
    for where in (record, *blocks):
        for key in ("use_audio_in_video", "load_audio_from_video"):
            if where.get(key):
                raise SampleError(
                    sid,
                    "bad_media",
                    f"{key}={where[key]!r} is not supported (the video's own audio track "
                    "interleaved with its frames); give the track as a separate audio block",
                )

    videos = [load_video(v, sample_id=sid) for v in video_src]
    out: dict[str, Any] = {"videos": videos, "do_sample_frames": False}
    meta = video_metadata_of(record, videos, video_fps)
    rates = sorted({m["fps"] for m in meta}) if meta else []
    if len(rates) > 1:
        raise SampleError(
            sid,
            "bad_media",
            f"videos at fps {rates} in one sample; the Omni processors take one fps per call "
            "(video_second_per_grid): resample the frames to one rate or split the sample",
        )
    if rates:
        out["fps"] = float(rates[0])
    return out


def qwen_omni_estimate(record: Mapping[str, Any], processor: Any, *, mode: str = "exact") -> int:
    """Qwen2.5-Omni's ``omni_estimate`` (``pipes/omni_estimate.py``)."""
    return omni_estimate(record, processor, QWEN2_5_OMNI, mode=mode)


def qwen_omni_pack_media(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The model's media inputs for the documents of one pack, concatenated in document order:
    ``pixel_values`` / ``image_grid_thw`` and ``input_features`` / ``feature_attention_mask``
    (each present only when some document has that medium). Audio features narrower than the
    widest are right-padded with zeros and mask 0 (Qwen3-Omni pads each call to its longest
    audio; Qwen2.5-Omni's are all 3000 frames): the encoders read only the masked-in frames."""
    out: dict[str, Any] = {}
    width = max((int(s["input_features"].shape[-1]) for s in samples
                 if s.get("input_features") is not None), default=0)  # fmt: skip
    for key in _MEDIA_KEYS:
        parts = [s[key] for s in samples if s.get(key) is not None]
        if key in ("input_features", "feature_attention_mask"):
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in parts]
        if parts:
            out[key] = torch.cat(parts, dim=0)
    return out


# -- the length estimate of both Omni generations (Handler.estimate) ------------------------------


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
    image = image_token_counts(processor, sizes)
    video = video_token_counts(processor, _video_sizes(conv, record.get("videos_meta"), sid))
    image = [*image, *video]  # both: one placeholder in the text, expanded to its count
    if mode == "exact":
        text = processor.apply_chat_template(conv, tokenize=False)
        n_text = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        # each placeholder (image / video / audio) is one token of n_text, expanded to its count
        return int(n_text - len(image) - len(audio) + sum(image) + sum(audio) - 1)
    n_text = text_estimate(record, conv, where, processor)
    # + <|audio_bos|> / <|audio_eos|> per audio (the estimator sees no audio blocks)
    return int(n_text + sum(image) + sum(audio) + 2 * len(audio))


# -- positions: from the model, and without it (Handler.positions) --------------------------------


def qwen_omni_position_ids(sample: Mapping[str, Any], model: Any) -> Tensor:
    """``[3, L]`` mRoPE ids of ONE unshifted sample from the model's own ``get_rope_index``
    (images in 3-D, videos in 3-D with time scaled by ``video_second_per_grid``, audio in time;
    plain ``0..L-1`` on all rows when there is no image or video)."""
    ids = torch.as_tensor(sample["input_ids"]).reshape(1, -1)
    fam = sample.get("feature_attention_mask")
    # transformers 5.2x: on the text model; 5.17: only on the thinker itself
    rope_index = getattr(model.model, "get_rope_index", None) or model.get_rope_index
    with torch.no_grad():
        pos, _ = rope_index(
            ids,
            image_grid_thw=sample.get("image_grid_thw"),
            video_grid_thw=sample.get("video_grid_thw"),
            second_per_grids=sample.get("video_second_per_grid"),
            attention_mask=torch.as_tensor(sample["attention_mask"]).reshape(1, -1),
            audio_seqlens=None if fam is None else fam.sum(-1),
        )
    out: Tensor = pos[:, 0, :]
    return out


_FRACTIONAL_TIME: Final = frozenset({"Qwen3OmniMoeProcessor"})
"""Processors whose model keeps a video's temporal ids fractional (Qwen2.5-Omni truncates)."""


def qwen_omni_mrope(sample: Mapping[str, Any], processor: Any) -> Tensor:
    """``[3, L]`` mRoPE ids of ONE unshifted sample WITHOUT the model (for workers).

    Qwen-Omni's ``get_rope_index``: text and audio tokens count up by one on all three rows
    (audio runs in time); an image or a whole video gets its ``t x h x w`` grid (``h``, ``w``
    divided by the merge size) added to the current position, with ``t`` scaled to time:
    ``arange(t) * position_id_per_seconds`` for images (so 0) and ``arange(t) *
    video_second_per_grid * position_id_per_seconds`` for videos (float32, truncated to an
    integer by Qwen2.5-Omni, kept fractional by Qwen3-Omni); the next token starts at the
    block's largest id + 1 (not Qwen2.5-VL's ``start + max(h, w)``, which differs once a video's
    time outruns its width). ``position_id_per_seconds`` is the processor's: the model config
    must use the same. Long ids, or float32 when some Qwen3-Omni video time is fractional.
    Audio interleaved with video (``use_audio_in_video``) is never produced by neatpack. The
    tests check equality with the models' own ``get_rope_index``.

    >>> ids = torch.zeros(8, dtype=torch.long)
    >>> s = {"input_ids": ids, "mm_token_type_ids": torch.tensor([0, 2, 2, 2, 2, 0, 3, 0]),
    ...      "video_grid_thw": torch.tensor([[2, 2, 4]]),
    ...      "video_second_per_grid": torch.tensor([1.0])}  # 2 s per grid step at fps 2
    >>> from types import SimpleNamespace  # the two processor fields the rule reads
    >>> proc = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2),
    ...                        position_id_per_seconds=25)  # the tiny Qwen2.5-Omni's values
    >>> qwen_omni_mrope(s, proc).tolist()  # t step 25 ids per grid
    [[0, 1, 1, 26, 26, 27, 28, 29], [0, 1, 1, 1, 1, 27, 28, 29], [0, 1, 2, 1, 2, 27, 28, 29]]
    """
    mm = torch.as_tensor(sample["mm_token_type_ids"]).reshape(-1)
    keep = torch.as_tensor(sample.get("attention_mask", torch.ones_like(mm))).reshape(-1).bool()
    types = mm[keep].tolist()
    merge = int(processor.image_processor.merge_size)
    pps = processor_default(processor, "position_id_per_seconds")
    grids: dict[int, list[list[int]]] = {
        code: [] if g is None else torch.as_tensor(g).tolist()
        for code, g in ((1, sample.get("image_grid_thw")), (2, sample.get("video_grid_thw")))
    }
    seconds = sample.get("video_second_per_grid")
    fractional = type(processor).__name__ in _FRACTIONAL_TIME
    used = {1: 0, 2: 0}
    parts: list[Tensor] = []
    cur = torch.tensor(0.0)
    i = 0
    while i < len(types):
        code, j = types[i], i
        while j < len(types) and types[j] == code:
            j += 1
        if code in (1, 2):
            k = used[code]
            if k >= len(grids[code]):
                raise ValueError(
                    f"sample {sample.get('sample_id')}: more {('image', 'video')[code - 1]} "
                    "blocks than grids"
                )
            t, h, w = (int(x) for x in grids[code][k])
            used[code] += 1
            scale = torch.as_tensor(seconds).float()[k] if code == 2 else torch.tensor(1.0)
            t_idx = torch.arange(t) * scale * pps
            t_idx = t_idx.float() if fractional else t_idx.long().float()
            h, w = h // merge, w // merge
            block = torch.stack([
                t_idx.view(-1, 1).expand(-1, h * w).flatten(),
                torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten().float(),
                torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten().float(),
            ]) + cur  # fmt: skip
            if block.shape[1] != j - i:
                raise ValueError(
                    f"sample {sample.get('sample_id')}: a run of {j - i} media tokens but the "
                    f"grid {[t, h * merge, w * merge]} gives {block.shape[1]}"
                )
        else:
            block = (torch.arange(j - i).float() + cur).expand(3, -1)
        parts.append(block)
        cur = block.max() + 1
        i = j
    pos = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0)
    out = torch.zeros(3, mm.shape[0], dtype=pos.dtype)
    out[:, keep] = pos
    return out.long() if bool((out == out.round()).all()) else out


QWEN_OMNI_HANDLER = register_handler(
    Handler(
        "qwen_omni",
        tokenize_qwen_omni,
        modalities=OMNI_MODALITIES,
        pack_media=qwen_omni_pack_media,
        mrope=True,
        description="Qwen2.5-Omni: images + audio (WhisperFeatureExtractor features, 16 kHz "
        "checked), mRoPE from the model's get_rope_index (pipes/families/qwen_omni.py)",
        estimate=qwen_omni_estimate,
        positions=qwen_omni_mrope,
    ),
    ("Qwen2_5OmniProcessor",),
)
