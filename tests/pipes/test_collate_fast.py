"""The collater's fast path equals its general path, output for output and error for error.

``neat_packed_vlm_collater`` pads packs in the data contract's form with one ``torch.cat`` and
builds cu_seqlens / THD params from the packs' lengths (``pad_packs_fast``); anything else goes
through ``pad_packs``, the original key-by-key code that validates with ``check_doc_ids``. The
general path is the reference here: every test runs the collater twice, once as shipped and
once with the fast path switched off, and requires identical results (values, dtypes, shapes,
dict key order, the same exception and message), and checks that the fast path really ran
when it should.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from neatpack import pipes as M
from neatpack.pipes import collate as C
from neatpack.pipes import mask_format as MF
from neatpack.pipes.materializing.pack import build_pack

IMG, VID = 1, 2


def make_pack(
    lens: list[int],
    *,
    tail: int = 0,
    mrope: bool = False,
    image_tokens: int = 0,
    seed: int = 0,
    first_id: int = 0,
) -> dict[str, Any]:
    """A pack by the data contract: documents of ``lens`` tokens, then ``tail`` padding."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    t = n + tail
    ids = torch.randint(10, 500, (t,), generator=gen)
    labels = ids.clone()
    labels[n:] = -100
    doc = torch.zeros(t, dtype=torch.long)
    text_pos = torch.zeros(t, dtype=torch.long)
    a = 0
    for k, m in enumerate(lens, start=1):
        doc[a : a + m] = k
        text_pos[a : a + m] = torch.arange(m)
        a += m
    mm = torch.zeros(t, dtype=torch.long)
    mm[:image_tokens] = IMG
    pos = torch.stack([text_pos, text_pos + 1, text_pos + 2]) if mrope else text_pos.clone()
    return {
        "sample_ids": list(range(first_id, first_id + len(lens))),
        "input_ids": ids,
        "labels": labels,
        "attention_mask": doc,
        "position_ids": pos,
        "text_position_ids": text_pos,
        "mm_token_type_ids": mm,
        "seq_lens": list(lens),
        "seq_lens_padded": list(lens),
        "n_images": 0,
        "n_videos": 0,
    }


@contextmanager
def general_path_only() -> Iterator[None]:
    """Switch the fast path off: every batch goes through ``pad_packs`` (the reference)."""
    fast = C.pad_packs_fast
    C.pad_packs_fast = lambda *args, **kwargs: None
    try:
        yield
    finally:
        C.pad_packs_fast = fast


@contextmanager
def count_fast_hits() -> Iterator[list[bool]]:
    """Record, per collate call, whether the fast path produced the padded batch."""
    fast = C.pad_packs_fast
    hits: list[bool] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = fast(*args, **kwargs)
        hits.append(out is not None)
        return out

    C.pad_packs_fast = spy
    try:
        yield hits
    finally:
        C.pad_packs_fast = fast


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as err:  # the comparison below needs the exact type and message
        return "error", (type(err), str(err))


