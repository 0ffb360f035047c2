"""The graphs' configuration, grouped by concern and shared: each group is declared once here and
every graph's config is made of the groups it uses (``NeatVLMConfig``, ``NeatLLMConfig``,
``GroupedConfig``), so one option has one name, one type, one description and one check.

    group              fields                                              used by
    EpochOptions       seed shuffle tail                                   every graph
    PackingOptions     EpochOptions + pack_size batch_size overlong        VLM, LLM
                       max_packs cp_size balance
    RecordOptions      media_root cache_dir max_record_bytes               VLM, grouped
    IndexOptions       index_workers index_start_method progress           VLM, grouped
    AttentionOptions   attn_implementation pad_to_multiple_of boundaries   VLM, LLM
                       allow_packing_leak
    WorkerOptions      num_workers worker_method multiprocessing_context   every graph
                       prefetch pin_memory worker_transfer
    BookkeepingOptions keep_ledger ledger_epochs                           every graph
    StreamOptions      buffer_size                                         stream

A graph's own options (the VLM graph's length estimate, family and media choices) are declared in
its config class the same way. Every field is declared with :func:`option`: its description and
whether it enters the checkpoint key (``key=True``: a resume must use the same value, the loader
refuses a state saved with another; ``key=False``: it may change between runs, as worker counts
do). :func:`checkpoint_key` reads that declaration for every graph; a field declared without it
is a ``TypeError`` when the key is built, so a new option cannot silently join one graph's key
and miss another's. Policies are ``Literal`` types, checked at construction with the valid values
in the message (:func:`check_literals`).

>>> from neatpack.graphs import NeatLLMConfig
>>> checkpoint_key(NeatLLMConfig(pack_size=64))["pack_size"]
64
>>> "num_workers" in checkpoint_key(NeatLLMConfig())
False
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any, Final, Literal

from neatpack.graphs.runtime.stages import WorkerMethod, check_start_method
from neatpack.pipes.collating.attention_choice import choose_attention_format
from neatpack.pipes.collating.mask_format import resolve_mask_format
from neatpack.pipes.indexing.estimate import EstimateMode
from neatpack.pipes.indexing.index_workers import IndexStartMethod, index_start_method
from neatpack.pipes.materializing.materialize import BadSamplePolicy, OverflowPolicy
from neatpack.pipes.materializing.transfer import WorkerTransfer
from neatpack.pipes.mixtures.mixture import check_mixture_config
from neatpack.pipes.planning.balance import GRAPH_BALANCE, BalancePolicy
from neatpack.pipes.planning.binpack import OverlongPolicy
from neatpack.pipes.planning.source import TailPolicy
from neatpack.pipes.reading.read import MAX_RECORD_BYTES

__all__ = [
    "KEY_WHEN_SET",
    "AttentionOptions",
    "BookkeepingOptions",
    "EpochOptions",
    "GroupedConfig",
    "IndexOptions",
    "LegacyMixture",
    "NeatLLMConfig",
    "NeatStreamConfig",
    "NeatVLMConfig",
    "Options",
    "PackingOptions",
    "RecordOptions",
    "StreamOptions",
    "WorkerOptions",
    "check_literals",
    "check_mixture_options",
    "checkpoint_key",
    "field_docs",
    "legacy_mixture",
    "option",
    "options_markdown",
]

#: ``option(key=KEY_WHEN_SET)``: the field enters the key only when it differs from its default
#: (a field added after states were saved with the key: those states still load).
KEY_WHEN_SET: Final = "when_set"

#: How worker processes start (the platform may lack one: ``check_start_method``).
StartMethod = Literal["fork", "spawn", "forkserver"]


def option(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    key: bool | Literal["when_set"],
    default_factory: Any = dataclasses.MISSING,
    unkeyed: Any = dataclasses.MISSING,
) -> Any:
    """A config field with its description and its checkpoint-key declaration (module doc).

    ``unkeyed`` (with ``key=KEY_WHEN_SET``): the value a key without this field stands for,
    where the default changed after states were saved under the old one. The field enters
    the key when it differs from ``unkeyed`` (not from the default), so those states still
    load with the old value set, and are refused, naming the field, under the new default."""
    if not doc:
        raise ValueError("every option is documented where it is declared: pass doc=")
    if unkeyed is not dataclasses.MISSING and key != KEY_WHEN_SET:
        raise ValueError(f"option(unkeyed={unkeyed!r}) needs key=KEY_WHEN_SET, not {key=}")
    meta = {"doc": doc, "key": key}
    if unkeyed is not dataclasses.MISSING:
        meta["unkeyed"] = unkeyed
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class Options:
    """Base of every options group: ``__post_init__`` checks each ``Literal`` field, then runs
    the ``_check`` of every group the config is made of (most basic first)."""

    def __post_init__(self) -> None:
        check_literals(self)
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("_check")
            if check is not None:
                check(self)


@dataclass(frozen=True, kw_only=True)
class EpochOptions(Options):
    """The epoch's order and its last step."""

    seed: int = option(0, doc="the plan's shuffle seed (each epoch draws from it)", key=True)
    shuffle: bool = option(True, doc="shuffle the order every epoch", key=True)
    tail: TailPolicy = option(
        "pad",
        doc="the epoch's last step when there is too little left for every rank: pad (repeat "
        "entries, marked padded) or drop, so that ranks stay even",
        key=True,
    )


