"""Feeding batches to a transformers model: the right target, the right normalizer.

**The label convention (every neatpack output).** Labels are shifted per document when a pack
is built: ``labels[b, t]`` is the token that must follow ``input_ids[b, t]``, ``-100`` where
nothing is trained, and no label crosses a document. transformers' causal-LM loss shifts the
``labels`` it is given once more, unless it also gets ``shift_labels``; so
:func:`model_inputs` passes the batch's labels as both ``labels`` (which turns the loss on)
and ``shift_labels`` (which the loss then uses as they are). ``model(**model_inputs(batch)).loss``
is next-token cross-entropy; feeding ``batch["labels"]`` alone as ``labels`` would score
every position against the token after next.

**Normalization.** A per-micro-batch mean weights tokens by how they were packed, sharded and
accumulated. Each batch carries ``num_label_tokens``, ``num_documents`` and ``label_weights``
(``neatpack.pipes.materializing.loss``); :func:`step_normalizer` sums one optimizer step's
micro-batches over
the data-parallel ranks, and ``model_inputs(batch, num_items_in_batch=n)`` makes the model's loss
``sum / n``. Two conventions (``LOSS_CONVENTIONS``):

* ``"token"`` (default): the mean over every label token of the step;
* ``"document"``: each document's tokens averaged first, then the mean over the step's
  documents (:func:`packed_loss` with ``convention="document"``).

DDP and FSDP average gradients over ranks: with a global normalizer multiply each rank's loss
by the world size (``Trainer`` does so itself when ``average_tokens_across_devices``).

    n = step_normalizer(micro_batches)                      # all-reduced over ranks
    for b in micro_batches:
        loss = model(**model_inputs(b, num_items_in_batch=n)).loss * world_size
        loss.backward()

Which mask format for which attention implementation (``NeatVLMConfig.attn_implementation``;
its default ``"auto"`` gives ``flash_attention_2`` batches on CUDA and ``sdpa`` ones on CPU):

=====================  =========================================  ======================
model attention        batch["attention_mask"] / extra kwargs     note
=====================  =========================================  ======================
``sdpa``               4D bool ``[B,1,S,S]`` block-causal          True = attend
``eager``              4D additive float (0 / dtype min)           a bool mask is wrong
``flash_attention_2``  ``cu_seq_lens_q/k``, ``max_length_q/k``     varlen, no 4D mask
``flex_attention``     a ``BlockMask`` (document-causal)
``position_ids``       None; ``position_ids`` ``[4,B,S]`` (VL)     needs ``use_cache=False``
=====================  =========================================  ======================

Without a flash-attn build, ``flash_attention_2`` batches run on PyTorch's own varlen kernel
through ``neatpack.pipes.use_varlen_attention(model)`` (on CUDA: ``model.set_attn_implementation(
register_varlen_attention())``), which checks that each call's boundaries are its own tensor's
(``neatpack.pipes.collating.varlen_attention``). ``model_inputs(batch, model=model)`` checks the
pair first (``neatpack.pipes.collating.attention_check``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from neatpack.pipes.collating.attention_check import check_attention_inputs
from neatpack.pipes.collating.attention_choice import model_attention, use_varlen_attention
from neatpack.pipes.collating.mask_format import FLASH_FORMATS
from neatpack.pipes.materializing.loss import CROSS_ENTROPY_IGNORE_IDX, LOSS_COUNT_KEYS

__all__ = [
    "BOOKKEEPING_KEYS",
    "LOSS_CONVENTIONS",
    "model_inputs",
    "packed_loss",
    "step_normalizer",
    "use_varlen_attention_for",
]

LOSS_CONVENTIONS = ("token", "document")

BOOKKEEPING_KEYS = frozenset(
    {
        "doc_ids",
        "sample_ids",
        "packs",
        "n_images_per_sample",
        "n_videos_per_sample",
        "packed_seq_params",
        "dropped_sample_ids",
        "seq_lens",
        "seq_lens_padded",
        *LOSS_COUNT_KEYS,
    }
)


def model_inputs(
    batch: Mapping[str, Any],
    *,
    keep_labels: bool = True,
    num_items_in_batch: int | Tensor | None = None,
    model: Any = None,
) -> dict[str, Any]:
    """The keyword arguments for ``model(**model_inputs(batch))``.

    Drops the bookkeeping keys, sets ``use_cache=False`` (a cache makes transformers ignore the
    document boundaries carried by ``position_ids``) and passes the (already shifted) labels as
    ``labels`` and ``shift_labels``, so the model's loss is next-token cross-entropy.
    ``num_items_in_batch`` (from :func:`step_normalizer`) turns the model's per-batch mean into
    ``sum / num_items_in_batch``. ``model``: checked first against the batch's attention inputs
    (``attention_check.check_attention_inputs``): a batch its attention would let documents
    see each other in, or cannot take, raises naming the fix.

    >>> model_inputs({"input_ids": 1, "doc_ids": 2, "labels": 3, "packs": []})
    {'input_ids': 1, 'labels': 3, 'use_cache': False, 'shift_labels': 3}
    """
    if model is not None:
        check_attention_inputs(model, batch)
    out = {k: v for k, v in batch.items() if k not in BOOKKEEPING_KEYS and v is not None}
    if not keep_labels:
        out.pop("labels", None)
        out.pop("shift_labels", None)
    if "attention_mask" in batch and batch["attention_mask"] is None:
        out["attention_mask"] = None
    out["use_cache"] = False
    labels = out.get("labels")
    if labels is not None:
        # The loss calls .view(-1): an [:, 1:] slice of a padded batch needs a copy first.
        out["shift_labels"] = labels.contiguous() if isinstance(labels, Tensor) else labels
    if num_items_in_batch is not None:
        out["num_items_in_batch"] = num_items_in_batch
    return out


def use_varlen_attention_for(model: Any, loader: Any, *, cuda: bool | None = None) -> str:
    """``use_varlen_attention(model)`` when ``loader``'s batches carry document boundaries (its
    checkpoint key's ``attn_implementation`` is a flash one); the model's attention otherwise
    (a dense-mask loader keeps a mask-taking model). Returns the implementation in use."""
    fmt = dict(getattr(loader, "config", None) or {}).get("attn_implementation")
    if fmt not in FLASH_FORMATS:
        return model_attention(model) or ""
    return use_varlen_attention(model, cuda=cuda)


def _check_convention(convention: str) -> str:
    if convention not in LOSS_CONVENTIONS:
        raise ValueError(f"unknown loss {convention=}; choose one of {LOSS_CONVENTIONS}")
    return "num_label_tokens" if convention == "token" else "num_documents"


def _count(batch: Mapping[str, Any], key: str) -> int:
    if key not in batch:
        raise KeyError(
            f"batch has no {key!r}: build it with a neatpack collater (they attach "
            f"{LOSS_COUNT_KEYS}) or call neatpack.pipes.materializing.loss.add_label_counts(batch)"
        )
    return int(batch[key])


def step_normalizer(
    micro_batches: Iterable[Mapping[str, Any]],
    *,
    convention: str = "token",
    group: Any = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The normalizer of one optimizer step: label tokens (``"token"``) or documents
    (``"document"``) summed over the step's micro-batches on this rank and, when
    ``torch.distributed`` is initialized, over the ranks of ``group`` (all-reduce).

    ``device``: where the count lives (NCCL needs a CUDA tensor); CPU by default. Clamped to at
    least 1 so a step with no labels gives a zero loss, not a division by zero.
    """
    key = _check_convention(convention)
    total = torch.tensor(sum(_count(b, key) for b in micro_batches), dtype=torch.long)
    if device is not None:
        total = total.to(device)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.clamp_min(1)


def packed_loss(
    logits: Tensor,
    batch: Mapping[str, Any],
    *,
    convention: str = "token",
    num_items_in_batch: int | Tensor | None = None,
) -> Tensor:
    """Cross-entropy of ``logits [B, S, V]`` against the batch's (already shifted) labels.

    ``"token"``: ``sum(ce) / n``; ``"document"``: ``sum(ce * label_weights) / n`` (each
    document's mean, summed). ``n`` is ``num_items_in_batch`` (one step's
    :func:`step_normalizer`) or, without it, this batch's own count. The ``"token"`` value equals
    ``model(**model_inputs(batch, num_items_in_batch=n)).loss``.
    """
    key = _check_convention(convention)
    labels: Tensor = batch["labels"]
    ce = F.cross_entropy(
        logits.float().flatten(0, 1),
        labels.to(logits.device).flatten(),
        ignore_index=CROSS_ENTROPY_IGNORE_IDX,
        reduction="none",
    )
    if convention == "document":
        ce = ce * batch["label_weights"].to(ce.device).flatten()
    n = num_items_in_batch if num_items_in_batch is not None else max(_count(batch, key), 1)
    if isinstance(n, Tensor):
        n = n.to(ce.device)
    return ce.sum() / n
