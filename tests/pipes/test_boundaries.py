"""Boundaries for linear-attention / SSM / conv layers (issue #20, item 1).

Reference: transformers' own ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
return_seq_idx=True)`` on the same documents.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BambaConfig,
    DataCollatorWithFlattening,
    FalconH1Config,
    Mamba2Config,
    NemotronHConfig,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen3_5Config,
    Qwen3NextConfig,
)

from neatpack.pipes import (
    add_boundaries,
    boundary_kwargs,
    neat_packed_vlm_collater,
    needs_boundaries,
    stateful_layers,
)
from neatpack.pipes.collating.mask_format import MASK_FORMATS
from neatpack.pipes.materializing.pack import build_pack

KEYS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _samples(lengths: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, 1000, (n,), generator=gen)
        out.append({"sample_id": i, "input_ids": ids, "labels": ids.clone()})
    return out


def _reference(segments: list[torch.Tensor]) -> dict[str, object]:
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    return dict(collator([{"input_ids": s.tolist()} for s in segments]))


def _assert_equal(ours: dict[str, object], ref: dict[str, object]) -> None:
    for key in KEYS:
        a, b = ours[key], ref[key]
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), key
            assert a.dtype == b.dtype, (key, a.dtype, b.dtype)
            assert torch.equal(a.reshape(b.shape), b), (key, a, b)
        else:
            assert type(a) is type(b), (key, a, b)
            assert a == b, (key, a, b)


@pytest.mark.parametrize("fmt", MASK_FORMATS)
def test_one_row_equals_transformers_flattening(fmt: str) -> None:
    samples = _samples([8, 5, 12, 2])
    pack = build_pack(samples)
    batch = neat_packed_vlm_collater([pack], mask_format=fmt, boundaries=True)
    # The flattening collator does not shift: feed it the shifted documents the pack holds.
    ref = _reference([s["input_ids"][:-1] for s in samples])
    _assert_equal(batch, ref)
    assert torch.equal(batch["input_ids"], ref["input_ids"])
    text_pos = batch["position_ids"] if batch["position_ids"].dim() == 2 else None
    if text_pos is not None:
        assert torch.equal(text_pos, ref["position_ids"])


@pytest.mark.parametrize("fmt", ["sdpa", "flash_attention_2", "thd"])
def test_padded_rows_equal_flattening_with_padding_as_a_segment(fmt: str) -> None:
    """Two rows padded to 16: the flattened stream's segments are the documents and each
    row's padding run, in order; seq_idx numbers them over the whole stream."""
    rows = [_samples([5, 7], seed=1), _samples([9], seed=2)]
    packs = [build_pack(r) for r in rows]
    batch = neat_packed_vlm_collater(packs, mask_format=fmt, max_length=16, boundaries=True)
    segments = []
    for row, pack in enumerate(packs):
        a = 0
        for n in pack["seq_lens_padded"]:
            segments.append(batch["input_ids"][row, a : a + n])
            a += n
        if a < 16:
            segments.append(batch["input_ids"][row, a:])
    ref = _reference(segments)
    _assert_equal(batch, ref)
    assert batch["seq_idx"].shape == (2, 16)
    assert batch["seq_idx"].tolist()[0] == [0] * 4 + [1] * 6 + [2] * 6  # 5, 7 tokens shift to 4, 6
    # every format keeps its own outputs next to the boundaries
    if fmt == "thd":
        assert batch["packed_seq_params"]["cu_seqlens_q"].tolist() == [0, 4, 10, 18]
    if fmt == "sdpa":
        assert batch["attention_mask"].shape == (2, 1, 16, 16)


def test_off_by_default_and_add_boundaries_matches_the_collater() -> None:
    packs = [build_pack(_samples([4, 6, 3]))]
    plain = neat_packed_vlm_collater(packs, mask_format="sdpa", max_length=16)
    assert not set(KEYS) & set(plain)
    _assert_equal(
        add_boundaries(plain), neat_packed_vlm_collater(packs, max_length=16, boundaries=True)
    )
    with pytest.raises(ValueError, match="doc_ids"):
        add_boundaries({"input_ids": torch.zeros(1, 4)})


def test_boundary_kwargs_from_lengths_equals_scan() -> None:
    doc_ids = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 3, 3, 3, 3]])
    scanned = boundary_kwargs(doc_ids)
    from_lengths = boundary_kwargs(doc_ids, [[2, 3], [1, 1, 4]])
    _assert_equal(scanned, from_lengths)
    assert scanned["seq_idx"].tolist() == [[0, 0, 1, 1, 1, 2], [3, 4, 5, 5, 5, 5]]


def test_stateful_layers_read_from_real_configs() -> None:
    assert stateful_layers(Qwen2Config(num_hidden_layers=3)) == []
    assert stateful_layers(Qwen2_5_VLConfig()) == []
    assert stateful_layers(Qwen3NextConfig(num_hidden_layers=4)) == [
        (0, "linear_attention"),
        (1, "linear_attention"),
        (2, "linear_attention"),
    ]
    # a VLM config is read through its text config (Qwen3.5 is a VLM)
    assert stateful_layers(Qwen3_5Config())[:1] == [(0, "linear_attention")]
    assert stateful_layers(Mamba2Config(num_hidden_layers=2)) == [(0, "mamba"), (1, "mamba")]
    assert stateful_layers(BambaConfig(num_hidden_layers=2, attn_layer_indices=[1])) == [
        (0, "mamba")
    ]
    nemo = NemotronHConfig(num_hidden_layers=3, layers_block_type=["mamba", "attention", "mlp"])
    assert stateful_layers(nemo) == [(0, "mamba")]
    assert stateful_layers(FalconH1Config(num_hidden_layers=2)) == [(0, "hybrid"), (1, "hybrid")]
    # a plain mapping (a config.json read as a dict) works too
    assert stateful_layers({"model_type": "mamba2", "num_hidden_layers": 2}) == [
        (0, "mamba"),
        (1, "mamba"),
    ]
    assert needs_boundaries(nemo)
    assert not needs_boundaries(Qwen2Config())
