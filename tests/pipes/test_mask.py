"""Document ids -> masks: literal examples, brute-force properties, flex parity, bad input."""

from __future__ import annotations

import doctest
import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from neatpack import pipes as M
from neatpack.pipes import block_mask, cu_seqlens, doc_ids, mask, text_positions


def _doc_ids(rows: list[list[int]], s: int) -> torch.Tensor:
    """Rows of document lengths -> right-padded [B, S] document ids."""
    out = torch.zeros(len(rows), s, dtype=torch.long)
    for r, lens in enumerate(rows):
        pos = 0
        for k, n in enumerate(lens, start=1):
            out[r, pos : pos + n] = k
            pos += n
    return out


def _reference(doc: torch.Tensor) -> torch.Tensor:
    """Brute force: (same doc and causal and not padding) or the diagonal."""
    b, s = doc.shape
    ref = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for r in range(b):
        for i in range(s):
            for j in range(s):
                same = doc[r, i] == doc[r, j] and doc[r, j] > 0 and j <= i
                ref[r, 0, i, j] = bool(same) or i == j
    return ref


packs = st.lists(
    st.lists(st.integers(1, 6), min_size=0, max_size=4), min_size=1, max_size=3
).flatmap(
    lambda rows: st.tuples(
        st.just(rows), st.integers(max(1, max(sum(r) for r in rows)), max(sum(r) for r in rows) + 3)
    )
)


def test_doctests_pass() -> None:
    results = [doctest.testmod(m) for m in (block_mask, cu_seqlens, doc_ids, mask, text_positions)]
    assert sum(r.attempted for r in results) >= 7
    assert sum(r.failed for r in results) == 0


def test_bool_mask_literal() -> None:
    got = M.to_4d_bool_mask(torch.tensor([[1, 1, 2, 2, 2, 0]]))
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert got.shape == (1, 1, 6, 6)
    assert got.dtype == torch.bool
    assert got[0, 0].int().tolist() == expected


@given(packs)
def test_masks_match_brute_force(case: tuple[list[list[int]], int]) -> None:
    rows, s = case
    doc = _doc_ids(rows, s)
    bool_mask = M.to_4d_bool_mask(doc)
    assert torch.equal(bool_mask, _reference(doc))
    assert bool(bool_mask.any(-1).all())  # no fully masked row
    add = M.to_4d_additive_mask(doc, torch.float32)
    assert torch.equal(add == 0, bool_mask)
    assert bool((add[~bool_mask] == torch.finfo(torch.float32).min).all())


@given(packs)
def test_cu_seqlens_and_positions(case: tuple[list[list[int]], int]) -> None:
    rows, s = case
    doc = _doc_ids(rows, s)
    kw = M.to_cu_seqlens(doc)
    expected = [0]
    for lens in rows:
        segs = [n for n in lens if n] + ([s - sum(lens)] if s > sum(lens) else [])
        for n in segs:
            expected.append(expected[-1] + n)
    assert kw["cu_seq_lens_q"].tolist() == expected
    assert kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    assert kw["max_length_q"] == max(b - a for a, b in itertools.pairwise(expected))
    assert isinstance(kw["max_length_q"], int)
    pos = M.to_text_position_ids(doc)
    for r, lens in enumerate(rows):
        want = [i for n in lens for i in range(n)] + [0] * (s - sum(lens))
        assert pos[r].tolist() == want


@given(packs)
def test_thd_params(case: tuple[list[list[int]], int]) -> None:
    rows, s = case
    doc = _doc_ids(rows, s)
    real = [[max(0, n - 1) for n in lens] for lens in rows]  # pretend 1 alignment pad per doc
    p = M.to_thd_params(doc, [list(r) for r in rows], seq_lens=real)
    assert p["qkv_format"] == "thd"
    assert int(p["cu_seqlens_q_padded"][-1]) == doc.numel()
    flat_real = [n for r in real for n in (r or [0])]
    assert p["cu_seqlens_q"].diff().tolist() == flat_real
    spans = p["cu_seqlens_q_padded"].diff().tolist()
    assert len(spans) == len(flat_real)
    assert all(a >= b for a, b in zip(spans, flat_real, strict=True))


