"""The family registry: ``Handler`` (every fact about one model family) and the lookup by
processor class name (the seed's ``COLLATE_FNS`` idea). Re-exported by ``neatpack.pipes.families``,
whose modules each define and register one family.

One conversation -> one Sample (``docs/data_contracts.md`` section 4) goes through a *handler*.
The lookup, ``get_handler(processor, name=None)``:

1. ``name`` given: that handler, whatever the processor (explicit selection);
2. the processor's class name is registered: its family handler (Qwen-VL classes -> ``qwen_vl``,
   which checks the ``*_grid_thw`` grids and injects fake images);
3. the processor (or its tokenizer) has a chat template: ``chat_template``, the processor-agnostic
   default (labels from role markers derived from the template, media from content lists, media
   token counts from the processor's own ``_get_num_multimodal_tokens``);
4. otherwise ``ValueError`` naming the registry and how to add a handler.

Unlike the seed (which falls back to ``default`` with a warning even without a template and then
fails deep inside ``apply_chat_template``), a template-less processor is refused up front.

>>> from neatpack.pipes.families import get_handler
>>> from neatpack.pipes.testing.tiny import load_tiny_processor
>>> get_handler(load_tiny_processor("qwen2_vl")).name
'qwen_vl'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._shared import check_modalities, has_chat_template

__all__ = [
    "HANDLERS",
    "PROCESSOR_HANDLERS",
    "CalibrateFn",
    "CollateFn",
    "EstimateFn",
    "EstimatorFactory",
    "Handler",
    "PPSplitFn",
    "PackTokenizer",
    "PositionsFn",
    "check_processor_class",
    "get_handler",
    "packed_model_inputs",
    "register_handler",
    "resolve_handler",
    "tokenize_with_handler",
]

TokenizeFn = Callable[..., dict[str, Any]]
PackMediaFn = Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]
PackedMaskFn = Callable[..., Any]
#: ``estimate(record, processor, *, mode) -> int``: the Sample's length after the shift
EstimateFn = Callable[..., int]
#: ``estimator(processor, mode, **options) -> LengthEstimator``-shaped object (replaces
#: ``estimate``); ``options``: ``missing_media_fix``, the graph's advice for a missing media file
EstimatorFactory = Callable[..., Any]
#: ``calibrate(source, processor, **options) -> LengthEstimator``-shaped object fitted on records
#: of ``source`` (``estimate_mode="calibrated"``); ``options`` as for ``EstimatorFactory``
CalibrateFn = Callable[..., Any]
#: ``positions(sample, processor) -> [3, L]`` model-free mRoPE ids of one unshifted sample
PositionsFn = Callable[[Mapping[str, Any], Any], Any]
#: ``collate(packs, handler, **options) -> batch``: one batch of packed rows (``options``: those
#: of ``collate.neat_packed_vlm_collater``, plus ``mask_options`` and ``media_counts``)
CollateFn = Callable[..., dict[str, Any]]
#: ``pp_split(batch, handler, rows, n_microbatches) -> batch``: the batch's media moved to
#: per-micro-batch chunks at ``pp_media.VLM_PP_MEDIA_KEY`` (rows split as ``torch.tensor_split``)
PPSplitFn = Callable[..., Any]


@dataclass(frozen=True)
class PackTokenizer:
    """Tokenize the records of one pack with ONE processor call (Qwen-VL: same-size images
    resized together, the per-call overhead paid once per pack).

    ``prepare(record, processor, *, fake_image) -> prepared`` per record (the materialize step's
    failure policy sees each record's own loading error), then ``finish(prepared_list,
    processor, *, label_policy) -> list[Sample]``. Each Sample must equal the handler's
    ``tokenize`` of its record (``materialize_pack`` redoes a failing pack one record at a time
    through ``tokenize``)."""

    prepare: Callable[..., Any]
    finish: Callable[..., list[dict[str, Any]]]


@dataclass(frozen=True)
class Handler:
    """Everything neatpack knows about one model family, Qwen-VL included.

    ``tokenize(record, processor, **options) -> Sample``. ``modalities``: the media kinds the
    family accepts (a record with another kind is a ``SampleError`` naming the sample).
    ``needs_chat_template``: refuse a processor without one.

    Lengths. ``estimate(record, processor, *, mode) -> int``: the Sample's length after the shift
    without running the processor's media side (``mode`` "exact" or "estimate"); the length
    index of ``neat_vlm_graph`` uses it (``handler_lengths.HandlerEstimator``, which also fits
    the "calibrated" mode from it). ``estimator(processor, mode, **options)``: a whole
    ``LengthEstimator``-shaped object instead (Gemma 3, Qwen-VL). ``calibrate(source,
    processor, **options)``: the estimator of ``estimate_mode="calibrated"``, fitted on records
    of the source (Qwen-VL's ``LengthEstimator.calibrate``). ``estimate_modes`` (a property)
    says which modes these give; with none of them the graph needs ``lengths=`` (a
    ``LengthIndex``).

    Packs. ``pack_tokenizer``: a ``PackTokenizer`` that tokenizes a pack's records in one
    processor call (None: ``tokenize`` per record). ``media_per_sample``: packs keep each
    sample's media apart (``pack["media_samples"]``, merged over the batch by ``pack_media``);
    False: the tokenizer's media tensors are concatenated per pack (Qwen-VL's patch rows and
    grids). ``fake_image``: ``tokenize`` takes ``fake_image=True`` (a text-only sample gets a
    tiny image, so every rank's vision tower runs; ``NeatVLMConfig.fake_image``).
    ``mrope``: positions are 3-D (``packed_model_inputs`` refuses); ``positions(sample,
    processor) -> [3, L]``: the model-free mRoPE rule of an ``mrope`` family.

    Batches. ``collate(packs, handler, **options)``: the packed collate (None:
    ``collate_family.neat_packed_family_collater``; Qwen-VL: ``collate.core_collate``, which
    ``Collater`` runs as the public steps ``PackPadder`` + ``MaskConverter``).
    ``pack_media(samples) -> dict``: the model's media inputs for the samples of one batch, in
    order (None: each key concatenated on dim 0);
    ``packed_mask(doc_ids, mm_token_type_ids, **options)``: the attention mask (or per-layer-type
    dict) of packed rows (None: the block-causal mask of the attention format).

    Pipeline parallelism. ``pp_split(batch, handler, rows, n_microbatches)``: moves the batch's
    media to per-micro-batch chunks (None: ``pp_family_media.split_family_batch``, items
    counted per row from the samples, cut on ``media_axis``; Qwen-VL:
    ``pp_media.prepare_vlm_media_for_pp``, from the grids). ``pp_refused``: why the family's
    media cannot be split per micro-batch (None: they can); ``pp_microbatches`` is then refused,
    naming the handler and this reason. ``media_axis``: the dim of ``pack_media``'s tensors that
    holds the items (Idefics3 tiles are on 1).

    ``graph_refused``: why ``neat_vlm_graph`` cannot serve the family (None: it can).
    ``min_transformers``: the oldest transformers release that has the family's processor class
    (None: every 5.x); an older one loads only the tokenizer, which ``get_handler`` refuses.

    >>> h = Handler("mine", lambda record, processor: {}, media_axis=1)
    >>> h.media_axis, h.graph_refused, h.pp_refused, h.estimate_modes, h.fake_image
    (1, None, None, (), False)
    >>> Handler("mine", lambda record, processor: {}, estimate=lambda r, p, mode: 1).estimate_modes
    ('estimate', 'calibrated', 'exact')
    """

    name: str
    tokenize: TokenizeFn
    modalities: frozenset[str] = frozenset({"image", "video"})
    needs_chat_template: bool = True
    description: str = ""
    pack_media: PackMediaFn | None = None
    packed_mask: PackedMaskFn | None = None
    mrope: bool = False
    estimate: EstimateFn | None = None
    estimator: EstimatorFactory | None = None
    positions: PositionsFn | None = None
    media_axis: int = 0
    graph_refused: str | None = None
    min_transformers: str | None = None
    calibrate: CalibrateFn | None = None
    collate: CollateFn | None = None
    pp_split: PPSplitFn | None = None
    pp_refused: str | None = None
    pack_tokenizer: PackTokenizer | None = None
    media_per_sample: bool = True
    fake_image: bool = False

    @property
    def estimate_modes(self) -> tuple[str, ...]:
        """The ``estimate_mode`` values this handler's length estimate offers: "estimate" and
        "exact" with ``estimator`` or ``estimate``; "calibrated" with ``calibrate``, or with
        ``estimate`` (``HandlerEstimator`` fits it); none without any (the graph then needs
        ``lengths=``)."""
        if self.estimate is None and self.estimator is None:
            return ()
        if self.calibrate is not None or self.estimate is not None:
            return ("estimate", "calibrated", "exact")
        return ("estimate", "exact")

    @property
    def core_rows(self) -> bool:
        """Whether the family's packed rows are the core contract (``collate`` is
        ``collate.core_collate``: Qwen-VL): ``Collater`` runs them through the public steps
        ``PackPadder`` + ``MaskConverter``, and the length-grouped graph can pad them."""
        from neatpack.pipes.collating.collate import core_collate

        return self.collate is core_collate

    def __call__(self, record: Mapping[str, Any], processor: Any, **options: Any) -> dict[str, Any]:
        check_modalities(record, processor, self.modalities)
        return self.tokenize(record, processor, **options)


HANDLERS: dict[str, Handler] = {}
"""Handler name -> Handler."""
PROCESSOR_HANDLERS: dict[str, str] = {}
"""Processor class name (``type(processor).__name__``) -> handler name."""


def register_handler(
    handler: Handler, processor_classes: tuple[str, ...] = (), *, replace: bool = False
) -> Handler:
    """Add ``handler`` and map each processor class name to it.

    Re-registering a name or a class with a different handler raises unless ``replace=True``.

    >>> h = Handler("mine", lambda record, processor: {}, description="doc example")
    >>> register_handler(h, ("MyProcessor",)) is h
    True
    >>> PROCESSOR_HANDLERS.pop("MyProcessor"), HANDLERS.pop("mine").name
    ('mine', 'mine')
    """
    if not isinstance(handler, Handler):
        raise TypeError(f"handler must be a Handler, got {type(handler).__name__}")
    old = HANDLERS.get(handler.name)
    if old is not None and old is not handler and not replace:
        raise ValueError(
            f"a handler named {handler.name!r} is already registered; pass replace=True"
        )
    for cls in processor_classes:
        prev = PROCESSOR_HANDLERS.get(cls)
        if prev is not None and prev != handler.name and not replace:
            raise ValueError(
                f"processor class {cls!r} already maps to handler {prev!r}; pass replace=True"
            )
    HANDLERS[handler.name] = handler
    for cls in processor_classes:
        PROCESSOR_HANDLERS[cls] = handler.name
    return handler


def get_handler(processor: Any, name: str | None = None) -> Handler:
    """The handler for ``processor``: explicit ``name``, else by class name, else the default.

    A bare tokenizer saved by a registered processor class that the installed transformers
    lacks (``AutoProcessor`` silently falls back to the tokenizer, which would drop every
    image and audio) is a ``ValueError`` naming the transformers release the family needs."""
    check_processor_class(processor)
    if name is not None:
        if name not in HANDLERS:
            raise ValueError(f"unknown handler {name=}; registered: {sorted(HANDLERS)}")
        handler = HANDLERS[name]
    else:
        cls = type(processor).__name__
        handler = HANDLERS[PROCESSOR_HANDLERS.get(cls, "chat_template")]
    if handler.needs_chat_template and not has_chat_template(processor):
        cls = type(processor).__name__
        raise ValueError(
            f"processor {cls} has no chat template and no handler is registered for it in "
            f"neatpack.pipes.families (registered classes: {sorted(PROCESSOR_HANDLERS)}). Fix: "
            "give the processor a chat_template, select a template-free handler explicitly "
            "(handler='prompt_answer' for a prompt -> answer model), or add one with "
            f"register_handler(Handler('<name>', <tokenize fn>), processor_classes=({cls!r},))"
        )
    return handler


def check_processor_class(processor: Any) -> None:
    """Refuse a tokenizer standing in for a registered processor this transformers lacks.

    ``tokenizer_config.json`` records the ``processor_class`` it was saved with; when that class
    is registered here but ``transformers`` has no such name (a family newer than the installed
    release), ``AutoProcessor.from_pretrained`` returns the bare tokenizer."""
    if hasattr(processor, "tokenizer"):
        return  # a processor, not a bare tokenizer
    saved = (getattr(processor, "init_kwargs", None) or {}).get("processor_class")
    if not isinstance(saved, str) or saved == type(processor).__name__:
        return
    if saved not in PROCESSOR_HANDLERS:
        return
    import transformers

    if getattr(transformers, saved, None) is not None:
        return  # the class exists: a tokenizer loaded on purpose (text only)
    handler = HANDLERS[PROCESSOR_HANDLERS[saved]]
    fix = (
        f"pip install 'transformers>={handler.min_transformers}' (the family needs "
        f"{handler.min_transformers} or later)"
        if handler.min_transformers
        else "pip install --upgrade transformers"
    )
    raise ValueError(
        f"{type(processor).__name__} was saved by {saved} (family {handler.name!r}), but "
        f"transformers {transformers.__version__} has no {saved}, so AutoProcessor loaded only "
        f"the tokenizer and every image and audio would be lost. Fix: {fix}"
    )


def resolve_handler(handler: str | Handler) -> Handler:
    """``handler`` itself, or the registered handler of that name (``ValueError`` naming the
    registered ones otherwise)."""
    if isinstance(handler, Handler):
        return handler
    if handler not in HANDLERS:
        raise ValueError(f"unknown handler {handler=}; registered: {sorted(HANDLERS)}")
    return HANDLERS[handler]


def tokenize_with_handler(
    record: Mapping[str, Any], processor: Any, *, handler: str | None = None, **options: Any
) -> dict[str, Any]:
    """``get_handler(processor, handler)(record, processor, **options)``."""
    return get_handler(processor, handler)(record, processor, **options)


def packed_model_inputs(
    samples: Sequence[Mapping[str, Any]],
    processor: Any,
    *,
    handler: str | None = None,
    padding_idx: int = 0,
    mask_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Model kwargs for ONE packed row of UNSHIFTED samples of a 1-D-position family:
    ``input_ids`` / ``position_ids`` ``[1, S]``, the family's ``attention_mask`` and media.

    Qwen-VL (mRoPE) rows go through ``collate.neat_packed_vlm_collater`` instead.
    """
    from neatpack.pipes.collating.mask import to_4d_additive_mask
    from neatpack.pipes.materializing.pack import build_pack

    h = get_handler(processor, handler)
    if h.mrope:
        raise ValueError(
            f"handler {h.name!r} needs mRoPE positions; use neat_packed_vlm_collater for it"
        )
    pack = build_pack(list(samples), padding_idx=padding_idx)  # type: ignore[arg-type]
    doc, mm = pack["attention_mask"][None], pack["mm_token_type_ids"][None]
    if h.packed_mask is None:
        mask: Any = to_4d_additive_mask(doc)
    else:
        mask = h.packed_mask(doc, mm, **dict(mask_options or {}))
    if h.pack_media is not None:
        media = h.pack_media(samples)
    else:
        media = {} if pack["pixel_values"] is None else {"pixel_values": pack["pixel_values"]}
    out = {
        "input_ids": pack["input_ids"][None],
        "position_ids": pack["text_position_ids"][None],
        "attention_mask": mask,
        **media,
    }
    out["seq_lens"] = pack["seq_lens"]
    return out
