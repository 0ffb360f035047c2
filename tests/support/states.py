"""A loader state through ``torch.save`` / ``torch.load(weights_only=True)``, as a checkpoint
takes it, and the sample ids of a batch's packs: what the resume tests compare."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` saved and loaded the way a training checkpoint does (weights only)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    out: dict[str, Any] = torch.load(buf, weights_only=True)
    return out


def pack_ids(batch: Mapping[str, Any]) -> list[list[int]]:
    """The sample ids of each pack of ``batch``, in order."""
    return [list(m["sample_ids"]) for m in batch["packs"]]
