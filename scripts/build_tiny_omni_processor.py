"""Build the tiny, real, offline ``Qwen2_5OmniProcessor`` and ``Qwen3OmniMoeProcessor`` that
neatpack's Omni tests use.

Usage::

    python scripts/build_tiny_omni_processor.py [OUT_DIR]  # default: tests/support/assets/...

Writes ``qwen2_5_omni/``, every part a real transformers class:

* the byte-level BPE already shipped in ``qwen2_vl/`` (trained by
  ``scripts/build_tiny_processors.py``; reloaded, not retrained, so the ids of the shared vocabulary
  are the same in every tiny processor) plus Qwen2.5-Omni's named multimodal tokens
  (``<|IMAGE|>``, ``<|AUDIO|>``, ``<|VIDEO|>``, ``<|vision_bos|>`` / ``<|vision_eos|>``,
  ``<|audio_bos|>`` / ``<|audio_eos|>``), the attributes ``Qwen2_5OmniProcessor.__init__`` reads;
* a Qwen2.5-Omni-style chat template (the real default system prompt, one
  ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per audio block, ``<|vision_bos|><|IMAGE|><|vision_eos|>``
  per image block, the video equivalent, assistant turns in ``{% generation %}``);
* ``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor`` with the same small pixel budget as the
  Qwen-VL tiny processors (``MIN_PIXELS`` / ``MAX_PIXELS`` imported from that script);
* the real ``WhisperFeatureExtractor`` with Qwen2.5-Omni's settings: 128 mel bins, 16 kHz,
  hop 160, 30 s window, attention mask on (numpy/torch STFT only: no librosa, no torchaudio).

and ``qwen3_omni/``, the same recipe with Qwen3-Omni's differences:

* the same BPE plus Qwen3-Omni's token names (``<|image_pad|>`` / ``<|video_pad|>`` /
  ``<|vision_start|>`` / ``<|vision_end|>`` already in the Qwen-VL vocabulary, and the new
  ``<|audio_start|>`` / ``<|audio_pad|>`` / ``<|audio_end|>``);
* a Qwen3-Omni-style template: no default system prompt, ``<|audio_start|><|audio_pad|>
  <|audio_end|>`` per audio block, ``<|vision_start|><|image_pad|><|vision_end|>`` per image;
* ``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor`` with patch 16 and mean/std 0.5 (as
  the real Qwen3-Omni checkpoint's config; the Qwen3-VL tiny processor uses the same numbers);
* the same ``WhisperFeatureExtractor`` (the processor itself pads to the longest audio and does
  not truncate: its audio encoder works on 100-frame chunks, so there is no 30 s window).

Saved with ``save_pretrained``; reloads with ``AutoProcessor.from_pretrained(folder)`` and no
network. Deterministic: the same inputs give the same bytes (a slow test rebuilds and compares).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_processors import MAX_PIXELS, MIN_PIXELS, TEST_ASSETS, save_processors

OMNI_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
OMNI_SYSTEM = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech."
)
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' or 'audio' in content %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'image' or 'image' in content %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)
OMNI_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + OMNI_SYSTEM + "<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}" + _CONTENT + "<|im_end|>{% endgeneration %}"
    "{% else %}" + _CONTENT + "<|im_end|>{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


QWEN3_OMNI_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
_CONTENT3 = (
    _CONTENT.replace(
        "<|audio_bos|><|AUDIO|><|audio_eos|>", "<|audio_start|><|audio_pad|><|audio_end|>"
    )
    .replace("<|vision_bos|><|IMAGE|><|vision_eos|>", "<|vision_start|><|image_pad|><|vision_end|>")
    .replace("<|vision_bos|><|VIDEO|><|vision_eos|>", "<|vision_start|><|video_pad|><|vision_end|>")
)
QWEN3_OMNI_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}" + _CONTENT3 + "<|im_end|>{% endgeneration %}"
    "{% else %}" + _CONTENT3 + "<|im_end|>{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _whisper() -> Any:
    """Qwen-Omni's feature extractor: 128 mel bins, 16 kHz, hop 160, 30 s window, mask on."""
    import transformers as tf

    return tf.WhisperFeatureExtractor(  # type: ignore[no-untyped-call]
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
        return_attention_mask=True,
    )


def _vision(patch: int, **extra: Any) -> tuple[Any, Any]:
    """The real image and video processors with the Qwen-VL tiny pixel budget."""
    import transformers as tf

    unit = (patch * 2) ** 2
    common: dict[str, Any] = {
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": unit * MIN_PIXELS, "longest_edge": unit * MAX_PIXELS},
        **extra,
    }
    return (
        tf.Qwen2VLImageProcessor(**common),
        tf.Qwen2VLVideoProcessor(**common, cap_pixels_per_frame=False),
    )


def _tokenizer(tokens: dict[str, str]) -> Any:
    import transformers as tf

    qwen = Path(__file__).resolve().parents[1] / "pipes" / "_assets" / "processors" / "qwen2_vl"
    return tf.Qwen2Tokenizer.from_pretrained(
        str(qwen), local_files_only=True, extra_special_tokens=dict(tokens)
    )


def build_omni() -> Any:
    """Assemble the real ``Qwen2_5OmniProcessor`` (module docstring)."""
    import transformers as tf

    image, video = _vision(14)
    return tf.Qwen2_5OmniProcessor(  # type: ignore[no-untyped-call]
        image_processor=image,
        video_processor=video,
        feature_extractor=_whisper(),
        tokenizer=_tokenizer(OMNI_TOKENS),
        chat_template=OMNI_TEMPLATE,
    )


def build_qwen3_omni() -> Any:
    """Assemble the real ``Qwen3OmniMoeProcessor`` (module docstring)."""
    import transformers as tf

    image, video = _vision(16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return tf.Qwen3OmniMoeProcessor(  # type: ignore[no-untyped-call]
        image_processor=image,
        video_processor=video,
        feature_extractor=_whisper(),
        tokenizer=_tokenizer(QWEN3_OMNI_TOKENS),
        chat_template=QWEN3_OMNI_TEMPLATE,
    )


def main(argv: list[str]) -> int:
    builders = {"qwen2_5_omni": build_omni, "qwen3_omni": build_qwen3_omni}
    save_processors(Path(argv[1]) if len(argv) > 1 else TEST_ASSETS, builders)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
