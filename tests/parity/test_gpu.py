"""On a CUDA machine: neatpack's batches through real GPU kernels (marker ``gpu``; these tests
skip without CUDA, and CI has none, so they are run on a lent GPU machine and reported).

* **Flash-attention varlen.** A ``flash_attention_2`` batch carries ``cu_seq_lens_q/k`` and
  ``max_length_q/k``; transformers hands them to its attention function. The function
  registered here is PyTorch's own FlashAttention-2 varlen kernel
  (``torch.nn.attention.varlen.varlen_attn``), so no flash-attn build is needed and the
  kernel sees exactly the boundaries neatpack computed. ``model(**model_inputs(batch)).loss``
  on a packed batch must equal each sample run alone (sdpa, unpacked, the model's own loss).
* **Pinned memory.** ``pin_memory=True`` puts every batch tensor in page-locked memory and
  resumes exactly like an unpinned graph.
"""

from __future__ import annotations

import inspect
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.neat_llm import NeatLLMConfig, neat_llm_graph
from neatpack.graphs.train import model_inputs
from neatpack.pipes.read import JsonlSource
from neatpack.pipes.synth import write_corpus
from neatpack.pipes.tiny import load_tiny_processor
from neatpack.pipes.tiny_models import tiny_model
from neatpack.pipes.tokenize import tokenize_conversation

pytestmark = pytest.mark.gpu
VARLEN = "neatpack_torch_varlen"


def _varlen_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract ([B, H, S, D] in, [B, S, H, D] out) over
    PyTorch's varlen flash kernel, fed the batch's own ``cu_seq_lens_*``."""
    from torch.nn.attention.varlen import varlen_attn

    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return _vision_attention(module, query, key, value, scaling, **kwargs)
    b, hq, s, d = query.shape
    hk = key.shape[1]
    q = query.transpose(1, 2).reshape(b * s, hq, d)
    k = key.transpose(1, 2).reshape(b * s, hk, d).repeat_interleave(hq // hk, dim=1)
    v = value.transpose(1, 2).reshape(b * s, hk, d).repeat_interleave(hq // hk, dim=1)
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = kwargs.get("cu_seq_lens_k", cu_q)
    max_q = int(kwargs.get("max_length_q") or int((cu_q[1:] - cu_q[:-1]).max()))
    max_k = int(kwargs.get("max_length_k") or max_q)
    params = inspect.signature(varlen_attn).parameters
    extra: dict[str, Any] = {"scale": scaling}
    if "is_causal" in params:  # older torch
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)
    out = varlen_attn(
        q, k, v, cu_q.to(q.device, torch.int32), cu_k.to(q.device, torch.int32),
        max_q, max_k, **extra,
    )  # fmt: skip
    return out.reshape(b, s, hq, d), None


def _vision_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The vision tower (not packed text, not what these tests are about): plain sdpa per
    image, as transformers does for sdpa."""
    cu = kwargs.get("cu_seq_lens_q")
    bounds = [0, query.shape[2]] if cu is None else [int(c) for c in cu]
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:e], key[:, :, a:e], value[:, :, a:e], scale=scaling
        )
        for a, e in itertools.pairwise(bounds)
    ]
    return torch.cat(outs, dim=2).transpose(1, 2), None


@pytest.fixture(scope="module", autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.fixture(scope="module")
def varlen_registered() -> str:
    from transformers import AttentionInterface

    pytest.importorskip("torch.nn.attention.varlen")
    AttentionInterface.register(VARLEN, _varlen_attention)
    return VARLEN


def _on(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


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


def test_varlen_flash_kernel_qwen2_vl_loss(varlen_registered: str, tmp_path: Path) -> None:
    """Qwen2-VL: mRoPE positions + the vision tower, packed rows through the varlen kernel."""
    proc = load_tiny_processor("qwen2_vl")
    corpus = write_corpus(tmp_path, num_samples=10, seed=3)
    media = str(corpus.parent / "media")
    cfg = NeatVLMConfig(pack_size=1024, batch_size=1, media_root=media, prefetch=0,
                        attn_implementation="flash_attention_2")  # fmt: skip
    model = tiny_model("qwen2_vl", processor=proc).to("cuda", torch.bfloat16)
    source = JsonlSource(corpus, media)
    checked = 0
    for batch in neat_vlm_graph(corpus, proc, config=cfg):
        ids = batch["sample_ids"][0]
        if len(ids) < 2:
            continue
        model.set_attn_implementation(varlen_registered)
        inputs = model_inputs(_on(batch))
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
        with torch.no_grad():
            got = float(model(**inputs).loss)
        samples = []
        for sid in ids:
            smp = tokenize_conversation(source[sid], proc)
            one = {"input_ids": smp["input_ids"][None], "labels": smp["labels"][None]}
            if "pixel_values" in smp:
                one["pixel_values"] = smp["pixel_values"].to(torch.bfloat16)
                one["image_grid_thw"] = smp["image_grid_thw"]
                if "mm_token_type_ids" in smp:
                    one["mm_token_type_ids"] = smp["mm_token_type_ids"][None]
            samples.append(one)
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
