"""On a CUDA machine: neatpack's batches through real GPU kernels (marker ``gpu``; these tests
skip without CUDA, and CI has none, so they are run on a lent GPU machine and reported).

* **Flash-attention varlen.** A ``flash_attention_2`` batch carries ``cu_seq_lens_q/k`` and
  ``max_length_q/k``; transformers hands them to its attention function. The function
  registered here is neatpack's ``register_varlen_attention()`` over PyTorch's own
  FlashAttention-2 varlen kernel (``torch.nn.attention.varlen.varlen_attn``), so no flash-attn
  build is needed. Every kernel call must get its own tensor's boundaries (the CPU twin of
  these checks is tests/parity/test_varlen_attention.py), the vision tower's features must
  equal sdpa's, and ``model(**model_inputs(batch)).loss`` on a packed batch must equal each
  sample run alone (sdpa, unpacked, the model's own loss).
* **Pinned memory.** ``pin_memory=True`` puts every batch tensor in page-locked memory and
  resumes exactly like an unpinned graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.spies import attention_call, spy

import neatpack.pipes.collating.varlen_attention as va
from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.neat_llm import NeatLLMConfig, neat_llm_graph
from neatpack.graphs.train import model_inputs
from neatpack.pipes.collating.varlen_attention import register_varlen_attention
from neatpack.pipes.materializing.tokenize import tokenize_conversation
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import tiny_model

pytestmark = pytest.mark.gpu
TEXT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@pytest.fixture(scope="module", autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.fixture(scope="module")
def varlen_registered() -> str:
    pytest.importorskip("torch.nn.attention.varlen")
    return register_varlen_attention()


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int, list[int]]]:
    """(causal, tokens, boundaries) of every call into the varlen kernel."""
    return spy(va, "_kernel", attention_call, monkeypatch)


def _features(out: Any) -> Any:
    """Per-image features of ``get_image_features`` (an output object or, on some 5.x, a tuple)."""
    return getattr(out, "pooler_output", out)


def _on(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _bf16_pixels(inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with their pixels, if any, in the bf16 model's dtype."""
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    return inputs


def _default_graph(tmp_path: Path) -> tuple[Any, Path, str, Any]:
    """The tiny Qwen2-VL processor, a 10-sample corpus, its media folder and the default graph
    over it (packs of 1,024; ``"auto"`` attention); the test skips without a varlen kernel."""
    from neatpack.pipes.collating.attention_choice import cuda_training

    if not cuda_training():
        pytest.skip("no varlen kernel (torch.nn.attention.varlen) and no flash-attn")
    proc = load_tiny_processor("qwen2_vl")
    corpus = write_corpus(tmp_path, num_samples=10, seed=3)
    media = str(corpus.parent / "media")
    config = NeatVLMConfig(pack_size=1024, media_root=media, prefetch=0)
    return proc, corpus, media, neat_vlm_graph(corpus, proc, config=config)


@torch.no_grad()
def _reference_loss(model: Any, samples: list[dict[str, Any]]) -> float:
    """Token-mean next-token CE of the samples, each run alone with sdpa (the model shifts)."""
    total, count = 0.0, 0
    model.set_attn_implementation("sdpa")
    for smp in samples:
        n = int(smp["labels"][0, 1:].ne(-100).sum())
        if n:
            total += float(model(**_on(smp), num_items_in_batch=1, use_cache=False).loss)
            count += n
    return total / count


