"""Materialize one planned pack: read, tokenize, mRoPE, shift, concat (the worker-side step).

`materialize_pack(source, sample_ids, processor, config, epoch=0) -> (pack, report)` is a pure
function of its arguments (no global RNG, no logging), defined at module level so process
workers can pickle it. The plan's lengths are estimates, so the real pack can be longer than
`pack_size`; `config.overflow` decides what happens, and every sample that is not packed as
planned is named in the `MaterializeReport`:

    planned [17, 4, 92], pack_size 100, real shifted lengths [60, 30, 25] (total 115)
    overflow="raise"     ValueError naming the ids, 115 vs 100, and the fixes
    overflow="drop"      pack [17, 4] (90 tokens)            report.dropped   == (92,)
    overflow="truncate"  pack [17, 4, 92] with 92 cut to 10  report.truncated == (92,)

A sample that fails to load (`SampleError` / `RecordError` / `OSError`) follows
`config.on_bad_sample`: "raise", "skip" (left out, in `report.skipped`) or "replace" (another id
drawn with `random.Random(f"{seed}:{epoch}:{sample_id}:{attempt}")`, at most `max_retries`
tries, in `report.replaced` as (failed id, replacement id)). Replacement lengths differ from the
plan's, so overflow handling applies to them too.

On the Qwen-VL path (`config.handler` None, or a handler with a `PackTokenizer`: `qwen_vl`)
the pack's samples go through the processor in
ONE call (`tokenize.finish_conversations`): same-size images are resized together, the
per-call overhead is paid once per pack, and the pack's `pixel_values` is that call's tensor
rather than a second copy. If any sample fails after loading, the whole pack is redone one
sample at a time, so the failure policy sees each sample's own error; the result is the same
pack either way (tests/pipes/test_tokenize_batch.py).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import InitVar, asdict, dataclass, field
from typing import Any, Literal, NamedTuple, get_args

from neatpack.pipes.contracts import Pack
from neatpack.pipes.families.registry import PackTokenizer
from neatpack.pipes.materializing.mrope import MRopeConfig
from neatpack.pipes.materializing.pack import build_pack, sample_mrope, truncate_sample
from neatpack.pipes.materializing.sample_media import PositionsFn, media_after, split_media
from neatpack.pipes.materializing.tokenize import (
    finish_conversations,
    prepare_conversation,
    tokenize_conversation,
)
from neatpack.pipes.reading._conversation import check_no_placeholders
from neatpack.pipes.reading._record import RecordError
from neatpack.pipes.reading.media import SampleError

#: A pack built longer than pack_size (an estimate was short).
OverflowPolicy = Literal["raise", "truncate", "drop"]
OVERFLOW_POLICIES: tuple[str, ...] = get_args(OverflowPolicy)
#: A sample that fails to load (a bad file, a bad record): the graphs' ``on_bad_sample``.
BadSamplePolicy = Literal["raise", "replace", "skip"]
FAILURE_POLICIES: tuple[str, ...] = get_args(BadSamplePolicy)
LOAD_ERRORS: tuple[type[BaseException], ...] = (SampleError, RecordError, OSError)
#: A per-sample hook (``sample_transform``, ``shift``): one tokenized sample in, one out.
SampleFn = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class MaterializeConfig:
    """Static choices of the materialize step. `mrope`: True derives an `MRopeConfig` from the
    processor (Qwen-VL), False gives 1-D positions, or pass an `MRopeConfig`."""

    pack_size: int
    padding_idx: int = 0
    alignment: int = 1
    mrope: bool | MRopeConfig = True
    fake_image: bool = False
    overflow: OverflowPolicy = "raise"
    on_bad_sample: BadSamplePolicy = "raise"
    max_retries: int = 10
    seed: int = 0
    label_policy: str = "assistant"
    handler: str | None = None  # None: tokenize_conversation (Qwen-VL); else a handler name
    # the earlier word for on_bad_sample (one word per concept: the graphs' word); warned
    on_failure: InitVar[str | None] = None

    def __post_init__(self, on_failure: str | None) -> None:
        if on_failure is not None:
            warnings.warn(
                "MaterializeConfig(on_failure=...) is deprecated: use on_bad_sample=...",
                DeprecationWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "on_bad_sample", on_failure)
        if self.pack_size < 1:
            raise ValueError(f"{self.pack_size=} must be >= 1")
        if self.alignment < 1 or self.pack_size % self.alignment:
            raise ValueError(f"{self.alignment=} must be >= 1 and divide {self.pack_size=}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"{self.overflow=!r}; valid: {OVERFLOW_POLICIES}")
        if self.on_bad_sample not in FAILURE_POLICIES:
            raise ValueError(f"{self.on_bad_sample=!r}; valid: {FAILURE_POLICIES}")
        if self.max_retries < 0:
            raise ValueError(f"{self.max_retries=} must be >= 0")
        if self.fake_image and self.handler is not None:
            from neatpack.pipes.families import HANDLERS, resolve_handler

            if not resolve_handler(self.handler).fake_image:
                able = sorted(n for n, h in HANDLERS.items() if h.fake_image)
                raise ValueError(
                    f"{self.fake_image=} needs a handler that injects a fake image "
                    f"(Handler.fake_image: {able}); got {self.handler=} (use handler=None or "
                    "one of those, or fake_image=False)"
                )


@dataclass(frozen=True)
class MaterializeReport:
    """What happened to a pack's planned samples (the loader's ledger counts these)."""

    planned: tuple[int, ...]
    packed: tuple[int, ...]
    dropped: tuple[int, ...] = ()
    truncated: tuple[int, ...] = ()
    truncated_tokens: int = 0
    replaced: tuple[tuple[int, int], ...] = ()
    skipped: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    errors: tuple[str, ...] = field(default=(), repr=False)
    real_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain picklable Python (lists and ints) for the pack dict."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def replacement_id(seed: int, epoch: int, sample_id: int, attempt: int, n: int) -> int:
    """The deterministic replacement for a failed sample (independent of rank and workers)."""
    return random.Random(f"{seed}:{epoch}:{sample_id}:{attempt}").randrange(n)


def load_sample(
    source: Any, sample_id: int, processor: Any, config: MaterializeConfig
) -> dict[str, Any]:
    """One Sample (docs/data_contracts.md section 4) from a record source.

    ``config.handler`` names a ``neatpack.pipes.families`` handler (e.g. ``"chat_template"``,
    ``"gemma3"``); None keeps the Qwen-VL ``tokenize_conversation`` path."""
    if config.handler is not None:
        from neatpack.pipes.families import tokenize_with_handler

        options: dict[str, Any] = {"label_policy": config.label_policy}
        if config.fake_image:
            options["fake_image"] = True
        record = source[sample_id]
        check_no_placeholders(record)  # the Qwen-VL path checks it while parsing
        return tokenize_with_handler(record, processor, handler=config.handler, **options)
    return tokenize_conversation(
        source[sample_id], processor, fake_image=config.fake_image,
        label_policy=config.label_policy,
    )  # fmt: skip


def _resolve_mrope(processor: Any, mrope: bool | MRopeConfig) -> MRopeConfig | None:
    if isinstance(mrope, MRopeConfig):
        return mrope
    return MRopeConfig.from_processor(processor) if mrope else None


def _positions_fn(processor: Any, config: MaterializeConfig) -> tuple[PositionsFn | None, int]:
    """Per-sample ``[3, L]`` positions of an UNSHIFTED sample (None: 1-D positions) and the
    spatial merge ``truncate_sample`` reads the vision grids with.

    ``mrope=True`` with a handler that has ``Handler.positions`` (Qwen2.5-Omni) takes that
    family's model-free rule; otherwise the Qwen-VL ``MRopeConfig`` (from the processor)."""
    rule = _handler_positions(config.handler) if config.mrope is True else None
    if rule is not None:
        merge = int(getattr(processor.image_processor, "merge_size", 2))
        return (lambda s: rule(s, processor)), merge
    mrope = _resolve_mrope(processor, config.mrope)
    if mrope is None:
        return None, 2
    return (lambda s: sample_mrope(s, mrope)), mrope.spatial_merge_size


