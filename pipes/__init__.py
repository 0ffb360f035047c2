"""neatpack.pipes: the nodes and the pure functions behind them.

Names are imported lazily (``from neatpack.pipes import plan_packs`` loads only what it needs:
the planner does not pull in torch or transformers). Type checkers and IDEs read the
``if TYPE_CHECKING:`` block below instead, so every name has its real type; it lists exactly the
names of ``_EXPORTS`` (``tests/test_typing.py`` keeps the two equal, and runs mypy on the names
the README imports).

Three tiers: ``__all__`` is the core a pipeline is built from plus every name the README
imports; the seed's names also live in ``neatpack.pipes.compat.seed_compat``; the model
families' helpers (``gemma3_estimator``, ``kimi_k25_pack_media``, ...) also live in
``neatpack.pipes.families``. Every name of ``_EXPORTS`` is importable from here (``dir()``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    "reading.stream_files": ("ShardStream",),
    "reading.stream_hf": ("HFStream",),
    "reading.stream_generator": ("GeneratorStream", "StreamOrderError"),
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
    "indexing.supervised": ("supervised_estimator", "supervised_tokens"),
    "reading.record_reader": ("RecordReader",),
    "planning.binpack": ("best_fit_decreasing", "greedy_knapsack", "lower_bound", "overlong_ids"),
    "planning.cost": ("CostModel",),
    "planning.plan": ("PackPlan", "greedy_knapsack_vt_balanced", "plan_packs"),
    "planning.plan_file": ("shared_plan",),
    "planning.sampler": ("LengthGroupedSampler",),
    "planning.source": ("PackSource", "StateMismatchError"),
    "planning.online": ("OnlinePacker",),
    "planning.stream_packer": ("StreamPacker", "merge_states"),
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
    "collating.attention_formats": ("FLASH_FORMATS", "MASK_FORMATS"),
    "collating.mask_format": (
        "attention_inputs",
        "resolve_mask_format",
    ),
    "collating.collate": ("neat_packed_vlm_collater",),
    "collating.collate_media": ("merge_media",),
    "collating.sample_collate": ("default_collate_fn", "pad_collate_fn"),
    "collating.expand_tokens": ("expand_image_tokens",),
    "collating.robust_collate": ("RobustCollate", "make_robust_collate"),
    "errors": ("EstimateError", "RecordError", "SampleError"),
    "contracts": ("Batch", "Pack", "PackMeta", "PackRef", "Record", "Sample"),
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
    "collating.attention_choice": ("choose_attention_format", "use_varlen_attention"),
    "collating.attention_check": ("check_attention_inputs",),
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
    "testing.tiny_models": ("tiny_model",),
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

if TYPE_CHECKING:  # the real types of the lazy names, for mypy, pyright and IDEs
    from neatpack.pipes.collating.attention_check import (
        check_attention_inputs as check_attention_inputs,
    )
    from neatpack.pipes.collating.attention_choice import (
        choose_attention_format as choose_attention_format,
    )
    from neatpack.pipes.collating.attention_choice import (
        use_varlen_attention as use_varlen_attention,
    )
    from neatpack.pipes.collating.attention_formats import FLASH_FORMATS as FLASH_FORMATS
    from neatpack.pipes.collating.attention_formats import MASK_FORMATS as MASK_FORMATS
    from neatpack.pipes.collating.block_mask import to_block_mask as to_block_mask
    from neatpack.pipes.collating.boundaries import add_boundaries as add_boundaries
    from neatpack.pipes.collating.boundaries import boundary_kwargs as boundary_kwargs
    from neatpack.pipes.collating.boundaries import needs_boundaries as needs_boundaries
    from neatpack.pipes.collating.boundaries import stateful_layers as stateful_layers
    from neatpack.pipes.collating.boundaries import to_seq_idx as to_seq_idx
    from neatpack.pipes.collating.collate import (
        neat_packed_vlm_collater as neat_packed_vlm_collater,
    )
    from neatpack.pipes.collating.collate_media import merge_media as merge_media
    from neatpack.pipes.collating.cu_seqlens import (
        cu_seqlens_from_doc_lengths as cu_seqlens_from_doc_lengths,
    )
    from neatpack.pipes.collating.cu_seqlens import (
        thd_params_from_doc_lengths as thd_params_from_doc_lengths,
    )
    from neatpack.pipes.collating.cu_seqlens import to_cu_seqlens as to_cu_seqlens
    from neatpack.pipes.collating.cu_seqlens import to_thd_params as to_thd_params
    from neatpack.pipes.collating.doc_ids import check_doc_ids as check_doc_ids
    from neatpack.pipes.collating.doc_ids import doc_ids_match_lengths as doc_ids_match_lengths
    from neatpack.pipes.collating.expand_tokens import expand_image_tokens as expand_image_tokens
    from neatpack.pipes.collating.leak_probe import LeakReport as LeakReport
    from neatpack.pipes.collating.leak_probe import PackingLeakError as PackingLeakError
    from neatpack.pipes.collating.leak_probe import check_packing as check_packing
    from neatpack.pipes.collating.leak_probe import probe_packing_leak as probe_packing_leak
    from neatpack.pipes.collating.mask import to_4d_additive_mask as to_4d_additive_mask
    from neatpack.pipes.collating.mask import to_4d_bool_mask as to_4d_bool_mask
    from neatpack.pipes.collating.mask import to_4d_mask as to_4d_mask
    from neatpack.pipes.collating.mask_format import attention_inputs as attention_inputs
    from neatpack.pipes.collating.mask_format import resolve_mask_format as resolve_mask_format
    from neatpack.pipes.collating.robust_collate import RobustCollate as RobustCollate
    from neatpack.pipes.collating.robust_collate import make_robust_collate as make_robust_collate
    from neatpack.pipes.collating.sample_collate import default_collate_fn as default_collate_fn
    from neatpack.pipes.collating.sample_collate import pad_collate_fn as pad_collate_fn
    from neatpack.pipes.collating.text_positions import (
        to_mrope_text_position_ids as to_mrope_text_position_ids,
    )
    from neatpack.pipes.collating.text_positions import to_text_position_ids as to_text_position_ids
    from neatpack.pipes.collating.varlen_attention import check_boundaries as check_boundaries
    from neatpack.pipes.collating.varlen_attention import (
        register_varlen_attention as register_varlen_attention,
    )
    from neatpack.pipes.collating.varlen_attention import varlen_attention as varlen_attention
    from neatpack.pipes.compat.packed_dataset import PackedDatasetWrapper as PackedDatasetWrapper
    from neatpack.pipes.compat.packed_dataset import neat_pack_dataset_vlm as neat_pack_dataset_vlm
    from neatpack.pipes.compat.seed_compat import _estimate_image_tokens as _estimate_image_tokens
    from neatpack.pipes.compat.seed_compat import _estimate_sample_length as _estimate_sample_length
    from neatpack.pipes.compat.seed_compat import _estimate_video_tokens as _estimate_video_tokens
    from neatpack.pipes.compat.seed_compat import _expand_image_tokens as _expand_image_tokens
    from neatpack.pipes.compat.seed_compat import _smart_resize_image as _smart_resize_image
    from neatpack.pipes.compat.seed_compat import _smart_resize_video as _smart_resize_video
    from neatpack.pipes.compat.seed_compat import build_packed_vlm_sample as build_packed_vlm_sample
    from neatpack.pipes.compat.text_pack import CROSS_ENTROPY_IGNORE_IDX as CROSS_ENTROPY_IGNORE_IDX
    from neatpack.pipes.compat.text_pack import neat_pack_dataset as neat_pack_dataset
    from neatpack.pipes.contracts import Batch as Batch
    from neatpack.pipes.contracts import Pack as Pack
    from neatpack.pipes.contracts import PackMeta as PackMeta
    from neatpack.pipes.contracts import PackRef as PackRef
    from neatpack.pipes.contracts import Record as Record
    from neatpack.pipes.contracts import Sample as Sample
    from neatpack.pipes.errors import EstimateError as EstimateError
    from neatpack.pipes.errors import RecordError as RecordError
    from neatpack.pipes.errors import SampleError as SampleError
    from neatpack.pipes.families import Handler as Handler
    from neatpack.pipes.families import get_handler as get_handler
    from neatpack.pipes.families import packed_model_inputs as packed_model_inputs
    from neatpack.pipes.families import register_handler as register_handler
    from neatpack.pipes.families import tokenize_with_handler as tokenize_with_handler
    from neatpack.pipes.families.chat_template import default_estimate as default_estimate
    from neatpack.pipes.families.chat_template import tokenize_default as tokenize_default
    from neatpack.pipes.families.gemma3 import gemma3_estimator as gemma3_estimator
    from neatpack.pipes.families.gemma3 import gemma3_pan_and_scan as gemma3_pan_and_scan
    from neatpack.pipes.families.gemma4 import GEMMA4_THINKING_PREFIX as GEMMA4_THINKING_PREFIX
    from neatpack.pipes.families.gemma4 import gemma4_estimate as gemma4_estimate
    from neatpack.pipes.families.gemma4 import inject_thinking_prefix as inject_thinking_prefix
    from neatpack.pipes.families.kimi import (
        kimi_k25_fixed_length_batch as kimi_k25_fixed_length_batch,
    )
    from neatpack.pipes.families.kimi import kimi_k25_pack_media as kimi_k25_pack_media
    from neatpack.pipes.families.nemotron_omni import (
        nemotron_omni_estimate as nemotron_omni_estimate,
    )
    from neatpack.pipes.families.nemotron_omni import (
        nemotron_omni_pack_media as nemotron_omni_pack_media,
    )
    from neatpack.pipes.families.nemotron_omni import (
        tokenize_nemotron_omni as tokenize_nemotron_omni,
    )
    from neatpack.pipes.families.phi4 import phi4_estimate as phi4_estimate
    from neatpack.pipes.families.phi4 import phi4_pack_media as phi4_pack_media
    from neatpack.pipes.families.phi4 import tokenize_phi4 as tokenize_phi4
    from neatpack.pipes.families.prompt_answer import prompt_answer_length as prompt_answer_length
    from neatpack.pipes.families.prompt_answer import (
        tokenize_prompt_answer as tokenize_prompt_answer,
    )
    from neatpack.pipes.families.smolvlm import smolvlm_estimate as smolvlm_estimate
    from neatpack.pipes.families.smolvlm import tokenize_smolvlm as tokenize_smolvlm
    from neatpack.pipes.families.step3 import step3_estimate as step3_estimate
    from neatpack.pipes.families.step3 import step3_pack_media as step3_pack_media
    from neatpack.pipes.families.step3 import step3_pp_media as step3_pp_media
    from neatpack.pipes.indexing.estimate import LengthEstimator as LengthEstimator
    from neatpack.pipes.indexing.estimate_types import SampleEstimate as SampleEstimate
    from neatpack.pipes.indexing.estimate_types import TemplateOverhead as TemplateOverhead
    from neatpack.pipes.indexing.exact_lengths import exact_samples as exact_samples
    from neatpack.pipes.indexing.exact_lengths import (
        templated_text_tokens_batch as templated_text_tokens_batch,
    )
    from neatpack.pipes.indexing.length_source import LengthSource as LengthSource
    from neatpack.pipes.indexing.lengths import LengthIndex as LengthIndex
    from neatpack.pipes.indexing.lengths import build_length_index as build_length_index
    from neatpack.pipes.indexing.media_tokens import ImageTokenConfig as ImageTokenConfig
    from neatpack.pipes.indexing.media_tokens import VideoTokenConfig as VideoTokenConfig
    from neatpack.pipes.indexing.media_tokens import smart_resize as smart_resize
    from neatpack.pipes.indexing.overlong import OverlongError as OverlongError
    from neatpack.pipes.indexing.overlong import OverlongSummary as OverlongSummary
    from neatpack.pipes.indexing.overlong import overlong_summary as overlong_summary
    from neatpack.pipes.indexing.overlong import summarize_overlong as summarize_overlong
    from neatpack.pipes.indexing.supervised import supervised_estimator as supervised_estimator
    from neatpack.pipes.indexing.supervised import supervised_tokens as supervised_tokens
    from neatpack.pipes.materializing.labels import build_labels as build_labels
    from neatpack.pipes.materializing.labels import (
        build_labels_from_template as build_labels_from_template,
    )
    from neatpack.pipes.materializing.labels import derive_role_markers as derive_role_markers
    from neatpack.pipes.materializing.materialize import MaterializeConfig as MaterializeConfig
    from neatpack.pipes.materializing.materialize import Materializer as Materializer
    from neatpack.pipes.materializing.materialize import MaterializeReport as MaterializeReport
    from neatpack.pipes.materializing.materialize import materialize_pack as materialize_pack
    from neatpack.pipes.materializing.mrope import MRopeConfig as MRopeConfig
    from neatpack.pipes.materializing.mrope import (
        compute_mrope_position_ids as compute_mrope_position_ids,
    )
    from neatpack.pipes.materializing.mrope import mrope_position_ids as mrope_position_ids
    from neatpack.pipes.materializing.pack import MEDIA_KEYS as MEDIA_KEYS
    from neatpack.pipes.materializing.pack import build_pack as build_pack
    from neatpack.pipes.materializing.pack import build_packed_sample as build_packed_sample
    from neatpack.pipes.materializing.pack import shift_sample as shift_sample
    from neatpack.pipes.materializing.tokenize import tokenize_conversation as tokenize_conversation
    from neatpack.pipes.materializing.tokenize import (
        tokenize_conversations as tokenize_conversations,
    )
    from neatpack.pipes.mixtures.mixture import Mixture as Mixture
    from neatpack.pipes.mixtures.mixture import MixtureSource as MixtureSource
    from neatpack.pipes.mixtures.mixture import epoch_counts as epoch_counts
    from neatpack.pipes.mixtures.mixture import fill_counts as fill_counts
    from neatpack.pipes.mixtures.mixture import source_targets as source_targets
    from neatpack.pipes.mixtures.mixture_plan import MixturePlan as MixturePlan
    from neatpack.pipes.mixtures.mixture_plan import plan_mixture as plan_mixture
    from neatpack.pipes.mixtures.mixture_plan import replan_from_cursor as replan_from_cursor
    from neatpack.pipes.mixtures.mixture_report import mixture_ledger as mixture_ledger
    from neatpack.pipes.mixtures.mixture_report import realized_shares as realized_shares
    from neatpack.pipes.mixtures.mixture_report import target_shares as target_shares
    from neatpack.pipes.mixtures.mixture_source import MixturePackSource as MixturePackSource
    from neatpack.pipes.mixtures.mixture_source import MixtureRecords as MixtureRecords
    from neatpack.pipes.mixtures.mixture_source import SourceTagger as SourceTagger
    from neatpack.pipes.parallel.context_parallel import (
        ContextParallelShard as ContextParallelShard,
    )
    from neatpack.pipes.parallel.context_parallel import (
        ContextParallelSplitter as ContextParallelSplitter,
    )
    from neatpack.pipes.parallel.context_parallel import (
        attention_work_per_rank as attention_work_per_rank,
    )
    from neatpack.pipes.parallel.context_parallel import (
        context_parallel_shards as context_parallel_shards,
    )
    from neatpack.pipes.parallel.context_parallel import cp_padded_lengths as cp_padded_lengths
    from neatpack.pipes.parallel.context_parallel import cp_split_indices as cp_split_indices
    from neatpack.pipes.parallel.context_parallel import (
        shard_for_context_parallel as shard_for_context_parallel,
    )
    from neatpack.pipes.parallel.pp_family_media import (
        prepare_family_media_for_pp as prepare_family_media_for_pp,
    )
    from neatpack.pipes.parallel.pp_family_media import (
        wrap_family_collate_for_pp as wrap_family_collate_for_pp,
    )
    from neatpack.pipes.parallel.pp_media import VLM_PP_MEDIA_KEY as VLM_PP_MEDIA_KEY
    from neatpack.pipes.parallel.pp_media import chunk_step3_media as chunk_step3_media
    from neatpack.pipes.parallel.pp_media import chunk_vlm_media as chunk_vlm_media
    from neatpack.pipes.parallel.pp_media import (
        prepare_vlm_media_for_pp as prepare_vlm_media_for_pp,
    )
    from neatpack.pipes.parallel.pp_media import stage_vlm_media_for_pp as stage_vlm_media_for_pp
    from neatpack.pipes.parallel.pp_media import wrap_vlm_collate_for_pp as wrap_vlm_collate_for_pp
    from neatpack.pipes.planning.binpack import best_fit_decreasing as best_fit_decreasing
    from neatpack.pipes.planning.binpack import greedy_knapsack as greedy_knapsack
    from neatpack.pipes.planning.binpack import lower_bound as lower_bound
    from neatpack.pipes.planning.binpack import overlong_ids as overlong_ids
    from neatpack.pipes.planning.cost import CostModel as CostModel
    from neatpack.pipes.planning.online import OnlinePacker as OnlinePacker
    from neatpack.pipes.planning.plan import PackPlan as PackPlan
    from neatpack.pipes.planning.plan import (
        greedy_knapsack_vt_balanced as greedy_knapsack_vt_balanced,
    )
    from neatpack.pipes.planning.plan import plan_packs as plan_packs
    from neatpack.pipes.planning.plan_file import shared_plan as shared_plan
    from neatpack.pipes.planning.sampler import LengthGroupedSampler as LengthGroupedSampler
    from neatpack.pipes.planning.source import PackSource as PackSource
    from neatpack.pipes.planning.source import StateMismatchError as StateMismatchError
    from neatpack.pipes.planning.stream_packer import StreamPacker as StreamPacker
    from neatpack.pipes.planning.stream_packer import merge_states as merge_states
    from neatpack.pipes.reading.audio import load_audio as load_audio
    from neatpack.pipes.reading.audio import split_audio_blocks as split_audio_blocks
    from neatpack.pipes.reading.formats import FORMATS as FORMATS
    from neatpack.pipes.reading.formats import normalize_format as normalize_format
    from neatpack.pipes.reading.media import load_image as load_image
    from neatpack.pipes.reading.media import to_rgb as to_rgb
    from neatpack.pipes.reading.media_policy import MediaRefusedError as MediaRefusedError
    from neatpack.pipes.reading.read import HFDatasetSource as HFDatasetSource
    from neatpack.pipes.reading.read import JsonListSource as JsonListSource
    from neatpack.pipes.reading.read import JsonlSource as JsonlSource
    from neatpack.pipes.reading.read import RecordSource as RecordSource
    from neatpack.pipes.reading.read import SequenceSource as SequenceSource
    from neatpack.pipes.reading.read import to_record as to_record
    from neatpack.pipes.reading.record_reader import RecordReader as RecordReader
    from neatpack.pipes.reading.remote import RemoteReadError as RemoteReadError
    from neatpack.pipes.reading.shards import ParquetSource as ParquetSource
    from neatpack.pipes.reading.shards import ShardIndexError as ShardIndexError
    from neatpack.pipes.reading.shards import TarShardSource as TarShardSource
    from neatpack.pipes.reading.stream_files import ShardStream as ShardStream
    from neatpack.pipes.reading.stream_generator import GeneratorStream as GeneratorStream
    from neatpack.pipes.reading.stream_generator import StreamOrderError as StreamOrderError
    from neatpack.pipes.reading.stream_hf import HFStream as HFStream
    from neatpack.pipes.reading.video import decode_video as decode_video
    from neatpack.pipes.reading.video import probe_video as probe_video
    from neatpack.pipes.steps.chain import StepChain as StepChain
    from neatpack.pipes.steps.collater import Collater as Collater
    from neatpack.pipes.steps.conversation_tokenizer import (
        ConversationTokenizer as ConversationTokenizer,
    )
    from neatpack.pipes.steps.mask_converter import MaskConverter as MaskConverter
    from neatpack.pipes.steps.materializer import PackMaterializer as PackMaterializer
    from neatpack.pipes.steps.meta import pack_meta as pack_meta
    from neatpack.pipes.steps.pack_padder import PackPadder as PackPadder
    from neatpack.pipes.steps.pad_collater import PadCollater as PadCollater
    from neatpack.pipes.steps.per_pack import PerPack as PerPack
    from neatpack.pipes.steps.pp_split import PPMediaSplitter as PPMediaSplitter
    from neatpack.pipes.steps.sample_reader import SampleReader as SampleReader
    from neatpack.pipes.steps.shifter import Shifter as Shifter
    from neatpack.pipes.testing.resume import assert_exactly_once as assert_exactly_once
    from neatpack.pipes.testing.resume import assert_resumable as assert_resumable
    from neatpack.pipes.testing.synth import write_corpus as write_corpus
    from neatpack.pipes.testing.tiny import load_tiny_processor as load_tiny_processor
    from neatpack.pipes.testing.tiny_hybrid_models import (
        TINY_HYBRID_FAMILIES as TINY_HYBRID_FAMILIES,
    )
    from neatpack.pipes.testing.tiny_hybrid_models import tiny_hybrid_model as tiny_hybrid_model
    from neatpack.pipes.testing.tiny_models import tiny_model as tiny_model

#: The core a pipeline is built from, in flow order (docs/architecture.md): read -> length
#: index -> plan -> pack source -> materialize -> collate, with the data contracts and the
#: checks for users' own nodes; and every name the README imports from here (a test keeps it
#: so). Every other name in ``_EXPORTS`` (seed names, family helpers, mask functions, ...) is
#: importable from here too; ``dir()`` lists them all.
__all__ = [
    "Batch",
    "CostModel",
    "JsonlSource",
    "LengthEstimator",
    "LengthIndex",
    "Materializer",
    "Mixture",
    "MixtureSource",
    "Pack",
    "PackMeta",
    "PackPlan",
    "PackRef",
    "PackSource",
    "PerPack",
    "Record",
    "RecordError",
    "Sample",
    "SampleError",
    "ShardStream",
    "TarShardSource",
    "assert_exactly_once",
    "assert_resumable",
    "build_length_index",
    "load_tiny_processor",
    "neat_packed_vlm_collater",
    "plan_packs",
    "shard_for_context_parallel",
    "tiny_model",
    "use_varlen_attention",
    "write_corpus",
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
