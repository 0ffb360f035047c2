"""Fixtures the parity tests share: the committed tiny Qwen2-VL processor and a small
generated image/text corpus (a module may override ``corpus`` with its own size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture(scope="module")
def proc() -> Any:
    return load_tiny_processor("qwen2_vl")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), num_samples=10, seed=3)
