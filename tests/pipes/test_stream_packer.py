"""``StreamPacker``: online packs of a stream, resumable from its state at every position."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neatpack.pipes.planning.source import StateMismatchError
from neatpack.pipes.planning.stream_packer import StreamPacker, merge_states
from neatpack.pipes.reading.stream import ListStream, address, sample_id
from neatpack.pipes.testing.resume import assert_resumable


def _stream(num_shards: int = 4, per_shard: int = 30, seed: int = 0) -> ListStream:
    rng = random.Random(seed)
    return ListStream(
        [[{"n": rng.randint(1, 40)} for _ in range(per_shard + s)] for s in range(num_shards)]
    )


def _node(stream: ListStream, rank: int = 0, world: int = 1, **kw: Any) -> StreamPacker:
    opts: dict[str, Any] = {"capacity": 64, "buffer_size": 8, "batch_size": 1, "seed": 1}
    opts.update(kw)
    return StreamPacker(
        stream, load=lambda raw, sid: dict(raw, sample_id=sid), length=lambda r: r["n"],
        rank=rank, world_size=world, **opts,
    )  # fmt: skip


def _epoch(node: StreamPacker) -> list[dict[str, Any]]:
    node.reset()
    out = []
    for ref in node:
        if ref["padded"]:
            break
        out.append(ref)
    return out


def test_every_sample_once_within_capacity_and_deterministic() -> None:
    stream = _stream()
    refs = _epoch(_node(stream))
    ids = [i for r in refs for i in r["sample_ids"]]
    assert sorted(ids) == sorted(sample_id(s, p) for s in range(4) for p in range(30 + s))
    assert all(r["estimated_tokens"] <= 64 for r in refs)
    assert all(
        rec["n"] == next(stream.open(address(i)[0], address(i)[1]))["n"]
        for r in refs
        for i, rec in zip(r["sample_ids"], r["records"], strict=True)
    )
    assert [r["sample_ids"] for r in refs] == [r["sample_ids"] for r in _epoch(_node(stream))]


def test_resumes_exactly_at_every_position() -> None:
    stream = _stream(num_shards=3, per_shard=12)
    assert assert_resumable(lambda: _node(stream, shuffle=True)) > 5


def test_overlong_samples_raise_or_are_dropped_and_listed() -> None:
    stream = ListStream([[{"n": 10}, {"n": 99}, {"n": 20}]])
    with pytest.raises(ValueError, match=r"sample 1 \(shard 0, position 1\) is 99 tokens"):
        _epoch(_node(stream))
    node = _node(stream, overlong="drop")
    refs = _epoch(node)
    assert [r["sample_ids"] for r in refs] == [[2, 0]]  # the flush packs longest first
    assert node.get_state()["stream"]["overlong"] == [1]


def test_fewer_shards_than_ranks_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="has 2 shard\\(s\\) for 3 ranks"):
        _node(_stream(num_shards=2), rank=0, world=3)


def test_ranks_pad_with_their_last_pack_when_dry() -> None:
    stream = _stream(num_shards=2, per_shard=5)
    node = _node(stream, rank=1, world=2)
    node.reset()
    refs = [next(node) for _ in range(12)]
    real = [r for r in refs if not r["padded"]]
    assert real
    assert refs[-1]["padded"]
    assert refs[-1]["sample_ids"] == real[-1]["sample_ids"]


def test_merged_states_deliver_every_sample_once() -> None:
    stream = _stream(num_shards=5, per_shard=20)
    seen: list[int] = []
    nodes = [_node(stream, rank=r, world=2) for r in range(2)]
    for n in nodes:
        n.reset()
        for _ in range(4):
            seen += next(n)["sample_ids"]
    states = [n.get_state() for n in nodes]
    with pytest.raises(StateMismatchError, match="every rank"):
        merge_states(states[:1], rank=0, world_size=3, batch_size=1)
    for r in range(3):
        node = _node(stream, rank=r, world=3)
        node.reset(merge_states(states, rank=r, world_size=3, batch_size=1))
        seen += [i for ref in _rest(node) for i in ref["sample_ids"]]
    assert sorted(seen) == sorted(sample_id(s, p) for s in range(5) for p in range(20 + s))


def _rest(node: StreamPacker) -> list[dict[str, Any]]:
    out = []
    for ref in node:
        if ref["padded"]:
            break
        out.append(ref)
    return out


@given(
    st.lists(st.integers(0, 25), min_size=3, max_size=7).filter(any),
    st.lists(st.tuples(st.integers(1, 4), st.integers(0, 8)), min_size=1, max_size=3),
    st.integers(1, 6),
)
@settings(max_examples=40, deadline=None)
def test_any_resizes_at_any_steps_deliver_every_sample_once(
    sizes: list[int], runs: list[tuple[int, int]], buffer_size: int
) -> None:
    """Runs of (world size, steps) one after another, each resumed from every rank's state
    of the one before; the last run finishes the epoch."""
    rng = random.Random(sum(sizes))
    stream = ListStream([[{"n": rng.randint(1, 40)} for _ in range(n)] for n in sizes])
    every = sorted(sample_id(s, p) for s, n in enumerate(sizes) for p in range(n))
    seen: list[int] = []
    states: list[dict[str, Any]] = []
    for i, (world, steps) in enumerate([*runs, (2, -1)]):
        world = min(world, len(sizes))  # fewer shards than ranks is refused (own test)
        nodes = [_node(stream, r, world, buffer_size=buffer_size) for r in range(world)]
        for r, node in enumerate(nodes):
            node.reset(merge_states(states, rank=r, world_size=world, batch_size=1) if i else None)
            refs = _rest(node) if steps < 0 else _take(node, steps)
            seen += [sid for ref in refs if not ref["padded"] for sid in ref["sample_ids"]]
        states = [n.get_state() for n in nodes]
    assert sorted(seen) == every


def _take(node: StreamPacker, steps: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(steps):
        try:
            out.append(next(node))
        except StopIteration:
            break
    return out


def test_doctests_pass() -> None:
    import doctest

    from neatpack.pipes.planning import online, stream_packer

    for module in (online, stream_packer):
        assert doctest.testmod(module).failed == 0
