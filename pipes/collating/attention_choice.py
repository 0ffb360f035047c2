"""Which attention format a packed batch gets, and which attention a model runs it with.

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

Where a batch meets a model, ``attention_check.check_attention_inputs`` makes sure the two agree.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from neatpack.pipes.collating.attention_formats import (
    DENSE_FORMATS,
    FLASH_FORMATS,
    MASK_CONVERSIONS,
    VARLEN_FORMAT,
)
from neatpack.pipes.collating.varlen_attention import VARLEN_ATTENTION, register_varlen_attention

__all__ = [
    "AUTO_ATTENTION",
    "attends_by_boundaries",
    "choose_attention_format",
    "cuda_training",
    "model_attention",
    "unwrap_model",
    "use_varlen_attention",
]

AUTO_ATTENTION = "auto"
#: The implementations a model already runs that use no boundaries: use_varlen_attention swaps
#: these (transformers' defaults) and leaves any other choice (flash_*, flex, a user's) alone.
_SWAPPED = DENSE_FORMATS


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


def unwrap_model(model: Any) -> Any:
    """The transformers model inside DDP / FSDP / accelerate wrappers (their ``.module``)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model


def model_attention(model: Any) -> str | None:
    """The attention implementation ``model`` (or a transformers config) runs, or None."""
    config = getattr(unwrap_model(model), "config", model)
    impl = getattr(config, "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def attends_by_boundaries(impl: str | None) -> bool:
    """Whether attention implementation ``impl`` attends within ``cu_seq_lens_q/k`` (and takes
    no 4D mask): transformers' flash ones and neatpack's varlen function."""
    return impl is not None and ("flash" in impl or impl == VARLEN_ATTENTION)


def _format_of_model(impl: str) -> str:
    if impl in FLASH_FORMATS or impl in MASK_CONVERSIONS:  # a batch format of its own name
        return impl
    if attends_by_boundaries(impl):  # another flash kernel, neatpack's varlen function
        return VARLEN_FORMAT
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
    return VARLEN_FORMAT if on_cuda else "sdpa"


def use_varlen_attention(model: Any, *, cuda: bool | None = None) -> str:
    """Make ``model`` attend through neatpack's varlen function on CUDA; return the attention
    implementation it runs afterwards.

    Swapped: a transformers model whose attention goes through transformers' registry
    (``set_attn_implementation``, ``_supports_attention_backend``) running sdpa or eager. Left
    alone: off CUDA (``cuda`` False, or None and :func:`cuda_training` says so), a model
    already on flash_* / flex / a function of your own, a model outside the registry. The
    batches must then be ``flash_attention_2`` ones (``attn_implementation="auto"`` on CUDA);
    ``attention_check.check_attention_inputs`` refuses a dense-mask batch for it.
    """
    model = unwrap_model(model)
    impl = model_attention(model)
    on_cuda = cuda_training() if cuda is None else cuda
    registry = callable(getattr(model, "set_attn_implementation", None)) and bool(
        getattr(model, "_supports_attention_backend", False)
    )
    if not on_cuda or not registry or impl not in _SWAPPED:
        return impl or ""
    model.set_attn_implementation(register_varlen_attention())
    return VARLEN_ATTENTION
