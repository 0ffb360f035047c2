"""The steps of ``neatpack.pipes.steps``, one module each: the grouped graph's chain composed by
hand from the exported steps equals ``grouped_vlm_graph``; the prebuilt collate is a chain of
public steps (``PackPadder``, then ``MaskConverter``) equal to ``Collater``."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neatpack.graphs import GroupedConfig, grouped_vlm_graph, open_source
from neatpack.graphs.grouped import grouped_plan
from neatpack.pipes import (
    ConversationTokenizer,
    LengthEstimator,
    PackSource,
    PadCollater,
    SampleReader,
    StepChain,
    build_length_index,
    load_tiny_processor,
    write_corpus,
)
from neatpack.pipes.testing.resume import same_item

STEP_MODULES = (
    "chain", "per_pack", "meta", "materializer", "shifter", "collater", "mask_converter",
    "pp_split", "sample_reader", "conversation_tokenizer", "pad_collater",
)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("steps")
    write_corpus(root, num_samples=14, seed=3)
    return root


@pytest.fixture(scope="module")
def processor() -> Any:
    return load_tiny_processor()


def test_each_step_is_its_own_module_reexported() -> None:
    import neatpack.pipes
    import neatpack.pipes.steps as steps

    for name in steps.__all__:
        obj = getattr(steps, name)
        assert obj.__module__.startswith("neatpack.pipes.steps."), name
        assert getattr(neatpack.pipes, name) is obj, name
    results = {
        m: doctest.testmod(importlib.import_module(f"neatpack.pipes.steps.{m}"))
        for m in STEP_MODULES
    }
    assert all(r.failed == 0 for r in results.values()), results
    assert sum(r.attempted for r in results.values()) >= 10


@pytest.mark.parametrize(("max_length", "truncate"), [(None, False), (1024, False)])
def test_grouped_chain_by_hand_equals_grouped_vlm_graph(
    corpus: Path, processor: Any, max_length: int | None, truncate: bool
) -> None:
    """The grouped graph is PackSource -> StepChain(SampleReader, ConversationTokenizer,
    PadCollater): the same chain built here from the exported steps gives the same batches,
    bookkeeping included."""
    data, media = corpus / "data.jsonl", str(corpus / "media")
    cfg = GroupedConfig(
        batch_size=3, media_root=media, seed=7, max_length=max_length, truncate=truncate
    )
    graph = list(grouped_vlm_graph(data, processor, config=cfg))

    source = open_source(data, media)
    lengths = build_length_index(
        source, LengthEstimator.from_processor(processor), progress=False, rank=0, world_size=1
    )
    total = np.asarray(lengths.total)
    refs = PackSource(
        lambda group_size: grouped_plan(total, 3, group_size=group_size, seed=7, shuffle=True),
        rank=0,
        world_size=1,
        batch_size=1,
    )
    chain = StepChain(
        SampleReader(source),
        ConversationTokenizer(processor),
        PadCollater(processor, max_length, truncate=truncate),
    )
    by_hand = [chain(ref) for ref in refs]
    assert len(by_hand) == len(graph) == 5  # 14 samples in batches of 3
    assert same_item(by_hand, graph)
    metas = [m for b in by_hand for m in b["packs"]]
    assert sorted(i for m in metas for i in m["sample_ids"]) == list(range(14))
    assert all(len(b["packs"]) == 1 for b in by_hand)  # a group is one ledger entry
