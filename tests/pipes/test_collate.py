"""neat_packed_vlm_collater and the non-packed collates, on packs built by the data contract."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import neatpack.pipes as C
from neatpack.pipes.collating.mask import to_4d_bool_mask

IMG = 1  # mm_token_type_ids value of an image token


def make_pack(
    sample_ids: list[int],
    lens: list[int],
    *,
    grids: list[list[int]] | None = None,
    mrope: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """A pack as docs/data_contracts.md section 5 says, by hand (shifted docs concatenated).

    With ``grids`` (one [t, h, w] per document, first doc first), each such document starts with
    ``t*h*w/4`` image tokens and the pack carries flat pixel rows filled with the sample id.
    """
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    ids = torch.randint(10, 500, (t,), generator=gen)
    mm = torch.zeros(t, dtype=torch.long)
    doc = torch.cat([torch.full((n,), k + 1) for k, n in enumerate(lens)]).long()
    text_pos = torch.cat([torch.arange(n) for n in lens]).long()
    pack: dict[str, Any] = {
        "sample_ids": sample_ids,
        "input_ids": ids,
        "labels": ids.clone(),
        "attention_mask": doc,
        "text_position_ids": text_pos,
        "position_ids": text_pos.clone() if not mrope else torch.stack([text_pos] * 3),
        "seq_lens": list(lens),
        "seq_lens_padded": list(lens),
        "n_images": 0,
        "n_videos": 0,
    }
    if grids:
        start = 0
        pix, grid_rows = [], []
        for k, g in enumerate(grids):
            n_tok = g[0] * g[1] * g[2] // 4
            mm[start : start + n_tok] = IMG
            pix.append(torch.full((g[0] * g[1] * g[2], 8), float(sample_ids[k])))
            grid_rows.append(g)
            start += lens[k]
        pack.update(
            pixel_values=torch.cat(pix),
            image_grid_thw=torch.tensor(grid_rows),
            n_images=len(grids),
        )
    pack["mm_token_type_ids"] = mm
    return pack


def test_literal_doc_ids_example() -> None:
    batch = [make_pack([17, 4], [3, 2]), make_pack([92], [3])]
    out = C.neat_packed_vlm_collater(batch, mask_format="doc_ids")
    assert out["attention_mask"].tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 0, 0]]
    assert out["labels"][1].tolist()[3:] == [-100, -100]
    assert out["input_ids"][1].tolist()[3:] == [0, 0]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 0]]
    assert out["sample_ids"] == [[17, 4], [92]]
    assert out["mm_token_type_ids"].shape == (2, 5)


@pytest.mark.parametrize("fmt", C.MASK_FORMATS)
def test_every_format(fmt: str) -> None:
    batch = [make_pack([1, 2], [4, 3]), make_pack([3], [5])]
    out = C.neat_packed_vlm_collater(batch, attn_implementation=fmt)
    s = 7
    doc = out["doc_ids"]
    assert doc.tolist() == [[1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0, 0]]
    am = out["attention_mask"]
    if fmt == "sdpa":
        assert am.dtype == torch.bool
        assert torch.equal(am, to_4d_bool_mask(doc))
    elif fmt == "eager":
        assert am.dtype == torch.float32
        assert torch.equal(am == 0, to_4d_bool_mask(doc))
    elif fmt == "flex_attention":
        assert type(am).__name__ == "BlockMask"
        assert am.shape == (2, 1, s, s)
    elif fmt == "doc_ids":
        assert torch.equal(am, doc)
    else:
        assert am is None
    if fmt in C.FLASH_FORMATS:
        assert out["cu_seq_lens_q"].tolist() == [0, 4, 7, 12, 14]
        assert out["max_length_q"] == 5
        assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 0, 0]]
    if fmt == "thd":
        p = out["packed_seq_params"]
        assert p["cu_seqlens_q"].tolist() == [0, 4, 7, 12]
        assert p["cu_seqlens_q_padded"].tolist() == [0, 4, 7, 14]


def test_mask_format_overrides_attn_implementation_and_materialize() -> None:
    batch = [make_pack([1], [3])]
    out = C.neat_packed_vlm_collater(batch, attn_implementation="sdpa", mask_format="eager")
    assert out["attention_mask"].dtype == torch.float32
    out = C.neat_packed_vlm_collater(batch, materialize_4d_mask=False)
    assert out["attention_mask"].shape == (1, 3)
    out = C.neat_packed_vlm_collater(batch)  # default sdpa
    assert out["attention_mask"].dtype == torch.bool


def test_padding_targets() -> None:
    batch = [make_pack([1], [5]), make_pack([2], [3])]
    assert C.neat_packed_vlm_collater(batch)["input_ids"].shape == (2, 5)
    assert C.neat_packed_vlm_collater(batch, max_length=9)["input_ids"].shape == (2, 9)
    out = C.neat_packed_vlm_collater(batch, pad_to_multiple_of=4)
    assert out["input_ids"].shape == (2, 8)
    assert out["attention_mask"].shape == (2, 1, 8, 8)
    out = C.neat_packed_vlm_collater(batch, max_length=8, pad_to_multiple_of=4)
    assert out["input_ids"].shape == (2, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        C.neat_packed_vlm_collater(batch, max_length=9, pad_to_multiple_of=4)


@pytest.mark.badinput
def test_overlong_pack_names_its_samples() -> None:
    batch = [make_pack([7, 8], [3, 3]), make_pack([2], [3])]
    with pytest.raises(ValueError, match=r"sample_ids=\[7, 8\].*6 tokens > max_length=5"):
        C.neat_packed_vlm_collater(batch, max_length=5)


def test_mrope_positions_per_format() -> None:
    batch = [make_pack([1, 2], [3, 2], mrope=True), make_pack([3], [4], mrope=True)]
    out = C.neat_packed_vlm_collater(batch, mask_format="sdpa")
    assert out["position_ids"].shape == (3, 2, 5)
    for fmt in ("position_ids", "flash_attention_2", "thd"):
        out = C.neat_packed_vlm_collater(batch, mask_format=fmt)
        assert out["position_ids"].shape == (4, 2, 5)
        assert out["position_ids"][0].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]


def test_text_positions_derived_when_pack_lacks_them() -> None:
    pack = make_pack([1, 2], [3, 2])
    del pack["text_position_ids"], pack["position_ids"]
    out = C.neat_packed_vlm_collater([pack], mask_format="position_ids")
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]]


def test_media_concatenated_with_counts() -> None:
    a = make_pack([5, 6], [6, 3], grids=[[1, 4, 4]])  # 16 patches, 4 image tokens
    b = make_pack([7], [8], grids=[[1, 4, 8]])  # 32 patches, 8 image tokens
    c = make_pack([8], [4])
    out = C.neat_packed_vlm_collater([a, b, c])
    assert out["pixel_values"].shape == (48, 8)
    assert out["pixel_values"].dtype == torch.float32
    assert out["pixel_values"][:16].unique().tolist() == [5.0]
    assert out["pixel_values"][16:].unique().tolist() == [7.0]
    assert out["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    assert out["n_images_per_sample"].tolist() == [1, 1, 0]
    assert "n_videos_per_sample" not in out
    assert int((out["mm_token_type_ids"] == IMG).sum()) == 12
    bf16 = C.neat_packed_vlm_collater([a, b], pixel_dtype=torch.bfloat16)
    assert bf16["pixel_values"].dtype == torch.bfloat16


def test_variable_resolution_pixels_become_a_list() -> None:
    a = make_pack([1], [4], grids=[[1, 4, 4]])
    b = make_pack([2], [4], grids=[[1, 4, 4]])
    b["pixel_values"] = b["pixel_values"][:, :6].contiguous()
    out = C.neat_packed_vlm_collater([a, b])
    assert isinstance(out["pixel_values"], list)
    assert [tuple(p.shape) for p in out["pixel_values"]] == [(16, 8), (16, 6)]


@given(
    st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=4), min_size=1, max_size=4),
    st.sampled_from(["doc_ids", "flash_attention_2", "sdpa"]),
)
def test_round_trip_property(rows: list[list[int]], fmt: str) -> None:
    packs = [make_pack(list(range(i * 10, i * 10 + len(r))), r, seed=i) for i, r in enumerate(rows)]
    out = C.neat_packed_vlm_collater(packs, mask_format=fmt)
    s = max(sum(r) for r in rows)
    assert out["input_ids"].shape == (len(rows), s)
    for row, pack in enumerate(packs):
        t = sum(rows[row])
        assert torch.equal(out["input_ids"][row, :t], pack["input_ids"])
        assert torch.equal(out["labels"][row, :t], pack["labels"])
        assert bool((out["labels"][row, t:] == -100).all())
        assert torch.equal(out["doc_ids"][row, :t], pack["attention_mask"])
        assert out["sample_ids"][row] == pack["sample_ids"]
    if fmt == "flash_attention_2":
        cu = out["cu_seq_lens_q"]
        assert int(cu[-1]) == len(rows) * s
        docs = [n for r in rows for n in [*r, s - sum(r)] if n]
        assert cu.diff().tolist() == docs


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.badinput
def test_empty_batch() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        C.neat_packed_vlm_collater([])


@pytest.mark.badinput
def test_zero_length_pack() -> None:
    empty = make_pack([3], [1])
    for key in ("input_ids", "labels", "attention_mask", "mm_token_type_ids", "position_ids"):
        empty[key] = empty[key][..., :0]
    with pytest.raises(ValueError, match=r"pack 1 \(sample_ids=\[3\]\) has no document token"):
        C.neat_packed_vlm_collater([make_pack([1], [3]), empty])
    padded_empty = make_pack([], [3])  # padded to a pack size but holding no document
    padded_empty["attention_mask"] = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="no document token"):
        C.neat_packed_vlm_collater([padded_empty])


@pytest.mark.badinput
def test_unknown_format_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown mask format 'flash'") as info:
        C.neat_packed_vlm_collater([make_pack([1], [3])], mask_format="flash")
    for name in C.MASK_FORMATS:
        assert name in str(info.value)


@pytest.mark.badinput
def test_media_placeholder_mismatch() -> None:
    pack = make_pack([4, 5], [6, 2], grids=[[1, 4, 4]])
    pack["mm_token_type_ids"][3] = 0  # 3 image tokens, grid says 4
    with pytest.raises(ValueError, match=r"sample_ids=\[4, 5\]\): 3 image placeholder tokens"):
        C.neat_packed_vlm_collater([pack])
    pack = make_pack([4], [6], grids=[[1, 4, 4]])
    pack["pixel_values"] = pack["pixel_values"][:10]
    with pytest.raises(ValueError, match="10 patch rows"):
        C.neat_packed_vlm_collater([pack])
    pack = make_pack([4], [6], grids=[[1, 4, 4]])
    pack["n_images"] = 2
    with pytest.raises(ValueError, match="n_images=2"):
        C.neat_packed_vlm_collater([pack])


@pytest.mark.badinput
def test_mixed_position_layouts() -> None:
    with pytest.raises(ValueError, match="disagree on position_ids"):
        C.neat_packed_vlm_collater([make_pack([1], [3], mrope=True), make_pack([2], [3])])


@pytest.mark.badinput
def test_bad_doc_ids_in_pack() -> None:
    pack = make_pack([1, 2], [2, 2])
    pack["attention_mask"] = torch.tensor([2, 2, 1, 1])
    with pytest.raises(ValueError, match=r"pack 1 \(sample_ids=\[1, 2\]\).*non-decreasing"):
        C.neat_packed_vlm_collater([make_pack([7], [4]), pack])


# -- non-packed collates ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor() -> Any:
    from neatpack.pipes.testing.tiny import load_tiny_processor

    return load_tiny_processor("qwen2_vl")


def _sample(processor: Any, sid: int, text: str, image: Any = None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image", "image": image})
    conv = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": "ok " * (sid + 1)}]},
    ]
    enc = processor.apply_chat_template(conv, tokenize=True, return_dict=True, return_tensors="pt")
    sample = dict(enc.items())
    sample["input_ids"] = enc["input_ids"][0]
    sample["attention_mask"] = enc["attention_mask"][0]
    sample["mm_token_type_ids"] = enc["mm_token_type_ids"][0]
    sample["labels"] = enc["input_ids"][0].clone()
    sample["sample_id"] = sid
    return sample


def test_pad_collate_fn_real_processor(processor: Any) -> None:
    from PIL import Image

    img = Image.new("RGB", (56, 56), (200, 10, 10))
    samples = [_sample(processor, 0, "hi"), _sample(processor, 1, "look", img)]
    lens = [int(s["input_ids"].numel()) for s in samples]
    out = C.pad_collate_fn(samples, processor)
    s = max(lens)
    assert out["input_ids"].shape == (2, s - 1)
    assert out["labels"].shape == (2, s - 1)
    pad = processor.tokenizer.pad_token_id
    short = lens.index(min(lens))
    assert out["input_ids"][short, min(lens) :].eq(pad).all()
    assert out["labels"][short, min(lens) - 1 :].eq(-100).all()
    assert torch.equal(out["labels"][1, : lens[1] - 1], samples[1]["input_ids"][1:])
    assert torch.equal(out["input_ids"][1, : lens[1] - 1], samples[1]["input_ids"][:-1])
    assert out["n_images_per_sample"].tolist() == [0, 1]
    assert out["pixel_values"].dtype == torch.float32
    assert out["sample_ids"] == [[0], [1]]
    fixed = C.pad_collate_fn(samples, processor, max_length=s + 5)
    assert fixed["input_ids"].shape == (2, s + 4)


@pytest.mark.badinput
def test_pad_collate_fn_overlong(processor: Any) -> None:
    samples = [_sample(processor, 3, "a fairly long question " * 3)]
    n = int(samples[0]["input_ids"].numel())
    with pytest.raises(ValueError, match=f"sample 3 has {n} tokens > max_length=10"):
        C.pad_collate_fn(samples, processor, max_length=10)
    out = C.pad_collate_fn(samples, processor, max_length=10, truncate=True)
    assert out["input_ids"].shape == (1, 9)


def test_expand_image_tokens() -> None:
    ids = torch.tensor([5, 9, 6, 9])
    mask = torch.tensor([1, 0, 1, 1])
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
    new_ids, new_mask = C.expand_image_tokens(ids, mask, grid, 9)
    assert new_ids.tolist() == [5, 9, 9, 9, 9, 6, 9, 9]
    assert new_mask.tolist() == [1, 1, 1, 1, 1, 1, 1, 1]
    fixed, fmask = C._expand_image_tokens(ids, mask, grid, 9, (2, 2), length=10, pad_token_id=0)
    assert fixed.tolist() == [5, 9, 9, 9, 9, 6, 9, 9, 0, 0]
    assert fmask.tolist()[-3:] == [1, 0, 0]
    with pytest.raises(ValueError, match="2 placeholder tokens"):
        C.expand_image_tokens(ids, mask, grid[:1], 9)
    with pytest.raises(ValueError, match="length=4"):
        C.expand_image_tokens(ids, mask, grid, 9, length=4)


def test_robust_collate_resamples_packs_deterministically() -> None:
    from functools import partial

    dataset = [make_pack([i], [3 + (i % 4) * 2], seed=i) for i in range(20)]
    collate = partial(C.neat_packed_vlm_collater, max_length=6)
    bad = [dataset[1], dataset[2]]  # 5 and 7 tokens: the second is overlong
    runs = []
    for _ in range(2):
        robust = C.make_robust_collate(dataset, collate, max_retries=10)
        out = robust(bad)
        runs.append(out["sample_ids"])
        assert robust.failures[0]["sample_ids"] == [[1], [2]]
        assert "max_length=6" in robust.failures[0]["error"]
        assert out["input_ids"].shape == (2, 6)
    assert runs[0] == runs[1]  # same replacement on every run / rank
    assert all(len(dataset[r[0]]["input_ids"]) <= 6 for r in runs[0])


@pytest.mark.badinput
def test_robust_collate_gives_up() -> None:
    dataset = [make_pack([i], [9], seed=i) for i in range(5)]

    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        return C.neat_packed_vlm_collater(batch, max_length=4)

    robust = C.make_robust_collate(dataset, collate, max_retries=3)
    with pytest.raises(RuntimeError, match="Collate failed after 3 retries"):
        robust([dataset[0]])
    assert len(robust.failures) == 3


class _TokenRows(torch.utils.data.Dataset[dict[str, Any]]):
    """Rows of token ids; row 3 is broken (its ids are not ints), so its collate fails."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, k: int) -> dict[str, Any]:
        return {"sample_id": k, "input_ids": ["x"] if k == 3 else [k + 1] * (k + 2)}


