"""Which attention format a packed batch gets, which attention a model runs it with, and a check
that the two agree before a step trains on them.

``attn_implementation="auto"`` (the graphs' default) picks the fastest format that is exact:

    attn_implementation   model=          CUDA + varlen kernel   otherwise
    "auto"                None            flash_attention_2      sdpa (dense 4D mask, as before)
    "auto"                a model         the model's format: neatpack_varlen / flash_* ->
                                          flash_attention_2 (flash_attention_3), sdpa, eager, ...
    "auto", cp_size > 1 or a family whose mask is not block-causal (Gemma 3)  -> sdpa
    anything else         -               itself

On CPU nothing changes (sdpa, the same batches and checkpoint key as before "auto" existed).
On CUDA the ``flash_attention_2`` batch carries ``cu_seq_lens_q/k``; :func:`use_varlen_attention`
makes the model attend by them through neatpack's function over PyTorch's own varlen kernel
(``varlen_attention.py``: no flash-attn build). NeatTrainer calls it by default. Measured on an
H200 (Qwen2-VL-2B shapes, pack 8192): 17.0k real tokens/s against 14.0k with the dense mask,
2.23x at pack 32,768 (notes/gpu_h200_measured.md).

:func:`check_attention_inputs` is where a batch meets a model (``model_inputs(batch,
model=model)``, NeatTrainer): a batch whose format the model's attention cannot honour raises,
naming the fix, instead of training on documents that see each other::

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

import importlib
import importlib.util
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from neatpack.pipes.collating.varlen_attention import VARLEN_ATTENTION, register_varlen_attention

__all__ = [
    "AUTO_ATTENTION",
    "attends_by_boundaries",
    "batch_format_of",
    "check_attention_inputs",
    "choose_attention_format",
    "cuda_training",
    "model_attention",
    "use_varlen_attention",
]

AUTO_ATTENTION = "auto"
#: The implementations a model already runs that use no boundaries: use_varlen_attention swaps
#: these (transformers' defaults) and leaves any other choice (flash_*, flex, a user's) alone.
_SWAPPED = ("sdpa", "eager")
#: Models already probed: model -> {(implementation, position layout)} found isolated.
_PROBED: weakref.WeakKeyDictionary[Any, set[tuple[str, Any]]] = weakref.WeakKeyDictionary()


def cuda_training() -> bool:
    """Whether this process trains on CUDA with a varlen kernel at hand (PyTorch's own
    ``torch.nn.attention.varlen``, or a flash-attn build): what ``"auto"`` asks."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        return importlib.util.find_spec("flash_attn") is not None
    return True


def _unwrap(model: Any) -> Any:
    """The transformers model inside DDP / FSDP / accelerate wrappers (their ``.module``)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model


def model_attention(model: Any) -> str | None:
    """The attention implementation ``model`` (or a transformers config) runs, or None."""
    config = getattr(_unwrap(model), "config", model)
    impl = getattr(config, "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def attends_by_boundaries(impl: str | None) -> bool:
    """Whether attention implementation ``impl`` attends within ``cu_seq_lens_q/k`` (and takes
    no 4D mask): transformers' flash ones and neatpack's varlen function."""
    return impl is not None and ("flash" in impl or impl == VARLEN_ATTENTION)


def _format_of_model(impl: str) -> str:
    if impl == "flash_attention_3":
        return impl
    if attends_by_boundaries(impl):
        return "flash_attention_2"
    if impl in ("sdpa", "eager", "flex_attention"):
        return impl
    raise ValueError(
        f"attn_implementation='auto' cannot tell the batch format of the model's attention "
        f"{impl!r}: name it (attn_implementation='flash_attention_2' for a function that attends "
        "by cu_seq_lens_q, 'sdpa' for one that takes a 4D mask)"
    )


def choose_attention_format(
    attn_implementation: str,
    *,
    model: Any = None,
    cuda: bool | None = None,
    block_causal: bool = True,
    cp_size: int = 1,
) -> str:
    """The batch format for ``attn_implementation``: itself, or for ``"auto"`` the table of the
    module docstring. ``cuda``: whether the run is on CUDA (None: :func:`cuda_training`).

    >>> choose_attention_format("auto", cuda=False), choose_attention_format("auto", cuda=True)
    ('sdpa', 'flash_attention_2')
    >>> choose_attention_format("eager", cuda=True)
    'eager'
    """
    if attn_implementation != AUTO_ATTENTION:
        return attn_implementation
    if cp_size > 1 or not block_causal:  # CP shards a 4D mask; Gemma 3 needs one
        return "sdpa"
    impl = None if model is None else model_attention(model)
    if impl is not None:  # a config without a chosen implementation: as if no model
        return _format_of_model(impl)
    on_cuda = cuda_training() if cuda is None else cuda
    return "flash_attention_2" if on_cuda else "sdpa"


def use_varlen_attention(model: Any, *, cuda: bool | None = None) -> str:
    """Make ``model`` attend through neatpack's varlen function on CUDA; return the attention
    implementation it runs afterwards.

    Swapped: a transformers model whose attention goes through transformers' registry
    (``set_attn_implementation``, ``_supports_attention_backend``) running sdpa or eager. Left
    alone: off CUDA (``cuda`` False, or None and :func:`cuda_training` says so), a model
    already on flash_* / flex / a function of your own, a model outside the registry. The
    batches must then be ``flash_attention_2`` ones (``attn_implementation="auto"`` on CUDA);
    :func:`check_attention_inputs` refuses a dense-mask batch for it.
    """
    model = _unwrap(model)
    impl = model_attention(model)
    on_cuda = cuda_training() if cuda is None else cuda
    registry = callable(getattr(model, "set_attn_implementation", None)) and bool(
        getattr(model, "_supports_attention_backend", False)
    )
    if not on_cuda or not registry or impl not in _SWAPPED:
        return impl or ""
    model.set_attn_implementation(register_varlen_attention())
    return VARLEN_ATTENTION


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
    model = _unwrap(model)
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
    from neatpack.pipes.collating.leak_probe import PackingLeakError, probe_packing_leak

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
