"""Hypothesis fuzzing of the stages that meet untrusted input: the JSONL reader (random bytes,
random JSON lines), record conversion and the estimator (random conversations and metadata),
the planner, pack building, the collater and the pipeline-parallel media chunker.

Each property: the invariants hold, or a clear error is raised (a ``ValueError`` subclass
such as ``RecordError`` / ``EstimateError`` / ``SampleError``, with a message); never another
exception type, never a hang (pytest-timeout), never a crash."""

# ruff: noqa: PT017  (a property checks the error it caught: raise-or-invariant, per example)

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neatpack.pipes.collating.collate import neat_packed_vlm_collater
from neatpack.pipes.indexing._media_meta import media_items
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.media_tokens import ImageTokenConfig
from neatpack.pipes.materializing.pack import build_pack
from neatpack.pipes.parallel.pp_media import chunk_vlm_media
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.reading.read import JsonlSource, RecordError, SequenceSource

pytestmark = [pytest.mark.badinput, pytest.mark.timeout(120)]

FAST = settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])

#: what each generated case of the running property came to ("accepted" / "refused")
OUTCOMES: Counter[str] = Counter()


def accepted_cases(prop: Any) -> int:
    """Run the Hypothesis property ``prop`` (it counts each case in ``OUTCOMES``) and return
    how many cases it accepted: a property whose every case is refused proves nothing about
    the accepted path, so each test below asserts some were accepted."""
    OUTCOMES.clear()
    prop()
    return OUTCOMES["accepted"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=12,
)  # fmt: skip

_block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image", "video", "audio"]) | st.none()},
    optional={
        "text": st.text(max_size=30) | json_values,
        "image": st.sampled_from(["a.jpg", "../x.png", "/etc/passwd"]) | json_values,
        "video": st.just("v.mp4") | json_values,
        "path": st.text(max_size=8),
    },
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "robot"]) | json_values},
    optional={"content": st.text(max_size=40) | st.lists(_block | st.text(max_size=10),
                                                         max_size=4) | json_values},
)  # fmt: skip
_meta = st.lists(
    st.lists(st.integers(-5, 5000) | st.floats(-1, 1e6, allow_nan=False) | st.text(max_size=3),
             max_size=5) | st.none(),
    max_size=4,
) | json_values  # fmt: skip
conversations = st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=4) | json_values},
    optional={"images_meta": _meta, "videos_meta": _meta,
              "_text_tokens": st.integers(-3, 10**6) | json_values},
) | st.fixed_dictionaries(
    {"conversations": st.lists(st.fixed_dictionaries(
        {"from": st.sampled_from(["human", "gpt", "system", "bot"]) | json_values,
         "value": st.text(alphabet="ab\n<>imgevdo", max_size=20) | json_values}), max_size=3)},
    optional={"image": st.sampled_from(["a.jpg", "b.jpg"]),
              "images": st.lists(st.just("a.jpg"), max_size=3)},
)  # fmt: skip