def assert_same(a: Any, b: Any, where: str = "batch") -> None:
    """Exact equality of two collate outputs: tensors by value, dtype, shape and layout."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        assert a.is_contiguous() == b.is_contiguous(), where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert list(a) == list(b), where  # same keys in the same order
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif type(a).__name__ == "BlockMask":
        assert type(b).__name__ == "BlockMask", where
        assert a.BLOCK_SIZE == b.BLOCK_SIZE, where
        assert a.seq_lengths == b.seq_lengths, where
        assert_same(a.to_dense(), b.to_dense(), f"{where}.to_dense()")
        assert_same(a.as_tuple()[2:-1], b.as_tuple()[2:-1], f"{where}.as_tuple()")
    else:
        assert type(a) is type(b), (where, a, b)
        assert a == b, (where, a, b)


def collate_both(packs: list[dict[str, Any]], **kwargs: Any) -> tuple[bool, tuple[str, Any]]:
    """Collate with and without the fast path; assert the same result; (fast ran?, outcome)."""
    with count_fast_hits() as hits:
        got = outcome(lambda: C.neat_packed_vlm_collater(packs, **kwargs))
    with general_path_only():
        ref = outcome(lambda: C.neat_packed_vlm_collater(packs, **kwargs))
    assert got[0] == ref[0], (got, ref)
    if got[0] == "ok":
        assert_same(got[1], ref[1])
    else:
        assert got[1] == ref[1]
    return bool(hits and hits[0]), got


# -- the contract's packs take the fast path and give the reference output ------------------


@pytest.mark.parametrize("fmt", MF.MASK_FORMATS)
@pytest.mark.parametrize("mrope", [False, True])
def test_every_format_equals_reference(fmt: str, mrope: bool) -> None:
    packs = [
        make_pack([4, 3], mrope=mrope, seed=1),
        make_pack([5], tail=2, mrope=mrope, seed=2, first_id=5),
        make_pack([1, 1, 1], mrope=mrope, seed=3, first_id=9),
    ]
    fast, (status, out) = collate_both(packs, mask_format=fmt)
    assert fast
    assert status == "ok"
    s = 7
    assert out["doc_ids"].tolist() == [
        [1, 1, 1, 1, 2, 2, 2],
        [1] * 5 + [0] * 2,
        [1, 2, 3, 0, 0, 0, 0],
    ]
    assert out["input_ids"].is_contiguous()
    assert out["position_ids"].is_contiguous()
    if fmt in MF.FLASH_FORMATS:
        assert out["cu_seq_lens_q"].tolist() == [0, 4, 7, 12, 14, 15, 16, 17, 21]
    if mrope and fmt in MF.MASK_FREE_FORMATS:
        assert out["position_ids"].shape == (4, 3, s)


@pytest.mark.parametrize("fmt", ["doc_ids", "flash_attention_2", "thd", "sdpa"])
def test_real_build_pack_with_alignment_and_pack_size(fmt: str) -> None:
    """build_pack's packs (alignment pad inside a document, tail padding) take the fast path."""
    gen = torch.Generator().manual_seed(0)
    packs = []
    for row, lens in enumerate([[5, 9, 3], [12], [2, 2, 2, 2]]):
        samples = []
        for i, n in enumerate(lens):
            ids = torch.randint(2, 300, (n,), generator=gen)
            samples.append({"sample_id": row * 10 + i, "input_ids": ids, "labels": ids.clone()})
        packs.append(build_pack(samples, alignment=4, pack_size=24, padding_idx=1))
    assert packs[0]["seq_lens"] != packs[0]["seq_lens_padded"]  # alignment pads inside docs
    fast, (status, out) = collate_both(packs, mask_format=fmt, padding_idx=1)
    assert fast
    assert status == "ok"
    if fmt == "thd":
        p = out["packed_seq_params"]
        assert p["cu_seqlens_q"].tolist() == [0, 4, 12, 14, 25, 26, 27, 28, 29]
        assert p["cu_seqlens_q_padded"].tolist() == [0, 4, 12, 24, 48, 52, 56, 60, 72]


def test_full_rows_single_documents() -> None:
    """Rows with no padding whose last id equals the next row's first (no step at the seam)."""
    packs = [make_pack([6], seed=1), make_pack([6], seed=2), make_pack([2, 4], seed=3)]
    for fmt in ("flash_attention_2", "thd", "doc_ids"):
        fast, (status, _) = collate_both(packs, mask_format=fmt)
        assert fast
        assert status == "ok"


def test_media_checks_on_the_fast_path() -> None:
    good = make_pack([6, 2], image_tokens=4, seed=1)
    good["pixel_values"] = torch.ones(16, 8)
    good["image_grid_thw"] = torch.tensor([[1, 4, 4]])
    good["n_images"] = 1
    video = make_pack([5], seed=2)
    video["mm_token_type_ids"][:2] = VID
    video["pixel_values_videos"] = torch.ones(8, 8)
    video["video_grid_thw"] = torch.tensor([[2, 2, 2]])
    video["n_videos"] = 1
    text = make_pack([3], seed=3)
    fast, (status, out) = collate_both([good, video, text])
    assert fast
    assert status == "ok"
    assert out["n_images_per_sample"].tolist() == [1, 0, 0]
    assert out["n_videos_per_sample"].tolist() == [0, 1, 0]
    stray = make_pack([4], image_tokens=1, seed=4)  # an image token but no image
    fast, (status, err) = collate_both([text, stray])
    assert fast
    assert status == "error"
    assert "pack 1" in err[1]
    assert "1 image placeholder tokens" in err[1]


