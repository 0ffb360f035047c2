"""The one assembler of the prebuilt graphs: what every graph does after it knows its lengths.

``neat_vlm_parts``, ``neat_llm_parts`` and ``grouped_vlm_parts`` each do only what is theirs
(open the records, find every sample's length, say how one pack is materialized and collated)
and hand the rest here:

    plan_for(group_size) ─► PackSource (this rank) ─► Batcher ─► map_stage(StepChain(steps))
                                                                   ─► NeatLoader(checkpoint key)

``packed_parts`` adds what the two packed graphs share: boundaries for hybrid models, context
parallel padding, the greedy plan, the worker chain ``PerPack(materialize) [, PerPack(
pack_transform)], Collater [, batch_transform] [, extra steps] [, ContextParallelSplitter]``.
The checkpoint key is ``{"graph", "lengths", **checkpoint_key(config)}`` for every graph
(graphs/config.py). ``loader_of`` makes a graph function from its parts function, so the
parameters are written once.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, ParamSpec

import numpy as np

from neatpack.graphs.config import checkpoint_key
from neatpack.graphs.runtime.loader import NeatLoader
from neatpack.graphs.runtime.stages import GraphParts
from neatpack.graphs.runtime.step_cost import StepCost
from neatpack.pipes.collating.leak_probe import packing_boundaries
from neatpack.pipes.collating.mask_format import resolve_mask_format, warn_dense_mask_on_cuda
from neatpack.pipes.parallel.context_parallel import ContextParallelSplitter, cp_padded_lengths
from neatpack.pipes.planning.balance import pack_cost_terms
from neatpack.pipes.planning.plan import PackPlan, plan_packs
from neatpack.pipes.planning.plan_file import shared_plan
from neatpack.pipes.planning.source import PackSource
from neatpack.pipes.planning.stream_packer import StreamPacker
from neatpack.pipes.steps import Collater, PackMaterializer, PerPack

__all__ = [
    "Hooks",
    "assemble",
    "cp_alignment",
    "lengths_fingerprint_of",
    "loader_of",
    "packed_parts",
    "probe_boundaries",
]

P = ParamSpec("P")
Step = Callable[[Any], Any]


class Hooks(NamedTuple):
    """What a user adds to a packed graph's worker chain (the graph functions' arguments):
    a per-pack and a per-batch step, a model to probe for boundaries, a context-parallel rank."""

    pack_transform: Step | None = None
    batch_transform: Step | None = None
    model: Any = None
    cp_rank: int | None = None


def assemble(
    config: Any,
    *,
    graph: str,
    plan_for: Callable[[int], PackPlan] | None,
    lengths_fingerprint: str,
    steps: Sequence[Step],
    rank: int,
    world_size: int,
    pack_size: int,
    data: dict[str, str] | None,
    batched: bool = True,
    materialize: PackMaterializer | None = None,
    collate: Collater | None = None,
    step_cost: StepCost | None = None,
    stream: StreamPacker | None = None,
) -> GraphParts:
    """The ``GraphParts`` of any graph: this rank's ``PackSource`` over ``plan_for`` (or, for
    a stream, the ``StreamPacker`` given as ``stream``, with ``plan_for=None``), the worker
    ``steps``, the config's worker and bookkeeping groups, and the checkpoint key.
    ``batched=False``: each plan entry is a whole batch (one entry per step and rank, no
    ``Batcher``), else ``config.batch_size`` entries make a batch."""
    per_batch = config.batch_size if batched else 1
    source: PackSource | StreamPacker
    if stream is not None:
        source = stream
    elif plan_for is not None:
        source = PackSource(
            plan_for, rank=rank, world_size=world_size, batch_size=per_batch, tail=config.tail
        )
    else:
        raise ValueError("assemble needs plan_for (a planned graph) or stream (a stream)")
    return GraphParts(
        source=source,
        materialize=materialize,
        collate=collate,
        steps=tuple(steps),
        batch_size=per_batch,
        pack_size=pack_size,
        config={"graph": graph, "lengths": lengths_fingerprint, **checkpoint_key(config)},
        num_workers=config.num_workers,
        method=config.worker_method,
        multiprocessing_context=config.multiprocessing_context,
        prefetch=config.prefetch,
        pin_memory=config.pin_memory,
        transfer=config.worker_transfer,
        keep_ledger=config.keep_ledger,
        ledger_epochs=config.ledger_epochs,
        data=data,
        batched=batched,
        step_cost=step_cost,
    )


def cp_alignment(config: Any) -> int:
    """What each document's length is padded to a multiple of (context parallelism)."""
    return 1 if config.cp_size == 1 else 2 * config.cp_size


def probe_boundaries(config: Any, hooks: Hooks) -> bool:
    """Whether the batches carry boundaries for the hooks' ``model`` (hybrid models); a model
    whose layers leak across documents raises ``PackingLeakError`` here unless
    ``allow_packing_leak`` (``pipes/collating/leak_probe.py``). A graph asks this first, before
    it reads a record or builds a length index, so a model it cannot pack fails at once."""
    return packing_boundaries(
        hooks.model, boundaries=config.boundaries, allow_leak=config.allow_packing_leak
    )