def _handler_positions(handler: str | None) -> Any:
    """The handler's model-free positions rule (None: no handler, or it has none)."""
    if handler is None:
        return None
    from neatpack.pipes.families import resolve_handler

    return resolve_handler(handler).positions


def _pack_path(config: MaterializeConfig) -> tuple[bool, PackTokenizer | None]:
    """Whether samples keep their media apart (``Handler.media_per_sample``), and the
    ``PackTokenizer`` of the handler (``handler=None``: Qwen-VL's ``tokenize_conversation``)."""
    if config.handler is None:
        return False, PackTokenizer(prepare_conversation, finish_conversations)
    from neatpack.pipes.families import resolve_handler

    h = resolve_handler(config.handler)
    return h.media_per_sample, h.pack_tokenizer


class _Loaded(NamedTuple):
    items: list[tuple[int, Any]]  # (loaded id, sample or prepared sample), in plan order
    planned_of: list[int]  # the planned id each item stands for
    skipped: list[int]
    failed: list[int]
    errors: list[str]


def _collect(
    planned: list[int],
    load: Callable[[int], Any],
    config: MaterializeConfig,
    epoch: int,
    n: int,
) -> _Loaded:
    """``load`` every planned id under ``config.on_bad_sample`` (raise / skip / replace)."""
    taken = set(planned)
    out = _Loaded([], [], [], [], [])
    for sid in planned:
        current, attempt, tried = sid, 0, [sid]
        while True:
            try:
                out.items.append((current, load(current)))
                out.planned_of.append(sid)
                break
            except LOAD_ERRORS as exc:
                out.failed.append(current)
                out.errors.append(str(exc)[:300])
                if config.on_bad_sample == "raise":
                    raise
                if config.on_bad_sample == "skip":
                    out.skipped.append(current)
                    break
                if attempt >= config.max_retries:
                    raise RuntimeError(
                        f"sample {sid} and its replacements failed to load (tried {tried}); "
                        f"last error: {exc}. Fix the data, "
                        "raise max_retries, or use on_bad_sample='skip'"
                    ) from exc
                attempt += 1
                current = replacement_id(config.seed, epoch, sid, attempt, n)
                while current in taken and len(taken) < n:
                    attempt += 1
                    current = replacement_id(config.seed, epoch, sid, attempt, n)
                taken.add(current)
                tried.append(current)
    return out


