"""Build tiny, real, offline processors for the non-Qwen families neatpack tests.

Usage::

    python scripts/build_tiny_family_processors.py [OUT_DIR]  # default: tests/support/assets/...

Writes ``gemma3/``: a byte-fallback BPE (vocab 2048) trained with ``tokenizers`` on this Python's
stdlib sources, with Gemma's normalizer (space -> "▁"), wrapped in the real ``GemmaTokenizer``
plus Gemma 3's turn and image specials (``boi_token`` / ``eoi_token`` / ``image_token`` named as
in the real tokenizer config), a Gemma-3-style chat template (``<start_of_turn>model``, assistant
content wrapped in ``{% generation %}``), and the real ``Gemma3ImageProcessor`` at 28x28 pixels;
``Gemma3Processor`` with ``image_seq_length=4`` (a 2x2 pooled grid). Saved with
``save_pretrained``; reloads with ``AutoProcessor.from_pretrained(folder)`` and no network.

Training is deterministic for a given Python build; the saved files are committed.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_processors import TEST_ASSETS, save_processors

GEMMA_VOCAB = 2048
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
GEMMA_EXTRA = {
    "sot_token": "<start_of_turn>",
    "eot_token": "<end_of_turn>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
GEMMA_IMAGE_SIZE = 28
GEMMA_IMAGE_SEQ = 4

# Gemma 3's template, reduced to what neatpack renders (system folded into the first user turn).
_GEMMA3_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}{% endif %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}" + _GEMMA3_CONTENT + "{{ '<end_of_turn>' }}{% endgeneration %}"
    "{% else %}" + _GEMMA3_CONTENT + "{{ '<end_of_turn>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def corpus(limit: int = 80) -> list[str]:
    """The first ``limit`` stdlib top-level ``*.py`` files, sorted: deterministic."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:limit]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_gemma_tokenizer(extra: dict[str, str] | None = None) -> Any:
    """Byte-fallback BPE with Gemma's normalization, wrapped in the real ``GemmaTokenizer``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # training only: words start at "▁" so no merge crosses a word boundary
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=GEMMA_VOCAB,
        min_frequency=2,
        special_tokens=GEMMA_SPECIALS + byte_tokens,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    return GemmaTokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        model_max_length=8192,
        extra_special_tokens=dict(GEMMA_EXTRA if extra is None else extra),
    )


def build_gemma3() -> Any:
    import transformers as tf

    image_processor = tf.Gemma3ImageProcessor(
        size={"height": GEMMA_IMAGE_SIZE, "width": GEMMA_IMAGE_SIZE}
    )
    return tf.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=train_gemma_tokenizer(),
        chat_template=GEMMA3_TEMPLATE,
        image_seq_length=GEMMA_IMAGE_SEQ,
    )


GEMMA4_EXTRA = {
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
    "soc_token": "<|channel>",
    "eoc_token": "<channel|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
}
# Gemma-4-style turns: `<|turn>role\n` ... `<turn|>\n`, assistant role "model", system as its own
# turn. Historic model turns carry no thinking channel: neatpack's gemma4 handler injects it.
_GEMMA4_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif item['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif item['type'] == 'video' %}{{ '<|video|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
)
GEMMA4_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}" + _GEMMA4_CONTENT + "{{ '<turn|>' }}{% endgeneration %}"
    "{% else %}" + _GEMMA4_CONTENT + "{{ '<turn|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)


def build_gemma4() -> Any:
    import transformers as tf

    tok = train_gemma_tokenizer(GEMMA4_EXTRA)
    common = {"patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 2}
    return tf.Gemma4Processor(
        feature_extractor=tf.Gemma4AudioFeatureExtractor(),
        image_processor=tf.Gemma4ImageProcessor(**common),
        tokenizer=tok,
        # frames arrive pre-sampled (neatpack videos are frame lists): keep them all, as the
        # Qwen processors do with a frame list; the real default samples 32 frames
        video_processor=tf.Gemma4VideoProcessor(**common, do_sample_frames=False),
        chat_template=GEMMA4_TEMPLATE,
        image_seq_length=70,
    )


LLAVA_OV_SIDE = 28  # one 28x28 tile = (28 / 7)**2 = 16 features ("full": SigLIP has no CLS)
LLAVA_OV_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]
LLAVA_OV_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endgeneration %}"
    "{% else %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif c['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_llava_onevision() -> Any:
    """The Qwen2 BPE already shipped in ``qwen2_vl/`` plus ``<image>`` / ``<video>``."""
    import transformers as tf

    qwen = Path(__file__).resolve().parents[1] / "pipes" / "_assets" / "processors" / "qwen2_vl"
    tok = tf.Qwen2Tokenizer.from_pretrained(str(qwen), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    size = {"height": LLAVA_OV_SIDE, "width": LLAVA_OV_SIDE}
    return tf.LlavaOnevisionProcessor(
        image_processor=tf.LlavaOnevisionImageProcessor(
            size=size, image_grid_pinpoints=LLAVA_OV_PINPOINTS
        ),
        tokenizer=tok,
        video_processor=tf.LlavaOnevisionVideoProcessor(size=size),
        num_image_tokens=(LLAVA_OV_SIDE // 7) ** 2,
        vision_feature_select_strategy="full",
        chat_template=LLAVA_OV_TEMPLATE,
    )


# SmolVLM / Idefics3 turns: `<|im_start|>User:` ... `<end_of_utterance>\n`, assistant
# `<|im_start|>Assistant:` then a space before text (BPE merges it into the first word).
IDEFICS3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}"
    "{% endif %}{% for line in message['content'] %}"
    "{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_utterance>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>Assistant:' }}{% endif %}"
)


def build_idefics3() -> Any:
    """The Qwen2 BPE shipped in ``qwen2_vl/``; 28 px tiles, images split up to 2x2 + global."""
    import transformers as tf

    qwen = Path(__file__).resolve().parents[1] / "pipes" / "_assets" / "processors" / "qwen2_vl"
    tok = tf.Qwen2Tokenizer.from_pretrained(str(qwen), local_files_only=True)
    tiles = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok.add_special_tokens({"additional_special_tokens": ["<global-img>", *tiles]})
    return tf.Idefics3Processor(
        image_processor=tf.Idefics3ImageProcessor(
            size={"longest_edge": 56}, max_image_size={"longest_edge": 28}
        ),
        tokenizer=tok,
        image_seq_len=4,  # (28 / 7)**2 patches / scale_factor 2**2
        chat_template=IDEFICS3_TEMPLATE,
    )


INTERNVL_EXTRA = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
INTERNVL_TEMPLATE = LLAVA_OV_TEMPLATE.replace("<image>", "<IMG_CONTEXT>")


def build_internvl() -> Any:
    """The Qwen2 BPE shipped in ``qwen2_vl/`` plus InternVL's named image tokens; GotOcr2 crops
    of 28 px (up to 4 + thumbnail), 4 tokens per crop."""
    import transformers as tf

    qwen = Path(__file__).resolve().parents[1] / "pipes" / "_assets" / "processors" / "qwen2_vl"
    tok = tf.Qwen2Tokenizer.from_pretrained(
        str(qwen), local_files_only=True, extra_special_tokens=dict(INTERNVL_EXTRA)
    )
    size = {"height": 28, "width": 28}
    return tf.InternVLProcessor(
        image_processor=tf.GotOcr2ImageProcessor(
            size=size, crop_to_patches=True, min_patches=1, max_patches=4
        ),
        tokenizer=tok,
        video_processor=tf.InternVLVideoProcessor(size=size),
        image_seq_length=4,  # (28 / 7)**2 * 0.5**2
        chat_template=INTERNVL_TEMPLATE,
    )


BUILDERS = {
    "gemma3": build_gemma3,
    "gemma4": build_gemma4,
    "llava_onevision": build_llava_onevision,
    "idefics3": build_idefics3,
    "internvl": build_internvl,
}


def main(argv: list[str]) -> int:
    save_processors(Path(argv[1]) if len(argv) > 1 else TEST_ASSETS, BUILDERS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
