"""CostModel and pack_terms (pipes/planning/cost.py): the terms of hand-built packs, the
attention term per format, the vision term per image, calibration, and from_config against
the parameters of real tiny Qwen-VL models."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from neatpack.pipes import CostModel, plan_packs
from neatpack.pipes.planning.cost import TERMS, grid_patches, pack_terms
from neatpack.pipes.testing.tiny_models import tiny_model

DOCUMENT_FORMATS = ("flash_attention_2", "flash_attention_3", "flex_attention", "thd",
                    "position_ids", "doc_ids", "neatpack_varlen")  # fmt: skip


def test_pack_terms_of_hand_built_packs() -> None:
    # pack 0: samples 2, 0 (5 + 3 tokens, 2 visual tokens = 8 patches); pack 1: sample 1 alone
    lengths = np.array([3, 6, 5])
    visual = np.array([0, 0, 2])
    got = pack_terms(np.array([0, 2, 3]), np.array([2, 0, 1]), lengths, visual)
    assert TERMS == ("tokens", "attention", "patches", "patch_attention")
    assert got.tolist() == [[8.0, 34.0, 8.0, 64.0], [6.0, 36.0, 0.0, 0.0]]
    assert pack_terms(np.array([0, 0, 1]), np.array([1]), lengths).tolist() == [
        [0.0, 0.0, 0.0, 0.0],
        [6.0, 36.0, 0.0, 0.0],
    ]


@pytest.mark.parametrize("fmt", ["sdpa", "eager", *DOCUMENT_FORMATS])
def test_attention_term_per_format(fmt: str) -> None:
    """Documents [3, 5] padded to a row of 10: a dense mask pays 10^2 whatever the documents;
    a document-aware kernel 3^2 + 5^2 and the padding's 2^2."""
    flops = CostModel.from_config(tiny_model("qwen2_vl").config, fmt)
    terms = pack_terms([0, 2], [0, 1], [3, 5])
    only_pairs = CostModel(attention=flops.attention, per_pair=1.0)
    want = 100.0 if fmt in ("sdpa", "eager") else 38.0
    assert only_pairs.cost(terms, row_length=10).tolist() == [want]
    assert only_pairs.per_term(terms, row_length=10)[0].tolist() == [0.0, 0.0, want, 0.0, 0.0]
    assert only_pairs.cost(terms).tolist() == [64.0 if fmt in ("sdpa", "eager") else 34.0]


def test_dense_mask_costs_the_same_whatever_the_documents() -> None:
    """Two packs of 8,192 tokens: one document, or eight of 1,024 (the module's table)."""
    terms = pack_terms([0, 1, 9], np.arange(9), [8192] + [1024] * 8)
    cfg = tiny_model("qwen2_vl").config
    dense = CostModel.from_config(cfg, "sdpa").per_term(terms)[:, 2]
    varlen = CostModel.from_config(cfg, "flash_attention_2").per_term(terms)[:, 2]
    assert dense[0] == dense[1] == 2 * varlen[0]  # causal kernels skip the masked half
    assert varlen[0] == 8 * varlen[1]
    total = CostModel.from_config(cfg, "flash_attention_2").cost(terms)
    assert total[0] > total[1]


def test_vision_term_per_image() -> None:
    """Sample 0 has two images of 16 and 4 patches, sample 1 one of 36: squares per image.
    Without per-image counts a sample's visual tokens count as one image."""
    assert grid_patches([[1, 4, 4], [1, 2, 2], [1, 6, 6]]).tolist() == [16, 4, 36]
    assert grid_patches([[3, 2, 4]]).tolist() == [8, 8, 8]  # a video: one unit per frame group
    patches = grid_patches([[1, 4, 4], [1, 2, 2], [1, 6, 6]])
    exact = pack_terms([0, 2], [0, 1], [30, 20], image_offsets=[0, 2, 3], image_patches=patches)
    assert exact.tolist() == [[50.0, 1300.0, 56.0, 16**2 + 4**2 + 36**2]]
    merged = pack_terms([0, 2], [0, 1], [30, 20], [5, 9])  # 5 visual tokens = 20 patches
    assert merged.tolist() == [[50.0, 1300.0, 56.0, 20**2 + 36**2]]
    only = CostModel(per_patch=1.0, per_patch_pair=1.0)
    assert only.per_term(exact)[0].tolist() == [0.0, 0.0, 0.0, 56.0, 1568.0]
    with pytest.raises(ValueError, match="image_offsets"):
        pack_terms([0, 1], [0], [30], image_patches=patches)


