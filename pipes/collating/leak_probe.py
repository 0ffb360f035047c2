"""Does packing leak for this model? Change one document, measure every other document.

A packed row is exact only if no layer lets one document see another. Attention layers are
isolated by the mask; linear-attention, SSM and conv layers only by kernels that honour
``cu_seq_lens_q`` / ``seq_idx`` (``pipes/collating/boundaries.py``). transformers' torch fallbacks
(used
when flash-linear-attention, causal-conv1d or mamba-ssm is not installed, and always on CPU)
ignore them. :func:`probe_packing_leak` measures it on the model as it will run::

    row 0:  doc 1 (perturbed)  | doc 2            | doc 3            | pad
    run the packed batch twice, doc 1's tokens changed the second time, and record per layer
    max |out_2 - out_1| over the tokens of docs 2 and 3 (0.0 where documents are isolated)

    layer  kind               max change   (tiny random Qwen3-Next on CPU, fallbacks)
    0      linear_attention   4.6e-03      <- leaks
    3      full_attention     6.1e-03      <- inherits the leak of layers 0-2

:func:`check_packing` runs the probe on a small synthetic batch and raises
:class:`PackingLeakError` naming the leaking layers and the fix; the prebuilt graphs call it
when given a ``model``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from neatpack.pipes.collating.attention_formats import DENSE_FORMATS
from neatpack.pipes.collating.boundaries import BOUNDARY_KEYS, stateful_layers

__all__ = [
    "LayerLeak",
    "LeakReport",
    "PackingLeakError",
    "check_packing",
    "packing_boundaries",
    "probe_packing_leak",
]

#: fp32 outputs of documents that share nothing are bit-identical; 1e-5 leaves room for
#: kernels whose reduction order depends on the whole row (never seen on CPU).
DEFAULT_TOLERANCE = 1e-5
#: What installs the fused kernel that honours the boundaries, per layer kind.
KERNEL_FIXES = {
    "linear_attention": "flash-linear-attention and causal-conv1d (Gated DeltaNet)",
    "mamba": "mamba-ssm and causal-conv1d (Mamba-2)",
    "conv": "causal-conv1d",
    "hybrid": "mamba-ssm and causal-conv1d (Mamba-2)",
}
_MODEL_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "mm_token_type_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    *BOUNDARY_KEYS,
)


class PackingLeakError(ValueError):
    """A packed document changes when another document of its row changes."""


@dataclass(frozen=True)
class LayerLeak:
    """One decoder layer: its kind and the largest change of any unperturbed document."""

    index: int
    kind: str
    max_change: float
    per_document: dict[tuple[int, int], float] = field(default_factory=dict)


@dataclass(frozen=True)
class LeakReport:
    """The probe's result: per layer, how much the other documents moved."""

    perturbed: tuple[int, int]  # (row, document id)
    layers: list[LayerLeak]
    tolerance: float = DEFAULT_TOLERANCE
    #: Set by :func:`check_packing` when the model refused the boundary kwargs (transformers
    #: 5.x raises when a torch fallback gets ``seq_idx`` / ``cu_seqlens``): the layers above were
    #: then measured without them, as a batch without boundaries would run.
    boundaries_refused: str | None = None

    @property
    def max_change(self) -> float:
        return max((layer.max_change for layer in self.layers), default=0.0)

    @property
    def leaks(self) -> bool:
        return self.max_change > self.tolerance

    def leaking_layers(self) -> list[LayerLeak]:
        """Every layer whose output moved more than the tolerance (a layer after the first
        leaking one may only pass the leak on: the first one and the stateful ones are where
        it comes from)."""
        return [layer for layer in self.layers if layer.max_change > self.tolerance]

    def __str__(self) -> str:
        lines = [f"perturbed row {self.perturbed[0]} document {self.perturbed[1]}"]
        lines += [f"layer {x.index:>3} {x.kind:<18} {x.max_change:.3e}" for x in self.layers]
        return "\n".join(lines)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The language model's decoder layers: the longest ``ModuleList`` outside the vision tower
    whose length is the text config's ``num_hidden_layers``."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) != n or n == 0:
            continue
        if any(part in name for part in ("visual", "vision", "audio", "mtp")):
            continue
        return list(module)
    raise ValueError(
        f"could not find the {n} decoder layers of {type(model).__name__} (no nn.ModuleList of "
        "that length outside the vision tower); probe a model whose config sets num_hidden_layers"
    )


def _first_tensor(value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, Sequence) and value and isinstance(value[0], Tensor):
        return value[0]
    hidden = getattr(value, "last_hidden_state", None)
    if isinstance(hidden, Tensor):
        return hidden
    raise TypeError(f"a decoder layer returned {type(value).__name__}; expected a tensor")


def _run(model: nn.Module, inputs: Mapping[str, Any], layers: list[nn.Module]) -> list[Tensor]:
    outs: list[Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out: outs.append(_first_tensor(out).detach()))
        for layer in layers
    ]
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return outs


