"""The packing-leak probe (issue #20, item 2): on CPU transformers' torch fallbacks leak across
packed documents for hybrid models; attention-only models do not leak; the graph refuses to pack
a leaking model unless told to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neatpack.graphs import NeatLLMConfig, neat_llm_graph
from neatpack.pipes import (
    PackingLeakError,
    check_packing,
    neat_packed_vlm_collater,
    probe_packing_leak,
    tiny_hybrid_model,
)
from neatpack.pipes.materializing.pack import build_pack
from neatpack.pipes.testing.tiny_models import tiny_model

HYBRIDS = ("qwen3_next", "qwen3_5", "mamba2", "bamba", "nemotron_h", "falcon_h1")


def _batch(vocab: int, lengths: tuple[int, ...] = (20, 13, 17), **collate: object) -> dict:
    gen = torch.Generator().manual_seed(1)
    samples = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=gen)
        samples.append({"input_ids": ids, "labels": ids.clone()})
    return neat_packed_vlm_collater([build_pack(samples)], **collate)  # type: ignore[arg-type]


def test_attention_only_model_does_not_leak() -> None:
    model = tiny_model("qwen2")
    for fmt in ("sdpa", "eager", "position_ids"):
        report = probe_packing_leak(model, _batch(4000, mask_format=fmt))
        assert not report.leaks, (fmt, str(report))
        assert report.max_change == 0.0
        assert len(report.layers) == model.config.num_hidden_layers
    # and the probe can see a leak when there is one: no mask at all on the same model
    leaky = dict(_batch(4000, mask_format="sdpa"), attention_mask=None)
    leaky.pop("position_ids")
    report = probe_packing_leak(model, leaky)
    assert report.leaks
    assert report.layers[0].max_change > 1e-3


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_torch_fallback_leaks_on_cpu(family: str) -> None:
    model = tiny_hybrid_model(family)
    batch = _batch(model.config.vocab_size, mask_format="sdpa")
    report = probe_packing_leak(model, batch)
    assert report.leaks, str(report)
    # the first stateful layer already leaks (layer 0 of every tiny hybrid model is one)
    first = report.layers[0]
    assert first.kind in ("linear_attention", "mamba", "hybrid")
    assert first.max_change > report.tolerance
    # the perturbed document itself is not in the report; both later documents are
    assert set(first.per_document) == {(0, 2), (0, 3)}


def test_check_packing_names_layers_and_fix() -> None:
    model = tiny_hybrid_model("qwen3_next")
    with pytest.raises(PackingLeakError) as info:
        check_packing(model)
    msg = str(info.value)
    assert "layers 0 (linear_attention" in msg
    assert "flash-linear-attention" in msg
    assert "causal-conv1d" in msg
    assert "pad instead of packing" in msg
    assert "allow_packing_leak=True" in msg
    report = check_packing(model, allow_leak=True)
    assert report.leaks
    # transformers 5.24 refuses seq_idx / cu_seqlens on its torch fallbacks (5.17 takes and
    # ignores them: the leak is measured with them): the message says which happened
    assert ("refuses" in msg) == (report.boundaries_refused is not None)
    with pytest.raises(PackingLeakError, match="mamba-ssm"):
        check_packing(tiny_hybrid_model("bamba"))
    assert not check_packing(tiny_model("qwen2")).leaks


def test_check_packing_on_mrope_vlms_finds_no_leak() -> None:
    """The synthetic row of a Qwen-VL model carries [3, B, S] mRoPE positions (as the graph's
    batches do): attention-only VLMs pack exactly."""
    for family in ("qwen2_5_vl", "qwen3_vl"):
        report = check_packing(tiny_model(family))
        assert report.max_change == 0.0, (family, str(report))
        assert len(report.layers) == tiny_model(family).config.text_config.num_hidden_layers


def test_graph_refuses_a_leaking_model_unless_allowed() -> None:
    records = [{"input_ids": list(range(1, n + 1))} for n in (9, 12, 5, 7)]
    cfg = NeatLLMConfig(pack_size=32, attn_implementation="sdpa")
    model = tiny_hybrid_model("mamba2")
    with pytest.raises(PackingLeakError, match="mamba-ssm"):
        neat_llm_graph(records, config=cfg, model=model)
    allowed = NeatLLMConfig(pack_size=32, attn_implementation="sdpa", allow_packing_leak=True)
    batch = next(iter(neat_llm_graph(records, config=allowed, model=model)))
    # boundaries stay on unless the model refuses them (then the batch would not run);
    # Mamba2ForCausalLM in transformers 5.x drops seq_idx silently, so they stay on here
    refused = check_packing(model, allow_leak=True).boundaries_refused
    assert ("seq_idx" in batch) == (refused is None)
    # an attention-only model packs, with no boundaries (nothing needs them)
    batch = next(iter(neat_llm_graph(records, config=cfg, model=tiny_model("qwen2"))))
    assert "seq_idx" not in batch
    # a hybrid config (no weights to probe): boundaries on from the config
    batch = next(iter(neat_llm_graph(records, config=cfg, model=model.config)))
    assert batch["seq_idx"].dtype == torch.int32
    cu = batch["cu_seq_lens_q"].tolist()
    assert cu[0] == 0
    assert cu[-1] == 32
    assert batch["seq_idx"].shape == (1, 32)


#: the CUDA kernel packages each hybrid family's layers need to honour seq_idx / cu_seqlens
FUSED_KERNELS = {
    "qwen3_next": ("fla", "causal_conv1d"),
    "qwen3_5": ("fla", "causal_conv1d"),
    "mamba2": ("mamba_ssm", "causal_conv1d"),
    "bamba": ("mamba_ssm", "causal_conv1d"),
    "nemotron_h": ("mamba_ssm", "causal_conv1d"),
    "falcon_h1": ("mamba_ssm", "causal_conv1d"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("family", HYBRIDS)
def test_fused_kernels_do_not_leak_gpu(family: str) -> None:
    """On CUDA with flash-linear-attention / causal-conv1d / mamba-ssm installed, a packed row
    with boundaries equals separate runs: the probe finds no leak. Without them transformers
    falls back to its torch code on CUDA too, which leaks as on CPU: then the probe must see
    the leak (so ``check_packing`` and the graph refuse to pack the model)."""
    from importlib.util import find_spec

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    missing = [k for k in FUSED_KERNELS[family] if find_spec(k) is None]
    model = tiny_hybrid_model(family).cuda()
    batch = _batch(model.config.vocab_size, mask_format="sdpa", boundaries=True)
    if missing:  # the probe's own tolerance, as check_packing uses it
        report = probe_packing_leak(model, batch)
        assert report.leaks, f"{family} without {missing}: the torch fallback should leak"
        with pytest.raises(PackingLeakError):
            check_packing(model)
    else:
        report = probe_packing_leak(model, batch, tolerance=1e-4)
        assert not report.leaks, str(report)


def test_a_leaking_model_is_refused_before_any_record_is_read(tmp_path: Path) -> None:
    """The probe runs first: a model the graph cannot pack fails at once, not after the length
    index of a large corpus was built (here the data does not even exist)."""
    from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
    from neatpack.pipes import load_tiny_processor

    model = tiny_hybrid_model("mamba2")
    missing = tmp_path / "not-there.jsonl"
    with pytest.raises(PackingLeakError, match="mamba-ssm"):
        neat_llm_graph(str(missing), config=NeatLLMConfig(pack_size=32), model=model)
    with pytest.raises(PackingLeakError, match="mamba-ssm"):
        neat_vlm_graph(missing, load_tiny_processor(), config=NeatVLMConfig(), model=model)
