"""neatpack's varlen attention function on CPU: the boundaries each attention call attends by.

A real tiny Qwen2-VL forward on ``neat_vlm_graph``'s ``flash_attention_2`` batches, with
``register_varlen_attention()`` set as the model's attention. Off CUDA the function runs its
per-document sdpa reference in place of the kernel, with the same checks and the same splits,
so what is checked here is what the GPU kernel gets (tests/parity/test_gpu.py runs the kernel).

transformers 5.17 forwards the model's keyword arguments, the text's ``cu_seq_lens_q/k``
included, to every vision-tower attention call; 5.24 (here) does not. ``_forward_text_kwargs``
does what 5.17 does, so both releases' call patterns are checked on this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.alone_loss import alone_loss
from support.spies import attention_call, spy

import neatpack.pipes.collating.varlen_attention as va
from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.train import model_inputs
from neatpack.pipes import check_boundaries, register_varlen_attention
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.tiny_models import tiny_model

pytestmark = pytest.mark.parity
TOL = 1e-4
TEXT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@pytest.fixture(scope="module")
def batch(corpus: Path, proc: Any) -> dict[str, Any]:
    media = str(corpus.parent / "media")
    cfg = NeatVLMConfig(pack_size=1024, batch_size=1, media_root=media, prefetch=0,
                        shuffle=False, attn_implementation="flash_attention_2")  # fmt: skip
    for b in neat_vlm_graph(corpus, proc, config=cfg):
        if len(b["sample_ids"][0]) > 1 and int(b["image_grid_thw"].shape[0]) > 1:
            return b
    raise AssertionError("no packed batch with several images")


@pytest.fixture
def model(proc: Any) -> Any:
    return tiny_model("qwen2_vl", processor=proc)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int, list[int]]]:
    """(causal, tokens, boundaries used) of every attention call the function makes."""
    return spy(va, "_reference", attention_call, monkeypatch)


def _forward_text_kwargs(model: Any, batch: dict[str, Any], monkeypatch: Any) -> None:
    """Hand the batch's text boundaries to the vision tower, as transformers 5.17 does (5.24's
    ``accepts_precomputed_kwargs`` drops them before the tower; 5.17 passes them through)."""
    visual = model.model.visual
    real = visual.forward
    extra = {k: batch[k] for k in TEXT_KEYS}
    monkeypatch.setattr(visual, "forward", lambda *a, **kw: real(*a, **{**kw, **extra}))


@pytest.mark.parametrize("release", ["5.24", "5.17"])
def test_each_call_attends_by_its_own_boundaries(
    release: str,
    batch: dict[str, Any],
    model: Any,
    calls: list[tuple[bool, int, list[int]]],
    corpus: Path,
    proc: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Text layers: the pack's documents. Vision tower: one image per call, never the text's
    boundaries, also when transformers forwards them (5.17). The loss is each sample alone's."""
    if release == "5.17":
        _forward_text_kwargs(model, batch, monkeypatch)
    model.set_attn_implementation(register_varlen_attention())
    with torch.no_grad():
        got = float(model(**model_inputs(batch)).loss)
    text_cu = batch["cu_seq_lens_q"].tolist()
    per_image = [int(t * h * w) for t, h, w in batch["image_grid_thw"].tolist()]
    layers, depth = model.config.text_config.num_hidden_layers, model.config.vision_config.depth
    assert [c for c in calls if c[0]] == [(True, text_cu[-1], text_cu)] * layers
    assert [c for c in calls if not c[0]] == [(False, n, [0, n]) for n in per_image] * depth
    source = JsonlSource(corpus, corpus.parent / "media")
    want = alone_loss(model, source, proc, batch["sample_ids"][0])
    assert abs(got - want) <= TOL * max(1.0, abs(want)), (got, want)


def test_vision_tower_output_ignores_the_forwarded_text_boundaries(
    batch: dict[str, Any], model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 5.17 call chain on the tower alone: its features equal plain sdpa's."""
    pv, grid = batch["pixel_values"], batch["image_grid_thw"]
    with torch.no_grad():
        want = model.model.get_image_features(pv, grid, return_dict=True).pooler_output
        _forward_text_kwargs(model, batch, monkeypatch)
        model.set_attn_implementation(register_varlen_attention())
        got = model.model.get_image_features(pv, grid, return_dict=True).pooler_output
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)


def test_text_layer_refuses_boundaries_of_another_tensor(batch: dict[str, Any], model: Any) -> None:
    """A pack's boundaries that do not cover its tokens: a clear error, not a silent split."""
    model.set_attn_implementation(register_varlen_attention())
    inputs = model_inputs(batch)
    inputs["cu_seq_lens_q"] = inputs["cu_seq_lens_k"] = batch["cu_seq_lens_q"][:-1]
    with pytest.raises(ValueError, match=r"cu_seq_lens_q=.* attends over 1024 tokens"):
        model(**inputs)
    del inputs["cu_seq_lens_q"], inputs["cu_seq_lens_k"]
    with pytest.raises(ValueError, match="no cu_seq_lens_q; build the batches with"):
        model(**inputs)


@pytest.mark.parametrize(
    ("cu", "tokens"), [([0, 4, 6], 7), ([0, 4, 3, 6], 6), ([1, 6], 6), ([6], 6)]
)
def test_check_boundaries_refuses_what_is_not_this_tensors(cu: list[int], tokens: int) -> None:
    with pytest.raises(ValueError, match=f"attends over {tokens} tokens"):
        check_boundaries(cu, tokens, key="cu_seq_lens_q")
    assert check_boundaries([0, 2, 2, tokens], tokens, key="k").tolist() == [0, 2, 2, tokens]


def test_vision_call_with_its_own_mask_goes_through_sdpa(model: Any) -> None:
    """A tower that masks its images apart (one tensor, a block-diagonal mask) keeps its mask."""
    block = model.model.visual.blocks[0].attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 16, generator=g) for _ in range(3))
    mask = torch.zeros(10, 10, dtype=torch.bool)
    mask[:6, :6] = mask[6:, 6:] = True
    got, _ = va.varlen_attention(block, q, k, v, mask[None, None], is_causal=False,
                                 cu_seq_lens_q=torch.tensor([0, 3, 10]))  # fmt: skip
    want = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:e], k[:, :, a:e], v[:, :, a:e]
            )
            for a, e in ((0, 6), (6, 10))
        ],
        dim=2,
    )
    torch.testing.assert_close(got, want.transpose(1, 2))