@dataclass(frozen=True, kw_only=True)
class PackingOptions(EpochOptions):
    """How samples become packs and packs become steps (the plan)."""

    pack_size: int = option(8192, doc="tokens per packed row", key=True)
    batch_size: int = option(1, doc="packs per rank per step", key=True)
    overlong: OverlongPolicy = option(
        "raise",
        doc="a single sample longer than pack_size: raise (naming it), or drop (counted in "
        "the plan's dropped ids and the ledger)",
        key=True,
    )
    max_packs: int | None = option(
        None, doc="use at most this many packs per epoch (None: all)", key=True
    )
    cp_size: int = option(
        1,
        doc="context parallel: documents padded to a multiple of 2 * cp_size, so each of the "
        "2 * cp_size chunks of a row holds whole tokens of every document (docs/long_context.md)",
        key=KEY_WHEN_SET,
    )
    balance: BalancePolicy = option(
        GRAPH_BALANCE,
        doc="what the ranks of a step are made alike on: cost (the default: the attention "
        "and vision-encoder work, squared document lengths and squared patches per image, "
        "since a step waits for its slowest rank), tokens (visual, then total), the cost of "
        "the language model alone (lm: tokens and squared document lengths) or of the vision "
        "encoder alone (vision: patches and squared patches per image), or the supervised "
        "(label) tokens (supervised: the length index then counts them per sample, "
        "pipes/indexing/supervised.py). tokens, lm, vision and supervised keep best fit's "
        "packs and only pick which share a step; cost makes the packs for their step groups "
        "(pipes/planning/group_pack.py) where that evens the ranks more, fill within 0.2 "
        "points. One rank: every policy gives best fit's packs. States saved before cost "
        "became the default were planned on tokens: resume them with balance='tokens'",
        key=KEY_WHEN_SET,
        unkeyed="tokens",
    )

    def _check(self) -> None:
        if self.pack_size < 2:
            raise ValueError(f"{self.pack_size=} must be at least 2 tokens")
        if self.batch_size < 1:
            raise ValueError(f"{self.batch_size=} must be >= 1")
        if self.max_packs is not None and self.max_packs < 1:
            raise ValueError(f"{self.max_packs=} must be >= 1, or None for every pack")
        if self.cp_size < 1 or (self.cp_size > 1 and self.pack_size % (2 * self.cp_size)):
            raise ValueError(
                f"{self.cp_size=} must be >= 1 and 2 * cp_size must divide {self.pack_size=} "
                "(every document and the row are split into 2 * cp_size chunks)"
            )