def _text_records(n: int = 24, seed: int = 5) -> list[dict[str, Any]]:
    """Tokenized text samples: a prompt third that is not trained, then trained tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 40, (1,), generator=g))
        ids = torch.randint(10, 4000, (length,), generator=g)
        labels = ids.clone()
        labels[: length // 3] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def _close(got: float, want: float, rel: float = 2e-2) -> None:
    """bf16 on both sides (the varlen kernel takes half precision only)."""
    assert abs(got - want) <= rel * max(1.0, abs(want)), (got, want)


def test_varlen_flash_kernel_text_loss(varlen_registered: str) -> None:
    records = _text_records()
    cfg = NeatLLMConfig(pack_size=128, batch_size=1, attn_implementation="flash_attention_2",
                        prefetch=0)  # fmt: skip
    model = tiny_model("qwen2").to("cuda", torch.bfloat16)
    checked = 0
    for batch in neat_llm_graph(records, config=cfg):
        assert len(batch["sample_ids"][0]) > 1  # really packed
        assert "attention_mask" not in batch or batch["attention_mask"] is None
        model.set_attn_implementation(varlen_registered)
        with torch.no_grad():
            got = float(model(**model_inputs(_on(batch))).loss)
        samples = [
            {"input_ids": torch.tensor([records[i]["input_ids"]]),
             "labels": torch.tensor([records[i]["labels"]])}
            for i in batch["sample_ids"][0]
        ]  # fmt: skip
        _close(got, _reference_loss(model, samples))
        checked += 1
    assert checked >= 3


def test_varlen_flash_kernel_qwen2_vl_loss(
    varlen_registered: str,
    kernel_calls: list[tuple[bool, int, list[int]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Qwen2-VL: mRoPE positions + the vision tower, packed rows through the varlen kernel.

    transformers 5.17 hands the text's ``cu_seq_lens_*`` to every vision-tower call (60 of 60
    on the H200 run), 5.24 does not; the tower's ``forward`` gets them here on every release.
    Each kernel call must attend by its own tensor's boundaries (the pack's documents in the
    text layers, one image per vision call) and the tower's features must equal sdpa's. The
    function this file registered before split every image by the text's boundaries on 5.17
    and still passed the loss check alone."""
    proc = load_tiny_processor("qwen2_vl")
    corpus = write_corpus(tmp_path, num_samples=10, seed=3)
    media = str(corpus.parent / "media")
    cfg = NeatVLMConfig(pack_size=1024, batch_size=1, media_root=media, prefetch=0,
                        attn_implementation="flash_attention_2")  # fmt: skip
    model = tiny_model("qwen2_vl", processor=proc).to("cuda", torch.bfloat16)
    visual = model.model.visual
    tower = visual.forward
    forwarded: dict[str, Any] = {}  # the text boundaries, as 5.17 passes them to the tower
    monkeypatch.setattr(visual, "forward", lambda *a, **kw: tower(*a, **{**kw, **forwarded}))
    source = JsonlSource(corpus, media)
    checked = 0
    for batch in neat_vlm_graph(corpus, proc, config=cfg):
        ids = batch["sample_ids"][0]
        if len(ids) < 2 or "pixel_values" not in batch:
            continue
        inputs = model_inputs(_on(batch))
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
        pv, grid = inputs["pixel_values"], inputs["image_grid_thw"]
        forwarded.clear()
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            want_features = _features(model.model.get_image_features(pv, grid))
        forwarded.update({k: inputs[k] for k in TEXT_KEYS})
        model.set_attn_implementation(varlen_registered)
        kernel_calls.clear()
        with torch.no_grad():
            got_features = _features(model.model.get_image_features(pv, grid))
            got = float(model(**inputs).loss)
        # bf16 hides a wrong split of this tiny tower (0.7 % of the features' norm): the
        # recorded boundaries below are the decisive check, the fp32 twin on CPU the exact one.
        for g, w in zip(got_features, want_features, strict=True):
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
        text_cu = batch["cu_seq_lens_q"].tolist()
        images = [int(t * h * w) for t, h, w in batch["image_grid_thw"].tolist()]
        vision = [(False, n, [0, n]) for n in images] * model.config.vision_config.depth
        layers = model.config.text_config.num_hidden_layers
        assert kernel_calls == vision * 2 + [(True, text_cu[-1], text_cu)] * layers
        forwarded.clear()
        samples = [_alone_inputs(tokenize_conversation(source[sid], proc)) for sid in ids]
        _close(got, _reference_loss(model, samples))
        checked += 1
    assert checked >= 2


def test_pin_memory_pins_every_tensor_and_resumes_exactly() -> None:
    records = _text_records(40)
    cfg = NeatLLMConfig(pack_size=64, batch_size=2, pin_memory=True, num_workers=1,
                        attn_implementation="sdpa")  # fmt: skip
    loader = neat_llm_graph(records, config=cfg)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    for batch in first:
        tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
        assert tensors
        assert all(t.is_pinned() for t in tensors), [k for k, v in batch.items()
                                                    if isinstance(v, torch.Tensor)
                                                    and not v.is_pinned()]  # fmt: skip
        batch["input_ids"].to("cuda", non_blocking=True)
    state = loader.state_dict()
    rest = [b["sample_ids"] for b in it]
    resumed = neat_llm_graph(records, config=cfg)
    resumed.load_state_dict(state)
    assert [b["sample_ids"] for b in resumed] == rest
    assert rest


