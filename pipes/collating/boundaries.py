"""Document boundaries for layers that are not attention: linear attention, SSM, causal conv.

An attention layer sees document boundaries in its mask (or ``cu_seq_lens`` / positions). A
*stateful* layer (Gated DeltaNet in Qwen3-Next / Qwen3.5, Mamba-2 in Nemotron-H / Bamba /
Falcon-H1, a causal conv) carries a state along the row, so in a packed row document 2 starts
from document 1's state unless the layer's kernel gets the boundaries too. transformers 5.x
hands two kwargs to those kernels: ``cu_seq_lens_q`` (flash-linear-attention's
``chunk_gated_delta_rule`` and ``causal_conv1d``) and ``seq_idx`` (``mamba_ssm`` and
``causal_conv1d``). :func:`boundary_kwargs` builds both from the document ids, with the names,
dtypes and values of transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
return_seq_idx=True)``::

    doc_ids        [[1, 1, 1, 2, 2, 0]]       two documents (3 + 2 tokens), one padding token
    seq_idx        [[0, 0, 0, 1, 1, 2]]       int32; the padding run is a segment of its own
    cu_seq_lens_q  [0, 3, 5, 6]               int32, over the B*S flattened tokens
    max_length_q   3                          Python int

Rows are seen as one stream of ``B*S`` tokens (as ``mask.to_cu_seqlens`` does), so
``seq_idx.view(1, -1)`` and ``cu_seq_lens_q`` describe the same segments. The fused
linear-attention kernels accept ``cu_seqlens`` only for a batch of one row: pack with
``batch_size=1`` (one long row) for those models, or flatten the rows yourself.

Which models need them: :func:`stateful_layers` reads a transformers config (``layer_types``,
``layers_block_type``, ``hybrid_override_pattern`` or the ``model_type``) and
:func:`needs_boundaries` says whether any layer is stateful. The torch fallbacks that
transformers uses when the kernels are not installed IGNORE these kwargs: check a model with
``neatpack.pipes.probe_packing_leak`` before packing for it.

>>> kw = boundary_kwargs(torch.tensor([[1, 1, 1, 2, 2, 0]]))
>>> kw["seq_idx"].tolist(), kw["cu_seq_lens_q"].tolist(), kw["max_length_q"]
([[0, 0, 0, 1, 1, 2]], [0, 3, 5, 6], 3)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from neatpack.pipes.collating.cu_seqlens import cu_seqlens_from_doc_lengths, to_cu_seqlens
from neatpack.pipes.collating.doc_ids import check_doc_ids, segment_starts

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "BOUNDARY_KEYS",
    "HYBRID_MODEL_TYPES",
    "add_boundaries",
    "boundary_kwargs",
    "needs_boundaries",
    "stateful_layers",
    "to_seq_idx",
]

#: The kwargs :func:`add_boundaries` adds to a batch (and the model forwards to its layers).
BOUNDARY_KEYS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: Layer types whose tokens only meet through attention (their boundaries are the mask's job).
ATTENTION_LAYER_TYPES = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "attention",
    "mlp",
    "moe",
    "*",
    "-",
    "E",
)
#: ``model_type`` values whose stacks hold stateful layers, with the kind of those layers when
#: the config names none (``Mamba2Config`` has no ``layer_types``).
HYBRID_MODEL_TYPES: dict[str, str] = {
    "qwen3_next": "linear_attention",
    "qwen3_5": "linear_attention",
    "qwen3_5_text": "linear_attention",
    "qwen3_5_moe": "linear_attention",
    "qwen3_5_moe_text": "linear_attention",
    "olmo_hybrid": "linear_attention",
    "mamba": "mamba",
    "mamba2": "mamba",
    "nemotron_h": "mamba",
    "bamba": "mamba",
    "falcon_h1": "mamba",
    "granitemoehybrid": "mamba",
    "jamba": "mamba",
    "zamba": "mamba",
    "zamba2": "mamba",
    "lfm2": "conv",
    "lfm2_vl": "conv",
}
# Characters of Nemotron-H's ``hybrid_override_pattern``: M = Mamba-2, * = attention, - = MLP.
_PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _text_config(config: Any) -> Any:
    """The language model's config: ``text_config`` of a VLM, else the config itself."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        return getter()
    return getattr(config, "text_config", None) or config


