"""Which family a VLM graph serves, and whether its config can work for that family.

``plan_family(processor, config)`` is called first by ``neat_vlm_graph``. It returns the
``FamilyPlan`` of every family, Qwen-VL included: the handler and what the length index, the
materialize step, the collater and the PP split need for it. A config that cannot work for the
family is a ``ValueError`` here, before any record is read, from the handler's own declaration,
naming the handler, the option and the fix:

==========================  ================================================================
fake_image=True             ``Handler.fake_image`` False (no fake image injected)
pp_microbatches             ``Handler.pp_split`` None (media not split per micro-batch)
attn_implementation         a mask-free / doc-id / flex format for a family whose mask is not
                            block-causal (Gemma 3's image runs attend both ways): sdpa / eager
estimate_mode               not in ``Handler.estimate_modes`` (e.g. "calibrated" for Gemma 3)
mask_options                a handler without a ``packed_mask`` (its rows are block-causal)
a handler needing mRoPE     without a model-free position rule (``Handler.positions``)
``Handler.graph_refused``   set (Phi-4-multimodal: its forward cannot take a mixed batch)
==========================  ================================================================

Selection: ``config.handler`` when set; else the processor's class through
``families.get_handler`` (the Qwen-VL processor classes map to ``qwen_vl``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neatpack.graphs.assemble import cp_alignment
from neatpack.pipes.collating.attention_choice import AUTO_ATTENTION
from neatpack.pipes.collating.collate_family import (
    check_family_mask_format,
    family_mask_is_block_causal,
)
from neatpack.pipes.collating.mask_format import resolve_mask_format
from neatpack.pipes.families import Handler, get_handler
from neatpack.pipes.indexing.handler_lengths import check_estimate_mode, handler_estimator
from neatpack.pipes.materializing.materialize import MaterializeConfig
from neatpack.pipes.parallel.pp_family_media import check_pp_split
from neatpack.pipes.steps import PPMediaSplitter

__all__ = ["FamilyPlan", "family_attention", "plan_family"]


@dataclass(frozen=True)
class FamilyPlan:
    """The family of a graph: its handler and the options of each stage."""

    handler: Handler
    materialize_options: dict[str, Any] = field(default_factory=dict)
    collate_options: dict[str, Any] = field(default_factory=dict)

    def estimator(self, processor: Any, mode: str, source: Any = None, **options: Any) -> Any:
        """The family's length estimator (``pipes/indexing/handler_lengths.py``); ``source``:
        the records ``mode="calibrated"`` fits on; ``options``: ``missing_media_fix``."""
        return handler_estimator(processor, self.handler.name, mode, source=source, **options)

    def materialize_config(self, config: Any, padding_idx: int) -> MaterializeConfig:
        """How a pack of this family is materialized under a VLM graph ``config`` (the planned
        and the streaming graph alike)."""
        return MaterializeConfig(
            pack_size=config.pack_size,
            padding_idx=padding_idx,
            overflow=config.overflow,
            on_bad_sample=config.on_bad_sample,
            fake_image=config.fake_image,
            seed=config.seed,
            alignment=cp_alignment(config),
            **self.materialize_options,
        )

    def pp_steps(self, config: Any) -> list[PPMediaSplitter]:
        """The batch steps after collate: the pipeline-parallel media split when asked."""
        if not config.pp_microbatches:
            return []
        return [PPMediaSplitter(config.pp_microbatches, handler=self.handler.name)]


def family_attention(processor: Any, config: Any, model: Any = None) -> Any:
    """``config`` with ``attn_implementation="auto"`` resolved (``AttentionOptions.
    with_attention``) for ``model``, this machine and the processor's family: a family whose
    packed mask is not block-causal (Gemma 3's image runs) keeps sdpa's 4D mask."""
    if config.attn_implementation != AUTO_ATTENTION:
        return config
    handler = get_handler(processor, config.handler)
    causal = family_mask_is_block_causal(handler, config.mask_options)
    return config.with_attention(model=model, block_causal=causal)


def plan_family(processor: Any, config: Any) -> FamilyPlan:
    """The family's plan; ValueError for a config that cannot work for the family (module
    docstring). ``config`` is a ``NeatVLMConfig``."""
    handler = get_handler(processor, config.handler)
    h = handler.name
    if handler.graph_refused:
        raise ValueError(f"neat_vlm_graph cannot serve handler {h!r}: {handler.graph_refused}")
    if config.fake_image and not handler.fake_image:
        raise ValueError(
            f"fake_image=True needs a handler that injects a fake image (Handler.fake_image), "
            f"but the processor {type(processor).__name__} uses handler {h!r}, which injects "
            "none: set fake_image=False (text-only packs then carry no vision tokens)"
        )
    if config.pp_microbatches is not None:
        check_pp_split(handler, config.pp_microbatches)
    check_estimate_mode(handler, config.estimate_mode)
    if config.mask_options and handler.packed_mask is None:
        raise ValueError(
            f"mask_options={dict(config.mask_options)!r} but handler {h!r} has no packed_mask "
            "(its packed rows are block-causal): set mask_options=None"
        )
    fmt = resolve_mask_format(config.attn_implementation)
    check_family_mask_format(handler, fmt, config.mask_options)
    if handler.mrope and handler.positions is None:
        raise ValueError(
            f"handler {h!r} needs mRoPE positions but has no model-free rule: register it with "
            "Handler(..., positions=<fn(sample, processor) -> [3, L] ids>)"
        )
    collate_options: dict[str, Any] = {"handler": h, "mask_options": config.mask_options}
    if config.pp_microbatches:
        collate_options["media_counts"] = True  # each row's media items, for the PP split
    return FamilyPlan(
        handler,
        materialize_options={"handler": h, "mrope": handler.mrope},
        collate_options=collate_options,
    )
