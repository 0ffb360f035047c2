"""neatpack.graphs: prebuilt graphs and the checkpointable loader."""

from neatpack.graphs.grouped import GroupedConfig, grouped_vlm_graph
from neatpack.graphs.loader import EpochLedger, LoaderStats, NeatLoader, StateMismatchError
from neatpack.graphs.neat_llm import NeatLLMConfig, neat_llm_graph
from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph, open_source
from neatpack.graphs.train import model_inputs, packed_loss, step_normalizer

__all__ = [
    "EpochLedger",
    "GroupedConfig",
    "LoaderStats",
    "NeatLLMConfig",
    "NeatLoader",
    "NeatVLMConfig",
    "StateMismatchError",
    "grouped_vlm_graph",
    "model_inputs",
    "neat_llm_graph",
    "neat_vlm_graph",
    "open_source",
    "packed_loss",
    "step_normalizer",
]
