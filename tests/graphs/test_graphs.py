"""The prebuilt graphs beyond the VLM default: PP media, the text graph, the grouped graph."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from neatpack.graphs import (
    GroupedConfig,
    NeatLLMConfig,
    NeatVLMConfig,
    grouped_vlm_graph,
    neat_llm_graph,
    neat_vlm_graph,
)
from neatpack.pipes.parallel.pp_media import VLM_PP_MEDIA_KEY
from neatpack.pipes.testing.resume import assert_exactly_once, same_item
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("graphs")
    write_corpus(root, num_samples=20, seed=5)
    return root


@pytest.fixture(scope="module")
def processor() -> Any:
    return load_tiny_processor()


def test_pp_microbatches_split_media_with_the_rows(corpus: Path, processor: Any) -> None:
    cfg = NeatVLMConfig(pack_size=1024, batch_size=2, media_root=str(corpus / "media"))
    plain = next(iter(neat_vlm_graph(corpus / "data.jsonl", processor, config=cfg)))
    pp_cfg = NeatVLMConfig(
        pack_size=1024, batch_size=2, media_root=str(corpus / "media"), pp_microbatches=2
    )
    split = next(iter(neat_vlm_graph(corpus / "data.jsonl", processor, config=pp_cfg)))
    assert "pixel_values" not in split
    chunks = split[VLM_PP_MEDIA_KEY]
    assert len(chunks["pixel_values"]) == 2
    assert torch.equal(torch.cat(chunks["pixel_values"]), plain["pixel_values"])
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row in range(2):  # micro-batch i's pixels belong to row i's image tokens
        tokens = int((split["input_ids"][row] == image_pad).sum())
        assert chunks["pixel_values"][row].shape[0] == tokens * 4  # merge 2x2 patches per token


def test_pp_microbatches_must_fit_the_batch() -> None:
    with pytest.raises(ValueError, match="pp_microbatches"):
        NeatVLMConfig(batch_size=2, pp_microbatches=3)


def _records(n: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 40, (1,), generator=gen))
        ids = torch.randint(5, 500, (length,), generator=gen).tolist()
        out.append({"input_ids": ids, "loss_mask": [int(j >= length // 2) for j in range(length)]})
    return out


def test_llm_graph_resumes_exactly_and_is_exactly_once() -> None:
    records = _records(60)
    cfg = NeatLLMConfig(pack_size=64, batch_size=2, attn_implementation="doc_ids", tail="drop")
    reference = list(neat_llm_graph(records, config=cfg))
    first = neat_llm_graph(records, config=cfg)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    resumed = neat_llm_graph(records, config=cfg)
    resumed.load_state_dict(first.state_dict())
    assert same_item(head + list(resumed), reference)
    ledger = resumed.ledgers[0]
    consumed = [i for b in head for m in b["packs"] for i in m["sample_ids"]] + ledger.consumed
    assert_exactly_once(consumed, range(60), excused=ledger.tail_dropped)
    labels = reference[0]["labels"][0]
    assert int((labels != -100).sum()) > 0


def test_grouped_graph_batches_similar_lengths_and_resumes(corpus: Path, processor: Any) -> None:
    cfg = GroupedConfig(batch_size=4, media_root=str(corpus / "media"))
    reference = list(grouped_vlm_graph(corpus / "data.jsonl", processor, config=cfg))
    assert sorted(i for b in reference for ids in b["sample_ids"] for i in ids) == list(range(20))
    first = grouped_vlm_graph(corpus / "data.jsonl", processor, config=cfg)
    it = iter(first)
    head = [next(it) for _ in range(2)]
    resumed = grouped_vlm_graph(corpus / "data.jsonl", processor, config=cfg)
    resumed.load_state_dict(first.state_dict())
    assert same_item(
        [b["input_ids"] for b in head + list(resumed)], [b["input_ids"] for b in reference]
    )


def test_llm_graph_reads_a_pre_tokenized_line_over_the_record_limit(tmp_path: Path) -> None:
    """The record size limit (pipes/reading/read.py MAX_RECORD_BYTES) guards text that is tokenized;
    a pre-tokenized long document is only parsed, so the text graph reads it whole."""
    import json

    from neatpack.pipes.reading.read import MAX_RECORD_BYTES

    long_doc = list(range(1000, 1000 + 1_300_000))  # > 8 MiB of JSON
    data = tmp_path / "tokens.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps(
        {"input_ids": long_doc}) + "\n")  # fmt: skip
    assert data.stat().st_size > MAX_RECORD_BYTES
    cfg = NeatLLMConfig(pack_size=1_400_000, attn_implementation="doc_ids", shuffle=False)
    metas = [m for b in neat_llm_graph(data, config=cfg) for m in b["packs"]]
    assert sorted(i for m in metas for i in m["sample_ids"]) == [0, 1]
    assert sum(m["real_tokens"] for m in metas) == 2 + len(long_doc) - 1  # shifted lengths
