"""Tiny real Qwen-VL processors shipped with neatpack, loadable fully offline.

The folders under ``pipes/_assets/processors/<family>/`` are written by
``scripts/build_tiny_processors.py``: a 4110-token byte-level BPE wrapped in the real
``Qwen2Tokenizer``, a Qwen-style multimodal chat template and the real torchvision image/video
processors, saved with ``save_pretrained``. Loading them never touches the network::

    >>> proc = load_tiny_processor("qwen2_vl")
    >>> type(proc).__name__, proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ('Qwen2VLProcessor', 4108)

Tiny *model* builders live in ``pipes/testing/tiny_models.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Processor families shipped as package data (patch 14 for Qwen2/2.5-VL, 16 for Qwen3-VL)."""

_ASSETS = Path(__file__).resolve().parent.parent / "_assets" / "processors"


def tiny_processor_dir(family: str = "qwen2_vl") -> Path:
    """The folder holding the saved tiny processor for ``family``."""
    if family not in FAMILIES:
        raise ValueError(f"{family=} is not a shipped tiny processor; valid options: {FAMILIES}")
    folder = _ASSETS / family
    if not (folder / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny processor files missing in {folder}; rebuild them with "
            "`python scripts/build_tiny_processors.py` or reinstall neatpack"
        )
    return folder


def load_tiny_processor(family: str = "qwen2_vl") -> Any:
    """Load the real transformers processor for ``family`` with ``AutoProcessor``, offline.

    Sets ``HF_HUB_OFFLINE=1`` (if unset) before loading, and passes ``local_files_only=True``,
    so nothing is ever fetched.
    """
    folder = tiny_processor_dir(family)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(folder), local_files_only=True)  # type: ignore[no-untyped-call]
