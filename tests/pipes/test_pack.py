"""shift_sample / build_pack: literal examples and invariants on random packs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from neatpack.pipes.compat.seed_compat import build_packed_vlm_sample
from neatpack.pipes.materializing.mrope import MRopeConfig, mrope_position_ids
from neatpack.pipes.materializing.pack import build_pack, build_packed_sample, shift_sample

IMG = 4108
CFG = MRopeConfig(family="qwen2_vl", image_token_id=IMG, video_token_id=4109)


def _sample(sid: int, ids: list[int], labels: list[int] | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "sample_id": sid,
        "input_ids": torch.tensor(ids),
        "labels": torch.tensor(ids if labels is None else labels),
        **kw,
    }


def test_shift_literal() -> None:
    s = _sample(3, [5, 6, 7, 8], [-100, 6, 7, 8], attention_mask=torch.tensor([1, 1, 1, 1]))
    s["position_ids"] = torch.arange(4).expand(3, -1)
    s["pixel_values"] = torch.ones(2, 3)
    out = shift_sample(s)
    assert out["input_ids"].tolist() == [5, 6, 7]
    assert out["labels"].tolist() == [6, 7, 8]
    assert out["position_ids"].tolist() == [[0, 1, 2]] * 3
    assert out["pixel_values"] is s["pixel_values"]
    assert out["sample_id"] == 3


def test_shift_rejects_short_and_ragged() -> None:
    with pytest.raises(ValueError, match="sample 9: 1 token"):
        shift_sample(_sample(9, [1]))
    with pytest.raises(ValueError, match="sample 2: labels has 2 entries"):
        shift_sample(_sample(2, [1, 2, 3], [1, 2]))


def test_build_pack_literal() -> None:
    pack = build_pack(
        [_sample(17, [5, 6, 7, 8], [-100, 6, 7, 8]), _sample(4, [9, 10, 11], [-100, -100, 11])],
        pack_size=8,
    )
    assert pack["input_ids"].tolist() == [5, 6, 7, 9, 10, 0, 0, 0]
    assert pack["labels"].tolist() == [6, 7, 8, -100, 11, -100, -100, -100]
    assert pack["attention_mask"].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    assert pack["text_position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert pack["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert (pack["seq_lens"], pack["seq_lens_padded"]) == ([3, 2], [3, 2])
    assert pack["sample_ids"] == [17, 4]
    assert (pack["n_images"], pack["n_videos"], pack["pixel_values"]) == (0, 0, None)


def test_seed_alignment_example() -> None:
    """peer note 3.5 [smoke]: align=4, docs of 3 and 2 tokens (already shifted)."""
    docs = [_sample(0, [1, 2, 3]), _sample(1, [4, 5])]
    pack = build_packed_vlm_sample(docs, pack_size=99, padding_idx=0, sequence_alignment=4)
    assert pack["input_ids"].tolist() == [1, 2, 3, 0, 4, 5, 0, 0]
    assert pack["labels"].tolist() == [1, 2, 3, -100, 4, 5, -100, -100]
    assert pack["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert pack["attention_mask"].tolist() == [1, 1, 1, 1, 2, 2, 2, 2]
    assert (pack["seq_lens"], pack["seq_lens_padded"]) == ([3, 2], [4, 4])


def test_mrope_with_alignment_pads_positions() -> None:
    ids = [1, 2, 4105, IMG, IMG, IMG, IMG, 4106, 3, 4]
    s = _sample(0, ids, image_grid_thw=torch.tensor([[1, 4, 4]]), pixel_values=torch.ones(16, 5))
    pack = build_pack([s, _sample(1, [7, 8, 9])], alignment=4, mrope=CFG)
    full = mrope_position_ids(
        torch.tensor(ids), CFG.token_types(torch.tensor(ids)), torch.tensor([[1, 4, 4]]), config=CFG
    )
    pos = pack["position_ids"]
    assert pos.shape == (3, 16)
    assert torch.equal(pos[:, :9], full[:, :9])  # computed before the shift, then shifted
    top = int(full[:, :9].max()) + 1
    assert pos[:, 9:12].tolist() == [[top, top + 1, top + 2]] * 3  # alignment pad continues
    assert pos[:, 12:].tolist() == [[0, 1, 2, 3]] * 3  # doc 2 restarts (2 real + 2 pad)
    assert pack["seq_lens_padded"] == [12, 4]
    assert pack["n_images"] == 1
    assert pack["pixel_values"].shape == (16, 5)


def test_mrope_true_needs_positions_and_callable_works() -> None:
    s = _sample(5, [1, 2, 3])
    with pytest.raises(ValueError, match="sample 5: mrope=True needs"):
        build_pack([s], mrope=True)

    def get_rope_index(input_ids: torch.Tensor, attention_mask: Any = None) -> Any:
        return torch.arange(input_ids.shape[1]).expand(3, 1, -1) * 10, None

    pack = build_pack([s], mrope=get_rope_index)
    assert pack["position_ids"].tolist() == [[0, 10]] * 3


def test_overflow_raises_naming_ids() -> None:
    with pytest.raises(ValueError, match=r"samples \[3, 4\] is 5 tokens .* pack_size=4"):
        build_pack([_sample(3, [1, 2, 3]), _sample(4, [1, 2, 3, 4])], pack_size=4)


def test_masked_fake_image_tokens_move_to_document_end() -> None:
    ids = [1, 2, 4105, IMG, IMG, IMG, IMG, 4106, 3, 4]
    am = torch.tensor([1, 1, 1, 0, 0, 0, 0, 1, 1, 1])
    s = _sample(0, ids, [-100] * 8 + [3, 4], attention_mask=am,
                image_grid_thw=torch.tensor([[1, 4, 4]]))  # fmt: skip
    pack = build_pack([s, _sample(1, [7, 8, 9])], mrope=CFG, pack_size=14)
    assert pack["input_ids"].tolist()[:9] == [1, 2, 4105, 4106, 3, IMG, IMG, IMG, IMG]
    assert pack["labels"].tolist()[:9] == [-100, -100, -100, 3, 4] + [-100] * 4
    assert pack["attention_mask"].tolist() == [1] * 9 + [2, 2] + [0] * 3  # contiguous docs
    assert pack["mm_token_type_ids"].tolist()[:9] == [0] * 5 + [1] * 4
    # real tokens keep the model's masked numbering (the fake image is left out)
    assert pack["position_ids"][0, :5].tolist() == [0, 1, 2, 3, 4]
    assert pack["text_position_ids"].tolist()[:9] == list(range(9))


def test_build_packed_sample_llm() -> None:
    pack = build_packed_sample([{"input_ids": [1, 2], "labels": [2, 3]}, {"input_ids": [4],
                                "labels": [5]}], pack_size=5)  # fmt: skip
    assert pack["input_ids"].tolist() == [1, 2, 4, 0, 0]
    assert pack["attention_mask"].tolist() == [1, 1, 2, 0, 0]
    assert pack["position_ids"].tolist() == [0, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="pack_size=2"):
        build_packed_sample([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}], pack_size=2)


def test_empty_pack_is_padding_with_right_position_rank() -> None:
    pack = build_pack([], pack_size=4, mrope=True)
    assert pack["position_ids"].shape == (3, 4)
    assert pack["labels"].eq(-100).all()
    assert pack["attention_mask"].eq(0).all()


_docs = st.lists(
    st.tuples(st.integers(2, 30), st.integers(0, 2), st.booleans()), min_size=1, max_size=5
)


@given(docs=_docs, align=st.sampled_from([1, 2, 4, 8]), extra=st.integers(0, 9))
def test_pack_invariants(docs: list[tuple[int, int, bool]], align: int, extra: int) -> None:
    samples = []
    for sid, (n_text, n_img, labelled) in enumerate(docs):
        ids: list[int] = list(range(100 * sid, 100 * sid + n_text))
        grids = []
        for _ in range(n_img):
            ids += [4105, IMG, IMG, IMG, IMG, 4106]
            grids.append([1, 4, 4])
        labels = [i if labelled and i < IMG - 10 else -100 for i in ids]
        s = _sample(sid * 7, ids, labels)
        if grids:
            s["image_grid_thw"] = torch.tensor(grids)
            s["pixel_values"] = torch.full((16 * n_img, 3), float(sid))
        samples.append(s)
    real = [len(s["input_ids"]) - 1 for s in samples]
    padded = [-(-n // align) * align for n in real]
    size = sum(padded) + extra
    pack = build_pack(samples, alignment=align, pack_size=size, mrope=CFG)
    doc = pack["attention_mask"]
    assert pack["input_ids"].shape == (size,)
    assert pack["seq_lens"] == real
    assert pack["seq_lens_padded"] == padded
    assert pack["sample_ids"] == [s["sample_id"] for s in samples]
    assert pack["labels"][doc == 0].eq(-100).all()  # padding labels are -100
    start = 0
    for k, (s, n, lp) in enumerate(zip(samples, real, padded, strict=True), start=1):
        assert doc[start : start + lp].eq(k).all()
        # positions restart per document
        assert pack["text_position_ids"][start : start + lp].tolist() == list(range(lp))
        assert pack["position_ids"][:, start].tolist() == [0, 0, 0]
        # labels never cross a document: each is the next token of the SAME sample, or -100
        assert pack["labels"][start : start + n].tolist() == s["labels"][1:].tolist()
        assert pack["labels"][start + n : start + lp].eq(-100).all()
        start += lp
    n_img = sum(d[1] for d in docs)
    assert pack["n_images"] == n_img
    # image-pad count equals t*h*w/merge^2 per image
    assert int((pack["input_ids"] == IMG).sum()) == n_img * 4
    if n_img:
        assert pack["pixel_values"].shape[0] == 16 * n_img
