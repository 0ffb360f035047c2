"""Build the tiny, real, offline processors of the audio families Phi-4-multimodal and
Nemotron-H Omni.

Usage::

    python scripts/build_tiny_audio_family_processors.py [OUT_DIR]

(default ``OUT_DIR``: ``tests/support/assets/processors``).

Writes ``phi4_multimodal/``, every part a real transformers class:

* the byte-level BPE merges and vocabulary already shipped in ``qwen2_vl/`` (trained by
  ``scripts/build_tiny_processors.py``; reused, not retrained) wrapped in the real
  ``GPT2Tokenizer`` (Phi-4-multimodal's tokenizer class), with Phi-4's turn tokens
  (``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|end|>``, eos ``<|endoftext|>``) and its
  named media tokens ``image_token="<|image|>"`` / ``audio_token="<|audio|>"`` (the attributes
  ``Phi4MultimodalProcessor.__init__`` reads);
* a Phi-4-style chat template: ``<|role|>content<|end|>`` per message, one ``<|image|>`` /
  ``<|audio|>`` per media block, assistant turns in ``{% generation %}``, eos at the end;
* ``Phi4MultimodalImageProcessor`` with the real 448-pixel crops (the processor's token rule
  hard-codes the 448/14 geometry: 256 global tokens + 16 separators, so a smaller crop would
  disagree with the model) and ``dynamic_hd=4`` (at most 4 crops per image);
* ``Phi4MultimodalFeatureExtractor`` with its real settings (80 mel bins, 16 kHz, hop 160,
  window 400, compression 8).

And ``nemotron_h_omni/``:

* the same BPE in ``GPT2Tokenizer`` with ChatML turns (``<|im_start|>`` / ``<|im_end|>``, eos
  ``<|im_end|>``) and Nemotron-H Omni's media tokens named as its processor reads them
  (``<image>`` in ``<img>`` ... ``</img>``, ``<video>``, ``<so_embedding>`` between
  ``<so_start>`` / ``<so_end>``), plus ``<think>`` / ``</think>``;
* a ChatML template (one ``<image>`` / ``<so_embedding>`` / ``<video>`` per block, assistant turns
  in ``{% generation %}``);
* ``NemotronH_Omni_Reasoning_V3ImageProcessor`` with a small patch budget (16..256 patches of 16
  px: 4..64 image tokens), its video processor, and the real ``ParakeetFeatureExtractor`` with
  128 mel bins (16 kHz, hop 160).

Note: ``Phi4MultimodalProcessor.__init__`` does not name ``chat_template``, so
``from_pretrained`` drops the processor's copy in transformers 5.23; the tokenizer keeps it and
``tests/support/tiny.load_tiny_phi4_processor`` restores it.

Saved with ``save_pretrained``; reloads with ``AutoProcessor.from_pretrained(folder)`` and no
network. Deterministic (no training: the vocabulary is read from ``qwen2_vl/``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_processors import ASSETS, TEST_ASSETS, save_processors

PHI4_TURNS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PHI4_MEDIA = {"image_token": "<|image|>", "audio_token": "<|audio|>"}
PHI4_CROPS = 4
_PHI4_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif content['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)
PHI4_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}" + _PHI4_CONTENT + "{{ '<|end|>' }}{% endgeneration %}"
    "{% else %}" + _PHI4_CONTENT + "{{ '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)


def shipped_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE vocabulary (added tokens dropped) and merges of the shipped ``qwen2_vl/``."""
    data = json.loads((ASSETS / "qwen2_vl" / "tokenizer.json").read_text(encoding="utf-8"))
    added = {t["content"] for t in data["added_tokens"]}
    vocab = {k: v for k, v in data["model"]["vocab"].items() if k not in added}
    merges: list[tuple[str, str]] = []
    for m in data["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ")
        merges.append((a, b))
    return vocab, merges