def _alone_inputs(smp: dict[str, Any]) -> dict[str, Any]:
    one = {"input_ids": smp["input_ids"][None], "labels": smp["labels"][None]}
    if "pixel_values" in smp:
        one["pixel_values"] = smp["pixel_values"].to(torch.bfloat16)
        one["image_grid_thw"] = smp["image_grid_thw"]
        if "mm_token_type_ids" in smp:
            one["mm_token_type_ids"] = smp["mm_token_type_ids"][None]
    return one


def test_default_graph_and_helper_train_packed_as_separate_in_bf16(
    kernel_calls: list[tuple[bool, int, list[int]]], tmp_path: Path
) -> None:
    """#27: the default config on CUDA gives flash_attention_2 batches (``"auto"``), and
    ``use_varlen_attention`` puts the real tiny Qwen2-VL (bf16) on neatpack's varlen function:
    every text layer goes through PyTorch's varlen kernel with the pack's boundaries, each
    document's logits match the sample run alone (sdpa, unpacked) and so does the loss."""
    from neatpack.pipes import use_varlen_attention

    proc, corpus, media, loader = _default_graph(tmp_path)
    assert loader.config["attn_implementation"] == "flash_attention_2"
    model = tiny_model("qwen2_vl", processor=proc).to("cuda", torch.bfloat16)
    assert use_varlen_attention(model) == "neatpack_varlen"
    source = JsonlSource(corpus, media)
    layers = model.config.text_config.num_hidden_layers
    checked = 0
    for batch in loader:
        ids = batch["sample_ids"][0]
        if len(ids) < 2:
            continue
        assert batch["attention_mask"] is None
        model.set_attn_implementation("neatpack_varlen")  # the sdpa runs below switched it
        inputs = _bf16_pixels(model_inputs(_on(batch), model=model))
        kernel_calls.clear()
        with torch.no_grad():
            out = model(**inputs)
        text_cu = batch["cu_seq_lens_q"].tolist()
        assert [c for c in kernel_calls if c[0]] == [(True, text_cu[-1], text_cu)] * layers
        samples = [_alone_inputs(tokenize_conversation(source[sid], proc)) for sid in ids]
        model.set_attn_implementation("sdpa")
        doc = batch["doc_ids"][0]
        for j, one in enumerate(samples, start=1):
            where = (doc == j).nonzero().flatten()
            assert torch.equal(batch["input_ids"][0, where], one["input_ids"][0])
            with torch.no_grad():
                alone = model(**_on(one), use_cache=False).logits[0].float()
            packed = out.logits[0, where.cuda()].float()
            cos = torch.nn.functional.cosine_similarity(packed.flatten(), alone.flatten(), dim=0)
            assert float(cos) > 0.999, (j, float(cos))
            assert float((packed - alone).abs().mean()) <= 2e-2 * float(alone.abs().mean()) + 1e-3
        _close(float(out.loss), _reference_loss(model, samples))
        checked += 1
    assert checked >= 2


def test_default_boundary_batches_on_a_kept_sdpa_model_pass_the_check(tmp_path: Path) -> None:
    """``varlen_attention=False`` (the model kept on sdpa) with the default CUDA batches: the
    check probes the bf16 model once, finds the documents apart (transformers rebuilds the mask
    from the text positions) and the loss is the varlen path's."""
    from neatpack.pipes import use_varlen_attention

    proc, _, _, loader = _default_graph(tmp_path)
    batch = next(b for b in loader if len(b["sample_ids"][0]) > 1)
    model = tiny_model("qwen2_vl", processor=proc).to("cuda", torch.bfloat16)
    inputs = _bf16_pixels(model_inputs(_on(batch), model=model))  # sdpa: probed, passes
    with torch.no_grad():
        kept = float(model(**inputs).loss)
        use_varlen_attention(model)
        varlen = float(model(**inputs).loss)
    _close(kept, varlen)
