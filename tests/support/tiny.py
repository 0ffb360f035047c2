"""Tiny real processors of the model families, loadable fully offline: test scaffolding.

The folders under ``tests/support/assets/processors/<family>/`` are written by the
``scripts/build_tiny_*_processors.py`` scripts (a tiny byte-level BPE wrapped in each family's
real tokenizer class, the family's chat template and its real image / audio processors, saved
with ``save_pretrained``). The package ships only the Qwen-VL ones
(``neatpack.pipes.tiny.load_tiny_processor``); these serve the tests::

    from support.tiny import load_tiny_gemma3_processor
    proc = load_tiny_gemma3_processor()   # a real Gemma3Processor, no network

Tiny *model* builders of the families are in ``support/tiny_family_models.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent / "assets" / "processors"
_GEMMA3 = ASSETS / "gemma3"
_GEMMA4 = ASSETS / "gemma4"
_IDEFICS3 = ASSETS / "idefics3"
_INTERNVL = ASSETS / "internvl"
_KIMI_K25 = ASSETS / "kimi_k25"
_LLAVA_ONEVISION = ASSETS / "llava_onevision"
_NEMOTRON_H_OMNI = ASSETS / "nemotron_h_omni"
_PHI4_MULTIMODAL = ASSETS / "phi4_multimodal"
_QWEN2_5_OMNI = ASSETS / "qwen2_5_omni"
_QWEN3_OMNI = ASSETS / "qwen3_omni"
_SMOLVLM = ASSETS / "smolvlm"
_STEP3 = ASSETS / "step3"

__all__ = [
    "ASSETS",
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


def load_tiny_gemma3_processor() -> Any:
    """The shipped tiny ``Gemma3Processor`` (``scripts/build_tiny_family_processors.py``)."""
    if not (_GEMMA3 / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Gemma 3 processor missing in {_GEMMA3}; rebuild it with "
            "`python scripts/build_tiny_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_GEMMA3), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_gemma4_processor() -> Any:
    """The shipped tiny ``Gemma4Processor`` (``scripts/build_tiny_family_processors.py``)."""
    if not (_GEMMA4 / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Gemma 4 processor missing in {_GEMMA4}; rebuild it with "
            "`python scripts/build_tiny_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_GEMMA4), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_idefics3_processor() -> Any:
    """The shipped tiny ``Idefics3Processor`` (``scripts/build_tiny_family_processors.py``)."""
    if not (_IDEFICS3 / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Idefics3 processor missing in {_IDEFICS3}; rebuild it with "
            "`python scripts/build_tiny_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_IDEFICS3), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_internvl_processor() -> Any:
    """The shipped tiny ``InternVLProcessor`` (``scripts/build_tiny_family_processors.py``)."""
    if not (_INTERNVL / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny InternVL processor missing in {_INTERNVL}; rebuild it with "
            "`python scripts/build_tiny_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_INTERNVL), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_kimi_k25_processor() -> Any:
    """The shipped tiny ``Kimi_K25Processor`` (``scripts/build_tiny_crop_family_processors.py``)."""
    if not (_KIMI_K25 / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Kimi K2.5 processor missing in {_KIMI_K25}; rebuild it with "
            "`python scripts/build_tiny_crop_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_KIMI_K25), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_llava_onevision_processor() -> Any:
    """The shipped tiny ``LlavaOnevisionProcessor`` (built by
    ``scripts/build_tiny_family_processors.py``)."""
    if not (_LLAVA_ONEVISION / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny LLaVA-OneVision processor missing in {_LLAVA_ONEVISION}; rebuild it with "
            "`python scripts/build_tiny_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_LLAVA_ONEVISION), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_nemotron_omni_processor() -> Any:
    """The shipped tiny ``NemotronH_Omni_Reasoning_V3Processor``
    (``scripts/build_tiny_audio_family_processors.py``)."""
    if not (_NEMOTRON_H_OMNI / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Nemotron-H Omni processor missing in {_NEMOTRON_H_OMNI}; rebuild it with "
            "`python scripts/build_tiny_audio_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_NEMOTRON_H_OMNI), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_phi4_processor() -> Any:
    """The shipped tiny ``Phi4MultimodalProcessor``
    (``scripts/build_tiny_audio_family_processors.py``), its chat template restored."""
    if not (_PHI4_MULTIMODAL / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Phi-4-multimodal processor missing in {_PHI4_MULTIMODAL}; rebuild it with "
            "`python scripts/build_tiny_audio_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(_PHI4_MULTIMODAL), local_files_only=True)  # type: ignore[no-untyped-call]
    if proc.chat_template is None:
        proc.chat_template = proc.tokenizer.chat_template
    return proc


def load_tiny_qwen3_omni_processor() -> Any:
    """The shipped tiny ``Qwen3OmniMoeProcessor`` (``scripts/build_tiny_omni_processor.py``)."""
    if not (_QWEN3_OMNI / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Qwen3-Omni processor missing in {_QWEN3_OMNI}; rebuild it with "
            "`python scripts/build_tiny_omni_processor.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_QWEN3_OMNI), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_qwen_omni_processor() -> Any:
    """The shipped tiny ``Qwen2_5OmniProcessor`` (``scripts/build_tiny_omni_processor.py``)."""
    if not (_QWEN2_5_OMNI / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Qwen2.5-Omni processor missing in {_QWEN2_5_OMNI}; rebuild it with "
            "`python scripts/build_tiny_omni_processor.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_QWEN2_5_OMNI), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_smolvlm_processor() -> Any:
    """The shipped tiny ``SmolVLMProcessor`` (``scripts/build_tiny_crop_family_processors.py``);
    needs ``num2words``."""
    if not (_SMOLVLM / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny SmolVLM processor missing in {_SMOLVLM}; rebuild it with "
            "`python scripts/build_tiny_crop_family_processors.py` (needs num2words)"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_SMOLVLM), local_files_only=True)  # type: ignore[no-untyped-call]


def load_tiny_step3_processor() -> Any:
    """The shipped tiny ``Step3p7Processor`` (``scripts/build_tiny_crop_family_processors.py``)."""
    if not (_STEP3 / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Step3 processor missing in {_STEP3}; rebuild it with "
            "`python scripts/build_tiny_crop_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_STEP3), local_files_only=True)  # type: ignore[no-untyped-call]