def packed_parts(
    config: Any,
    *,
    graph: str,
    total: Any,
    lengths_fingerprint: str,
    materialize: PackMaterializer,
    collate_options: dict[str, Any],
    rank: int,
    world_size: int,
    data: dict[str, str] | None,
    visual: Any = None,
    images: Any = None,
    supervised: Any = None,
    hooks: Hooks,
    boundaries: bool,
    packing_ratio: float = 1.0,
    extra_steps: Sequence[Step] = (),
    stream: StreamPacker | None = None,
) -> GraphParts:
    """``assemble`` for a packed graph (VLM, LLM, stream): the plan over ``total`` (padded per
    document for context parallelism; a stream gives its ``StreamPacker`` as ``stream`` and
    ``total=None`` instead), the ``Collater`` from the config's attention group plus
    ``collate_options``, the worker chain with the ``hooks``, and the CP splitter for their
    ``cp_rank``. ``boundaries``: ``probe_boundaries``' answer, asked before any record is read.
    ``images``: media items per sample (the images budget and the vision cost's split);
    ``supervised``: label tokens per sample (``balance="supervised"`` and its step report)."""
    plan_for: Callable[[int], PackPlan] | None = None
    if stream is None:
        planned = total if config.cp_size == 1 else cp_padded_lengths(total, config.cp_size)

        cache_dir = getattr(config, "cache_dir", None)
        # with a cache folder, planned once per node and mapped by every rank (plan_file.py),
        # found by the lengths' fingerprint (the CP padding is a function of it and cp_size)
        key = f"{lengths_fingerprint}|cp_size={config.cp_size}|visual={visual is not None}"
        if config.balance == "supervised" and supervised is None:
            raise ValueError(
                "balance='supervised' needs the supervised (label) tokens per sample, and the "
                "lengths this graph was given have none; see LengthIndex.require_supervised"
            )

        def plan_for(group_size: int) -> PackPlan:
            plan: Callable[..., PackPlan] = (
                plan_packs
                if cache_dir is None
                else functools.partial(shared_plan, cache_dir, key=key)
            )
            return plan(
                planned,
                config.pack_size,
                visual=visual,
                packing_ratio=packing_ratio,
                max_packs=config.max_packs,
                overlong=config.overlong,
                world_size=group_size,
                seed=config.seed,
                shuffle=config.shuffle,
                balance=config.balance,
                max_visual=getattr(config, "max_visual_tokens", None),  # the VLM graph's option
                images=images,
                max_images=getattr(config, "max_images", None),  # the VLM graph's option
                supervised=supervised if config.balance == "supervised" else None,
                per_rank=config.batch_size,  # the step shape (read under cost only)
            )

        warn_dense_mask_on_cuda(
            resolve_mask_format(config.attn_implementation), total, config.pack_size
        )  # a dense mask costs the whole row's square on a GPU: say how much
    collate = Collater(
        attn_implementation=config.attn_implementation,
        pad_to_multiple_of=config.pad_to_multiple_of,
        boundaries=boundaries,
        **collate_options,
    )
    steps: list[Step] = [PerPack(materialize)]
    if hooks.pack_transform is not None:
        steps.append(PerPack(hooks.pack_transform))
    steps.append(collate)
    if hooks.batch_transform is not None:
        steps.append(hooks.batch_transform)
    steps.extend(extra_steps)
    if hooks.cp_rank is not None:
        steps.append(ContextParallelSplitter(config.cp_size, hooks.cp_rank))
    return assemble(
        config,
        graph=graph,
        plan_for=plan_for,
        lengths_fingerprint=lengths_fingerprint,
        steps=steps,
        rank=rank,
        world_size=world_size,
        pack_size=config.pack_size,
        data=data,
        materialize=materialize,
        collate=collate,
        step_cost=(
            None
            if stream is not None
            else StepCost(
                functools.partial(_plan_terms, total=planned, visual=visual, images=images),
                supervised=supervised,
            )
        ),
        stream=stream,
    )


def _plan_terms(plan: PackPlan, packs: Any, *, total: Any, visual: Any, images: Any = None) -> Any:
    """The cost terms (``balance.pack_cost_terms``) of the plan's packs ``packs``, for
    ``StepCost``: their samples' lengths gathered first, so a step touches only its own."""
    starts, ends = plan.offsets[packs], plan.offsets[packs + 1]
    spans = zip(starts.tolist(), ends.tolist(), strict=True)
    ids = np.concatenate([plan.ids[a:b] for a, b in spans])
    offsets = np.concatenate([[0], np.cumsum(ends - starts)])
    local = np.arange(ids.size)
    vis = None if visual is None else np.asarray(visual[ids])
    items = None if images is None else np.asarray(images[ids])
    return pack_cost_terms(offsets, local, np.asarray(total[ids]), vis, items)


def loader_of(
    parts: Callable[P, GraphParts],
) -> Callable[[Callable[..., Any]], Callable[P, NeatLoader]]:
    """Make ``graph(*args) = parts(*args).loader()`` with ``parts``' parameters (written once)
    and the decorated function's name and docstring."""

    def make(doc_holder: Callable[..., Any]) -> Callable[P, NeatLoader]:
        @functools.wraps(parts)
        def graph(*args: P.args, **kwargs: P.kwargs) -> NeatLoader:
            return parts(*args, **kwargs).loader()

        graph.__name__ = graph.__qualname__ = doc_holder.__name__
        graph.__doc__ = doc_holder.__doc__
        graph.__module__ = doc_holder.__module__
        sig = inspect.signature(parts)
        graph.__signature__ = sig.replace(return_annotation=NeatLoader)  # type: ignore[attr-defined]
        return graph

    return make


def lengths_fingerprint_of(total: Any) -> str:
    """The content fingerprint of exact lengths (pre-tokenized data has no other)."""
    return hashlib.sha256(np.ascontiguousarray(total, dtype="<i8").tobytes()).hexdigest()