def materialize_pack(
    source: Any,
    sample_ids: Sequence[int],
    processor: Any,
    config: MaterializeConfig,
    *,
    epoch: int = 0,
    sample_transform: SampleFn | None = None,
    shift: SampleFn | None = None,
) -> tuple[Pack, MaterializeReport]:
    """Build the pack of `sample_ids` (in plan order). See the module docstring.

    ``sample_transform`` (a user hook) maps each tokenized, unshifted sample before its
    positions and the shift; a sample it makes longer meets the overflow policy."""
    positions, merge = _positions_fn(processor, config)
    per_sample_media, pack_tokenizer = _pack_path(config)
    planned = [int(i) for i in sample_ids]
    loaded: _Loaded | None = None
    if pack_tokenizer is not None:  # Qwen-VL: one processor call for the whole pack
        # Loading applies the failure policy per sample already (and raises naming it).
        prepare = pack_tokenizer.prepare

        def load(i: int) -> Any:
            return prepare(source[i], processor, fake_image=config.fake_image)

        got = _collect(planned, load, config, epoch, len(source))
        try:
            done = pack_tokenizer.finish(
                [p for _, p in got.items], processor, label_policy=config.label_policy
            )
            loaded = got._replace(items=[(i, s) for (i, _), s in zip(got.items, done, strict=True)])
        except LOAD_ERRORS:  # a check after the processor call: redo one by one, so the
            loaded = None  # policy sees that sample's own error
    if loaded is None:
        loaded = _collect(planned, lambda i: load_sample(source, i, processor, config), config,
                          epoch, len(source))  # fmt: skip
    replaced = [(sid, cur) for sid, (cur, _) in zip(loaded.planned_of, loaded.items, strict=True)
                if cur != sid]  # fmt: skip
    samples: list[dict[str, Any]] = []
    for _, s in loaded.items:
        if sample_transform is not None:
            s = sample_transform(s)
        if positions is not None:
            s["position_ids"] = positions(s)
        samples.append(s)
    skipped, failed, errors = loaded.skipped, loaded.failed, loaded.errors

    lengths = [_aligned(len(s["input_ids"]) - 1, config.alignment) for s in samples]
    dropped: list[int] = []
    truncated: list[int] = []
    cut_tokens = 0
    if sum(lengths) > config.pack_size:
        ids = [int(s["sample_id"]) for s in samples]
        if config.overflow == "raise":
            raise ValueError(
                f"pack of samples {ids} is {sum(lengths)} tokens after the shift (lengths "
                f"{lengths}) but pack_size={config.pack_size}: the length estimate was too low. "
                "Plan with exact lengths or more headroom (capacity below pack_size), or set "
                "overflow='drop' / 'truncate'"
            )
        while samples and sum(lengths) > config.pack_size:
            room = config.pack_size - sum(lengths[:-1])
            keep = room // config.alignment * config.alignment  # shifted tokens that fit
            # A family sample (per_sample_media) is cut only through text: its media tensors
            # (tiles, crops, audio features) cannot be cut per item here, so a cut through a
            # media token drops the sample instead (counted in report.dropped).
            cuttable = not per_sample_media or not media_after(samples[-1], keep + 1)
            if config.overflow == "truncate" and keep >= 1 and cuttable:
                last = samples[-1]
                cut = truncate_sample(last, keep + 1, merge=merge)
                if len(cut["input_ids"]) >= 2:
                    cut_tokens += len(last["input_ids"]) - len(cut["input_ids"])
                    truncated.append(int(last["sample_id"]))
                    samples[-1] = cut
                    lengths[-1] = _aligned(len(cut["input_ids"]) - 1, config.alignment)
                    continue
            dropped.append(int(samples.pop()["sample_id"]))
            lengths.pop()
    pack = build_pack(
        [split_media(s)[0] for s in samples] if per_sample_media else samples,
        padding_idx=config.padding_idx, alignment=config.alignment,
        pack_size=config.pack_size, mrope=positions is not None, shift=shift,
    )  # fmt: skip
    if per_sample_media:  # the collater merges them over the batch (collate_family.py)
        pack["media_samples"] = [split_media(s)[1] for s in samples]
    report = MaterializeReport(
        planned=tuple(planned),
        packed=tuple(pack["sample_ids"]),
        dropped=tuple(dropped),
        truncated=tuple(truncated),
        truncated_tokens=cut_tokens,
        replaced=tuple(replaced),
        skipped=tuple(skipped),
        failed=tuple(failed),
        errors=tuple(errors),
        real_tokens=sum(pack["seq_lens"]),
    )
    return pack, report