def test_missing_mm_token_type_ids_is_zeros() -> None:
    packs = [make_pack([3, 2], seed=1), make_pack([4], seed=2)]
    del packs[1]["mm_token_type_ids"]
    packs[0]["mm_token_type_ids"] = None
    fast, (status, out) = collate_both(packs, mask_format="thd", max_length=8)
    assert fast
    assert status == "ok"
    assert not out["mm_token_type_ids"].any()


# -- anything else goes to the general path, with its outputs and errors ----------------------


def _variants() -> Iterator[tuple[str, list[dict[str, Any]], dict[str, Any]]]:
    def base() -> list[dict[str, Any]]:
        return [make_pack([3, 2], seed=1), make_pack([4], tail=1, seed=2, first_id=7)]

    packs = base()
    packs[1]["attention_mask"] = torch.tensor([1, 2, 1, 1, 0])  # not non-decreasing
    yield "bad ids", packs, {}
    packs = base()
    packs[0]["attention_mask"] = torch.tensor([1, 1, 1, 1, 2])  # valid ids, other lengths
    yield "ids disagree with seq_lens", packs, {"mask_format": "flash_attention_2"}
    packs = base()
    packs[0]["attention_mask"] = torch.tensor([2, 2, 2, 5, 5])  # accepted by check_doc_ids
    packs[0]["seq_lens_padded"] = [3, 2]
    yield "gapped ids", packs, {"mask_format": "thd"}
    packs = base()
    packs[1]["attention_mask"] = torch.zeros(5, dtype=torch.long)
    yield "all padding", packs, {"max_length": 4}
    packs = base()
    packs[0]["seq_lens_padded"] = [3, 3]
    yield "lengths past the pack", packs, {}
    packs = base()
    for key in ("input_ids", "labels", "attention_mask", "position_ids", "mm_token_type_ids"):
        packs[0][key] = packs[0][key].int()
    yield "int32 tensors", packs, {"mask_format": "position_ids"}
    packs = base()
    packs[1]["labels"] = packs[1]["labels"].tolist()
    yield "list labels", packs, {}
    packs = base()
    del packs[0]["seq_lens"], packs[0]["seq_lens_padded"]
    yield "no seq_lens", packs, {"mask_format": "thd"}
    packs = base()
    packs[0]["position_ids"] = torch.stack([packs[0]["position_ids"]] * 3)
    yield "mixed position layouts", packs, {}
    packs = [make_pack([3, 2], mrope=True, seed=1), make_pack([4], mrope=True, seed=2)]
    del packs[0]["text_position_ids"]
    yield "mRoPE without text positions", packs, {"mask_format": "position_ids"}
    packs = base()
    del packs[0]["text_position_ids"], packs[0]["position_ids"]
    del packs[1]["text_position_ids"], packs[1]["position_ids"]
    yield "no positions at all", packs, {"mask_format": "position_ids"}
    packs = base()
    del packs[1]["labels"]
    yield "missing labels", packs, {}
    yield "too long for max_length", base(), {"max_length": 4}
    yield "bad multiple", base(), {"max_length": 6, "pad_to_multiple_of": 4}


@pytest.mark.badinput
@pytest.mark.parametrize(("name", "packs", "kwargs"), list(_variants()), ids=lambda v: v)
def test_off_contract_input_equals_reference(
    name: str, packs: list[dict[str, Any]], kwargs: dict[str, Any]
) -> None:
    fast, _ = collate_both(packs, **kwargs)
    assert not fast, f"{name}: the fast path must not take this batch"


def test_bad_pack_is_named_as_before() -> None:
    packs = [make_pack([3, 2], seed=1), make_pack([2, 2], seed=2, first_id=4)]
    packs[1]["attention_mask"] = torch.tensor([2, 2, 1, 1])
    _, (status, err) = collate_both(packs)
    assert status == "error"
    assert err[0] is ValueError
    assert "pack 1 (sample_ids=[4, 5])" in err[1]
    assert "non-decreasing" in err[1]


