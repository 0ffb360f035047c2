"""What a batch's loss is normalized by: label-token and document counts, per-token weights.

Every neatpack batch holds labels that are *already shifted* per document: ``labels[b, t]`` is
the token that should follow ``input_ids[b, t]`` (``-100`` where nothing is trained). Packing,
the number of ranks and gradient accumulation change how many label tokens one micro-batch
holds, so a per-micro-batch mean weights tokens unequally. The collaters therefore attach:

* ``num_label_tokens``: label tokens (``labels != -100``) in the batch, an ``int``;
* ``num_documents``: documents with at least one label token, an ``int``;
* ``label_weights``: ``float32 [B, S]``, ``1 / n_d`` at each label position of document ``d``
  (``n_d`` its label tokens) and ``0`` elsewhere, so that ``sum(ce * label_weights)`` is the
  sum of the documents' mean losses.

Worked example, one row packing two documents (ids 1, 2; ``.`` is -100, ``0`` padding)::

    doc_ids        1 1 1 1 2 2 2 0
    labels         . . a b . c d .
    label_weights  0 0 .5 .5 0 .5 .5 0      num_label_tokens 4, num_documents 2

>>> import torch
>>> out = label_counts(torch.tensor([[-100, -100, 7, 8, -100, 9, 5, -100]]),
...                    torch.tensor([[1, 1, 1, 1, 2, 2, 2, 0]]))
>>> out["num_label_tokens"], out["num_documents"], out["label_weights"].tolist()
(4, 2, [[0.0, 0.0, 0.5, 0.5, 0.0, 0.5, 0.5, 0.0]])
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["CROSS_ENTROPY_IGNORE_IDX", "LOSS_COUNT_KEYS", "add_label_counts", "label_counts"]

#: The seed's label value for "no loss here" (``llm/neat_packing.py``): padding, prompts, masks.
CROSS_ENTROPY_IGNORE_IDX = -100
LOSS_COUNT_KEYS = ("num_label_tokens", "num_documents", "label_weights")


def label_counts(
    labels: Tensor, doc_ids: Tensor | None = None, *, ignore_index: int = CROSS_ENTROPY_IGNORE_IDX
) -> dict[str, Any]:
    """Label-token count, document count and per-token document weights of one batch.

    ``doc_ids`` is ``[B, S]`` (``1..k`` per row, ``0`` padding) for packed rows; ``None`` means
    each row is one document (padded, unpacked batches).
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [B, S]; got shape {tuple(labels.shape)}")
    is_label = labels.ne(ignore_index)
    if doc_ids is None:
        doc_ids = torch.ones_like(labels)
    elif doc_ids.shape != labels.shape:
        raise ValueError(
            f"doc_ids {tuple(doc_ids.shape)} and labels {tuple(labels.shape)} differ in shape"
        )
    b, _ = labels.shape
    width = int(doc_ids.max()) + 1 if doc_ids.numel() else 1
    # One key per (row, document): count label tokens per key, then spread 1/count back.
    key = doc_ids.long() + torch.arange(b, device=labels.device).unsqueeze(1) * width
    per_doc = torch.bincount(key[is_label], minlength=b * width)
    weights = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    counts = per_doc[key[is_label]].to(torch.float32)
    weights[is_label] = 1.0 / counts
    return {
        "num_label_tokens": int(is_label.sum()),
        "num_documents": int(per_doc.gt(0).sum()),
        "label_weights": weights,
    }


def add_label_counts(
    batch: MutableMapping[str, Any], *, ignore_index: int = CROSS_ENTROPY_IGNORE_IDX
) -> MutableMapping[str, Any]:
    """Attach :func:`label_counts` to a collated batch (in place; returned for chaining).

    Uses ``batch["doc_ids"]`` when present (packed rows); else each row is one document.
    A batch without ``labels`` is returned unchanged.
    """
    labels = batch.get("labels")
    if not isinstance(labels, Tensor):
        return batch
    doc_ids = batch.get("doc_ids")
    batch.update(
        label_counts(
            labels, doc_ids if isinstance(doc_ids, Tensor) else None, ignore_index=ignore_index
        )
    )
    return batch
