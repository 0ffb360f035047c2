"""A transformers attention function over PyTorch's varlen FlashAttention kernel, fed the
boundaries of a ``flash_attention_2`` batch after checking that they belong to the tensor the
call attends over.

    name = register_varlen_attention()       # "neatpack_varlen"
    model.set_attn_implementation(name)
    model(**model_inputs(batch)).loss        # graph config: attn_implementation="flash_attention_2"

Why the check: transformers hands the model's keyword arguments on to the vision tower too. On
5.17 every vision-tower attention call received the *text's* ``cu_seq_lens_q/k`` (60 of 60 calls
on the H200 run); a function that splits by them cuts each image at the text's document
boundaries, and a packed-vs-alone comparison run through that same function agrees with itself.
Boundaries belong to a call when they start at 0, never decrease and end at its token count:

    text layer, 3 documents:  q [1, H, 1024, D]   cu = [0, 654, 1017, 1024]   its own: kernel
    vision tower, one image:  q [1, H, 936, D]    cu = [0, 654, 1017, 1024]   the text's

A causal (text) call must get its own boundaries or raises. A bidirectional (vision-tower) call
gets its own only on transformers' flash path (an implementation name containing "flash"); under
this function's name transformers has already cut the tower's tensor per image, so any
boundaries it carries were forwarded from the text and the call attends over its whole tensor
(what sdpa does there), or by its mask when the tower passes one (transformers' sdpa path).
Off CUDA, or in float32, the same boundaries go to a per-document sdpa reference instead of the
kernel (which takes half precision on CUDA only), so CPU tests run the same checks and splits.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "VARLEN_ATTENTION",
    "check_boundaries",
    "register_varlen_attention",
    "varlen_attention",
]

VARLEN_ATTENTION = "neatpack_varlen"  # no "flash": transformers keeps its per-image vision path
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def check_boundaries(cu: Any, tokens: int, *, key: str, module: Any = None) -> Tensor:
    """``cu`` as an int32 tensor when it describes ``tokens`` tokens (starts at 0, never
    decreases, ends at ``tokens``); otherwise ``ValueError`` naming the layer and the fix.

    >>> check_boundaries([0, 4, 6], 6, key="cu_seq_lens_q").tolist()
    [0, 4, 6]
    >>> check_boundaries([0, 4, 6], 5, key="cu_seq_lens_q")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: cu_seq_lens_q=[0, 4, 6] end at 6 but this attention call (None) attends over 5 ...
    """
    cu_t = torch.as_tensor(cu).reshape(-1)
    values = [int(c) for c in cu_t.tolist()]
    ok = len(values) >= 2 and values[0] == 0 and all(a <= b for a, b in itertools.pairwise(values))
    if ok and values[-1] == tokens:
        return cu_t.to(torch.int32)
    where = type(module).__name__ if module is not None else None
    shown = values if len(values) <= 12 else [*values[:6], "...", *values[-3:]]
    raise ValueError(
        f"{key}={shown} end at {values[-1] if values else None} but this attention call "
        f"({where}) attends over {tokens} tokens: these boundaries belong to another tensor "
        "(transformers forwards the text's boundaries to the vision tower on some releases) or "
        "are not cumulative lengths from 0; pass the batch of a graph built with "
        "attn_implementation='flash_attention_2' to model(**model_inputs(batch))"
    )


def _own_vision_boundaries(module: Any, kwargs: dict[str, Any], tokens: int) -> Tensor | None:
    """The boundaries of a bidirectional call, or None for its whole tensor (see the module)."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None) or ""
    if "flash" not in impl or kwargs.get("cu_seq_lens_q") is None:
        return None  # transformers cut the tensor per image; what arrived is the text's
    return check_boundaries(kwargs["cu_seq_lens_q"], tokens, key="cu_seq_lens_q", module=module)


def _reference(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, causal: bool, scale: Any) -> Tensor:
    """Per-segment sdpa over ``[T, H, D]`` streams (the kernel's result, on any device)."""
    outs = []
    for a, e in itertools.pairwise(cu.tolist()):
        qs, ks, vs = (t[a:e].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale))
    return torch.cat(outs, dim=1).transpose(0, 1)


def _kernel(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, causal: bool, scale: Any) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    extra: dict[str, Any] = {}
    if "scale" in params:
        extra["scale"] = scale
    elif scale is not None:  # a release without ``scale``: fold it into q (default is d**-0.5)
        q = q * (scale * q.shape[-1] ** 0.5)
    if "is_causal" in params:  # older torch
        extra["is_causal"] = causal
    else:
        extra["window_size"] = (-1, 0) if causal else (-1, -1)
    cu = cu.to(q.device)
    longest = int(cu.diff().max())
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **extra)
    return out[0] if isinstance(out, tuple) else out  # a tuple only with ``return_aux``


def varlen_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract (``[B, H, S, D]`` in, ``[B, S, H, D]`` out),
    attending within the documents of ``cu_seq_lens_q`` once they are checked to be this
    call's own (:func:`check_boundaries`)."""
    if dropout:
        raise ValueError(f"{dropout=}: the varlen kernel has no dropout; set attention dropout 0")
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    b, hq, s, d = query.shape
    tokens = b * s
    if causal:
        if kwargs.get("cu_seq_lens_q") is None:
            raise ValueError(
                f"{type(module).__name__}: no cu_seq_lens_q; build the batches with "
                "attn_implementation='flash_attention_2' and call model(**model_inputs(batch))"
            )
        cu = check_boundaries(kwargs["cu_seq_lens_q"], tokens, key="cu_seq_lens_q", module=module)
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and not torch.equal(
            check_boundaries(cu_k, b * key.shape[2], key="cu_seq_lens_k", module=module), cu
        ):
            raise ValueError("cu_seq_lens_k differs from cu_seq_lens_q: packed training has one")
    elif attention_mask is not None:  # a tower that masks images apart itself: its own path
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, is_causal=False
        )
    else:
        own = _own_vision_boundaries(module, kwargs, tokens)
        cu = torch.tensor([0, tokens], dtype=torch.int32) if own is None else own
    hk = key.shape[1]
    q = query.transpose(1, 2).reshape(tokens, hq, d)
    k = key.transpose(1, 2).reshape(tokens, hk, d).repeat_interleave(hq // hk, dim=1)
    v = value.transpose(1, 2).reshape(tokens, hk, d).repeat_interleave(hq // hk, dim=1)
    run = _kernel if query.is_cuda and query.dtype in _KERNEL_DTYPES else _reference
    return run(q, k, v, cu.cpu(), causal, scaling).reshape(b, s, hq, d), None


def register_varlen_attention(name: str = VARLEN_ATTENTION) -> str:
    """Register :func:`varlen_attention` with transformers under ``name`` and return the name,
    for ``model.set_attn_implementation(name)``."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, varlen_attention)
    return name