def _layer_kinds(config: Any) -> list[str] | None:
    """Per-layer kind names from whatever field the config has; None when it has none."""
    for key in ("layer_types", "layers_block_type"):
        kinds = getattr(config, key, None)
        if isinstance(kinds, Sequence) and not isinstance(kinds, str) and kinds:
            return [str(k) for k in kinds]
    pattern = getattr(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and pattern:
        return [_PATTERN_KINDS.get(c, c) for c in pattern]
    return None


def stateful_layers(config: Any) -> list[tuple[int, str]]:
    """``(layer index, kind)`` of every layer whose state runs along the row (not attention).

    ``config``: a transformers ``PretrainedConfig`` (a VLM's is read through its text config),
    or a mapping with the same fields. A model whose config lists no layer kinds counts by its
    ``model_type`` (:data:`HYBRID_MODEL_TYPES`): every layer of a Mamba-2 model is stateful.

    >>> from transformers import Qwen2Config, Qwen3NextConfig
    >>> stateful_layers(Qwen2Config(num_hidden_layers=2))
    []
    >>> stateful_layers(Qwen3NextConfig(num_hidden_layers=4))
    [(0, 'linear_attention'), (1, 'linear_attention'), (2, 'linear_attention')]
    """
    if isinstance(config, Mapping):
        from types import SimpleNamespace

        config = SimpleNamespace(**config)
    text = _text_config(config)
    kinds = _layer_kinds(text)
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    if kinds is None:
        kind = HYBRID_MODEL_TYPES.get(model_type)
        if kind is None:
            return []
        n = int(getattr(text, "num_hidden_layers", 0) or 0)
        return [(i, kind) for i in range(n)]
    # Mamba-2 stacks name their mixer layers "linear_attention" in transformers 5.x: say mamba.
    family_kind = HYBRID_MODEL_TYPES.get(model_type)
    return [
        (i, "mamba" if k == "linear_attention" and family_kind == "mamba" else k)
        for i, k in enumerate(kinds)
        if k not in ATTENTION_LAYER_TYPES
    ]


def needs_boundaries(config: Any) -> bool:
    """True when a model of this config has linear-attention, SSM or conv layers.

    >>> from transformers import BambaConfig, Qwen2Config
    >>> needs_boundaries(BambaConfig(num_hidden_layers=2, attn_layer_indices=[1]))
    True
    >>> needs_boundaries(Qwen2Config())
    False
    """
    return bool(stateful_layers(config))


def to_seq_idx(doc_ids: Tensor, *, validate: bool = True) -> Tensor:
    """``[B, S]`` int32 segment index over the flattened rows (Mamba-2 / causal-conv ``seq_idx``).

    Segment ``j`` is the j-th run of one document id in ``doc_ids.view(-1)``; a row's padding
    run and every row start open a new segment, exactly where ``mask.to_cu_seqlens`` cuts.

    >>> to_seq_idx(torch.tensor([[1, 1, 2, 0], [1, 1, 1, 1]])).tolist()
    [[0, 0, 1, 2], [3, 3, 3, 3]]
    """
    if validate:
        check_doc_ids(doc_ids)
    starts = segment_starts(doc_ids)
    return (starts.cumsum(0) - 1).to(torch.int32).view(doc_ids.shape)


def boundary_kwargs(
    doc_ids: Tensor,
    doc_lengths: Sequence[Sequence[int]] | None = None,
    *,
    validate: bool = True,
) -> dict[str, Any]:
    """``seq_idx`` and the varlen kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``) of a batch.

    ``doc_lengths`` (per row, the lengths of documents 1..k, e.g. the packs'
    ``seq_lens_padded``) skips the scan of ``doc_ids`` for the cu_seqlens when given.
    """
    if validate:
        check_doc_ids(doc_ids)
    cu = (
        to_cu_seqlens(doc_ids, validate=False)
        if doc_lengths is None
        else cu_seqlens_from_doc_lengths(doc_lengths, doc_ids.shape[1])
    )
    cu["cu_seq_lens_q"] = cu["cu_seq_lens_q"].to(doc_ids.device)
    cu["cu_seq_lens_k"] = cu["cu_seq_lens_q"]
    return {"seq_idx": to_seq_idx(doc_ids, validate=False), **cu}


def add_boundaries(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a collated batch with :func:`boundary_kwargs` of its ``doc_ids`` added.

    Works for every mask format (the batch's ``attention_mask`` / ``packed_seq_params`` are
    kept); flash formats already hold the same ``cu_seq_lens`` values, which are kept as they
    are. Raises ``ValueError`` when the batch has no ``doc_ids``.

    >>> b = add_boundaries({"doc_ids": torch.tensor([[1, 1, 2, 2]])})
    >>> b["seq_idx"].tolist(), b["cu_seq_lens_k"].tolist()
    ([[0, 0, 1, 1]], [0, 2, 4])
    """
    doc_ids = batch.get("doc_ids")
    if not isinstance(doc_ids, Tensor):
        raise ValueError(
            f"add_boundaries needs the batch's [B, S] 'doc_ids' tensor; got keys {sorted(batch)}. "
            "Collate with neat_packed_vlm_collater (every format keeps doc_ids)."
        )
    out = dict(batch)
    for key, value in boundary_kwargs(doc_ids).items():
        out.setdefault(key, value)
    return out
