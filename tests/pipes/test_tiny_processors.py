"""The shipped tiny processors load offline and behave like real Qwen-VL processors."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from neatpack.pipes.testing.tiny import FAMILIES, load_tiny_processor, tiny_processor_dir

EXPECTED_CLASS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_layout(family: str) -> None:
    names = {p.name for p in tiny_processor_dir(family).iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "processor_config.json"} <= names
    assert "chat_template.jinja" in names


def test_unknown_family_lists_options() -> None:
    with pytest.raises(ValueError, match="qwen2_5_vl"):
        tiny_processor_dir("llava")


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_offline_and_expands_image(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = load_tiny_processor(family)
    assert type(proc).__name__ == EXPECTED_CLASS[family]
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessor"
    tok = proc.tokenizer
    assert len(tok) == 4110
    assert tok.convert_tokens_to_ids("<|image_pad|>") == 4108
    assert tok.convert_tokens_to_ids("<|video_pad|>") == 4109
    assert tok.eos_token == "<|im_end|>"

    conv = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": Image.new("RGB", (100, 70), (200, 30, 30))},
                {"type": "text", "text": "What is this?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A red box."}]},
    ]
    out = proc.apply_chat_template(
        conv,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        return_assistant_tokens_mask=True,
    )
    grid = out["image_grid_thw"]
    assert grid.shape == (1, 3)
    merge = proc.image_processor.merge_size
    patch = proc.image_processor.patch_size
    assert patch == (16 if family == "qwen3_vl" else 14)
    n_pad = int((out["input_ids"][0] == tok.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert n_pad == math.prod(grid[0].tolist()) // merge**2
    assert out["pixel_values"].shape == (math.prod(grid[0].tolist()), 3 * 2 * patch * patch)
    mm = out["mm_token_type_ids"][0]
    assert torch.equal(mm == 1, out["input_ids"][0] == tok.convert_tokens_to_ids("<|image_pad|>"))
    # the template's {% generation %} markers give transformers' assistant mask. Checked on the
    # text turn alone: transformers 5.17.0's processor returns an all-zero mask once an image is
    # expanded (neatpack's labels come from role markers, not from this mask)
    text_only = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}]}, conv[1]]
    out = proc.apply_chat_template(
        text_only,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        return_assistant_tokens_mask=True,
    )
    labelled = tok.decode(out["input_ids"][0][out["assistant_masks"][0].bool()])
    assert labelled == "A red box.<|im_end|>"


def test_template_renders_default_system_and_turn_newlines() -> None:
    proc = load_tiny_processor("qwen2_vl")
    conv = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "yo"},
    ]
    text = proc.apply_chat_template(conv, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )


def test_loader_never_needs_the_network(tmp_path: Path) -> None:
    """A fresh interpreter with no offline flags and a dead hub endpoint still loads."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    code = (
        "from neatpack.pipes.testing.tiny import load_tiny_processor\n"
        "p = load_tiny_processor('qwen3_vl')\n"
        "print(type(p).__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "Qwen3VLProcessor"
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").rglob("*.json"))


@pytest.mark.slow
@pytest.mark.skipif(
    sys.version_info[:3] != (3, 11, 7), reason="the BPE corpus is this Python build's stdlib"
)
def test_builder_reproduces_committed_files(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_processors.py"
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, timeout=300)
    for family in FAMILIES:
        for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json",
                     "chat_template.jinja"):  # fmt: skip
            built = (tmp_path / family / name).read_bytes()
            assert built == (tiny_processor_dir(family) / name).read_bytes(), (family, name)
