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

>>> proc = load_tiny_qwen3_omni_processor()
>>> qwen3_omni_audio_tokens(proc, [16000])  # 1 s: 100 frames = one full chunk -> 13 tokens
[13]
>>> qwen3_omni_audio_tokens(proc, [12345, 16000])  # ceil(77.2) = 78 frames -> 39 -> 20 -> 10
[10, 13]
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from neatpack.pipes.labels import RoleMarkers
from neatpack.pipes.media import SampleError
from neatpack.pipes.tiny_family_models import WITH_AUDIO, init_tiny_model

from . import Handler, register_handler
from .qwen_omni import (
    OMNI_MODALITIES,
    OmniRule,
    omni_estimate,
    omni_tokenize,
    qwen_omni_mrope,
    qwen_omni_pack_media,
)

__all__ = [
    "QWEN3_OMNI",
    "QWEN3_OMNI_HANDLER",
    "load_tiny_qwen3_omni_processor",
    "qwen3_omni_audio_tokens",
    "qwen3_omni_estimate",
    "tiny_qwen3_omni_model",
    "tokenize_qwen3_omni",
]

_FOLDER = Path(__file__).resolve().parents[1] / "_assets" / "processors" / "qwen3_omni"
_CHUNK_TOKENS: Final = 13  # tokens of one full 2 * n_window-frame chunk (conv3(100))


def load_tiny_qwen3_omni_processor() -> Any:
    """The shipped tiny ``Qwen3OmniMoeProcessor`` (``scripts/build_tiny_omni_processor.py``)."""
    if not (_FOLDER / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Qwen3-Omni processor missing in {_FOLDER}; rebuild it with "
            "`python scripts/build_tiny_omni_processor.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_FOLDER), local_files_only=True)  # type: ignore[no-untyped-call]


def _tokens(processor: Any, frames: int) -> int:
    """Audio tokens for ``frames`` mel frames: 13 per full chunk plus the remainder's three
    stride-2 convolutions (``(n - 1) // 2 + 1`` each; 0 frames give 0)."""
    chunk = 2 * int(getattr(processor, "n_window", 50))
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
        steps = seconds.float() * float(processor.position_id_per_seconds)
        if not bool((steps == steps.round()).all()):
            raise SampleError(
                sample["sample_id"],
                "bad_media",
                f"video time step {steps.tolist()} position ids per frame pair "
                f"(video_second_per_grid {seconds.tolist()} x position_id_per_seconds "
                f"{processor.position_id_per_seconds}) is fractional; packed rows hold integer "
                "positions: give the frames at fps 0.5, 1 or 2 (resample them beforehand)",
            )
    return sample


def qwen3_omni_estimate(record: Mapping[str, Any], processor: Any, *, mode: str = "exact") -> int:
    """Length after the shift without the feature extractor or the image processor
    (``qwen_omni.omni_estimate`` with Qwen3-Omni's audio rule)."""
    return omni_estimate(record, processor, QWEN3_OMNI, mode=mode)


def tiny_qwen3_omni_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``Qwen3OmniMoeThinkerForConditionalGeneration`` for the tiny processor.

    Text: a real mixture of experts (4 experts, top 2, every layer sparse), hidden 64, 2 layers,
    interleaved mRoPE sections [2, 3, 3]; vision: depth 2, width 32, patch 16, deepstack from
    layer 0 into text layer 0; audio: 2 layers, d_model 32, 128 mel bins, ``n_window`` 50 (as
    the processor), initialised with std 0.2 so that its output depends on the audio.
    ``position_id_per_seconds`` 13, as the processor (videos' temporal scale).
    """
    from transformers import (
        Qwen3OmniMoeThinkerConfig,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    tok = processor.tokenizer
    cfg = Qwen3OmniMoeThinkerConfig(
        text_config={
            "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 4096, "bos_token_id": None,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": [2, 3, 3], "interleaved": True},
            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
        },
        audio_config={
            "num_mel_bins": int(processor.feature_extractor.feature_size), "encoder_layers": 2,
            "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "d_model": 32,
            "output_dim": 64, "n_window": int(getattr(processor, "n_window", 50)),
            "downsample_hidden_size": 16,
            # at 0.02 this tiny tower's output has std 0.006 and barely depends on its input
            # (zeroed features move the logits by 1e-4); at 0.2 the audio really counts
            "initializer_range": 0.2,
        },
        audio_token_id=int(processor.audio_token_id),
        image_token_id=int(processor.image_token_id),
        video_token_id=int(processor.video_token_id),
        audio_start_token_id=int(tok.convert_tokens_to_ids(processor.audio_bos_token)),
        position_id_per_seconds=int(processor.position_id_per_seconds),
        # not a declared field, but get_rope_index reads config.vision_start_token_id
        vision_start_token_id=int(tok.convert_tokens_to_ids(processor.vision_bos_token)),  # type: ignore[call-arg]
    )  # fmt: skip
    return init_tiny_model(
        Qwen3OmniMoeThinkerForConditionalGeneration,
        cfg,
        seed=seed,
        attn=attn,
        subconfigs=WITH_AUDIO,
    )


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
