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

import numpy as np
import torch

from neatpack.pipes.materializing.loss import CROSS_ENTROPY_IGNORE_IDX
from neatpack.pipes.materializing.pack import build_packed_sample
from neatpack.pipes.planning.binpack import greedy_knapsack

__all__ = ["CROSS_ENTROPY_IGNORE_IDX", "neat_pack_dataset", "token_tensor"]

_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def token_tensor(values: Any, key: str, where: str) -> torch.Tensor:
    """``values`` (a record's ``input_ids`` or ``labels``) as an int64 tensor, or a
    ``ValueError`` naming ``where`` (the sample) and the bad value.

    torch alone turns ``"a"`` into "too many dimensions 'str'", ``nan`` and ``2**70`` into an
    overflow naming no record, truncates ``1.5`` and keeps ``-5``, which only fails later as an
    embedding index error on the device. Ids must be ints in ``[0, 2**63)``; labels may also be
    the ignore index ``-100``.

    >>> token_tensor([1, 2, -100], "labels", "sample_id=3").tolist()
    [1, 2, -100]
    >>> try:
    ...     token_tensor([1, -5], "input_ids", "sample_id=3")
    ... except ValueError as e:
    ...     print(str(e)[:59])
    sample_id=3: input_ids has -5 at position 1; token ids must
    """
    fix = "fix the tokenized record"
    try:
        items = list(values) if not isinstance(values, str) else [values]
        arr = np.asarray(items)
    except (TypeError, ValueError) as e:  # not a list, or ragged nested lists
        raise ValueError(f"{where}: {key} must be a flat list of ints; {fix}") from e
    if arr.size and (arr.ndim != 1 or arr.dtype.kind not in "iub"):
        bad = next((v for v in items if not _is_int(v)), items[0])
        raise ValueError(
            f"{where}: {key} must be a flat list of ints in [0, 2**63), got {bad!r:.60}; {fix}"
        )
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 2**63:
        raise ValueError(f"{where}: {key} has {int(arr.max())}, above int64; {fix}")
    ids = torch.from_numpy(arr.astype(np.int64, copy=False)).reshape(-1)
    allowed = (ids >= 0) | (ids == CROSS_ENTROPY_IGNORE_IDX) if key == "labels" else ids >= 0
    if not bool(allowed.all()):
        at = int((~allowed).nonzero()[0, 0])
        what = "labels must be >= 0 or -100" if key == "labels" else "token ids must be >= 0"
        raise ValueError(f"{where}: {key} has {int(ids[at])} at position {at}; {what} ({fix})")
    return ids


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and -(2**63) <= int(value) < 2**63


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
    ids = token_tensor(raw["input_ids"], "input_ids", f"row {row}")
    if ids.numel() < 1:
        raise ValueError(
            f"row {row}: input_ids must be a non-empty 1-D list, got {raw['input_ids']!r:.60}"
        )
    labels = (
        ids.clone()
        if raw.get("labels") is None
        else token_tensor(raw["labels"], "labels", f"row {row}")
    )
    if labels.shape != ids.shape:
        raise ValueError(f"row {row}: labels {tuple(labels.shape)} != input_ids {tuple(ids.shape)}")
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
