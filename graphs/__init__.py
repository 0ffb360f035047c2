"""neatpack.graphs: prebuilt graphs and the checkpointable loader."""

from neatpack.pipes.compat.moved import MOVED_GRAPHS, install_moved_modules

install_moved_modules(__name__, MOVED_GRAPHS)  # neatpack.graphs.loader etc. (the flat layout)

# ruff: noqa: E402

from neatpack.graphs.config import (
    AttentionOptions,
    BookkeepingOptions,
    EpochOptions,
    PackingOptions,
    RecordOptions,
    StreamOptions,
    WorkerOptions,
    checkpoint_key,
)
from neatpack.graphs.grouped import GroupedConfig, grouped_vlm_graph, grouped_vlm_parts
from neatpack.graphs.neat_llm import NeatLLMConfig, neat_llm_graph, neat_llm_parts
from neatpack.graphs.neat_stream import NeatStreamConfig, neat_stream_graph, neat_stream_parts
from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph, neat_vlm_parts
from neatpack.graphs.open_data import open_source
from neatpack.graphs.runtime.loader import (
    BookkeepingError,
    EpochLedger,
    LoaderStats,
    NeatLoader,
    StateMismatchError,
)
from neatpack.graphs.runtime.stages import GraphParts, map_stage
from neatpack.graphs.train import (
    model_inputs,
    packed_loss,
    step_normalizer,
    use_varlen_attention_for,
)

__all__ = [
    "AttentionOptions",
    "BookkeepingError",
    "BookkeepingOptions",
    "EpochLedger",
    "EpochOptions",
    "GraphParts",
    "GroupedConfig",
    "LoaderStats",
    "NeatLLMConfig",
    "NeatLoader",
    "NeatStreamConfig",
    "NeatVLMConfig",
    "PackingOptions",
    "RecordOptions",
    "StateMismatchError",
    "StreamOptions",
    "WorkerOptions",
    "checkpoint_key",
    "grouped_vlm_graph",
    "grouped_vlm_parts",
    "map_stage",
    "model_inputs",
    "neat_llm_graph",
    "neat_llm_parts",
    "neat_stream_graph",
    "neat_stream_parts",
    "neat_vlm_graph",
    "neat_vlm_parts",
    "open_source",
    "packed_loss",
    "step_normalizer",
    "use_varlen_attention_for",
]