def _perturb(input_ids: Tensor, target: Tensor, text: Tensor) -> Tensor:
    """``input_ids`` with every text token of ``target`` moved to the next text token id seen in
    the batch (a permutation of ids already present: no special or media token appears)."""
    vocab = torch.unique(input_ids[text])
    if vocab.numel() < 2:
        raise ValueError(
            "the batch has fewer than 2 distinct text token ids; the probe needs documents with "
            "varied text to change one of them"
        )
    where = target & text
    if not bool(where.any()):
        raise ValueError("the document to perturb has no text token; pick another with document=")
    out = input_ids.clone()
    idx = torch.searchsorted(vocab, input_ids[where])
    out[where] = vocab[(idx + 1) % vocab.numel()]
    return out


def probe_packing_leak(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    row: int = 0,
    document: int = 1,
    tolerance: float = DEFAULT_TOLERANCE,
) -> LeakReport:
    """Change document ``document`` of row ``row`` and report how far every other document moves.

    ``batch``: a collated packed batch (``neat_packed_vlm_collater``, any mask format the model
    runs; with ``boundaries=True`` for hybrid models, as the graph would feed it). The model
    runs twice in ``no_grad``; a forward hook on each decoder layer records its output. For each
    layer the report holds the largest absolute change over the real tokens of every other
    document of the batch (padding excluded). Media tokens are never changed.

    >>> from neatpack.pipes.testing.tiny_models import tiny_model
    >>> from neatpack.pipes.materializing.pack import build_pack
    >>> from neatpack.pipes.collating.collate import neat_packed_vlm_collater
    >>> docs = [{"input_ids": torch.arange(n) + 7 * n} for n in (9, 6, 8)]
    >>> pack = build_pack([dict(d, labels=d["input_ids"]) for d in docs])
    >>> batch = neat_packed_vlm_collater([pack])
    >>> probe_packing_leak(tiny_model("qwen2"), batch).max_change
    0.0
    """
    doc_ids = batch.get("doc_ids")
    input_ids = batch.get("input_ids")
    if not isinstance(doc_ids, Tensor) or not isinstance(input_ids, Tensor):
        raise ValueError(
            f"probe_packing_leak needs a collated batch with 'input_ids' and 'doc_ids'; got keys "
            f"{sorted(batch)}"
        )
    if not 0 <= row < doc_ids.shape[0] or not bool((doc_ids[row] == document).any()):
        raise ValueError(
            f"{row=}, {document=} is not a document of the batch (row {row} has documents "
            f"1..{int(doc_ids[row].max()) if 0 <= row < doc_ids.shape[0] else 0})"
        )
    layers = _decoder_layers(model)
    device = next(model.parameters()).device
    inputs = {
        k: v.to(device) if isinstance(v, Tensor) else v
        for k, v in batch.items()
        if k in _MODEL_KEYS
    }
    mm = batch.get("mm_token_type_ids")
    text = (doc_ids > 0) if not isinstance(mm, Tensor) else (doc_ids > 0) & (mm == 0)
    target = torch.zeros_like(doc_ids, dtype=torch.bool)
    target[row] = doc_ids[row] == document
    changed = dict(inputs, input_ids=_perturb(input_ids, target, text).to(device))
    before = _run(model, inputs, layers)
    after = _run(model, changed, layers)
    kinds = dict(stateful_layers(getattr(model, "config", {})))
    config: Any = getattr(model, "config", None)
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    names = list(getattr(text_cfg, "layer_types", None) or [])
    others = [
        (r, int(d))
        for r in range(doc_ids.shape[0])
        for d in torch.unique(doc_ids[r]).tolist()
        if d > 0 and (r, d) != (row, document)
    ]
    report: list[LayerLeak] = []
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        delta = (b.float() - a.float()).abs().amax(dim=-1).cpu()  # [B, S]
        per = {(r, d): float(delta[r][doc_ids[r] == d].max()) for r, d in others}
        kind = kinds.get(i) or (names[i] if i < len(names) else "layer")
        report.append(LayerLeak(i, kind, max(per.values(), default=0.0), per))
    return LeakReport((row, document), report, tolerance)


