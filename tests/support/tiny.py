"""Tiny real processors of the model families, loadable fully offline: test scaffolding.

The folders under ``tests/support/assets/processors/<folder>/`` are written by the
``scripts/build_tiny_*`` scripts (a tiny byte-level BPE wrapped in each family's real tokenizer
class, the family's chat template and its real image / audio processors, saved with
``save_pretrained``). The package ships only the Qwen-VL ones
(``neatpack.pipes.testing.tiny.load_tiny_processor``); these serve the tests::

    from support.tiny import load_tiny_gemma3_processor
    proc = load_tiny_gemma3_processor()   # a real Gemma3Processor, no network

Tiny *model* builders of the families are in ``support/tiny_family_models.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = [
    "ASSETS",
    "PROCESSORS",
    "load_tiny_family_processor",
    "load_tiny_gemma3_processor",
    "load_tiny_gemma4_processor",
    "load_tiny_idefics3_processor",
    "load_tiny_internvl_processor",
    "load_tiny_kimi_k25_processor",
    "load_tiny_llava_onevision_processor",
    "load_tiny_nemotron_omni_processor",
    "load_tiny_phi4_processor",
    "load_tiny_qwen3_omni_processor",
    "load_tiny_qwen_omni_processor",
    "load_tiny_smolvlm_processor",
    "load_tiny_step3_processor",
]

ASSETS = Path(__file__).resolve().parent / "assets" / "processors"

#: family -> (folder under ASSETS, the script that writes it)
PROCESSORS: dict[str, tuple[str, str]] = {
    "gemma3": ("gemma3", "build_tiny_family_processors.py"),
    "gemma4": ("gemma4", "build_tiny_family_processors.py"),
    "idefics3": ("idefics3", "build_tiny_family_processors.py"),
    "internvl": ("internvl", "build_tiny_family_processors.py"),
    "llava_onevision": ("llava_onevision", "build_tiny_family_processors.py"),
    "kimi_k25": ("kimi_k25", "build_tiny_crop_family_processors.py"),
    "smolvlm": ("smolvlm", "build_tiny_crop_family_processors.py (needs num2words)"),
    "step3": ("step3", "build_tiny_crop_family_processors.py"),
    "nemotron_omni": ("nemotron_h_omni", "build_tiny_audio_family_processors.py"),
    "phi4": ("phi4_multimodal", "build_tiny_audio_family_processors.py"),
    "qwen_omni": ("qwen2_5_omni", "build_tiny_omni_processor.py"),
    "qwen3_omni": ("qwen3_omni", "build_tiny_omni_processor.py"),
}


def load_tiny_family_processor(family: str) -> Any:
    """The real transformers processor of ``family`` (a key of ``PROCESSORS``), loaded with
    ``AutoProcessor`` from its committed folder, offline (``HF_HUB_OFFLINE=1``,
    ``local_files_only``)."""
    if family not in PROCESSORS:
        raise ValueError(f"{family=} has no tiny test processor; valid: {sorted(PROCESSORS)}")
    folder, script = PROCESSORS[family]
    path = ASSETS / folder
    if not (path / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny {family} processor missing in {path}; rebuild it with `python scripts/{script}`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(path), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_gemma3_processor() -> Any:
    """``Gemma3Processor``."""
    return load_tiny_family_processor("gemma3")


def load_tiny_gemma4_processor() -> Any:
    """``Gemma4Processor``."""
    return load_tiny_family_processor("gemma4")


def load_tiny_idefics3_processor() -> Any:
    """``Idefics3Processor``."""
    return load_tiny_family_processor("idefics3")


def load_tiny_internvl_processor() -> Any:
    """``InternVLProcessor`` (served by the ``chat_template`` family)."""
    return load_tiny_family_processor("internvl")


def load_tiny_kimi_k25_processor() -> Any:
    """``Kimi_K25Processor``."""
    return load_tiny_family_processor("kimi_k25")


def load_tiny_llava_onevision_processor() -> Any:
    """``LlavaOnevisionProcessor``."""
    return load_tiny_family_processor("llava_onevision")


def load_tiny_nemotron_omni_processor() -> Any:
    """``NemotronH_Omni_Reasoning_V3Processor``; the test skips on a transformers without it
    (new in 5.18; ``test_family_nemotron_omni`` checks that neatpack refuses such a one)."""
    import pytest
    import transformers

    if getattr(transformers, "NemotronH_Omni_Reasoning_V3Processor", None) is None:
        pytest.skip(
            f"transformers {transformers.__version__} has no NemotronH_Omni_Reasoning_V3Processor"
            " (new in 5.18)"
        )
    return load_tiny_family_processor("nemotron_omni")


def load_tiny_phi4_processor() -> Any:
    """``Phi4MultimodalProcessor``, its chat template restored (its ``__init__`` does not name
    ``chat_template``, so ``from_pretrained`` leaves it on the tokenizer only)."""
    proc = load_tiny_family_processor("phi4")
    if proc.chat_template is None:
        proc.chat_template = proc.tokenizer.chat_template
    return proc


def load_tiny_qwen3_omni_processor() -> Any:
    """``Qwen3OmniMoeProcessor``."""
    return load_tiny_family_processor("qwen3_omni")


def load_tiny_qwen_omni_processor() -> Any:
    """``Qwen2_5OmniProcessor``."""
    return load_tiny_family_processor("qwen_omni")


def load_tiny_smolvlm_processor() -> Any:
    """``SmolVLMProcessor`` (its processor needs ``num2words``)."""
    return load_tiny_family_processor("smolvlm")


def load_tiny_step3_processor() -> Any:
    """``Step3p7Processor``."""
    return load_tiny_family_processor("step3")
