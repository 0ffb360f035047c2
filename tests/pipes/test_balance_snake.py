"""``balance._snake`` (all strips at once, one radix sort) against the per-strip loop it
replaced: ``np.array_split`` of the attention order and a ``lexsort`` per strip. Small integer
costs give many ties, so the tie-breaks (vision, then attention, then pack index) are pinned
too; ``radix_argsort`` against numpy's stable argsort, ``group_p95`` on columns against the
``[n, c]`` array."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from hypothesis import given
from hypothesis import strategies as st

from neatpack.pipes.planning.balance import _snake, group_p95
from neatpack.pipes.planning.binpack import radix_argsort

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def per_strip_snake(by_attention: IntArray, attention: FloatArray, vision: FloatArray,
                    k: int) -> IntArray:  # fmt: skip
    """The pre-vectorized ``_snake``: strips by attention, each sorted by (vision, attention,
    pack), every second one reversed."""
    parts = []
    for s, strip in enumerate(np.array_split(by_attention, k)):
        order = strip[np.lexsort((strip, attention[strip], vision[strip]))]
        parts.append(order[::-1] if s % 2 else order)
    return np.concatenate(parts).astype(np.int64)


@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=300),
    st.integers(1, 400),
)
def test_snake_equals_the_per_strip_loop(costs: list[tuple[int, int]], k_raw: int) -> None:
    attention = np.array([a for a, _ in costs], dtype=np.float64) ** 2
    vision = np.array([v for _, v in costs], dtype=np.float64) * 3.5
    n = attention.size
    k = 1 + (k_raw - 1) % n  # 1..n strips (balanced_order tries up to n / group_size)
    index = np.arange(n, dtype=np.int64)
    by_attention = np.lexsort((index, vision, attention)).astype(np.int64)
    by_vision = np.lexsort((index, attention, vision)).astype(np.int64)
    expected = per_strip_snake(by_attention, attention, vision, k)
    assert _snake(by_attention, by_vision, k).tolist() == expected.tolist()


@given(st.lists(st.integers(0, 2**40), max_size=500), st.integers(0, 40))
def test_radix_argsort_is_the_stable_argsort(values: list[int], shift: int) -> None:
    key = np.array(values, dtype=np.int64) >> shift  # many ties once shifted
    bits = int(key.max(initial=0)).bit_length()
    assert radix_argsort(key, bits).tolist() == np.argsort(key, kind="stable").tolist()


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=200),
       st.integers(1, 9))  # fmt: skip
def test_group_p95_columns_equal_the_array(rows: list[tuple[int, int]], group: int) -> None:
    both = np.array(rows, dtype=np.float64).reshape(-1, 2) / 7.0
    columns = (np.ascontiguousarray(both[:, 0]), np.ascontiguousarray(both[:, 1]))
    assert group_p95(columns, group) == group_p95(both, group)
