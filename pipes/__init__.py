"""neatpack.pipes: the nodes and the pure functions behind them.

Names are imported lazily (``from neatpack.pipes import plan_packs`` loads only what it needs:
the planner does not pull in torch or transformers).
"""

from __future__ import annotations

import importlib
from typing import Any

from neatpack.pipes.compat.moved import MOVED_PIPES, install_moved_modules

install_moved_modules(__name__, MOVED_PIPES)  # neatpack.pipes.read etc. (the flat layout)

_EXPORTS: dict[str, tuple[str, ...]] = {
    "reading.read": (
        "HFDatasetSource",
        "JsonListSource",
        "JsonlSource",
        "RecordSource",
        "SequenceSource",
        "to_record",
    ),
    "reading.formats": ("FORMATS", "normalize_format"),
    "reading.shards": ("ParquetSource", "ShardIndexError", "TarShardSource"),
    "reading.remote": ("RemoteReadError",),
    "reading.media_policy": ("MediaRefusedError",),
    "reading.video": ("decode_video", "probe_video"),
    "indexing.estimate": ("LengthEstimator",),
    "indexing.estimate_types": ("SampleEstimate", "TemplateOverhead"),
    "indexing.media_tokens": ("ImageTokenConfig", "VideoTokenConfig", "smart_resize"),
    "indexing.lengths": ("LengthIndex", "build_length_index"),
    "indexing.exact_lengths": ("exact_samples", "templated_text_tokens_batch"),
    "indexing.overlong": (
        "OverlongError",
        "OverlongSummary",
        "overlong_summary",
        "summarize_overlong",
    ),
    "indexing.length_source": ("LengthSource",),
    "reading.record_reader": ("RecordReader",),
    "planning.binpack": ("best_fit_decreasing", "greedy_knapsack", "lower_bound", "overlong_ids"),
    "planning.plan": ("PackPlan", "greedy_knapsack_vt_balanced", "plan_packs"),
    "planning.sampler": ("LengthGroupedSampler",),
    "planning.source": ("PackSource", "StateMismatchError"),
    "reading.media": ("load_image", "to_rgb"),
    "reading.audio": ("load_audio", "split_audio_blocks"),
    "materializing.tokenize": ("tokenize_conversation", "tokenize_conversations"),
    "materializing.labels": ("build_labels", "build_labels_from_template", "derive_role_markers"),
    "materializing.mrope": ("MRopeConfig", "compute_mrope_position_ids", "mrope_position_ids"),
    "materializing.pack": (
        "MEDIA_KEYS",
        "build_pack",
        "build_packed_sample",
        "shift_sample",
    ),
    "materializing.materialize": (
        "MaterializeConfig",
        "MaterializeReport",
        "Materializer",
        "materialize_pack",
    ),
    "compat.packed_dataset": ("PackedDatasetWrapper", "neat_pack_dataset_vlm"),
    "collating.doc_ids": ("check_doc_ids", "doc_ids_match_lengths"),
    "collating.mask": ("to_4d_additive_mask", "to_4d_bool_mask", "to_4d_mask"),
    "collating.cu_seqlens": (
        "cu_seqlens_from_doc_lengths",
        "thd_params_from_doc_lengths",
        "to_cu_seqlens",
        "to_thd_params",
    ),
    "collating.block_mask": ("to_block_mask",),
    "collating.text_positions": ("to_mrope_text_position_ids", "to_text_position_ids"),
    "collating.mask_format": (
        "FLASH_FORMATS",
        "MASK_FORMATS",
        "attention_inputs",
        "resolve_mask_format",
    ),
    "collating.collate": ("neat_packed_vlm_collater",),
    "collating.collate_media": ("merge_media",),
    "collating.sample_collate": ("default_collate_fn", "pad_collate_fn"),
    "collating.expand_tokens": ("expand_image_tokens",),
    "collating.robust_collate": ("RobustCollate", "make_robust_collate"),
    "errors": ("EstimateError", "RecordError", "SampleError"),
    "contracts": ("Batch", "Pack", "PackRef", "Record", "Sample"),
    "parallel.pp_media": (
        "VLM_PP_MEDIA_KEY",
        "chunk_step3_media",
        "chunk_vlm_media",
        "prepare_vlm_media_for_pp",
        "stage_vlm_media_for_pp",
        "wrap_vlm_collate_for_pp",
    ),
    "parallel.pp_family_media": ("prepare_family_media_for_pp", "wrap_family_collate_for_pp"),
    "testing.resume": ("assert_exactly_once", "assert_resumable"),
    "steps.chain": ("StepChain",),
    "steps.per_pack": ("PerPack",),
    "steps.meta": ("pack_meta",),
    "steps.materializer": ("PackMaterializer",),
    "steps.shifter": ("Shifter",),
    "steps.collater": ("Collater",),
    "steps.pack_padder": ("PackPadder",),
    "steps.mask_converter": ("MaskConverter",),
    "steps.pp_split": ("PPMediaSplitter",),
    "steps.sample_reader": ("SampleReader",),
    "steps.conversation_tokenizer": ("ConversationTokenizer",),
    "steps.pad_collater": ("PadCollater",),
    "families": (
        "Handler",
        "get_handler",
        "packed_model_inputs",
        "register_handler",
        "tokenize_with_handler",
    ),
    "families.chat_template": ("default_estimate", "tokenize_default"),
    "families.prompt_answer": ("prompt_answer_length", "tokenize_prompt_answer"),
    "families.gemma3": ("gemma3_estimator", "gemma3_pan_and_scan"),
    "families.gemma4": ("GEMMA4_THINKING_PREFIX", "gemma4_estimate", "inject_thinking_prefix"),
    "families.kimi": ("kimi_k25_fixed_length_batch", "kimi_k25_pack_media"),
    "families.step3": ("step3_estimate", "step3_pack_media", "step3_pp_media"),
    "families.smolvlm": ("smolvlm_estimate", "tokenize_smolvlm"),
    "families.phi4": ("phi4_estimate", "phi4_pack_media", "tokenize_phi4"),
    "families.nemotron_omni": (
        "nemotron_omni_estimate",
        "nemotron_omni_pack_media",
        "tokenize_nemotron_omni",
    ),
    "compat.text_pack": ("CROSS_ENTROPY_IGNORE_IDX", "neat_pack_dataset"),
    "collating.varlen_attention": (
        "check_boundaries",
        "register_varlen_attention",
        "varlen_attention",
    ),
    "collating.boundaries": (
        "add_boundaries",
        "boundary_kwargs",
        "needs_boundaries",
        "stateful_layers",
        "to_seq_idx",
    ),
    "collating.leak_probe": (
        "LeakReport",
        "PackingLeakError",
        "check_packing",
        "probe_packing_leak",
    ),
    "testing.tiny_hybrid_models": ("TINY_HYBRID_FAMILIES", "tiny_hybrid_model"),
    "parallel.context_parallel": (
        "ContextParallelShard",
        "ContextParallelSplitter",
        "attention_work_per_rank",
        "context_parallel_shards",
        "cp_padded_lengths",
        "cp_split_indices",
        "shard_for_context_parallel",
    ),
    "testing.tiny": ("load_tiny_processor",),
    "testing.synth": ("write_corpus",),
    "mixtures.mixture": (
        "Mixture",
        "MixtureSource",
        "epoch_counts",
        "fill_counts",
        "source_targets",
    ),
    "mixtures.mixture_plan": ("MixturePlan", "plan_mixture", "replan_from_cursor"),
    "mixtures.mixture_source": ("MixturePackSource", "MixtureRecords", "SourceTagger"),
    "mixtures.mixture_report": ("mixture_ledger", "realized_shares", "target_shares"),
    # The seed's own names, kept for code written against the seed's API (seed_compat.py).
    "compat.seed_compat": (
        "_estimate_image_tokens",
        "_estimate_sample_length",
        "_estimate_video_tokens",
        "_expand_image_tokens",
        "_smart_resize_image",
        "_smart_resize_video",
        "build_packed_vlm_sample",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

#: The core a pipeline is built from, in flow order (docs/architecture.md): read -> length
#: index -> plan -> pack source -> materialize -> collate, with the data contracts and the
#: checks for users' own nodes. Every other name in ``_EXPORTS`` (seed names, family helpers,
#: mask functions, ...) is importable from here too; ``dir()`` lists them all.
__all__ = [
    "Batch",
    "JsonlSource",
    "LengthEstimator",
    "LengthIndex",
    "Materializer",
    "Pack",
    "PackPlan",
    "PackRef",
    "PackSource",
    "Record",
    "RecordError",
    "Sample",
    "SampleError",
    "assert_exactly_once",
    "assert_resumable",
    "build_length_index",
    "neat_packed_vlm_collater",
    "plan_packs",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'neatpack.pipes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(_WHERE)