#: well-formed text conversations, mixed into the tokenizer's cases so some are accepted
_turn = st.text(alphabet="abcxyz.", min_size=1, max_size=20)
valid_conversations = st.lists(st.tuples(_turn, _turn), min_size=1, max_size=3).map(
    lambda turns: {
        "messages": [
            m
            for user, answer in turns
            for m in (
                {"role": "user", "content": [{"type": "text", "text": user}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            )
        ]
    }
)

ESTIMATOR = LengthEstimator(image=ImageTokenConfig(), on_missing_media="fallback")


def _write(data: bytes) -> Any:
    tmp = tempfile.TemporaryDirectory()
    path = Path(tmp.name) / "data.jsonl"
    path.write_bytes(data)
    return tmp, path


# -- readers --------------------------------------------------------------------------------
@FAST
@given(st.lists(st.binary(max_size=40), max_size=8))
def test_jsonl_reader_on_random_bytes(lines: list[bytes]) -> None:
    data = b"\n".join(lines)
    tmp, path = _write(data)
    with tmp:
        source = JsonlSource(path)
        raw = list(source.iter_raw(0, len(source)))
        assert len(raw) == len(source)
        n_lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
        assert len(source) + source.blank_lines == n_lines
        for sid in range(len(source)):
            try:
                record = source[sid]
            except RecordError as e:
                assert f"sample_id={sid}" in str(e)
                continue
            assert record["sample_id"] == sid
            assert isinstance(record["conversation"], list)


@FAST
@given(st.lists(conversations | json_values, min_size=1, max_size=6))
def _random_json_lines(values: list[Any]) -> None:
    tmp, path = _write(b"\n".join(json.dumps(v).encode() for v in values))
    with tmp:
        source = JsonlSource(path, media_root=tmp.name)
        assert len(source) == len(values)
        for sid in range(len(source)):
            try:
                record = source[sid]
            except RecordError as e:
                assert f"sample_id={sid}" in str(e), str(e)
                OUTCOMES["refused"] += 1
                continue
            for msg in record["conversation"]:  # Record contract: blocks are typed dicts
                assert msg["role"] in ("system", "user", "assistant")
                for block in msg["content"]:
                    assert block["type"] in ("text", "image", "video")
                    if block["type"] != "text" and isinstance(block[block["type"]], str):
                        assert block[block["type"]].startswith(str(Path(tmp.name).resolve()))
            OUTCOMES["accepted"] += 1


def test_jsonl_reader_on_random_json_lines() -> None:
    assert accepted_cases(_random_json_lines) > 0


# -- the estimator --------------------------------------------------------------------------
@FAST
@given(st.lists(conversations, min_size=1, max_size=6))
def _estimator_cases(raws: list[Any]) -> None:
    source = SequenceSource(raws)
    fast_total, fast_visual, fast_items, slow = ESTIMATOR.estimate_raw_batch(raws)
    for sid in range(len(raws)):
        try:
            total, visual = ESTIMATOR.estimate(source[sid])
        except RecordError as e:  # EstimateError included
            assert f"sample_id={sid}" in str(e), str(e)
            assert sid in slow, "the fast path decided a record the full path refuses"
            OUTCOMES["refused"] += 1
            continue
        assert 0 <= visual <= total + 1
        if sid not in slow:  # the fast path agrees exactly with the full path
            assert (int(fast_total[sid]), int(fast_visual[sid])) == (total, visual)
            assert int(fast_items[sid]) == media_items(source[sid])  # images + videos
        OUTCOMES["accepted"] += 1


def test_estimator_on_random_records_and_metadata() -> None:
    assert accepted_cases(_estimator_cases) > 0


# -- the planner ---------------------------------------------------------------------------
@FAST
@given(
    lengths=st.lists(st.integers(0, 3000), max_size=60),
    capacity=st.integers(1, 2048),
    ratio=st.floats(0.05, 1.0),
    world=st.integers(1, 4),
    max_packs=st.none() | st.integers(1, 6),
    overlong=st.sampled_from(["raise", "drop"]),
    seed=st.integers(0, 5),
)
def _planner_cases(
    lengths: list[int], capacity: int, ratio: float, world: int, max_packs: int | None,
    overlong: str, seed: int,
) -> None:  # fmt: skip
    kw: dict[str, Any] = {"packing_ratio": ratio, "world_size": world, "max_packs": max_packs,
                          "overlong": overlong, "seed": seed}  # fmt: skip
    try:
        plan = plan_packs(np.asarray(lengths, np.int64), capacity, **kw)
    except ValueError as e:
        assert str(e)
        too_long = [i for i, n in enumerate(lengths) if n > capacity]
        assert (overlong == "raise" and too_long) or int(capacity * ratio) < 1, str(e)
        OUTCOMES["refused"] += 1
        return
    ids = [i for p in plan.packs() for i in p]
    everything = sorted(ids + plan.dropped_ids.tolist() + plan.truncated_ids.tolist())
    assert everything == list(range(len(lengths))), "not a partition of the samples"
    assert sorted(plan.dropped_ids.tolist()) == [i for i, n in enumerate(lengths) if n > capacity]
    for p in plan.packs():
        assert p
        assert sum(lengths[i] for i in p) <= capacity
    assert sorted(plan.epoch_order(1).tolist()) == list(range(len(plan)))
    again = plan_packs(np.asarray(lengths, np.int64), capacity, **kw)
    assert again.fingerprint == plan.fingerprint
    assert again.packs() == plan.packs()
    OUTCOMES["accepted"] += 1


def test_planner_partitions_or_refuses() -> None:
    assert accepted_cases(_planner_cases) > 0


# -- pack building and collating -----------------------------------------------------------
_samples = st.lists(
    st.tuples(st.integers(0, 9), st.integers(1, 12), st.integers(0, 2**16)), min_size=1,
    max_size=4,
)  # fmt: skip


def _make(spec: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    out = []
    for sid, n, bits in spec:
        ids = torch.arange(100 + sid, 100 + sid + n)
        trained = torch.tensor([(bits >> k) & 1 for k in range(n)], dtype=torch.bool)
        out.append({"sample_id": sid, "input_ids": ids, "labels": torch.where(trained, ids, -100)})
    return out


@FAST
@given(_samples, st.none() | st.integers(1, 40), st.integers(1, 4))
def _build_pack_cases(
    spec: list[tuple[int, int, int]], pack_size: int | None, alignment: int
) -> None:
    samples = _make(spec)
    if pack_size is not None:
        pack_size = -(-pack_size // alignment) * alignment
    try:
        pack = build_pack(samples, pack_size=pack_size, alignment=alignment)
    except ValueError as e:
        need = sum(-(-(len(s["input_ids"]) - 1) // alignment) * alignment for s in samples)
        assert any(len(s["input_ids"]) < 2 for s in samples) or (
            pack_size is not None and need > pack_size
        ), str(e)
        OUTCOMES["refused"] += 1
        return
    doc = pack["attention_mask"]
    if pack_size is not None:
        assert doc.numel() == pack_size
    assert pack["sample_ids"] == [s["sample_id"] for s in samples]
    assert (pack["labels"][doc == 0] == -100).all()
    for k, s in enumerate(samples, start=1):
        where = torch.nonzero(doc == k).flatten()
        n = len(s["input_ids"]) - 1
        assert where.numel() == -(-n // alignment) * alignment
        start = int(where[0])
        assert torch.equal(pack["input_ids"][start : start + n], s["input_ids"][:-1])
        assert torch.equal(pack["labels"][start : start + n], s["labels"][1:])
        assert int(pack["text_position_ids"][start]) == 0
    OUTCOMES["accepted"] += 1


def test_build_pack_invariants_or_clear_error() -> None:
    assert accepted_cases(_build_pack_cases) > 0


@FAST
@given(
    st.lists(_samples, min_size=1, max_size=3),
    st.sampled_from(["sdpa", "eager", "flash_attention_2"]),
    st.none() | st.sampled_from([1, 8, 16]),
)
def test_collater_invariants(
    packs_spec: list[list[tuple[int, int, int]]], attn: str, multiple: int | None
) -> None:
    packs = []
    for spec in packs_spec:
        spec = [(sid, max(n, 2), bits) for sid, n, bits in spec]
        packs.append(build_pack(_make(spec)))
    batch = neat_packed_vlm_collater(packs, attn_implementation=attn, pad_to_multiple_of=multiple)
    b, s = batch["input_ids"].shape
    assert b == len(packs)
    assert s >= max(int(p["input_ids"].numel()) for p in packs)
    if multiple:
        assert s % multiple == 0
    for row, p in enumerate(packs):
        t = int(p["input_ids"].numel())
        assert torch.equal(batch["input_ids"][row, :t], p["input_ids"])
        assert (batch["labels"][row, t:] == -100).all()
    if attn == "sdpa":
        assert batch["attention_mask"].shape == (b, 1, s, s)
        assert batch["attention_mask"].dtype == torch.bool
        assert batch["attention_mask"].any(-1).all(), "a fully masked query row"


@FAST
@given(
    st.lists(st.lists(st.tuples(st.integers(1, 2), st.integers(1, 4), st.integers(1, 4)),
                      max_size=2), min_size=1, max_size=6),
    st.integers(1, 8),
)  # fmt: skip
def _pp_media_cases(per_sample: list[list[tuple[int, int, int]]], n_micro: int) -> None:
    grids = [g for sample in per_sample for g in sample]
    counts = [len(sample) for sample in per_sample]
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    rows = int(grid.prod(-1).sum()) if grids else 0
    pixels = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    try:
        pv, gr = chunk_vlm_media(pixels, grid, len(per_sample), n_micro, counts)
    except ValueError as e:
        assert n_micro > len(per_sample), str(e)
        OUTCOMES["refused"] += 1
        return
    assert len(pv) == len(gr) == n_micro
    assert torch.equal(torch.cat([p for p in pv if isinstance(p, torch.Tensor)]), pixels)
    assert torch.equal(torch.cat(gr), grid)
    for chunk, g in zip(pv, gr, strict=True):
        assert isinstance(chunk, torch.Tensor)
        assert chunk.shape[0] == int(g.prod(-1).sum())
    OUTCOMES["accepted"] += 1


def test_pp_media_chunks_reassemble_or_refuse() -> None:
    assert accepted_cases(_pp_media_cases) > 0


# -- the tokenizer (real tiny processor) --------------------------------------------------
_PROCESSOR: list[Any] = []


@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(conversations | valid_conversations)
def _tokenizer_cases(raw: Any) -> None:
    from neatpack.pipes.materializing.tokenize import tokenize_conversation
    from neatpack.pipes.reading.media import SampleError
    from neatpack.pipes.testing.tiny import load_tiny_processor

    if not _PROCESSOR:
        _PROCESSOR.append(load_tiny_processor())
    try:
        record = SequenceSource([raw], media_root="/nonexistent-root")[0]
        sample = tokenize_conversation(record, _PROCESSOR[0])
    except (RecordError, SampleError) as e:
        assert "sample_id=0" in str(e), str(e)
        OUTCOMES["refused"] += 1
        return
    n = sample["input_ids"].numel()
    assert sample["labels"].shape == sample["attention_mask"].shape == (n,)
    assert (sample["labels"] != -100).any()
    OUTCOMES["accepted"] += 1


def test_tokenizer_on_random_records() -> None:
    assert accepted_cases(_tokenizer_cases) > 0