def test_pack_terms_of_a_plan_are_its_packs_sums() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 900, 300)
    visual = np.where(rng.random(300) < 0.5, rng.integers(1, 200, 300), 0).clip(0, lengths)
    plan = plan_packs(lengths, 2048, visual=visual, shuffle=False)
    terms = pack_terms(plan.offsets, plan.ids, lengths, visual)
    assert terms.shape == (len(plan), 4)
    for g, ids in enumerate(plan.packs()):
        ln, p = lengths[ids], visual[ids] * 4
        assert terms[g].tolist() == [ln.sum(), (ln**2).sum(), p.sum(), (p**2).sum()]
    assert terms[:, 0].tolist() == plan.totals.tolist()


@pytest.mark.parametrize("attention", ["documents", "dense"])
def test_calibrate_recovers_known_coefficients(attention: Any) -> None:
    rng = np.random.default_rng(1)
    n = 40
    docs = [rng.integers(20, 800, rng.integers(1, 6)) for _ in range(n)]
    offsets = np.concatenate([[0], np.cumsum([d.size for d in docs])])
    visual = rng.integers(0, 300, offsets[-1]) * (rng.random(offsets[-1]) < 0.4)
    terms = pack_terms(offsets, np.arange(offsets[-1]), np.concatenate(docs), visual)
    rows = np.maximum(terms[:, 0], 2048.0)
    true = CostModel(attention=attention, per_pack=0.01, per_token=2e-5, per_pair=3e-9,
                     per_patch=4e-6, per_patch_pair=0.0)  # fmt: skip
    seconds = true.cost(terms, row_length=rows)
    fit = CostModel(attention=attention).calibrate(terms, seconds, row_length=rows)
    assert fit.unit == "s"
    np.testing.assert_allclose(fit.coefficients, true.coefficients, rtol=1e-6, atol=1e-12)
    noisy = seconds * rng.normal(1.0, 0.02, n) - 0.02  # no exact fit; never a negative one
    fit = CostModel(attention=attention).calibrate(terms, noisy, row_length=rows)
    assert np.all(fit.coefficients >= 0)
    with pytest.raises(ValueError, match="packs and"):
        CostModel().calibrate(terms, seconds[:-1])


def _weights(module: torch.nn.Module, skip: str = "") -> int:
    """Multiply-adds per position: every Linear / Conv weight (not embeddings, norms, biases)."""
    return sum(int(m.weight.numel()) for name, m in module.named_modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d))
               and not (skip and skip in name))  # fmt: skip


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_from_config_counts_the_real_models_weights(family: str) -> None:
    """fwd+bwd FLOPs per token = 6 x the text layers' and LM head's weights; per patch = 6 x
    the tower's weights (the merger's per merged token / 4), plus Qwen2.5-VL's windows."""
    model = tiny_model(family)
    cost = CostModel.from_config(model.config, "flash_attention_2")
    text = model.config.text_config
    assert cost.attention == "documents"
    assert cost.per_token == 6 * (_weights(model.model.language_model) + _weights(model.lm_head))
    visual, vc = model.model.visual, model.config.vision_config
    mergers = _weights(visual) - _weights(visual, skip="merger")
    per_patch = _weights(visual, skip="merger") + mergers / 4
    width = vc.embed_dim if family == "qwen2_vl" else vc.hidden_size
    full, windows = vc.depth, 0
    if family == "qwen2_5_vl":  # windows of (window_size / patch_size)^2 patches (real: 64)
        full = len(vc.fullatt_block_indexes)
        windows = 4 * width * (vc.window_size // vc.patch_size) ** 2 * (vc.depth - full)
    assert cost.per_patch == 6 * (per_patch + windows / 2)
    assert cost.per_patch_pair == 3 * 4 * width * full
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert cost.per_pair == 3 * 2 * text.num_hidden_layers * text.num_attention_heads * head_dim
    assert CostModel.from_config(model.config, "sdpa").per_pair == 2 * cost.per_pair
    assert CostModel.from_config(model.config, "sdpa", backward=False).per_token * 3 == (
        cost.per_token
    )


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="attn_implementation='bogus'"):
        CostModel.from_config(tiny_model("qwen2_vl").config, "bogus")
    with pytest.raises(ValueError, match=r"per_token=-1\.0"):
        CostModel(per_token=-1.0)
    with pytest.raises(ValueError, match="attention='sparse'"):
        CostModel(attention="sparse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="row_length=5"):
        CostModel().cost(pack_terms([0, 1], [0], [8]), row_length=5)


def test_doctests_pass() -> None:
    import doctest

    from neatpack.pipes.planning import cost

    result = doctest.testmod(cost)
    assert result.failed == 0
    assert result.attempted >= 3
