"""PackSource: strided ranks, tail policies, exact and elastic resume (no process groups here)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from neatpack.pipes.planning.source import PackSource, StateMismatchError, epoch_slots
from neatpack.pipes.testing.resume import assert_exactly_once, assert_resumable


class ListPlan:
    """A literal plan: pack p holds sample ids [10p, 10p+1]; the epoch order rotates by epoch."""

    def __init__(self, num_packs: int, tag: str = "a") -> None:
        self.num_packs, self.fingerprint = num_packs, f"{tag}-{num_packs}"

    def __len__(self) -> int:
        return self.num_packs

    def pack(self, index: int) -> list[int]:
        return [10 * index, 10 * index + 1]

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.roll(np.arange(self.num_packs), epoch)


def _take(node: PackSource, n: int | None = None) -> list[dict]:
    out = []
    while n is None or len(out) < n:
        try:
            out.append(next(node))
        except StopIteration:
            break
    return out


def test_ranks_stride_the_epoch_and_drop_tail_is_even() -> None:
    plan = ListPlan(10)
    slots = []
    for rank in range(2):
        node = PackSource(plan, rank=rank, world_size=2, batch_size=2, tail="drop")
        node.reset()
        refs = _take(node)
        assert len(refs) == 4
        slots.append([r["slot"] for r in refs])
    assert slots == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert node.tail_dropped() == [9]


def test_pad_tail_repeats_from_the_start_and_marks_it() -> None:
    node = PackSource(ListPlan(5), rank=1, world_size=2, batch_size=2, tail="pad")
    node.reset()
    refs = _take(node)
    assert [r["slot"] for r in refs] == [1, 3, 5, 7]
    assert [r["padded"] for r in refs] == [False, False, True, True]
    assert [r["pack_index"] for r in refs] == [1, 3, 0, 2]


@pytest.mark.parametrize("tail", ["drop", "pad"])
def test_assert_resumable(tail: str) -> None:
    n = assert_resumable(lambda: PackSource(ListPlan(7), rank=1, world_size=3, tail=tail))
    assert n == (2 if tail == "drop" else 3)


def test_state_from_other_plan_or_rank_is_refused() -> None:
    node = PackSource(ListPlan(8), rank=0, world_size=2)
    node.reset()
    next(node)
    state = node.state_dict()
    with pytest.raises(StateMismatchError, match="different plan"):
        PackSource(ListPlan(8, tag="b"), rank=0, world_size=2).reset(state)
    with pytest.raises(StateMismatchError, match="rank 0 loaded into rank 1"):
        PackSource(ListPlan(8), rank=1, world_size=2).reset(state)
    with pytest.raises(StateMismatchError, match="version"):
        PackSource(ListPlan(8), rank=0, world_size=2).reset({**state, "version": 99})


def test_epoch_slots_literal() -> None:
    assert epoch_slots(10, 0, 4, "drop") == 8
    assert epoch_slots(10, 8, 4, "drop") == 0
    assert epoch_slots(10, 0, 4, "pad") == 12
    assert epoch_slots(3, 0, 4, "pad") == 4


@given(
    num_packs=st.integers(1, 60),
    world=st.integers(1, 5),
    batch=st.integers(1, 3),
    stop_step=st.integers(0, 30),
    new_world=st.integers(1, 5),
    new_batch=st.integers(1, 3),
)
def test_elastic_resume_is_exactly_once(
    num_packs: int, world: int, batch: int, stop_step: int, new_world: int, new_batch: int
) -> None:
    """Run ``stop_step`` lockstep steps on ``world`` ranks, resume on ``new_world``: every slot
    of the epoch is consumed exactly once, except the counted dropped tail."""
    plan = ListPlan(num_packs)
    nodes = [
        PackSource(plan, rank=r, world_size=world, batch_size=batch, tail="drop")
        for r in range(world)
    ]
    for n in nodes:
        n.reset()
    per_rank = nodes[0]._limit
    steps = min(stop_step, per_rank // batch)
    consumed = [r["slot"] for n in nodes for r in _take(n, steps * batch)]
    states = [n.state_dict() for n in nodes]
    assert len({s["cursor"] for s in states}) == 1
    resumed = [
        PackSource(plan, rank=r, world_size=new_world, batch_size=new_batch, tail="drop")
        for r in range(new_world)
    ]
    for r, n in enumerate(resumed):
        n.reset(states[r % world])
    rest = [_take(n) for n in resumed]
    assert len({len(x) for x in rest}) == 1, "ranks must yield the same number of packs"
    consumed += [r["slot"] for x in rest for r in x]
    dropped = list(range(states[0]["cursor"] + sum(len(x) for x in rest), num_packs))
    assert_exactly_once(consumed, range(num_packs), excused=dropped)
    assert len(dropped) < new_world * new_batch
