"""Issue 18 items 4 and 5, through the seed-named functions with the seed's arguments.

4. ``PackedDatasetWrapper.robust_collate(collate_fn)`` (from ``neat_pack_dataset_vlm``) retries
   a failing collate with replacement *packs*, seeded, with or without an inner
   ``robust_collate``; failures are recorded with ids; bounded retries, then a clear error.
5. ``build_labels_from_template(input_ids_batch, conversations, processor)`` never labels the
   padding after an answer truncated before its stop token.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import pytest
import torch

from neatpack.pipes import (
    build_labels_from_template,
    neat_pack_dataset_vlm,
    neat_packed_vlm_collater,
)
from neatpack.pipes.materializing.tokenize import tokenize_conversation
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture(scope="module")
def proc() -> Any:
    return load_tiny_processor("qwen2_vl")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> JsonlSource:
    d = tmp_path_factory.mktemp("corpus")
    return JsonlSource(write_corpus(d, num_samples=16, seed=5), media_root=d / "media")


class Tokenized:
    """The seed's inner dataset shape (PreTokenizedDatasetWrapper): one unshifted sample per id,
    and no ``robust_collate`` of its own."""

    def __init__(self, source: Any, proc: Any) -> None:
        self.source, self.proc = source, proc

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return tokenize_conversation(self.source[i], self.proc)


class TokenizedWithOwnRetry(Tokenized):
    """An inner dataset that has the seed's ``robust_collate``: its retries give UNPACKED samples
    (the seed delegated to it, bug B1); the packed wrapper must not use it."""

    def robust_collate(self, collate_fn: Any) -> Any:
        def unpacked_retry(batch: list[dict[str, Any]]) -> Any:
            try:
                return collate_fn(batch)
            except Exception:
                return collate_fn([self[0]])  # an unpacked sample: the seed's B1

        return unpacked_retry


class FailsOn:
    """The real packed collater, failing (as a transient error would) on batches that hold
    ``bad`` sample ids; counts its calls."""

    def __init__(self, bad: set[int], pad: int) -> None:
        self.bad, self.calls = bad, 0
        self.collate = partial(neat_packed_vlm_collater, padding_idx=pad)

    def __call__(self, packs: list[dict[str, Any]]) -> dict[str, Any]:
        self.calls += 1
        ids = {int(i) for p in packs for i in p["sample_ids"]}
        if ids & self.bad:
            raise RuntimeError(f"transient failure on sample ids {sorted(ids & self.bad)}")
        return self.collate(packs)


def _pad(proc: Any) -> int:
    return int(proc.tokenizer.pad_token_id)


def _dataset(source: Any, proc: Any, inner_cls: type = Tokenized) -> Any:
    return neat_pack_dataset_vlm(inner_cls(source, proc), 1024, padding_idx=_pad(proc),
                                 ds_raw=source, processor=proc)  # fmt: skip


@pytest.mark.parametrize("inner_cls", [Tokenized, TokenizedWithOwnRetry])
def test_robust_collate_retries_with_packs(source: Any, proc: Any, inner_cls: type) -> None:
    ds = _dataset(source, proc, inner_cls)
    assert len(ds) >= 4
    packs = {k: ds[k] for k in range(len(ds))}
    first = [packs[0], packs[1]]
    bad = {int(packs[0]["sample_ids"][0])}
    results = []
    for global_seed in (0, 12345):  # the global RNG must not matter, nor be touched
        random.seed(global_seed)
        state = random.getstate()
        collate = ds.robust_collate(FailsOn(bad, _pad(proc)))
        out = collate(first)
        assert random.getstate() == state
        results.append(out["sample_ids"])
        failures = collate.failures
        assert failures
        assert failures == out.collate_failures
        assert "collate_failures" not in out  # beside the batch's keys, not among them
        assert failures[0]["rows"] is None  # the caller's batch
        assert failures[0]["sample_ids"] == [packs[0]["sample_ids"], packs[1]["sample_ids"]]
        assert "transient failure" in failures[0]["error"]
        # every retry row is one of the dataset's packs, the one its index names
        rows = failures[-1]["replacement"]
        assert len(rows) == 2
        for row, k in enumerate(rows):
            pack = packs[k]
            n = pack["input_ids"].shape[0]
            assert out["sample_ids"][row] == pack["sample_ids"]
            assert torch.equal(out["input_ids"][row, :n], pack["input_ids"])
            assert torch.equal(out["labels"][row, :n], pack["labels"])
            assert int(pack["attention_mask"].max()) == len(pack["sample_ids"])  # doc ids: a pack
        assert not {int(i) for r in out["sample_ids"] for i in r} & bad
    assert results[0] == results[1]  # deterministic: same replacement on every run and rank


def test_robust_collate_passes_good_batches_untouched(source: Any, proc: Any) -> None:
    ds = _dataset(source, proc)
    collate = ds.robust_collate(FailsOn(set(), _pad(proc)))
    out = collate([ds[0], ds[1]])
    assert out["sample_ids"] == [ds[0]["sample_ids"], ds[1]["sample_ids"]]
    assert "collate_failures" not in out
    assert collate.failures == []


@pytest.mark.badinput
def test_robust_collate_bounded_then_clear_error(source: Any, proc: Any) -> None:
    ds = _dataset(source, proc)
    every = {i for b in ds.bins for i in b}
    failing = FailsOn(every, _pad(proc))
    collate = ds.robust_collate(failing)
    with pytest.raises(RuntimeError, match=r"Collate failed after 10 retries") as err:
        collate([ds[0]])
    assert failing.calls == ds.max_retries == 10
    assert len(collate.failures) == 10
    msg = str(err.value)
    assert str(ds[0]["sample_ids"]) in msg  # the first failing batch is named by its ids
    assert "max_retries" in msg


# ------------------------------------------------------------------------------------------
# 5. build_labels_from_template: labels stop at the row's real tokens
# ------------------------------------------------------------------------------------------


def _conv(user: str, answer: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": user}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]  # fmt: skip


def _truncated_batch(proc: Any, side: str) -> tuple[Any, list[Any], list[int]]:
    """Two rows tokenized with the processor's template, the first truncated (max_length) in the
    middle of its answer, then padded together by the tokenizer (``side`` padding)."""
    convs = [_conv("hi there", "a long answer that will be cut in the middle of it"),
             _conv("yo", "a long answer that is kept whole, and a little longer too")]  # fmt: skip
    rows = [
        proc.apply_chat_template([c], tokenize=True, return_dict=True,
                                 processor_kwargs={"truncation": True, "max_length": m})[
            "input_ids"][0]
        for c, m in zip(convs, (30, 500), strict=True)
    ]  # fmt: skip
    tok = proc.tokenizer
    old = tok.padding_side
    tok.padding_side = side
    try:
        batch = tok.pad({"input_ids": rows}, padding="longest", return_tensors="pt")
    finally:
        tok.padding_side = old
    return batch, convs, [len(r) for r in rows]


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncated_answer_does_not_label_padding(proc: Any, side: str) -> None:
    batch, convs, lens = _truncated_batch(proc, side)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids[0][mask[0] == 1].tolist()[-1] != im_end  # cut before its stop token ...
    assert lens[0] < ids.shape[1]  # ... then padded
    for labels in (
        build_labels_from_template(ids, convs, proc),  # the seed's call: ids only
        build_labels_from_template(ids, convs, proc, attention_mask=mask),
    ):
        assert bool((labels[mask == 0] == -100).all()), labels[0]
        # the truncated answer's real tokens are labelled up to the cut
        real = mask[0].nonzero().flatten()
        last = int(real[-1])
        assert int(labels[0, last]) == int(ids[0, last]) != -100
        # the whole row keeps its labels, ending with <|im_end|>
        full = labels[1][labels[1] != -100]
        assert int(full[-1]) == im_end


def test_robust_collate_docstring_examples() -> None:
    import doctest

    from neatpack.pipes import packed_dataset, robust_collate

    for obj in (robust_collate.RobustCollate, packed_dataset.PackedDatasetWrapper.robust_collate):
        runner = doctest.DocTestRunner()
        for test in doctest.DocTestFinder().find(obj):
            runner.run(test)
        assert runner.summarize(verbose=False).attempted > 0
        assert runner.summarize(verbose=False).failed == 0
