"""Build the tiny, real, offline Qwen-VL processors that neatpack's tests use.

Usage::

    python scripts/build_tiny_processors.py [OUT_DIR]     # default: pipes/_assets/processors

Writes one folder per family (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``), each saved with the real
``ProcessorMixin.save_pretrained`` so ``AutoProcessor.from_pretrained(folder)`` reloads it with no
network. Every part is a real transformers class:

* a byte-level BPE (Qwen2 pre-tokenizer regex, vocab 4096) trained with ``tokenizers`` on this
  Python's stdlib ``*.py`` sources, plus the 14 Qwen2-VL special tokens, wrapped in
  ``transformers.Qwen2Tokenizer`` (``<|endoftext|>``=4096 ... ``<|image_pad|>``=4108,
  ``<|video_pad|>``=4109; eos ``<|im_end|>``, pad ``<|endoftext|>``);
* a Qwen-style multimodal chat template written here (default system prompt, one
  ``<|vision_start|><|image_pad|><|vision_end|>`` per image block, the video equivalent, assistant
  turns wrapped in ``{% generation %}`` so ``return_assistant_tokens_mask=True`` works);
* the torchvision ``Qwen2VLImageProcessor`` and ``Qwen2VLVideoProcessor`` /
  ``Qwen3VLVideoProcessor`` with small pixel budgets so tests stay fast.

Training is deterministic for a given Python build, but the corpus is that build's stdlib, so the
saved files are committed and this script is only rerun on purpose.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB_SIZE = 4096
QWEN2_RE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
MIN_PIXELS = 4  # in units of (patch*merge)^2: at least 2x2 merged tokens
MAX_PIXELS = 256  # at most 256 merged tokens per image
DEFAULT_SYSTEM = "You are a helpful assistant."

# Qwen2-VL-style template. Assistant turns: `<|im_start|>assistant\n` + generation(content +
# `<|im_end|>`) + `\n`; the closing <|im_end|> is inside the generation block (Qwen trains on it).
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}" + _CONTENT + "<|im_end|>{% endgeneration %}"
    "{% else %}" + _CONTENT + "<|im_end|>{% endif %}"
    "{{ '\\n' }}"  # transformers renders with trim_blocks: a literal newline after a tag is eaten
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus() -> list[str]:
    """The stdlib top-level ``*.py`` files (sorted) plus ``pydoc_data.topics``: deterministic."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]
    from pydoc_data import topics

    texts.extend(str(v) for _, v in sorted(topics.topics.items()))
    return texts


def train_tokenizer() -> Any:
    """Train the byte-level BPE and wrap it in the real ``Qwen2Tokenizer``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_RE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    qtok = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    qtok.add_special_tokens(
        {"extra_special_tokens": SPECIAL_TOKENS}, replace_extra_special_tokens=True
    )
    qtok.eos_token = "<|im_end|>"  # Instruct convention: eos=<|im_end|>, pad=<|endoftext|>
    return qtok


def build(family: str, tokenizer: Any) -> Any:
    """Assemble the real processor for ``family`` around ``tokenizer``."""
    import transformers as tf

    if family in ("qwen2_vl", "qwen2_5_vl"):
        patch, mean, std = 14, None, None
        video_cls: Any = tf.Qwen2VLVideoProcessor
        proc_cls: Any = tf.Qwen2VLProcessor if family == "qwen2_vl" else tf.Qwen2_5_VLProcessor
    elif family == "qwen3_vl":
        patch, mean, std = 16, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
        video_cls, proc_cls = tf.Qwen3VLVideoProcessor, tf.Qwen3VLProcessor
    else:
        raise ValueError(f"{family=} is not one of ('qwen2_vl', 'qwen2_5_vl', 'qwen3_vl')")
    unit = (patch * 2) ** 2
    common: dict[str, Any] = {
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": unit * MIN_PIXELS, "longest_edge": unit * MAX_PIXELS},
    }
    if mean is not None:
        common.update(image_mean=mean, image_std=std)
    image_processor = tf.Qwen2VLImageProcessor(**common)
    # explicit False: today's uncapped token counts, and no "per-frame pixel cap" warning
    video_processor = video_cls(**common, cap_pixels_per_frame=False)
    return proc_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


ASSETS = Path(__file__).resolve().parents[1] / "pipes" / "_assets" / "processors"
"""The Qwen-VL processors shipped in the package (the demo and the quickstart use them)."""
TEST_ASSETS = Path(__file__).resolve().parents[1] / "tests" / "support" / "assets" / "processors"
"""The other families' processors: test scaffolding, not shipped (``tests/support/tiny.py``)."""


def save_processors(out: Path, builders: Mapping[str, Callable[[], Any]]) -> None:
    """Save each builder's processor under ``out/<name>/`` (``save_pretrained``) and print its
    files and total size: the last step of every tiny-family build script."""
    for name, build in builders.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        build().save_pretrained(str(folder))
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{name}: {folder} {sorted(p.name for p in folder.iterdir())} {size} bytes")


def main(argv: list[str]) -> int:
    default = Path(__file__).resolve().parents[1] / "pipes" / "_assets" / "processors"
    out = Path(argv[1]) if len(argv) > 1 else default
    tokenizer = train_tokenizer()
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        folder = out / family
        folder.mkdir(parents=True, exist_ok=True)
        build(family, tokenizer).save_pretrained(str(folder))
        digest = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()[:16]
        files = sorted(p.name for p in folder.iterdir())
        print(f"{family}: {folder} {files} tokenizer.json sha256[:16]={digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
