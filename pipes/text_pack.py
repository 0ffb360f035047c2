"""``neat_pack_dataset``: pre-tokenized text samples -> a ``datasets.Dataset`` of packs.

The seed's signature and semantics (``llm/neat_packing.py``, peer notes 2.3): samples carry
``input_ids`` and ``labels`` ALREADY shifted by the dataset (or a ``loss_mask``: labels are set to
-100 where it is 0; without labels, ``labels = input_ids``), bins come from the seed's greedy
knapsack on ``len(input_ids)``, each pack is padded to ``pack_size`` with an indexed attention
mask (1..k per document, 0 = padding) and positions that restart per document. Worked example,
``pack_size=6`` and samples of 3 and 2 tokens::

    input_ids       a b c d e 0
    attention_mask  1 1 1 2 2 0
    position_ids    0 1 2 0 1 0

Differences from the seed, on purpose:

* a sample with fewer than 1 token, or labels / loss_mask of another length, is a ``ValueError``
  naming its row (the seed packs it silently);
* "no split" is detected with ``isinstance(dataset, DatasetDict)`` / a mapping lookup, not by
  swallowing any exception;
* the error for an overlong sample names its row.

The same packing, lazily and resumable, is ``neatpack.graphs.neat_llm_graph``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .binpack import greedy_knapsack
from .loss import CROSS_ENTROPY_IGNORE_IDX
from .pack import build_packed_sample

__all__ = ["CROSS_ENTROPY_IGNORE_IDX", "neat_pack_dataset"]

_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def _split(dataset: Any, split: str) -> Any:
    """``dataset[split]`` for a DatasetDict / mapping; the object itself for a plain Dataset."""
    try:
        from datasets import DatasetDict, IterableDatasetDict
    except ImportError:  # a list of dicts also works without the extra
        DatasetDict = IterableDatasetDict = dict
    if isinstance(dataset, DatasetDict | IterableDatasetDict | Mapping):
        if split not in dataset:
            raise KeyError(f"{split=} is not in the dataset; splits: {sorted(dataset)}")
        return dataset[split]
    return dataset


def _sample(row: int, raw: Any) -> dict[str, torch.Tensor]:
    if not isinstance(raw, Mapping) or "input_ids" not in raw:
        raise ValueError(f"row {row}: a sample needs 'input_ids'; got {type(raw).__name__}")
    ids = torch.as_tensor(list(raw["input_ids"]), dtype=torch.long)
    if ids.dim() != 1 or ids.numel() < 1:
        raise ValueError(
            f"row {row}: input_ids must be a non-empty 1-D list, got {raw['input_ids']!r:.60}"
        )
    labels = ids.clone() if raw.get("labels") is None else torch.as_tensor(list(raw["labels"]))
    if labels.shape != ids.shape:
        raise ValueError(f"row {row}: labels {tuple(labels.shape)} != input_ids {tuple(ids.shape)}")
    labels = labels.long()
    if raw.get("loss_mask") is not None:
        mask = torch.as_tensor(list(raw["loss_mask"]))
        if mask.shape != ids.shape:
            raise ValueError(
                f"row {row}: loss_mask {tuple(mask.shape)} != input_ids {tuple(ids.shape)}"
            )
        labels = labels.masked_fill(mask == 0, CROSS_ENTROPY_IGNORE_IDX)
    return {"input_ids": ids, "labels": labels}


def neat_pack_dataset(
    dataset: Any,
    split: str,
    pack_size: int,
    max_packs: int | None = None,
    padding_idx: int = 0,
    drop_long_samples: bool = False,
) -> Any:
    """Pack ``dataset[split]`` (or ``dataset``) into a ``datasets.Dataset`` of ``pack_size`` rows.

    Columns: ``input_ids``, ``labels``, ``attention_mask`` (document ids), ``position_ids``,
    ``seq_lens`` (real document lengths); values read back as Python lists, as in the seed.
    ``max_packs`` keeps the first packs in creation order. Raises ``ValueError`` for an overlong
    sample (unless ``drop_long_samples``) and when nothing is left.

    >>> ds = neat_pack_dataset([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}], "train", 6)
    >>> ds[0]["attention_mask"], ds[0]["position_ids"]
    ([1, 1, 1, 2, 2, 0], [0, 1, 2, 0, 1, 0])
    """
    from datasets import Dataset

    if isinstance(pack_size, bool) or not isinstance(pack_size, int) or pack_size < 1:
        raise ValueError(f"{pack_size=} must be a positive int")
    if max_packs is not None and max_packs < 1:
        raise ValueError(f"{max_packs=} must be None or >= 1")
    rows = _split(dataset, split)
    samples: list[dict[str, torch.Tensor]] = []
    for row, raw in enumerate(rows):
        s = _sample(row, raw)
        n = int(s["input_ids"].numel())
        if n > pack_size:
            if drop_long_samples:
                continue
            raise ValueError(
                f"row {row}: sample is too long ({n} > {pack_size=}); set "
                "drop_long_samples=True or increase pack_size"
            )
        samples.append(s)
    if not samples:
        raise ValueError("no samples remaining after filtering; lower the filter or check the data")
    bins = greedy_knapsack([int(s["input_ids"].numel()) for s in samples], pack_size)
    if max_packs is not None:
        bins = bins[:max_packs]
    columns: dict[str, list[Any]] = {k: [] for k in (*_KEYS, "seq_lens")}
    for b in bins:
        pack = build_packed_sample([samples[i] for i in b], pack_size, padding_idx)
        for k in _KEYS:
            columns[k].append(pack[k].tolist())
        columns["seq_lens"].append([int(samples[i]["input_ids"].numel()) for i in b])
    return Dataset.from_dict(columns)
