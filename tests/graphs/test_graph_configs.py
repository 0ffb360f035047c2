"""Each graph config refuses an unknown policy or mask format when it is built, not later.

Before, ``NeatVLMConfig(attn_implementation="nonsense")`` built a loader and the first collate,
in a worker, refused it; ``overlong`` / ``overflow`` / ``on_bad_sample`` waited for the graph,
an unknown ``multiprocessing_context`` for the first iteration with workers.
The valid values come from the tuples the checks downstream use (no second list here).
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

from neatpack.graphs import GroupedConfig, NeatLLMConfig, NeatVLMConfig, neat_llm_graph
from neatpack.graphs.neat_vlm import ESTIMATE_MODES
from neatpack.pipes.collating.mask_format import MASK_FORMATS
from neatpack.pipes.materializing.materialize import FAILURE_POLICIES, OVERFLOW_POLICIES
from neatpack.pipes.planning.binpack import OVERLONG_POLICIES
from neatpack.pipes.planning.source import TAIL_POLICIES

START_METHODS = tuple(multiprocessing.get_all_start_methods())
CASES = [
    (NeatVLMConfig, "attn_implementation", MASK_FORMATS),
    (NeatVLMConfig, "overlong", OVERLONG_POLICIES),
    (NeatVLMConfig, "overflow", OVERFLOW_POLICIES),
    (NeatVLMConfig, "on_bad_sample", FAILURE_POLICIES),
    (NeatVLMConfig, "estimate_mode", ESTIMATE_MODES),
    (NeatVLMConfig, "tail", TAIL_POLICIES),
    (NeatLLMConfig, "attn_implementation", MASK_FORMATS),
    (NeatLLMConfig, "overlong", OVERLONG_POLICIES),
    (NeatLLMConfig, "tail", TAIL_POLICIES),
    (GroupedConfig, "tail", TAIL_POLICIES),
    *[
        (c, "multiprocessing_context", START_METHODS)
        for c in (NeatVLMConfig, NeatLLMConfig, GroupedConfig)
    ],
]


@pytest.mark.badinput
@pytest.mark.parametrize(("config", "field", "valid"), CASES)
def test_unknown_value_is_refused_at_construction_listing_the_valid_ones(
    config: Any, field: str, valid: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError, match=f"{field}='nonsense'") as info:
        config(**{field: "nonsense"})
    for name in valid:
        assert repr(name) in str(info.value) or f" {name}" in str(info.value)


@pytest.mark.parametrize(("config", "field", "valid"), CASES)
def test_every_valid_value_is_accepted(config: Any, field: str, valid: tuple[str, ...]) -> None:
    for name in valid:
        assert getattr(config(**{field: name}), field) == name


@pytest.mark.badinput
def test_bad_attn_implementation_says_how_to_fix() -> None:
    with pytest.raises(ValueError, match="Fix: pass one of them") as info:
        NeatVLMConfig(attn_implementation="flash_attention")  # a near miss of a real name
    assert "unknown mask format 'flash_attention'" in str(info.value)


def test_a_transformers_attention_name_still_collates_through_the_graph() -> None:
    records = [{"input_ids": list(range(1, n + 1))} for n in (5, 9, 3)]
    cfg = NeatLLMConfig(pack_size=16, attn_implementation="flash_attention_2", shuffle=False)
    batch = next(iter(neat_llm_graph(records, config=cfg)))
    assert batch["attention_mask"] is None
    assert "cu_seq_lens_q" in batch
