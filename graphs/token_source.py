"""Pre-tokenized records for the text graph: ``TokenSource`` reads them by id (a ``.jsonl``
path, a list, a ``datasets.Dataset``), ``to_token_sample`` checks one, ``token_lengths`` gives
their exact lengths after the shift."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neatpack.pipes.compat.text_pack import token_tensor
from neatpack.pipes.reading.read import JsonlSource

__all__ = ["TokenSource", "to_token_sample", "token_lengths", "token_supervised"]


class TokenSource:
    """Random access to pre-tokenized records: a ``.jsonl`` path, a list, or a datasets.Dataset."""

    def __init__(self, data: Any) -> None:
        if isinstance(data, (str, os.PathLike)):
            path = Path(data)
            if not path.exists():
                raise FileNotFoundError(f"data file {str(path)!r} does not exist")
            # no size limit: a pre-tokenized line is parsed, never tokenized again (a 1M-token
            # document with its labels is ~14 MB of JSON, ~50 MB once read)
            self._jsonl: JsonlSource | None = JsonlSource(path, max_record_bytes=None)
            self._items: Any = None
        elif isinstance(data, Sequence) or hasattr(data, "__getitem__"):
            self._jsonl, self._items = None, data
        else:
            raise TypeError(f"cannot read tokens from {type(data).__name__}")

    def __len__(self) -> int:
        return len(self._jsonl) if self._jsonl is not None else len(self._items)

    def __getitem__(self, sample_id: int) -> dict[str, Any]:
        raw = self._jsonl.raw(sample_id) if self._jsonl is not None else self._items[sample_id]
        return to_token_sample(raw, sample_id)


def to_token_sample(raw: Any, sample_id: int) -> dict[str, Any]:
    """One unshifted sample (``input_ids``, ``labels``) from a tokenized record; errors name it."""
    if not isinstance(raw, dict) or "input_ids" not in raw:
        raise ValueError(
            f"sample_id={sample_id}: a tokenized record needs 'input_ids' (and optionally "
            f"'labels' or 'loss_mask'); got {type(raw).__name__} with keys "
            f"{sorted(raw) if isinstance(raw, dict) else None}"
        )
    where = f"sample_id={sample_id}"
    ids = token_tensor(raw["input_ids"], "input_ids", where)
    if ids.numel() < 2:
        raise ValueError(f"sample_id={sample_id}: {ids.numel()} tokens; a sample needs at least 2")
    labels = token_tensor(raw["labels"], "labels", where) if "labels" in raw else ids.clone()
    if labels.shape != ids.shape:
        raise ValueError(
            f"sample_id={sample_id}: labels {tuple(labels.shape)} != input_ids {tuple(ids.shape)}"
        )
    if "loss_mask" in raw:
        mask = torch.as_tensor(list(raw["loss_mask"]), dtype=torch.bool)
        if mask.shape != ids.shape:
            raise ValueError(
                f"sample_id={sample_id}: loss_mask {tuple(mask.shape)} != input_ids "
                f"{tuple(ids.shape)}"
            )
        labels = labels.masked_fill(~mask, -100)
    return {
        "sample_id": int(sample_id),
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.ones_like(ids),
    }


def token_lengths(source: TokenSource) -> np.ndarray:
    """Exact lengths after the shift (``len(input_ids) - 1``) of every sample."""
    return np.fromiter(
        (source[i]["input_ids"].numel() - 1 for i in range(len(source))),
        dtype=np.int64,
        count=len(source),
    )


def token_supervised(source: TokenSource) -> np.ndarray:
    """Exact supervised tokens after the shift (``labels[1:] != -100``) of every sample: what
    ``balance="supervised"`` balances (read only under it)."""
    return np.fromiter(
        (int((source[i]["labels"][1:] != -100).sum()) for i in range(len(source))),
        dtype=np.int64,
        count=len(source),
    )
