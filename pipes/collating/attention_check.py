"""Where a packed batch meets a model: do the batch's attention inputs and the model's attention
agree? :func:`check_attention_inputs` (called by ``model_inputs(batch, model=model)`` and the
trainer integrations) raises, naming the fix, instead of training on documents that see each
other.

The cases::

    batch                     model attention            result
    cu_seq_lens, no mask      neatpack_varlen, flash_*   ok (attends by the boundaries)
    cu_seq_lens, no mask      sdpa / eager / other       ok only if the documents stay apart:
                                                         transformers rebuilds a block mask from
                                                         restarting text positions (5.x); probed
                                                         once per model on the batch itself
    dense 4D mask             neatpack_varlen, flash_*   error: no boundaries to attend by
    bool 4D mask              eager                      error: eager adds the mask
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from neatpack.pipes.collating.attention_choice import (
    attends_by_boundaries,
    model_attention,
    unwrap_model,
)
from neatpack.pipes.collating.leak_probe import PackingLeakError, probe_packing_leak

__all__ = ["batch_format_of", "check_attention_inputs"]

#: Models already probed: model -> {(implementation, position layout)} found isolated.
_PROBED: weakref.WeakKeyDictionary[Any, set[tuple[str, Any]]] = weakref.WeakKeyDictionary()


def batch_format_of(batch: Mapping[str, Any]) -> str:
    """What attention input a collated batch carries: ``"boundaries"`` (cu_seq_lens, no mask),
    ``"bool_4d"`` / ``"float_4d"`` (a dense mask), or ``"other"`` (doc ids, a BlockMask, ...)."""
    mask = batch.get("attention_mask")
    if mask is None and batch.get("cu_seq_lens_q") is not None:
        return "boundaries"
    if isinstance(mask, Tensor) and mask.dim() == 4:
        return "bool_4d" if mask.dtype == torch.bool else "float_4d"
    return "other"


def check_attention_inputs(model: Any, batch: Mapping[str, Any]) -> None:
    """``ValueError`` (``PackingLeakError`` for a measured leak) when ``model``'s attention
    cannot run ``batch`` exactly (module docstring's table); nothing otherwise.

    A boundaries batch for an attention that ignores them is probed once per model, attention
    and position layout (``leak_probe.probe_packing_leak`` on the batch itself: one document
    changed, every other document's hidden states compared), so a model that keeps documents
    apart by their positions passes and one that would let them see each other raises.
    """
    model = unwrap_model(model)
    impl = model_attention(model)
    fmt = batch_format_of(batch)
    if impl is None or fmt == "other":
        return
    fix_batch = "build the graph with attn_implementation='auto' (on CUDA) or 'flash_attention_2'"
    if attends_by_boundaries(impl):
        if fmt != "boundaries":
            raise ValueError(
                f"the model attends with {impl!r}, which attends within cu_seq_lens_q, but the "
                f"batch carries a dense 4D mask and no boundaries. Fix: {fix_batch}, or "
                "model.set_attn_implementation('sdpa') to use the mask"
            )
        return
    if fmt == "bool_4d" and impl == "eager":
        raise ValueError(
            "the model attends with 'eager', which adds the mask to its scores, but the batch's "
            "4D mask is bool (sdpa's): masked pairs would be attended. Fix: build the graph with "
            "attn_implementation='eager' (an additive mask), or model.set_attn_implementation("
            "'sdpa')"
        )
    if fmt == "boundaries":
        _check_isolated(model, impl, batch)


def _check_isolated(model: Any, impl: str, batch: Mapping[str, Any]) -> None:
    positions = batch.get("position_ids")
    layout = None if not isinstance(positions, Tensor) else tuple(positions.shape[:-2])
    seen = _PROBED.setdefault(model, set())
    doc_ids = batch.get("doc_ids")
    if (impl, layout) in seen or not isinstance(doc_ids, Tensor) or int(doc_ids[0].max()) < 2:
        return  # probed already, or nothing to probe: one document per row cannot leak
    training = bool(getattr(model, "training", False))
    model.eval()  # dropout would move every document
    try:
        report = probe_packing_leak(model, batch)
    finally:
        model.train(training)
    if report.leaks:
        worst = max(report.layers, key=lambda x: x.max_change)
        shown = "absent" if layout is None else f"of shape {tuple(batch['position_ids'].shape)}"
        raise PackingLeakError(
            f"the batch carries document boundaries (cu_seq_lens_q) and no mask, but the "
            f"model's attention {impl!r} ignores them: its documents attend to each other "
            f"(changing one moved the others by {worst.max_change:.2e} at layer {worst.index}; "
            f"position_ids {shown}"
            " do not restart where the documents do). Fix: neatpack.pipes.use_varlen_attention("
            "model) on CUDA (or model.set_attn_implementation(neatpack.pipes."
            "register_varlen_attention())), or build the graph with attn_implementation='sdpa' "
            "for a dense mask; keep the batch's position_ids"
        )
    seen.add((impl, layout))