# -- random batches, mutated or not -----------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    b = draw(st.integers(1, 4))
    mrope = draw(st.booleans())
    packs = []
    for row in range(b):
        lens = draw(st.lists(st.integers(1, 7), min_size=1, max_size=4))
        tail = draw(st.integers(0, 3))
        packs.append(make_pack(lens, tail=tail, mrope=mrope, seed=row, first_id=10 * row))
    # Off-contract mutations: each sends the batch to the general path or to an error there.
    for pack in packs:
        kind = draw(st.sampled_from(["none"] * 6 + ["id", "lens", "dtype", "mm", "text"]))
        t = int(pack["input_ids"].shape[0])
        if kind == "id":
            i = draw(st.integers(0, t - 1))
            pack["attention_mask"][i] = draw(st.integers(-1, 5))
        elif kind == "lens":
            pack["seq_lens_padded"] = draw(st.lists(st.integers(0, 8), min_size=0, max_size=4))
        elif kind == "dtype":
            pack["labels"] = pack["labels"].int()
        elif kind == "mm":
            pack["mm_token_type_ids"][draw(st.integers(0, t - 1))] = draw(st.integers(0, 2))
        elif kind == "text":
            del pack["text_position_ids"]
    longest = max(int(p["input_ids"].shape[0]) for p in packs)
    kwargs = {
        "mask_format": draw(st.sampled_from(MF.MASK_FORMATS)),
        "padding_idx": draw(st.sampled_from([0, 3])),
        "max_length": draw(st.none() | st.integers(max(1, longest - 1), longest + 5)),
        "pad_to_multiple_of": draw(st.none() | st.sampled_from([1, 4])),
    }
    if kwargs["max_length"] is not None and kwargs["pad_to_multiple_of"] == 4:
        kwargs["max_length"] = -(-kwargs["max_length"] // 4) * 4
    return packs, kwargs


@given(batches())
def test_random_batches_equal_reference(case: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    packs, kwargs = case
    collate_both(packs, **kwargs)


@given(
    st.lists(
        st.tuples(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(0, 3)),
        min_size=1,
        max_size=4,
    )
)
def test_contract_batches_always_take_the_fast_path(rows: list[tuple[list[int], int]]) -> None:
    packs = [make_pack(lens, tail=tail, seed=i) for i, (lens, tail) in enumerate(rows)]
    for fmt in ("doc_ids", "flash_attention_2", "thd", "position_ids"):
        fast, (status, _) = collate_both(packs, mask_format=fmt)
        assert fast
        assert status == "ok"


# -- the mask helpers the fast path uses, against brute force ---------------------------------


def canonical(rows: list[list[int]], s: int) -> torch.Tensor:
    """Brute force: row r is 1 x L1, 2 x L2, ..., then zeros to length s."""
    out = []
    for lens in rows:
        row = [k for k, n in enumerate(lens, start=1) for _ in range(n)]
        out.append(row + [0] * (s - len(row)))
    return torch.tensor(out, dtype=torch.long)


rows_and_s = st.lists(st.lists(st.integers(1, 6), min_size=0, max_size=4), min_size=1, max_size=4)


@given(rows_and_s, st.integers(0, 3), st.data())
def test_doc_ids_match_lengths_is_exact(rows: list[list[int]], extra: int, data: Any) -> None:
    s = max(1, max(sum(r) for r in rows) + extra)
    ids = canonical(rows, s)
    assert M.doc_ids_match_lengths(ids, rows)
    # Any single change of one token is seen, whatever the value (the brute force decides).
    r = data.draw(st.integers(0, len(rows) - 1))
    i = data.draw(st.integers(0, s - 1))
    value = data.draw(st.integers(-2, 7) | st.sampled_from([2**62, -(2**63)]))
    changed = ids.clone()
    changed[r, i] = value
    assert M.doc_ids_match_lengths(changed, rows) == torch.equal(changed, ids)
    # So is a different set of lengths with the same total.
    other = data.draw(rows_and_s.filter(lambda o: len(o) == len(rows)))
    if all(sum(o) <= s for o in other):
        assert M.doc_ids_match_lengths(ids, other) == torch.equal(canonical(other, s), ids)


def test_doc_ids_match_lengths_rejects() -> None:
    ids = torch.tensor([[1, 1, 2, 0]])
    assert M.doc_ids_match_lengths(ids, [[2, 1]])
    assert not M.doc_ids_match_lengths(ids, [[2, 2]])  # wrong lengths
    assert not M.doc_ids_match_lengths(ids, [[2, 1, 0]])  # a zero length
    assert not M.doc_ids_match_lengths(ids, [[3, 2]])  # past S
    assert not M.doc_ids_match_lengths(ids, [[2, 1], [1]])  # wrong row count
    assert not M.doc_ids_match_lengths(ids[0], [[2, 1]])  # not 2-D
    # A change inside a segment is caught though every segment start holds the right id ...
    assert not M.doc_ids_match_lengths(torch.tensor([[1, 5, 1, 2, 2]]), [[3, 2]])
    # ... and so is a missing change at a segment start.
    assert not M.doc_ids_match_lengths(torch.tensor([[1, 2, 2, 2, 2]]), [[3, 2]])
    # Any integer dtype is compared by value; floats and bools are never document ids.
    assert M.doc_ids_match_lengths(ids.int(), [[2, 1]])
    assert M.doc_ids_match_lengths(ids.to(torch.uint8), [[2, 1]])
    assert not M.doc_ids_match_lengths(ids.float(), [[2, 1]])
    assert not M.doc_ids_match_lengths(torch.tensor([[True, False]]), [[1]])
    # A non-contiguous view is read by value too.
    wide = torch.tensor([[1, 9, 1, 9, 2, 9, 0, 9]])
    assert M.doc_ids_match_lengths(wide[:, ::2], [[2, 1]])


@given(rows_and_s, st.integers(0, 3))
def test_lengths_helpers_equal_doc_ids_versions(rows: list[list[int]], extra: int) -> None:
    s = max(1, max(sum(r) for r in rows) + extra)  # to_cu_seqlens needs S >= 1
    ids = canonical(rows, s)
    assert_same(M.cu_seqlens_from_doc_lengths(rows, s), M.to_cu_seqlens(ids))
    reals = [[max(0, n - 1) for n in r] for r in rows]
    for seq_lens in (None, reals):
        assert_same(
            M.thd_params_from_doc_lengths(rows, s, seq_lens=seq_lens),
            M.to_thd_params(ids, seq_lens=seq_lens),
        )


def test_cu_seqlens_from_doc_lengths_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match=r"row 0: doc_lengths=\[3, 0\]"):
        M.cu_seqlens_from_doc_lengths([[3, 0]], 4)
    with pytest.raises(ValueError, match=r"row 1: doc_lengths=\[5\] .* at most s=4"):
        M.cu_seqlens_from_doc_lengths([[4], [5]], 4)


@pytest.mark.parametrize("mrope", [False, True])
def test_every_batch_tensor_owns_its_storage(mrope: bool) -> None:
    """As on the general path: no tensor is a view into a bigger buffer (plain pickle would
    write that whole buffer once per view), and none shares memory with another."""
    packs = [make_pack([3, 2], mrope=mrope, seed=1), make_pack([4], mrope=mrope, seed=2)]
    for fmt in ("position_ids", "doc_ids"):
        fast, (status, out) = collate_both(packs, mask_format=fmt)
        assert fast
        assert status == "ok"
        keys = ("input_ids", "labels", "mm_token_type_ids", "doc_ids", "position_ids")
        for key in keys:
            t = out[key]
            assert not t._is_view(), key
            assert t.storage_offset() == 0, key
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
        ptrs = {out[k].untyped_storage().data_ptr() for k in keys}
        assert len(ptrs) == len(keys)
        with general_path_only():
            ref = C.neat_packed_vlm_collater(packs, mask_format=fmt)
        assert len(pickle.dumps(out)) == len(pickle.dumps(ref))