@dataclass(frozen=True, kw_only=True)
class RecordOptions(Options):
    """Where raw records and their media come from, and where built indexes are cached."""

    media_root: str | None = option(
        None, doc="relative media paths resolve against this folder", key=False
    )
    cache_dir: str | None = option(
        None, doc="cache the length index (and shard offset indexes) here", key=False
    )
    max_record_bytes: int | None = option(
        MAX_RECORD_BYTES,
        doc="a JSONL line longer than this is refused by its id (None: no limit); tokenizing "
        "costs ~200 bytes of memory per byte of text (pipes/reading/read.py)",
        key=False,
    )

    def _check(self) -> None:
        if self.max_record_bytes is not None and self.max_record_bytes < 1:
            raise ValueError(f"{self.max_record_bytes=} must be >= 1 byte, or None for no limit")


@dataclass(frozen=True, kw_only=True)
class IndexOptions(Options):
    """How the length index is built (it is the same whatever these say)."""

    index_workers: int | None = option(
        None,
        doc="length index build: None one forked process per core this rank may use once its "
        "slice is large enough to pay (pipes/indexing/index_workers.py), N exactly N, 0 this "
        "process; the index is the same for any number",
        key=False,
    )
    index_start_method: IndexStartMethod = option(
        "fork",
        doc="how the index build's processes start: fork, or spawn / forkserver where this "
        "process must not fork (CUDA or NCCL threads already running)",
        key=False,
    )
    progress: bool = option(False, doc="a progress bar while the length index builds", key=False)

    def _check(self) -> None:
        if self.index_workers is not None and self.index_workers < 0:
            raise ValueError(f"{self.index_workers=} must be >= 0, or None for one per core")
        index_start_method(self.index_start_method)  # this platform has it


@dataclass(frozen=True, kw_only=True)
class AttentionOptions(Options):
    """The collated batch's attention inputs: format, padding, boundaries."""

    attn_implementation: str = option(
        "auto",
        doc="the batch's attention format: auto (flash_attention_2 batches on CUDA, for "
        "use_varlen_attention(model); sdpa's dense mask on CPU; the format of the graph's "
        "model= when given: pipes/collating/attention_choice.py), the model's "
        "attn_implementation (sdpa, eager, flash_attention_2, flex_attention) or position_ids, "
        "thd, doc_ids (pipes/collating/mask_format.py MASK_FORMATS); the key holds the "
        "resolved format",
        key=True,
    )
    pad_to_multiple_of: int | None = option(
        None, doc="pad each batch's sequence length to a multiple of this", key=True
    )
    boundaries: bool = option(
        False,
        doc="add seq_idx and cu_seq_lens for linear-attention / SSM / conv layers (also on "
        "when the graph's model= needs them; docs/long_context.md)",
        key=False,
    )
    allow_packing_leak: bool = option(
        False, doc="pack a model whose leak probe fails (pipes/collating/leak_probe.py)", key=False
    )

    def _check(self) -> None:
        resolve_mask_format(self.attn_implementation)  # the collate's own check, at construction
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"{self.pad_to_multiple_of=} must be >= 1, or None")

    def with_attention(self, *, model: Any = None, block_causal: bool = True) -> Any:
        """This config with ``attn_implementation="auto"`` resolved for this machine, the
        graph's ``model`` and the family (``block_causal``: its mask is block-causal), by
        ``choose_attention_format``: what a graph builds its batches and its checkpoint key
        from. A config that names its format is returned as it is."""
        fmt = choose_attention_format(
            self.attn_implementation,
            model=model,
            block_causal=block_causal,
            cp_size=getattr(self, "cp_size", 1),
        )
        if fmt == self.attn_implementation:
            return self
        resolved = dataclasses.replace(self, attn_implementation=fmt)
        if hasattr(self, "_mixture"):  # LegacyMixture's, kept off the fields: carried over
            object.__setattr__(resolved, "_mixture", self._mixture)
        return resolved


