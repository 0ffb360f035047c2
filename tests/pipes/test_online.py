"""The online best-fit packer: capacity, every sample once, determinism, resume from its state."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neatpack.pipes.planning.online import OnlinePacker

lengths_st = st.lists(st.integers(min_value=0, max_value=64), max_size=200)


def _run(lengths: list[int], capacity: int, buffer_size: int) -> list[list[int]]:
    p = OnlinePacker(capacity, buffer_size)
    out = [pack for i, n in enumerate(lengths) for pack in p.add(i, n)]
    return out + p.flush()


@given(lengths_st, st.integers(64, 200), st.integers(1, 50))
def test_capacity_every_sample_once_and_deterministic(
    lengths: list[int], capacity: int, buffer_size: int
) -> None:
    packs = _run(lengths, capacity, buffer_size)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= capacity for p in packs)
    assert all(p for p in packs)
    assert packs == _run(lengths, capacity, buffer_size)


@given(lengths_st, st.integers(64, 200), st.integers(1, 50), st.data())
def test_buffer_bound_and_resume_from_state(
    lengths: list[int], capacity: int, buffer_size: int, data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(lengths)))
    p = OnlinePacker(capacity, buffer_size)
    head: list[list[int]] = []
    for i, n in enumerate(lengths[:cut]):
        head += p.add(i, n)
        assert len(p) <= buffer_size
    resumed = OnlinePacker(capacity, buffer_size, state=p.state())
    assert resumed.state() == p.state()
    tail = [pack for i, n in enumerate(lengths[cut:], cut) for pack in resumed.add(i, n)]
    assert head + tail + resumed.flush() == _run(lengths, capacity, buffer_size)


def test_a_full_pack_leaves_at_once_and_overflow_takes_the_fullest() -> None:
    p = OnlinePacker(capacity=10, buffer_size=3)
    assert p.add(0, 4) == []
    assert p.add(1, 7) == []
    assert p.add(2, 3) == [[1, 2]]  # best fit: the pack with room 3, now full
    assert p.add(3, 5) == []
    assert p.add(4, 6) == []
    assert p.add(5, 2) == [[0, 3]]  # 4 samples > 3: the fullest (room 1) leaves
    assert p.flush() == [[4, 5]]


def test_bad_lengths_are_refused_by_name() -> None:
    p = OnlinePacker(capacity=8, buffer_size=4)
    with pytest.raises(ValueError, match="sample 7 has length 9"):
        p.add(7, 9)
    with pytest.raises(ValueError, match="buffer_size=0"):
        OnlinePacker(8, 0)
    with pytest.raises(ValueError, match="does not fit its pack"):
        OnlinePacker(8, 4, state=[[[1, 5], [2, 5]]])


def test_fill_of_a_large_buffer_is_close_to_the_offline_best_fit() -> None:
    import random

    from neatpack.pipes.planning.binpack import best_fit_decreasing

    rng = random.Random(0)
    lengths = [rng.randint(20, 900) for _ in range(4000)]
    online = _run(lengths, 4096, 1000)
    offsets, _ = best_fit_decreasing(lengths, 4096)
    assert len(online) <= (len(offsets) - 1) * 1.02  # within 2 % of the offline pack count