def _pad_ids(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A user's own collate: exactly the keys its model takes."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"])) for r in rows])
    return {"input_ids": ids, "labels": ids.masked_fill(ids == 0, -100)}


class _StrictLM(torch.nn.Module):
    """A model whose forward takes only its own arguments (no ``**kwargs``), as many do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(input_ids))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_robust_collate_reports_failures_beside_the_users_batch() -> None:
    """Through a DataLoader worker process: a retried batch keeps exactly the user's keys, so
    ``model(**batch)`` runs, and its failures come along beside them (issue 25: a
    ``"collate_failures"`` key made the model raise on an unexpected argument)."""
    dataset = _TokenRows()
    collate = C.make_robust_collate(dataset, _pad_ids, max_retries=5)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=2, collate_fn=collate, num_workers=1, multiprocessing_context="fork"
    )
    model, retried = _StrictLM(), []
    for batch in loader:
        assert sorted(batch) == ["input_ids", "labels"]
        assert torch.isfinite(model(**batch))
        failures = getattr(batch, "collate_failures", ())
        retried += [f["sample_ids"] for f in failures]
    assert retried == [[2, 3]]  # the batch holding row 3, named once, after the worker process
    assert collate.failures == []  # the worker's copy recorded it; the batch carried it here


def _record(sid: int, text: str, answer: str, image: Any = None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image", "image": image})
    return {
        "sample_id": sid,
        "conversation": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
    }


def test_default_collate_fn_tokenizes_labels_and_shifts(processor: Any) -> None:
    from PIL import Image

    from neatpack.pipes.materializing.tokenize import tokenize_conversation

    records = [
        _record(4, "what colour", "red", Image.new("RGB", (56, 56), (255, 0, 0))),
        _record(9, "say something longer please", "a longer answer here"),
    ]
    out = C.default_collate_fn(records, processor)
    ref = [tokenize_conversation(r, processor) for r in records]
    lens = [int(r["input_ids"].numel()) for r in ref]
    assert out["input_ids"].shape == (2, max(lens) - 1)
    for row, r in enumerate(ref):
        n = lens[row] - 1
        assert torch.equal(out["input_ids"][row, :n], r["input_ids"][:-1])
        assert torch.equal(out["labels"][row, :n], r["labels"][1:])
        answer = processor.tokenizer.decode(out["labels"][row][out["labels"][row] != -100])
        assert answer.startswith(records[row]["conversation"][1]["content"][0]["text"])
    assert out["sample_ids"] == [[4], [9]]
    assert out["n_images_per_sample"].tolist() == [1, 0]
    assert out["dropped_sample_ids"] == []
    short = min(lens)
    dropped = C.default_collate_fn(records, processor, max_length=short, drop_overlong=True)
    assert dropped["dropped_sample_ids"] == [[4, 9][lens.index(max(lens))]]
    assert dropped["input_ids"].shape == (1, short - 1)


@pytest.mark.badinput
def test_default_collate_fn_overlong_without_drop(processor: Any) -> None:
    records = [_record(5, "a question " * 10, "an answer")]
    with pytest.raises(ValueError, match=r"sample 5 has \d+ tokens > max_length=8"):
        C.default_collate_fn(records, processor, max_length=8)
    with pytest.raises(ValueError, match=r"all 1 samples exceed max_length=8: dropped=\[5\]"):
        C.default_collate_fn(records, processor, max_length=8, drop_overlong=True)


@pytest.mark.badinput
def test_pad_collate_fn_empty_and_missing_labels(processor: Any) -> None:
    with pytest.raises(ValueError, match="empty batch"):
        C.pad_collate_fn([], processor)
    sample = _sample(processor, 2, "hi")
    del sample["labels"]
    with pytest.raises(ValueError, match="sample 2 has no 'labels'"):
        C.pad_collate_fn([sample], processor)