class Materializer:
    """`ParallelMapper` map_fn: `pack_ref -> pack`, with `pack_ref = {"pack_index", "epoch",
    "sample_ids"}`. The pack carries those (planned ids as `planned_sample_ids`) plus
    `report` (`MaterializeReport.as_dict()`). Picklable when its source and processor are."""

    def __init__(
        self,
        source: Any,
        processor: Any,
        config: MaterializeConfig,
        *,
        sample_transform: SampleFn | None = None,
        shift: SampleFn | None = None,
    ) -> None:
        self.source = source
        self.processor = processor
        self.config = config
        self.sample_transform = sample_transform
        self.shift = shift  # None: shift_sample (see neatpack.pipes.Shifter)

    def __call__(self, pack_ref: Mapping[str, Any]) -> Pack:
        epoch = int(pack_ref.get("epoch", 0))
        prefetch = getattr(self.source, "prefetch", None)
        if prefetch is not None:  # remote shards: the pack's reads in one concurrent batch
            prefetch(pack_ref["sample_ids"])
        pack, report = materialize_pack(
            self.source, pack_ref["sample_ids"], self.processor, self.config, epoch=epoch,
            sample_transform=self.sample_transform, shift=self.shift,
        )  # fmt: skip
        pack["pack_index"] = int(pack_ref.get("pack_index", -1))
        pack["epoch"] = epoch
        pack["planned_sample_ids"] = [int(i) for i in pack_ref["sample_ids"]]
        pack["report"] = report.as_dict()
        return pack