@dataclass(frozen=True, kw_only=True)
class WorkerOptions(Options):
    """Where the worker steps run; none of it enters the checkpoint key."""

    num_workers: int = option(0, doc="worker processes (0: in the trainer's process)", key=False)
    worker_method: WorkerMethod = option(
        "process", doc="workers as processes, or threads (free-threaded Python)", key=False
    )
    multiprocessing_context: StartMethod | None = option(
        "fork", doc="how worker processes start (None: the platform's default)", key=False
    )
    prefetch: int = option(2, doc="batches buffered ahead of the trainer", key=False)
    pin_memory: bool = option(
        False, doc="page-locked batches for non_blocking host-to-GPU copies (CUDA)", key=False
    )
    worker_transfer: WorkerTransfer = option(
        "segment",
        doc="worker -> trainer batches: segment (reused shared memory, faster) or torch "
        "(torch's own path: each batch's memory is freed when the trainer drops it)",
        key=False,
    )

    def _check(self) -> None:
        check_start_method(self.multiprocessing_context)
        if self.num_workers < 0 or self.prefetch < 0:
            raise ValueError(f"{self.num_workers=} and {self.prefetch=} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class BookkeepingOptions(Options):
    """What the loader remembers about consumed samples (its ledger)."""

    keep_ledger: bool = option(
        True, doc="record every consumed sample id per epoch (exactly-once checks)", key=False
    )
    ledger_epochs: int | None = option(
        None, doc="keep the last N epochs' ledgers (None: all)", key=False
    )

    def _check(self) -> None:
        if self.ledger_epochs is not None and self.ledger_epochs < 1:
            raise ValueError(f"{self.ledger_epochs=} must be >= 1, or None for every epoch")


@dataclass(frozen=True, kw_only=True)
class StreamOptions(Options):
    """How a stream is packed online (``neat_stream_graph``): no length index, a buffer."""

    buffer_size: int = option(
        1000,
        doc="samples held in open packs while the stream is read; a pack leaves when full or, "
        "the buffer over this size, the fullest one (more: fuller packs, more records in "
        "memory and re-read on resume; benchmarks/bench_stream.py has the fill per size)",
        key=True,
    )

    def _check(self) -> None:
        if self.buffer_size < 1:
            raise ValueError(f"{self.buffer_size=} must be >= 1 sample")


def _fields(config: Any) -> Iterator[dataclasses.Field[Any]]:
    for f in dataclasses.fields(config):
        if "key" not in f.metadata or not f.metadata.get("doc"):
            raise TypeError(
                f"{type(config).__name__}.{f.name} is declared without option(doc=..., key=...): "
                "every config field says what it does and whether it enters the checkpoint key "
                "(graphs/config.py)"
            )
        yield f


def checkpoint_key(config: Any) -> dict[str, Any]:
    """The fields a checkpoint must agree on, for any graph's config: those declared
    ``key=True``, and those declared ``key=KEY_WHEN_SET`` whose value is not the default."""
    if isinstance(config, AttentionOptions):
        config = config.with_attention()  # "auto" as a graph without model= resolves it
    key: dict[str, Any] = {}
    for f in _fields(config):
        value = getattr(config, f.name)  # not asdict: it would deep-copy
        unkeyed = f.metadata.get("unkeyed", f.default)
        if f.metadata["key"] is True or (f.metadata["key"] == KEY_WHEN_SET and value != unkeyed):
            key[f.name] = value
    return key


def field_docs(config: Any) -> dict[str, str]:
    """``{name: description}`` of a config class or instance (``neatpack`` docs, ``help``)."""
    return {f.name: f.metadata["doc"] for f in _fields(config)}


def check_literals(config: Any) -> None:
    """Refuse a value outside its field's ``Literal`` type, naming the valid ones."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        valid = _literal_values(hints.get(f.name))
        value = getattr(config, f.name)
        if valid is not None and value not in valid:
            raise ValueError(
                f"{type(config).__name__}({f.name}={value!r}): not one of {list(valid)} "
                f"({f.metadata.get('doc', '')})"
            )


def _literal_values(hint: Any) -> tuple[Any, ...] | None:
    """The allowed values of ``Literal[...]`` or ``Literal[...] | None``, else None."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    args = typing.get_args(hint)
    literals = [a for a in args if typing.get_origin(a) is Literal]
    if literals and all(typing.get_origin(a) is Literal or a is type(None) for a in args):
        values = tuple(v for a in literals for v in typing.get_args(a))
        return values + ((None,) if type(None) in args else ())
    return None


@dataclass(frozen=True, kw_only=True)
class LegacyMixture(Options):
    """``config(mixture=...)``, as before mixtures became data: still accepted, with a
    ``DeprecationWarning``; pass the ``Mixture`` as the graph's data instead."""

    mixture: InitVar[Any] = None

    def __post_init__(self, mixture: Any) -> None:
        super().__post_init__()
        if mixture is not None:
            warnings.warn(
                f"{type(self).__name__}(mixture=...) is deprecated: a mixture is data, pass it "
                "where the data goes (neat_vlm_graph(mixture, processor, config=...), "
                "neat_llm_graph(mixture, config=...))",
                DeprecationWarning,
                stacklevel=4,
            )
            check_mixture_options(self)
            # kept off the instance otherwise, so Config(**cfg.__dict__) still rebuilds a config
            object.__setattr__(self, "_mixture", mixture)


def check_mixture_options(config: Any) -> None:
    """The config's options a mixture's plan contradicts (ValueError naming the option and the
    fix: ``pipes/mixtures/mixture.py`` ``check_mixture_config``)."""
    check_mixture_config(max_packs=config.max_packs, shuffle=config.shuffle)


def legacy_mixture(config: Any) -> Any:
    """The mixture a config was built with (``mixture=``, deprecated), else None."""
    return getattr(config, "_mixture", None)


@dataclass(frozen=True, kw_only=True)
class NeatVLMConfig(
    PackingOptions,
    RecordOptions,
    IndexOptions,
    AttentionOptions,
    WorkerOptions,
    BookkeepingOptions,
    LegacyMixture,
):
    """Static choices of the VLM graph (``neat_vlm_graph``): the shared groups (module doc) and
    the VLM graph's own, below. Runtime context (processor, rank) is passed apart."""

    # lengths / index
    estimate_mode: EstimateMode = option(
        "exact",
        doc="exact: real lengths (one batched template + tokenizer call per block of the "
        "index), packs fill to the brim and nothing is cut; estimate / calibrated build faster "
        "(benchmarks/bench_utilization.py has the trade-off)",
        key=True,
    )
    packing_ratio: float = option(
        1.0, doc="plan to this fraction of pack_size: headroom for estimate error", key=True
    )
    max_visual_tokens: int | None = option(
        None,
        doc="a second budget per pack: at most this many image and video tokens (the vision "
        "tower's memory; its patches are these tokens times the merge size squared, 4 for "
        "Qwen-VL); samples over it go into another pack, a sample over it alone follows "
        "overlong (None: no such budget)",
        key=KEY_WHEN_SET,
    )
    max_images: int | None = option(
        None,
        doc="a third budget per pack: at most this many media items (images and video clips: "
        "the vision tower's per-image buffers); kept with max_visual_tokens, overflow goes into "
        "another pack, a sample over it alone follows overlong (None: no such budget)",
        key=KEY_WHEN_SET,
    )
    # materializing
    overflow: OverflowPolicy = option(
        "truncate",
        doc="a pack built longer than pack_size (an estimate was short): raise, truncate its "
        "last document, or drop documents (counted in the pack's report)",
        key=True,
    )
    on_bad_sample: BadSamplePolicy = option(
        "raise",
        doc="a sample that fails to load: raise naming it, or skip / replace it (counted, with "
        "its id, in the loader's stats)",
        key=True,
    )
    fake_image: bool = option(
        False,
        doc="give text-only packs a masked fake image, so every step runs the vision tower "
        "(FSDP / ZeRO-3 hang otherwise); only for a family whose handler injects one",
        key=True,
    )
    # family
    handler: str | None = option(
        None,
        doc="the family handler by name (pipes/families); None: from the processor's class",
        key=KEY_WHEN_SET,
    )
    mask_options: Mapping[str, Any] | None = option(
        None, doc="options of the handler's own packed mask (Gemma 3 / 4)", key=False
    )
    pp_microbatches: int | None = option(
        None,
        doc="split each batch's rows and media into this many pipeline-parallel micro-batches",
        key=False,
    )

    def _check(self) -> None:
        if not 0.0 < self.packing_ratio <= 1.0:
            raise ValueError(f"{self.packing_ratio=} must be in (0, 1]")
        if self.max_visual_tokens is not None and (
            isinstance(self.max_visual_tokens, bool)
            or not isinstance(self.max_visual_tokens, int)
            or self.max_visual_tokens < 1
        ):
            raise ValueError(
                f"{self.max_visual_tokens=} must be a positive int (visual tokens per pack), "
                "or None for no visual budget"
            )
        if self.max_images is not None and (
            isinstance(self.max_images, bool)
            or not isinstance(self.max_images, int)
            or self.max_images < 1
        ):
            raise ValueError(
                f"{self.max_images=} must be a positive int (media items per pack), or None for "
                "no images budget"
            )
        if self.pp_microbatches is not None and not 1 <= self.pp_microbatches <= self.batch_size:
            raise ValueError(
                f"{self.pp_microbatches=} must be between 1 and {self.batch_size=} (one "
                "micro-batch needs at least one pack row)"
            )
        if self.handler is not None:
            from neatpack.pipes.families import HANDLERS

            if self.handler not in HANDLERS:
                raise ValueError(
                    f"{self.handler=} is not a registered handler; valid: {sorted(HANDLERS)} "
                    "(or None to pick it from the processor)"
                )

    def plan_key(self) -> dict[str, Any]:
        """The fields a checkpoint must agree on (``checkpoint_key``)."""
        return checkpoint_key(self)


@dataclass(frozen=True, kw_only=True)
class NeatLLMConfig(
    PackingOptions, AttentionOptions, WorkerOptions, BookkeepingOptions, LegacyMixture
):
    """Static choices of the text graph (``neat_llm_graph``): pre-tokenized samples, exact
    lengths, so there is no estimate, headroom or overflow to choose."""

    pack_size: int = option(4096, doc="tokens per packed row", key=True)
    padding_idx: int = option(0, doc="the token id that pads rows", key=True)


@dataclass(frozen=True, kw_only=True)
class GroupedConfig(EpochOptions, RecordOptions, IndexOptions, WorkerOptions, BookkeepingOptions):
    """Static choices of the length-grouped graph (``grouped_vlm_graph``): padded, not packed."""

    batch_size: int = option(8, doc="samples per rank per step (one padded batch)", key=True)
    max_length: int | None = option(
        None,
        doc="a longer sample is an error naming it (truncate=True cuts its text instead)",
        key=True,
    )
    truncate: bool = option(False, doc="cut samples longer than max_length", key=True)

    def _check(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"{self.batch_size=} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class NeatStreamConfig(NeatVLMConfig, StreamOptions):
    """Static choices of the streaming graph (``neat_stream_graph``): the VLM graph's options
    (its own ones too: the same estimate, materialize and family choices) plus
    ``StreamOptions``. What needs a length index of the whole epoch is refused by name:
    ``max_packs``, a ``balance`` other than tokens, ``max_visual_tokens``, ``max_images``,
    ``estimate_mode="calibrated"``, ``on_bad_sample="replace"`` and ``tail="drop"``.
    ``shuffle`` shuffles the shards' order each epoch; the index options do nothing here."""

    balance: BalancePolicy = option(
        "tokens",
        doc="a stream packs online and has no plan to balance steps in: tokens only",
        key=KEY_WHEN_SET,
    )

    def _check(self) -> None:
        refused = {
            "max_packs": (self.max_packs is not None, "every pack of the stream is used"),
            "balance": (self.balance != "tokens", "a stream has no plan to balance steps in"),
            "max_visual_tokens": (
                self.max_visual_tokens is not None,
                "the online packer keeps one budget (pack_size)",
            ),
            "max_images": (
                self.max_images is not None,
                "the online packer keeps one budget (pack_size)",
            ),
            "estimate_mode": (
                self.estimate_mode == "calibrated",
                "calibrated fits on the whole data; use exact or estimate",
            ),
            "on_bad_sample": (
                self.on_bad_sample == "replace",
                "a replacement is drawn from the whole data; use raise or skip",
            ),
            "tail": (
                self.tail == "drop",
                "what a dry rank's partners still hold cannot be listed without reading it; "
                "dry ranks repeat their last pack (pad) until every rank is dry",
            ),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise ValueError(
                    f"NeatStreamConfig({name}={getattr(self, name)!r}) is not available for a "
                    f"stream: {why}"
                )


GROUPS: tuple[type[Options], ...] = (
    EpochOptions,
    PackingOptions,
    RecordOptions,
    IndexOptions,
    AttentionOptions,
    WorkerOptions,
    BookkeepingOptions,
    StreamOptions,
)
CONFIGS: tuple[type[Options], ...] = (NeatVLMConfig, NeatLLMConfig, GroupedConfig, NeatStreamConfig)


def options_markdown() -> str:
    """docs/configuration.md: every group and every graph's own options, from the declarations
    (tests/graphs/test_config_groups.py keeps the file equal to this)."""

    def rows(cls: type[Options], names: list[str]) -> list[str]:
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        out = ["| option | default | checkpoint key | what it does |", "| --- | --- | --- | --- |"]
        for name in names:
            f = by_name[name]
            default = "(required)" if f.default is dataclasses.MISSING else repr(f.default)
            key = {True: "yes", False: "no", KEY_WHEN_SET: "when set"}[f.metadata["key"]]
            if "unkeyed" in f.metadata:
                key = f"when not `{f.metadata['unkeyed']!r}`"
            out.append(f"| `{name}` | `{default}` | {key} | {f.metadata['doc']} |")
        return out

    def own(cls: type[Any]) -> list[str]:
        return list(inspect.get_annotations(cls))

    lines = [
        "# Configuration",
        "",
        "Generated from `graphs/config.py` (`options_markdown()`); a test keeps it equal.",
        "Each graph's config is made of shared groups plus its own options; every option says",
        "whether it enters the checkpoint key (a resume must keep it) and is checked when the",
        "config is built. `when set`: in the key only when it differs from its default.",
        "",
        "| config | groups |",
        "| --- | --- |",
    ]
    for config in CONFIGS:
        groups = [g.__name__ for g in GROUPS if issubclass(config, g) and g is not EpochOptions]
        if not issubclass(config, PackingOptions):
            groups.insert(0, EpochOptions.__name__)
        groups += [f"{c.__name__}'s own" for c in CONFIGS if c is not config
                   and issubclass(config, c)]  # fmt: skip
        lines.append(f"| `{config.__name__}` | {', '.join(f'`{g}`' for g in groups)} |")
    for group in GROUPS:
        lines += ["", f"## `{group.__name__}`", "", inspect.getdoc(group) or "", ""]
        lines += rows(group, own(group))
    for config in CONFIGS:
        if not own(config):
            continue
        lines += ["", f"## `{config.__name__}`: its own options", ""]
        lines += rows(config, own(config))
    return "\n".join(lines) + "\n"