def phi4_tokenizer() -> Any:
    """The shipped BPE in the real ``GPT2Tokenizer`` with Phi-4's special tokens."""
    from transformers import GPT2Tokenizer

    vocab, merges = shipped_bpe()
    tok = GPT2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # pairs are accepted (as Qwen2Tokenizer's)
        unk_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        extra_special_tokens=dict(PHI4_MEDIA),
    )
    tok.add_special_tokens({"additional_special_tokens": PHI4_TURNS})
    return tok


def build_phi4() -> Any:
    """Assemble the real ``Phi4MultimodalProcessor`` (module docstring)."""
    import transformers as tf

    return tf.Phi4MultimodalProcessor(  # type: ignore[no-untyped-call]
        image_processor=tf.Phi4MultimodalImageProcessor(dynamic_hd=PHI4_CROPS),
        audio_processor=tf.Phi4MultimodalFeatureExtractor(),
        tokenizer=phi4_tokenizer(),
        chat_template=PHI4_TEMPLATE,
    )


NEMOTRON_MEDIA = {
    "image_token": "<image>",
    "video_token": "<video>",
    "audio_token": "<so_embedding>",
    "image_start_token": "<img>",
    "image_end_token": "</img>",
}
NEMOTRON_SPECIALS = ["<|im_start|>", "<|im_end|>", "<so_start>", "<so_end>", "<think>", "</think>"]
_NEMOTRON_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<image>' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>' }}"
    "{% elif content['type'] == 'audio' %}{{ '<so_embedding>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)
NEMOTRON_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}" + _NEMOTRON_CONTENT + "{{ '<|im_end|>' }}{% endgeneration %}"
    "{% else %}" + _NEMOTRON_CONTENT + "{{ '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NEMOTRON_MIN_PATCHES = 16  # 4x4 patches of 16 px: at least 4 image tokens
NEMOTRON_MAX_PATCHES = 256  # at most 64 image tokens per image


def nemotron_tokenizer() -> Any:
    """The shipped BPE in the real ``GPT2Tokenizer`` with Nemotron-H Omni's ChatML turns and
    media tokens (the names ``NemotronH_Omni_Reasoning_V3Processor.__init__`` reads)."""
    from transformers import GPT2Tokenizer

    vocab, merges = shipped_bpe()
    tok = GPT2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # pairs are accepted (as Qwen2Tokenizer's)
        unk_token="<|endoftext|>",
        bos_token=None,  # type: ignore[arg-type]  # Nemotron-H Omni's chat has no bos
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=16384,
        extra_special_tokens=dict(NEMOTRON_MEDIA),
    )
    tok.add_special_tokens({"additional_special_tokens": NEMOTRON_SPECIALS})
    return tok


def build_nemotron() -> Any:
    """Assemble the real ``NemotronH_Omni_Reasoning_V3Processor`` (module docstring)."""
    import transformers as tf
    from transformers.models.nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3ImageProcessor,
        NemotronH_Omni_Reasoning_V3Processor,
        NemotronH_Omni_Reasoning_V3VideoProcessor,
    )

    return NemotronH_Omni_Reasoning_V3Processor(
        image_processor=NemotronH_Omni_Reasoning_V3ImageProcessor(
            min_num_patches=NEMOTRON_MIN_PATCHES, max_num_patches=NEMOTRON_MAX_PATCHES
        ),
        video_processor=NemotronH_Omni_Reasoning_V3VideoProcessor(),
        tokenizer=nemotron_tokenizer(),
        feature_extractor=tf.ParakeetFeatureExtractor(feature_size=128),  # type: ignore[no-untyped-call]
        chat_template=NEMOTRON_TEMPLATE,
    )


BUILDERS = {"phi4_multimodal": build_phi4, "nemotron_h_omni": build_nemotron}


def main(argv: list[str]) -> int:
    save_processors(Path(argv[1]) if len(argv) > 1 else TEST_ASSETS, BUILDERS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