def test_thd_rejects_wrong_padded_lengths() -> None:
    doc = torch.tensor([[1, 1, 2, 0]])
    with pytest.raises(ValueError, match="seq_lens_padded"):
        M.to_thd_params(doc, [[1, 2]])
    with pytest.raises(ValueError, match="seq_lens"):
        M.to_thd_params(doc, seq_lens=[[3, 1]])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_matches_bool_mask_through_flex_attention() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    doc = torch.tensor([[1, 1, 2, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 2, 3]])
    bm = M.to_block_mask(doc, block_size=4)
    assert bm.shape == (2, 1, 8, 8)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=gen) for _ in range(3))
    got = flex_attention(q, k, v, block_mask=bm)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=M.to_4d_bool_mask(doc)
    )
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_sdpa_padding_rows_are_finite() -> None:
    doc = torch.tensor([[1, 1, 0, 0]])
    q = torch.randn(1, 2, 4, 8)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, q, q, attn_mask=M.to_4d_bool_mask(doc)
    )
    assert bool(torch.isfinite(out).all())


def test_mrope_text_position_ids() -> None:
    text = torch.tensor([[0, 1, 0, 1]])
    mrope = torch.arange(12).reshape(3, 1, 4)
    out = M.to_mrope_text_position_ids(text, mrope)
    assert out.shape == (4, 1, 4)
    assert out[0].tolist() == [[0, 1, 0, 1]]
    assert torch.equal(out[1:], mrope)
    with pytest.raises(ValueError, match="3, B, S"):
        M.to_mrope_text_position_ids(text, mrope[:2])


@pytest.mark.badinput
@pytest.mark.parametrize(
    ("doc", "match"),
    [
        (torch.tensor([1, 1, 0]), r"\[B, S\]"),
        (torch.tensor([[1.0, 0.0]]), "integer"),
        (torch.tensor([[1, -1]]), ">= 0"),
        (torch.tensor([[1, 0, 2]]), "after padding"),
        (torch.tensor([[2, 1, 1]]), "non-decreasing"),
    ],
)
def test_bad_doc_ids(doc: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        M.to_4d_bool_mask(doc)


def test_additive_mask_needs_float_dtype() -> None:
    with pytest.raises(ValueError, match="floating"):
        M.to_4d_additive_mask(torch.tensor([[1]]), torch.int64)


@given(packs, st.sampled_from([1, 2, 3, 4, 8, 128]))
def test_block_mask_equals_create_block_mask(case: tuple[list[list[int]], int], bs: int) -> None:
    """Block tables from document ranges == torch's dense create_block_mask, tile by tile."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, s = case
    doc = _doc_ids(rows, s)

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return ((doc[b, q] == doc[b, k]) & (doc[b, k] > 0) & (k <= q)) | (q == k)

    ref = create_block_mask(
        mask_mod, len(rows), None, s, s, device="cpu", BLOCK_SIZE=bs, _compile=False
    )
    got = M.to_block_mask(doc, block_size=bs)
    assert torch.equal(got.to_dense(), ref.to_dense())
    assert torch.equal(got.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(got.full_kv_num_blocks, ref.full_kv_num_blocks)


def test_to_4d_mask_dispatches_on_dtype() -> None:
    doc = torch.tensor([[1, 1, 2, 0]])
    assert torch.equal(M.to_4d_mask(doc), M.to_4d_bool_mask(doc))
    assert torch.equal(
        M.to_4d_mask(doc, torch.bfloat16), M.to_4d_additive_mask(doc, torch.bfloat16)
    )


def test_a_dense_mask_on_cuda_is_told_what_it_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """#27: on a CUDA machine the graph says what a dense 4D mask costs on this data (every
    row's square against the documents' own) and how to run varlen instead; on CPU, or with a
    document-aware format, it says nothing."""
    import warnings

    import torch

    from neatpack.graphs import NeatLLMConfig, neat_llm_graph

    records = [{"input_ids": list(range(1, n + 1))} for n in (5, 9, 3, 7, 4, 6)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU: no warning
        neat_llm_graph(records, config=NeatLLMConfig(pack_size=16))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default ("auto") gives varlen batches on CUDA
        neat_llm_graph(records, config=NeatLLMConfig(pack_size=16))
    sdpa = NeatLLMConfig(pack_size=16, attn_implementation="sdpa")
    with pytest.warns(UserWarning, match=r"dense \[16, 16\] mask.*about 3\.3x") as seen:
        neat_llm_graph(records, config=sdpa)
    assert "use_varlen_attention(model)" in str(seen[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        neat_llm_graph(records, config=NeatLLMConfig(pack_size=16, attn_implementation="thd"))
