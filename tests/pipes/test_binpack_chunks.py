"""The chunked slot ranking of ``bfd_bin_ids`` / ``best_fit_decreasing`` against the plain
implementation it replaced: a full stable argsort of ``-length`` and a scatter through it.

``_CHUNK_BITS`` is shrunk so that small inputs cross many chunk borders (a length's samples
spread over several chunks, chunks without some lengths, a short last chunk)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from neatpack.pipes import binpack
from neatpack.pipes.planning.binpack import best_fit_decreasing, bfd_bin_ids


def argsort_bin_ids(lengths: npt.ArrayLike, cap: int) -> npt.NDArray[np.int64]:
    """The pre-chunk ``bfd_bin_ids``: ids longest first by a stable argsort, then a scatter."""
    arr = np.asarray(lengths, dtype=np.int64)
    keep = arr <= cap
    order = np.argsort(cap - np.where(keep, arr, 0), kind="stable")
    order = order[keep[order]]
    out = np.full(arr.size, -1, dtype=np.int64)
    if order.size:
        pair_bin, pair_k, _, _, _ = binpack._layout(binpack._counts(arr, cap), cap)
        out[order] = np.repeat(pair_bin, pair_k)
    return out


def argsort_csr(
    lengths: npt.ArrayLike, cap: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The pre-chunk ``best_fit_decreasing``."""
    arr = np.asarray(lengths, dtype=np.int64)
    keep = arr <= cap
    order = np.argsort(cap - np.where(keep, arr, 0), kind="stable")
    order = order[keep[order]]
    if order.size == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    pair_bin, pair_k, pair_prior, bin_size, _ = binpack._layout(binpack._counts(arr, cap), cap)
    offsets = np.zeros(bin_size.size + 1, dtype=np.int64)
    np.cumsum(bin_size, out=offsets[1:])
    run_start = np.cumsum(pair_k) - pair_k
    pos = np.repeat(offsets[pair_bin] + pair_prior - run_start, pair_k)
    pos += np.arange(pos.size, dtype=np.int64)
    ids = np.empty(order.size, dtype=np.int64)
    ids[pos] = order
    return offsets, ids


@contextmanager
def chunk_bits(bits: int) -> Iterator[None]:
    saved = binpack._CHUNK_BITS
    binpack._CHUNK_BITS = bits
    try:
        yield
    finally:
        binpack._CHUNK_BITS = saved


@pytest.fixture
def tiny_chunks() -> Iterator[None]:
    with chunk_bits(3):  # 8 ids per chunk
        yield


def assert_same(lengths: npt.ArrayLike, cap: int) -> None:
    got = bfd_bin_ids(lengths, cap, overlong="drop")
    assert got.dtype == np.int64
    assert np.array_equal(got, argsort_bin_ids(lengths, cap))
    offsets, ids = best_fit_decreasing(lengths, cap, overlong="drop")
    ref_offsets, ref_ids = argsort_csr(lengths, cap)
    assert ids.dtype == np.int32  # ids below 2**31 samples: 4 bytes each (docs/scale.md)
    assert np.array_equal(offsets, ref_offsets)
    assert np.array_equal(ids, ref_ids)
    # what the planner takes with the packing: a value per sample in CSR order (scattered
    # with the ids, not gathered by them) and each pack's tokens (from the layout)
    arr = np.asarray(lengths, dtype=np.int64)
    load = (arr * 7 + 3) % (np.maximum(arr, 1) + 1)  # any values <= the lengths
    got_offsets, got_ids, carried, tokens = binpack.packed_csr(arr, cap, carry=[load, arr])
    assert np.array_equal(got_offsets, ref_offsets)
    assert np.array_equal(got_ids, ref_ids)
    assert np.array_equal(carried[0], load[ref_ids])
    assert np.array_equal(carried[1], arr[ref_ids])
    sums = np.add.reduceat(arr[ref_ids], ref_offsets[:-1]) if ref_ids.size else ref_ids
    assert tokens.dtype == np.int64
    assert np.array_equal(tokens, sums)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[int], int]:
    cap = draw(st.integers(1, 40))
    lengths = draw(st.lists(st.integers(0, cap + 3), max_size=90))  # overlong and zeros too
    return lengths, cap


@given(cases())
def test_equals_argsort_many_chunks(case: tuple[list[int], int]) -> None:
    with chunk_bits(3):
        assert_same(*case)


@given(cases())
def test_equals_argsort_one_chunk(case: tuple[list[int], int]) -> None:
    assert_same(*case)


@pytest.mark.parametrize(
    ("lengths", "cap"),
    [
        ([], 8),
        ([9, 9, 9], 8),  # all overlong: every id -1, no packs
        ([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 8),  # zeros only, across chunks
        ([8] * 17, 8),  # one length over three chunks
        ([3, 9, 3, 9, 3, 9, 3, 9, 3, 9, 3, 9, 3, 9, 3, 9, 3], 8),  # overlong inside chunks
    ],
)
def test_equals_argsort_edges(tiny_chunks: None, lengths: list[int], cap: int) -> None:
    assert_same(lengths, cap)


def test_wide_capacity_uses_uint64_keys(tiny_chunks: None) -> None:
    """Below 65,535 tokens the chunks are put in order by a radix argsort of uint16 lengths
    (the overlong class included); from there on a packed uint64 key, as before."""
    rng = np.random.default_rng(1)
    for cap in (16_382, 16_383, 65_534, 65_535, 70_000):
        assert_same(rng.integers(0, cap + 500, size=300), cap)


def test_bigger_random_default_chunks() -> None:
    """Several real chunks: 600k lengths in 18-bit chunks, lognormal-like and uniform."""
    rng = np.random.default_rng(2)
    cap = 8192
    logn = np.clip(np.rint(rng.lognormal(np.log(700.0), 1.0, 600_000)), 0, cap + 10)
    assert_same(logn.astype(np.int64), cap)
    assert_same(rng.integers(50, 4097, size=600_000), cap)


def test_deterministic_across_calls() -> None:
    lengths = np.random.default_rng(3).integers(0, 100, size=5_000)
    a = bfd_bin_ids(lengths, 100)
    b = bfd_bin_ids(lengths.astype(np.int32), 100)
    assert np.array_equal(a, b)
