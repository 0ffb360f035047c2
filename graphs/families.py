"""Which family a VLM graph serves, and whether its config can work for that family.

``plan_family(processor, config)`` is called first by ``neat_vlm_graph``. It returns None for
the Qwen-VL path (handler ``qwen_vl``: the graph is built exactly as before), else a
``FamilyPlan`` naming the handler and what the materialize step, the collater and the length
index need for it. A config that cannot work for the family is a ``ValueError`` here, before any
record is read, naming the option and the fix:

==========================  ================================================================
fake_image=True             Qwen-VL only (no other handler injects a fake image)
pp_microbatches             the PP media split knows the Qwen-VL media keys only
attn_implementation         a mask-free / doc-id / flex format for a family whose mask is not
                            block-causal (Gemma 3's image runs attend both ways): sdpa / eager
estimate_mode="calibrated"  Qwen-VL's LengthEstimator only
mask_options                only for a handler with a packed_mask (Gemma 3 / 4)
a handler needing mRoPE     without a model-free position rule (``Handler.positions``)
``Handler.graph_refused``   set (Phi-4-multimodal: its forward cannot take a mixed batch)
==========================  ================================================================

Selection: ``config.handler`` when set; else the processor's class through
``families.get_handler``, except the Qwen-VL processor classes
(``families.qwen_vl.QWEN_VL_PROCESSORS``), which always keep the Qwen-VL path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neatpack.graphs.open_data import MISSING_MEDIA_FIX
from neatpack.pipes.collating.collate_family import check_family_mask_format
from neatpack.pipes.collating.mask_format import resolve_mask_format
from neatpack.pipes.families import PROCESSOR_HANDLERS, Handler, get_handler
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.handler_lengths import HANDLER_ESTIMATE_MODES, handler_estimator

__all__ = ["QWEN_VL_HANDLER", "FamilyPlan", "plan_family", "vlm_estimator"]

QWEN_VL_HANDLER = "qwen_vl"


@dataclass(frozen=True)
class FamilyPlan:
    """The non-Qwen-VL family of a graph: its handler and the options of each stage."""

    handler: Handler
    materialize_options: dict[str, Any] = field(default_factory=dict)
    collate_options: dict[str, Any] = field(default_factory=dict)

    def estimator(self, processor: Any, mode: str) -> Any:
        """The family's length estimator (``pipes/indexing/handler_lengths.py``)."""
        return handler_estimator(processor, self.handler.name, mode)


def _is_qwen_vl(processor: Any) -> bool:
    cls = type(processor).__name__
    handler: str | None = PROCESSOR_HANDLERS.get(cls)
    return handler == QWEN_VL_HANDLER


def plan_family(processor: Any, config: Any) -> FamilyPlan | None:
    """None for the Qwen-VL path, else the family's plan; ValueError for a config that cannot
    work for the family (module docstring). ``config`` is a ``NeatVLMConfig``."""
    name = config.handler
    if name is None and _is_qwen_vl(processor):
        name = QWEN_VL_HANDLER
    handler = get_handler(processor, name)
    if handler.name == QWEN_VL_HANDLER:
        if config.mask_options:
            raise ValueError(
                f"mask_options={dict(config.mask_options)!r} is for a family with its own packed "
                "mask (Gemma 3 / 4); the Qwen-VL path builds its mask from attn_implementation: "
                "set mask_options=None"
            )
        return None
    h = handler.name
    if handler.graph_refused:
        raise ValueError(f"neat_vlm_graph cannot serve handler {h!r}: {handler.graph_refused}")
    if config.fake_image:
        raise ValueError(
            f"fake_image=True needs the Qwen-VL path, but the processor "
            f"{type(processor).__name__} uses handler {h!r}, which injects no fake image: set "
            "fake_image=False (text-only packs then carry no vision tokens)"
        )
    if config.pp_microbatches is not None:
        raise ValueError(
            f"pp_microbatches={config.pp_microbatches} splits the Qwen-VL media keys only; "
            f"handler {h!r} carries its own media layout: set pp_microbatches=None"
        )
    if config.estimate_mode not in HANDLER_ESTIMATE_MODES:
        raise ValueError(
            f"estimate_mode={config.estimate_mode!r} is not available for handler {h!r}; valid: "
            f"{HANDLER_ESTIMATE_MODES} ('calibrated' fits the Qwen-VL estimator only)"
        )
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
    return FamilyPlan(
        handler,
        materialize_options={"handler": h, "mrope": handler.mrope},
        collate_options={"handler": h, "mask_options": config.mask_options},
    )


def vlm_estimator(processor: Any, cfg: Any, family: FamilyPlan | None, source: Any) -> Any:
    """The length estimator of the VLM graph: the family's, or Qwen-VL's ``LengthEstimator``
    (calibrated on ``source`` for ``estimate_mode="calibrated"``)."""
    if family is not None:
        return family.estimator(processor, cfg.estimate_mode)
    if cfg.estimate_mode == "calibrated":
        return LengthEstimator.calibrate(
            source, processor, mode="calibrated", missing_media_fix=MISSING_MEDIA_FIX
        )
    return LengthEstimator.from_processor(
        processor, mode=cfg.estimate_mode, missing_media_fix=MISSING_MEDIA_FIX
    )
