"""neat_pack_dataset: the text-only path to a datasets.Dataset of packs, checked for real."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from neatpack.pipes.collating.mask import to_4d_additive_mask
from neatpack.pipes.compat.text_pack import neat_pack_dataset
from neatpack.pipes.planning.binpack import greedy_knapsack

datasets = pytest.importorskip("datasets")


def _rows(n: int = 30, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(2, 40)
        ids = [rng.randint(1, 500) for _ in range(length)]
        mask = [int(rng.random() < 0.6) for _ in range(length)]
        rows.append({"input_ids": ids, "labels": list(ids), "loss_mask": mask})
    return rows


def test_packs_hold_every_sample_exactly_once_in_knapsack_order() -> None:
    rows = _rows()
    ds = neat_pack_dataset(datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}),
                           "train", 64)  # fmt: skip
    bins = greedy_knapsack([len(r["input_ids"]) for r in rows], 64)
    assert len(ds) == len(bins)
    for pack, b in zip(ds, bins, strict=True):
        assert len(pack["input_ids"]) == 64
        assert pack["seq_lens"] == [len(rows[i]["input_ids"]) for i in b]
        am = pack["attention_mask"]
        start = 0
        for doc, i in enumerate(b, start=1):
            n = len(rows[i]["input_ids"])
            assert pack["input_ids"][start : start + n] == rows[i]["input_ids"]
            want = [
                t if m else -100
                for t, m in zip(rows[i]["labels"], rows[i]["loss_mask"], strict=True)
            ]
            assert pack["labels"][start : start + n] == want
            assert am[start : start + n] == [doc] * n
            assert pack["position_ids"][start : start + n] == list(range(n))
            start += n
        assert am[start:] == [0] * (64 - start)
        assert pack["labels"][start:] == [-100] * (64 - start)


def test_plain_dataset_list_and_padding_idx() -> None:
    ds = neat_pack_dataset([{"input_ids": [5, 6, 7]}], "ignored", 5, padding_idx=9)
    assert ds[0]["input_ids"] == [5, 6, 7, 9, 9]
    assert ds[0]["labels"] == [5, 6, 7, -100, -100]


@pytest.mark.badinput
def test_overlong_raises_names_row_or_is_dropped() -> None:
    rows = [{"input_ids": [1] * 3}, {"input_ids": [1] * 9}]
    with pytest.raises(ValueError, match=r"row 1: sample is too long \(9 > pack_size=8\)"):
        neat_pack_dataset(rows, "train", 8)
    ds = neat_pack_dataset(rows, "train", 8, drop_long_samples=True)
    assert [p["seq_lens"] for p in ds] == [[3]]
    with pytest.raises(ValueError, match="no samples remaining"):
        neat_pack_dataset(rows[1:], "train", 8, drop_long_samples=True)


@pytest.mark.badinput
@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"input_ids": []}, "row 0: input_ids must be a non-empty"),
        ({"input_ids": [1, 2], "labels": [1]}, r"row 0: labels \(1,\) != input_ids \(2,\)"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, r"row 0: loss_mask"),
        ({"text": "x"}, "row 0: a sample needs 'input_ids'"),
    ],
)
def test_bad_rows(row: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        neat_pack_dataset([row], "train", 8)


@pytest.mark.badinput
def test_bad_arguments_and_missing_split() -> None:
    with pytest.raises(ValueError, match="pack_size=0"):
        neat_pack_dataset([{"input_ids": [1]}], "train", 0)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"input_ids": [1]}])})
    with pytest.raises(KeyError, match="split='test' is not in the dataset; splits: \\['train'\\]"):
        neat_pack_dataset(dd, "test", 8)


def test_max_packs_keeps_the_first_packs() -> None:
    rows = _rows(20, seed=1)
    full = neat_pack_dataset(rows, "train", 48)
    cut = neat_pack_dataset(rows, "train", 48, max_packs=2)
    assert len(cut) == 2
    assert cut[:] == full[:2]


@pytest.mark.parity
def test_packed_row_equals_separate_runs_on_a_tiny_qwen2() -> None:
    """A pack through a real tiny Qwen2 with a 4D additive block-causal mask and reset positions
    gives the same logits as each document alone (fp32, max abs diff <= 1e-5)."""
    from neatpack.pipes.testing.tiny_models import tiny_model

    model = tiny_model("qwen2", attn_implementation="eager")
    rows = [{"input_ids": r["input_ids"]} for r in _rows(6, seed=3)]
    ds = neat_pack_dataset(rows, "train", 128)
    worst = 0.0
    for pack in ds:
        ids = torch.tensor([pack["input_ids"]])
        doc = torch.tensor([pack["attention_mask"]])
        with torch.no_grad():
            packed = model(
                input_ids=ids,
                attention_mask=to_4d_additive_mask(doc),
                position_ids=torch.tensor([pack["position_ids"]]),
            ).logits[0]
        start = 0
        for n in pack["seq_lens"]:
            with torch.no_grad():
                alone = model(input_ids=ids[:, start : start + n]).logits[0]
            worst = max(worst, float((packed[start : start + n] - alone).abs().max()))
            start += n
    assert worst <= 1e-5, worst