def _synthetic_batch(model: nn.Module, *, boundaries: bool, mask_format: str) -> dict[str, Any]:
    """Three text documents (24, 17 and 20 tokens) of ordinary token ids, packed in one row."""
    from neatpack.pipes.collating.collate import neat_packed_vlm_collater
    from neatpack.pipes.materializing.pack import build_pack

    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 0) or getattr(config, "vocab_size", 0) or 0)
    special = {
        int(v)
        for cfg in (config, text)
        for k, v in vars(cfg).items()
        if (k.endswith("_token_id") or k.endswith("_token_index")) and isinstance(v, int)
    }
    ordinary = torch.tensor([t for t in range(min(vocab, 4096)) if t not in special])
    if ordinary.numel() < 2:
        raise ValueError(f"the model's vocab_size={vocab} leaves no ordinary token to probe with")
    gen = torch.Generator().manual_seed(0)
    mrope = _uses_mrope(config)
    samples = []
    for n in (25, 18, 21):
        ids = ordinary[torch.randint(ordinary.numel(), (n,), generator=gen)]
        sample: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
        if mrope:
            sample["position_ids"] = torch.arange(n).expand(3, n).clone()
        samples.append(sample)
    pack = build_pack(samples, mrope=mrope)
    return neat_packed_vlm_collater([pack], mask_format=mask_format, boundaries=boundaries)


def _uses_mrope(config: Any) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return isinstance(rope, Mapping) and "mrope_section" in rope


def leak_fix_message(report: LeakReport) -> str:
    """Which layers leak, and what fixes it (kernels per layer kind, or padding)."""
    leaking = report.leaking_layers()
    layer_list = ", ".join(f"{x.index} ({x.kind}, max change {x.max_change:.2e})" for x in leaking)
    kinds = sorted({x.kind for x in leaking if x.kind in KERNEL_FIXES})
    kernels = "; ".join(f"{k}: install {KERNEL_FIXES[k]}" for k in kinds) or (
        "check the attention implementation and mask format"
    )
    refused = (
        ""
        if report.boundaries_refused is None
        else f" With seq_idx / cu_seq_lens the model refuses to run ({report.boundaries_refused})."
    )
    return (
        f"packing leaks between documents: changing one document of a packed row changes the "
        f"outputs of the others at layers {layer_list} (tolerance {report.tolerance:g}).{refused} "
        f"Fix: run the fused kernels that honour seq_idx / cu_seq_lens on a GPU ({kernels}), "
        "or pad instead of packing (neatpack.graphs.grouped_vlm_graph, or batch_size with one "
        "sample per pack), or pass allow_packing_leak=True to pack anyway."
    )


def check_packing(
    model: nn.Module,
    *,
    mask_format: str | None = None,
    allow_leak: bool = False,
    tolerance: float = DEFAULT_TOLERANCE,
) -> LeakReport:
    """Probe ``model`` on a synthetic packed row; raise :class:`PackingLeakError` if it leaks.

    The row holds three short text documents, collated with boundaries (``seq_idx``,
    ``cu_seq_lens``) in ``mask_format`` (default: the model's attention implementation, sdpa
    when it is a flash one on CPU). ``allow_leak=True`` returns the report instead of raising.
    """
    config: Any = getattr(model, "config", None)
    impl = str(getattr(config, "_attn_implementation", None) or "sdpa")
    device = next(model.parameters()).device
    if mask_format is None:  # the model's own implementation, where this device can run it
        flash_ok = device.type == "cuda" and impl.startswith("flash")
        mask_format = impl if impl in DENSE_FORMATS or flash_ok else "sdpa"
    batch = _synthetic_batch(model, boundaries=True, mask_format=mask_format)
    try:
        report = probe_packing_leak(model, batch, tolerance=tolerance)
    except (ValueError, NotImplementedError) as error:
        # 5.2x: ValueError "... packed sequences"; older 5.x (5.10): NotImplementedError
        # "`seq_idx` support requires fast path support" from the Mamba torch fallback
        if "packed sequences" not in str(error) and "seq_idx" not in str(error):
            raise
        # transformers refuses boundaries its torch fallback cannot honour: measure what a
        # batch without them does (what packing with boundaries off would train on).
        plain = _synthetic_batch(model, boundaries=False, mask_format=mask_format)
        measured = probe_packing_leak(model, plain, tolerance=tolerance)
        report = LeakReport(measured.perturbed, measured.layers, tolerance, str(error))
    if report.leaks and not allow_leak:
        raise PackingLeakError(leak_fix_message(report))
    return report


def packing_boundaries(model: Any, *, boundaries: bool = False, allow_leak: bool = False) -> bool:
    """Whether a graph should add boundaries for ``model``; raises if packing it leaks.

    ``model``: None (use ``boundaries`` as given), a transformers config (boundaries on when it
    has stateful layers: :func:`~neatpack.pipes.collating.boundaries.needs_boundaries`), or a model
    (``nn.Module``): a hybrid model is probed with :func:`check_packing`, which raises
    :class:`PackingLeakError` unless ``allow_leak``; when the model refuses the boundary kwargs
    (transformers' torch fallbacks), boundaries stay off so that the batches still run.
    """
    if model is None:
        return boundaries
    if not isinstance(model, nn.Module):
        return boundaries or bool(stateful_layers(model))
    if not stateful_layers(getattr(model, "config", {})):
        return boundaries
    report = check_packing(model, allow_leak=allow_leak)
    return report.boundaries_refused is None
