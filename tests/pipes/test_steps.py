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
import torch
from torchdata.nodes import Batcher, Mapper

from neatpack.graphs import (
    GroupedConfig,
    NeatLLMConfig,
    NeatVLMConfig,
    grouped_vlm_graph,
    neat_llm_parts,
    neat_vlm_graph,
    neat_vlm_parts,
    open_source,
)
from neatpack.graphs.grouped import grouped_plan
from neatpack.pipes import (
    Collater,
    ConversationTokenizer,
    LengthEstimator,
    MaskConverter,
    PackPadder,
    PackSource,
    PadCollater,
    PerPack,
    SampleReader,
    StepChain,
    build_length_index,
    load_tiny_processor,
    write_corpus,
)
from neatpack.pipes.testing.resume import assert_resumable, same_item

STEP_MODULES = (
    "chain",
    "per_pack",
    "meta",
    "materializer",
    "shifter",
    "collater",
    "mask_converter",
    "pp_split",
    "sample_reader",
    "conversation_tokenizer",
    "pad_collater",
    "pack_padder",
)
MASK_BUILT = ("sdpa", "eager", "flex_attention")
FORMATS = (*MASK_BUILT, "flash_attention_2", "position_ids", "thd", "doc_ids")  # fmt: skip


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


def _comparable(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch with a flex ``BlockMask`` as its dense mask (a BlockMask has no value equality)."""
    mask = batch.get("attention_mask")
    if type(mask).__name__ == "BlockMask":
        return {**batch, "attention_mask": mask.to_dense()}
    return batch


def _packs(corpus: Path, processor: Any, fmt: str) -> tuple[Any, Any, list[dict[str, Any]]]:
    """The VLM graph's own collate for ``fmt`` and two of its materialized (mRoPE) packs."""
    cfg = NeatVLMConfig(
        pack_size=1024,
        batch_size=2,
        media_root=str(corpus / "media"),
        attn_implementation=fmt,
        pad_to_multiple_of=64,
        boundaries=True,
    )
    parts = neat_vlm_parts(corpus / "data.jsonl", processor, config=cfg)
    parts.source.reset()
    return cfg, parts, [parts.materialize(parts.source.next()) for _ in range(2)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_prebuilt_collate_is_padder_then_mask_converter(
    corpus: Path, processor: Any, fmt: str
) -> None:
    """The VLM graph's ``Collater`` runs ``PackPadder`` (document ids in ``attention_mask``, or
    a mask-free format complete) then ``MaskConverter`` for the masks built from the ids; the
    same chain composed by hand from the exported steps gives the graph's batch, key order
    included, and the graph's first batch is that collate of its first packs."""
    cfg, parts, packs = _packs(corpus, processor, fmt)
    chain = parts.collate.steps
    assert isinstance(parts.collate, Collater)
    assert isinstance(chain, StepChain)
    want = [PackPadder, MaskConverter] if fmt in MASK_BUILT else [PackPadder]
    assert [type(step) for step in chain.steps] == want
    pad = int(processor.tokenizer.pad_token_id)
    padder = PackPadder(
        pad,
        mask_format="doc_ids" if fmt in MASK_BUILT else fmt,
        pad_to_multiple_of=64,
        boundaries=True,
    )
    by_hand = StepChain(padder, *([MaskConverter(fmt)] if fmt in MASK_BUILT else []))(
        [{k: v for k, v in p.items() if k != "meta"} for p in packs]
    )
    by_hand["packs"] = [p["meta"] for p in packs]
    direct = parts.collate(packs)
    assert list(by_hand) == list(direct)
    assert same_item(_comparable(by_hand), _comparable(direct))
    if fmt in MASK_BUILT:  # the padder's output is the doc_ids form: the ids as the mask
        padded = padder([{k: v for k, v in p.items() if k != "meta"} for p in packs])
        assert torch.equal(padded["attention_mask"], padded["doc_ids"])
        assert padded["position_ids"].shape[0] == 3  # mRoPE [3, B, S], as for doc_ids
    first = next(iter(neat_vlm_graph(corpus / "data.jsonl", processor, config=cfg)))
    assert same_item(_comparable(first), _comparable(direct))


def test_prebuilt_collate_builds_the_mask_once_and_checks_the_ids_once(
    corpus: Path, processor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PackPadder checks the document ids; the MaskConverter after it does not scan them again,
    and the 4D mask is built once (no dense mask built and dropped)."""
    import neatpack.pipes.collating.mask_format as mask_format

    calls = {"check": 0, "sdpa": 0}
    check, build = mask_format.check_doc_ids, mask_format.to_4d_bool_mask

    def counted_check(*args: Any, **kwargs: Any) -> Any:
        calls["check"] += 1
        return check(*args, **kwargs)

    def counted_build(*args: Any, **kwargs: Any) -> Any:
        calls["sdpa"] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(mask_format, "check_doc_ids", counted_check)
    monkeypatch.setattr(mask_format, "to_4d_bool_mask", counted_build)
    _, parts, packs = _packs(corpus, processor, "sdpa")
    batch = parts.collate(packs)
    assert calls == {"check": 0, "sdpa": 1}
    assert batch["attention_mask"].shape[-1] == batch["doc_ids"].shape[1]
    MaskConverter("sdpa")(dict(batch, attention_mask=batch["doc_ids"]))  # alone: it checks
    assert calls == {"check": 1, "sdpa": 2}


def test_pack_padder_refuses_a_format_whose_mask_it_does_not_build() -> None:
    with pytest.raises(ValueError, match=r"mask_format='sdpa' is not one of .*MaskConverter"):
        PackPadder(mask_format="sdpa")


def test_the_new_steps_pass_assert_resumable(corpus: Path, processor: Any) -> None:
    """The grouped graph's steps and the padder / converter chain, after a resumable source."""
    source = open_source(corpus / "data.jsonl", str(corpus / "media"))
    lengths = build_length_index(
        source, LengthEstimator.from_processor(processor), progress=False, rank=0, world_size=1
    )
    total = np.asarray(lengths.total)

    def grouped() -> Mapper[Any]:
        refs = PackSource(
            lambda g: grouped_plan(total, 4, group_size=g, seed=1, shuffle=True),
            rank=0,
            world_size=1,
        )
        chain = StepChain(
            SampleReader(source), ConversationTokenizer(processor), PadCollater(processor)
        )
        return Mapper(refs, chain)

    assert assert_resumable(grouped, epochs=1, positions=[0, 2]) == 4

    cfg = NeatLLMConfig(pack_size=48, batch_size=2, attn_implementation="doc_ids")
    records = [{"input_ids": list(range(1, 5 + (7 * i) % 23))} for i in range(24)]

    def padded() -> Mapper[Any]:
        parts = neat_llm_parts(records, config=cfg)
        chain = StepChain(PerPack(parts.materialize), PackPadder(), MaskConverter("eager"))
        return Mapper(Batcher(parts.source, 2, drop_last=False), chain)

    assert assert_resumable(padded, epochs=2) >= 3
