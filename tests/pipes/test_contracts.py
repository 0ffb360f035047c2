"""docs/data_contracts.md and ``neatpack.pipes.contracts`` describe the same keys.

Each contract's section in the document holds one ``python`` block: a dict literal whose
top-level keys are the contract's keys (values are shapes, read by ``ast``, never run). Every
key the document lists must be a key of the TypedDict and every key of the TypedDict must be
listed, so neither can gain or lose a key alone. The contracts are plain dicts at runtime.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import NotRequired

import pytest
import torch

from neatpack.pipes import contracts
from neatpack.pipes.contracts import Batch, Pack, PackMeta, PackRef, Record, Sample

DOC = Path(__file__).resolve().parents[2] / "docs" / "data_contracts.md"
CONTRACTS = {
    "Record": Record,
    "Sample": Sample,
    "PackRef": PackRef,
    "Pack": Pack,
    "PackMeta": PackMeta,
    "Batch": Batch,
}


def documented_keys(text: str) -> dict[str, list[str]]:
    """Contract name -> top-level keys of the first ``python`` block under its heading (a
    heading ``## n. Name (...)`` or ``### Name (...)``), in document order."""
    out: dict[str, list[str]] = {}
    heading = re.compile(r"^#{2,3} (?:\d+\. )?(\w+) \(", re.M)
    marks = list(heading.finditer(text))
    for k, m in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(text)
        block = re.search(r"```python\n(.*?)```", text[m.end() : end], re.S)
        if m.group(1) not in CONTRACTS or block is None:
            continue
        tree = ast.parse(block.group(1), mode="eval")
        assert isinstance(tree.body, ast.Dict), f"{m.group(1)}: the block is not a dict literal"
        keys = [k.value for k in tree.body.keys if isinstance(k, ast.Constant)]
        assert len(keys) == len(tree.body.keys), f"{m.group(1)}: a key is not a string literal"
        out[m.group(1)] = keys
    return out


def test_every_contract_has_a_documented_block() -> None:
    assert sorted(documented_keys(DOC.read_text())) == sorted(CONTRACTS)


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_document_and_typeddict_list_the_same_keys(name: str) -> None:
    documented = documented_keys(DOC.read_text())[name]
    typed = list(CONTRACTS[name].__annotations__)
    assert len(documented) == len(set(documented)), f"{name}: a key is listed twice"
    missing_in_type = sorted(set(documented) - set(typed))
    missing_in_doc = sorted(set(typed) - set(documented))
    fix = "update docs/data_contracts.md and pipes/contracts.py"
    assert not missing_in_type, (
        f"{name}: documented, not in the TypedDict: {missing_in_type}: {fix}"
    )
    assert not missing_in_doc, f"{name}: in the TypedDict, not documented: {missing_in_doc}; {fix}"


def test_the_check_sees_a_drifted_key() -> None:
    """A key renamed in the document (or a missing block) is seen, so the test above can fail."""
    text = DOC.read_text().replace('"slot": 3,', '"slot_index": 3,', 1)
    assert "slot_index" in documented_keys(text)["PackRef"]
    assert "slot" not in documented_keys(text)["PackRef"]
    text = text.replace("### PackRef (", "### Pack reference (", 1)
    assert "PackRef" not in documented_keys(text)


def test_required_keys_and_plain_dicts_at_runtime() -> None:
    assert Record.__required_keys__ == {"sample_id", "conversation"}
    assert {"images_meta", "_text_tokens"} <= Record.__optional_keys__
    assert "pixel_values" in Sample.__optional_keys__
    assert "input_ids" in Sample.__required_keys__
    assert PackRef.__optional_keys__ == {"source_ids"}  # mixtures only
    ref: PackRef = {"epoch": 0, "slot": 0, "pack_index": 0, "sample_ids": [1], "padded": False}
    assert type(ref) is dict


def test_the_stages_produce_the_documented_keys() -> None:
    """A real pack and batch carry every required key of their contract (nothing else needed)."""
    from neatpack.pipes import build_pack, neat_packed_vlm_collater

    def sample(sid: int, n: int) -> dict[str, torch.Tensor | int]:
        ids = torch.arange(1, n + 1)
        return {"sample_id": sid, "input_ids": ids, "labels": ids.clone(),
                "attention_mask": torch.ones(n, dtype=torch.long),
                "mm_token_type_ids": torch.zeros(n, dtype=torch.long)}  # fmt: skip

    pack = build_pack([sample(3, 5), sample(8, 4)], mrope=False)
    assert Pack.__required_keys__ <= set(pack)
    assert set(pack) <= set(Pack.__annotations__)
    batch = neat_packed_vlm_collater([pack], mask_format="doc_ids")
    assert Batch.__required_keys__ <= set(batch)
    assert set(batch) <= set(Batch.__annotations__)
    assert contracts.__all__ == ["Batch", "Pack", "PackMeta", "PackRef", "Record", "Sample"]


def test_pack_meta_requires_what_the_loader_checks() -> None:
    """``PackMeta``'s required keys are the ones ``NeatLoader`` refuses a batch without; what
    ``pack_meta`` makes is a ``PackMeta``; ``Pack.meta`` and ``Batch.packs`` are typed by it."""
    from neatpack.graphs.runtime.loader import META_KEYS
    from neatpack.pipes import pack_meta

    assert PackMeta.__required_keys__ == set(META_KEYS)
    ref: PackRef = {"epoch": 0, "slot": 3, "pack_index": 7, "sample_ids": [4, 9], "padded": False}
    made = pack_meta(ref, real_tokens=12, seq_lens=[5, 7])
    assert PackMeta.__required_keys__ <= set(made) <= set(PackMeta.__annotations__)
    assert Pack.__annotations__["meta"] == NotRequired[PackMeta]
    assert Batch.__annotations__["packs"] == NotRequired[list[PackMeta]]


def _check(contract: type, value: dict[str, object], what: str) -> None:
    missing = sorted(contract.__required_keys__ - set(value))  # type: ignore[attr-defined]
    unknown = sorted(set(value) - set(contract.__annotations__))
    assert not missing, f"{what} lacks required keys {missing}"
    assert not unknown, f"{what} has keys {unknown} not in {contract.__name__}"


@pytest.mark.parametrize("mixture", [False, True], ids=["one_source", "mixture"])
def test_a_graph_pack_and_batch_match_their_contracts(tmp_path: Path, mixture: bool) -> None:
    """Through the prebuilt graph's own steps (``neat_vlm_parts`` with the real tiny processor,
    a recorder inserted before its collate step): each pack has every required ``Pack`` key,
    ``meta`` included, and no key outside the contract; each batch likewise for ``Batch``,
    ``packs`` included, and each of its rows for ``PackMeta``. The mixture graph adds keys of
    its own (``doc_sources``, ``source_tokens``): they are in the contracts too."""
    from neatpack.graphs import NeatVLMConfig, neat_vlm_parts
    from neatpack.pipes import Mixture, MixtureSource, load_tiny_processor, write_corpus

    if mixture:
        sources = [
            MixtureSource(name=name, data=write_corpus(tmp_path / name, num_samples=n, seed=k),
                          media_root=str(tmp_path / name / "media"), weight=w)
            for k, (name, n, w) in enumerate((("ocr", 10, 0.7), ("charts", 4, 0.3)))
        ]  # fmt: skip
        mix = Mixture(sources=sources)
        data, config = mix, NeatVLMConfig(pack_size=1024, num_workers=0)
    else:
        data = write_corpus(tmp_path, num_samples=12)
        config = NeatVLMConfig(pack_size=1024, num_workers=0, media_root=str(tmp_path / "media"))
    parts = neat_vlm_parts(data, load_tiny_processor(), config=config, rank=0, world_size=1)
    packs: list[dict[str, object]] = []

    def keep(batch_packs: list[dict[str, object]]) -> list[dict[str, object]]:
        packs.extend(dict(p) for p in batch_packs)  # what the graph's collate step receives
        return batch_packs

    at = parts.steps.index(parts.collate)
    graph = dataclasses.replace(parts, steps=(*parts.steps[:at], keep, *parts.steps[at:]))
    batches = list(graph.loader())
    assert batches
    assert len(packs) == sum(len(b["packs"]) for b in batches)
    for i, pack in enumerate(packs):
        _check(Pack, pack, f"pack {i}")
        _check(PackMeta, pack["meta"], f"pack {i}'s meta")  # type: ignore[arg-type]
    for i, batch in enumerate(batches):
        _check(Batch, batch, f"batch {i}")
        for k, meta in enumerate(batch["packs"]):
            _check(PackMeta, meta, f"batch {i} packs[{k}]")
    keys = set().union(*(set(b) for b in batches))
    metas = set().union(*(set(m) for b in batches for m in b["packs"]))
    assert ("doc_sources" in keys) == mixture
    assert ("source_tokens" in metas) == mixture
