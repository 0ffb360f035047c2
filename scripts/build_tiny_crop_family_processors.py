"""Build tiny, real, offline processors for Kimi K2.5, Step3 (Step-3.7) and SmolVLM.

Usage::

    python scripts/build_tiny_crop_family_processors.py [OUT_DIR]

``OUT_DIR`` defaults to ``tests/support/assets/processors``.

Each reuses the Qwen2 byte-level BPE already shipped in ``qwen2_vl/`` (4110 tokens) plus the
family's named special tokens, a chat template in the family's turn format, and the REAL
transformers processor classes, saved with ``save_pretrained``:

* ``kimi_k25/``: ``Kimi_K25Processor`` + ``Kimi_K25ImageProcessor`` (patch 14, merge 2, at most
  4x4 merged tokens per image: ``size`` 112) + ``Kimi_K25VideoProcessor``; turns
  ``<|im_user|>user<|im_middle|>...<|im_end|>``, images
  ``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>``;
* ``step3/``: ``Step3p7Processor`` + ``Step3p7ImageProcessor`` with a 112 px global view
  (``(112 // (14 * 4))**2`` = 4 ``<im_patch>`` tokens) and 56 px crops (1 token each); turns
  ``<|BOT|>role\\n...<|EOT|>``;
* ``smolvlm/`` (only when ``num2words`` is importable, a test-only extra): ``SmolVLMProcessor``
  with Idefics3's layout at 28 px tiles (``scripts/build_tiny_family_processors.py``).

Deterministic: the tokenizer is loaded, not trained; the saved files are committed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_processors import ASSETS, TEST_ASSETS, save_processors


def qwen_bpe(**kwargs: Any) -> Any:
    """The tiny Qwen2 BPE shipped in ``qwen2_vl/`` (the other families' base tokenizer)."""
    import transformers as tf

    return tf.Qwen2Tokenizer.from_pretrained(
        str(ASSETS / "qwen2_vl"), local_files_only=True, **kwargs
    )


KIMI_SPECIALS = [
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
]  # fmt: skip
_KIMI_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}"
    "{{ '<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\\n' }}"
    "{% elif c['type'] == 'video' %}{{ '<|kimi_k25_video_placeholder|>' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
KIMI_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|im_system|>system<|im_middle|>' }}"
    "{% elif message['role'] == 'user' %}{{ '<|im_user|>user<|im_middle|>' }}"
    "{% else %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    + _KIMI_CONTENT
    + "{{ '<|im_end|>' }}{% endgeneration %}"
    "{% else %}" + _KIMI_CONTENT + "{{ '<|im_end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
)
KIMI_SIDE = 112  # at most (112 / 14)**2 = 64 patches -> 16 merged tokens per image


def build_kimi_k25() -> Any:
    import transformers as tf

    tok = qwen_bpe()
    tok.add_special_tokens({"additional_special_tokens": KIMI_SPECIALS})
    size = {"max_height": KIMI_SIDE // 14, "max_width": KIMI_SIDE // 14}
    return tf.Kimi_K25Processor(
        image_processor=tf.Kimi_K25ImageProcessor(size=size, max_patches=64),
        tokenizer=tok,
        video_processor=tf.Kimi_K25VideoProcessor(size=size, max_patches=64),
        chat_template=KIMI_TEMPLATE,
    )


STEP3_SPECIALS = [
    "<|BOT|>", "<|EOT|>", "<im_patch>", "<im_start>", "<im_end>", "<patch_start>",
    "<patch_end>", "<patch_newline>",
]  # fmt: skip
_STEP3_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}{{ '<im_patch>' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
STEP3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|BOT|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    + _STEP3_CONTENT
    + "{{ '<|EOT|>' }}{% endgeneration %}"
    "{% else %}" + _STEP3_CONTENT + "{{ '<|EOT|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|BOT|>assistant\\n' }}{% endif %}"
)
STEP3_GLOBAL = 112  # (112 // (14 * 4))**2 = 4 tokens for the global view
STEP3_CROP = 56  # (56 // 56)**2 = 1 token per crop


def build_step3() -> Any:
    import transformers as tf

    tok = qwen_bpe()
    tok.add_special_tokens({"additional_special_tokens": STEP3_SPECIALS})
    return tf.Step3p7Processor(
        image_processor=tf.Step3p7ImageProcessor(
            size={"height": STEP3_GLOBAL, "width": STEP3_GLOBAL},
            patch_size=STEP3_CROP,
            max_image_size=4 * STEP3_GLOBAL,
        ),
        tokenizer=tok,
        chat_template=STEP3_TEMPLATE,
    )


def build_smolvlm() -> Any:
    """Idefics3's tiny tokenizer, template and tile sizes (``build_tiny_family_processors``) in
    the real ``SmolVLMProcessor``; needs ``num2words`` (imported by the processor)."""
    import transformers as tf
    from build_tiny_family_processors import IDEFICS3_TEMPLATE, build_idefics3

    idefics3 = build_idefics3()
    # the processor declares video_token "<video>"; without it in the vocabulary the token
    # lookups of the length estimator get None
    idefics3.tokenizer.add_special_tokens({"additional_special_tokens": ["<video>"]})
    sizes = {"size": {"longest_edge": 56}, "max_image_size": {"longest_edge": 28}}
    return tf.SmolVLMProcessor(
        image_processor=tf.SmolVLMImageProcessor(**sizes),
        tokenizer=idefics3.tokenizer,
        video_processor=tf.SmolVLMVideoProcessor(**sizes),
        image_seq_len=idefics3.image_seq_len,
        chat_template=IDEFICS3_TEMPLATE,
    )


BUILDERS = {"kimi_k25": build_kimi_k25, "step3": build_step3, "smolvlm": build_smolvlm}


def main(argv: list[str]) -> int:
    builders = dict(BUILDERS)
    if importlib.util.find_spec("num2words") is None:
        print("smolvlm: skipped (SmolVLMProcessor needs `pip install num2words`)")
        del builders["smolvlm"]
    save_processors(Path(argv[1]) if len(argv) > 1 else TEST_ASSETS, builders)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
