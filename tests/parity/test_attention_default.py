"""The graphs' default attention (``attn_implementation="auto"``, #27 item 1) on real tiny
models, on CPU.

* CPU: "auto" is sdpa: the same batches, the same checkpoint key, a state saved by an explicit
  sdpa loader resumes in a default one.
* CUDA branch of the choice (``attention_choice.cuda_training`` answered True; nothing inside
  the model is replaced): the default graph gives ``flash_attention_2`` batches,
  ``use_varlen_attention`` / ``NeatTrainer`` switch the real tiny Qwen2-VL to neatpack's varlen
  function, whose CPU reference runs the forward: packed loss == each sample alone.
* Safety where the batch meets the model (``model_inputs(batch, model=model)``): a boundary
  batch for an attention that would let its documents see each other raises, naming the fix;
  one whose documents stay apart (transformers rebuilds the block mask from restarting text
  positions) runs and gives the dense mask's loss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.alone_loss import alone_loss
from transformers import Qwen2Config

import neatpack.pipes.collating.attention_choice as ac
import neatpack.pipes.collating.varlen_attention as va
from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.train import model_inputs
from neatpack.pipes import choose_attention_format, use_varlen_attention
from neatpack.pipes.collating.leak_probe import PackingLeakError, probe_packing_leak
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.tiny_models import tiny_model

pytestmark = pytest.mark.parity
TOL = 1e-4


def _config(corpus: Path, **kw: Any) -> NeatVLMConfig:
    return NeatVLMConfig(pack_size=1024, media_root=str(corpus.parent / "media"), prefetch=0,
                         shuffle=False, **kw)  # fmt: skip


def _packed(loader: Any) -> dict[str, Any]:
    """The first batch of several samples with several images."""
    for b in loader:
        if len(b["sample_ids"][0]) > 1 and int(b["image_grid_thw"].shape[0]) > 1:
            return dict(b)
    raise AssertionError("no packed batch with several images")


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA answer of the device check; the model still runs on CPU (fp32): neatpack's
    varlen function then runs its per-document sdpa reference in place of the kernel."""
    monkeypatch.setattr(ac, "cuda_training", lambda: True)


@pytest.fixture
def varlen_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """``causal`` of every attention call neatpack's varlen function made."""
    seen: list[bool] = []
    real = va._reference

    def recording(q: Any, k: Any, v: Any, cu: Any, causal: bool, scale: Any) -> Any:
        seen.append(causal)
        return real(q, k, v, cu, causal, scale)

    monkeypatch.setattr(va, "_reference", recording)
    return seen


def _alone_loss(model: Any, corpus: Path, proc: Any, ids: list[int]) -> float:
    return alone_loss(model, JsonlSource(corpus, corpus.parent / "media"), proc, ids)


def test_auto_on_cpu_is_sdpa_same_batches_key_and_resume(corpus: Path, proc: Any) -> None:
    default, sdpa = _config(corpus), _config(corpus, attn_implementation="sdpa")
    assert default.attn_implementation == "auto"
    a, b = neat_vlm_graph(corpus, proc, config=default), neat_vlm_graph(corpus, proc, config=sdpa)
    assert a.config == b.config
    assert a.config["attn_implementation"] == "sdpa"
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            same = torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
            assert same, k
    saved = neat_vlm_graph(corpus, proc, config=sdpa)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    rest = [z["sample_ids"] for z in it]
    resumed = neat_vlm_graph(corpus, proc, config=default)
    resumed.load_state_dict(state)
    assert [z["sample_ids"] for z in resumed] == rest
    assert rest


def _config_with(impl: str) -> Qwen2Config:
    cfg = Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    cfg._attn_implementation = impl
    return cfg


@pytest.mark.parametrize(
    ("name", "kw", "want"),
    [
        ("auto", {"cuda": False}, "sdpa"),
        ("auto", {"cuda": True}, "flash_attention_2"),
        ("auto", {"cuda": True, "cp_size": 2}, "sdpa"),  # CP shards a 4D mask
        ("auto", {"cuda": True, "block_causal": False}, "sdpa"),  # Gemma 3's image runs
        ("auto", {"cuda": True, "model": "sdpa"}, "sdpa"),  # the model says
        ("auto", {"cuda": False, "model": "neatpack_varlen"}, "flash_attention_2"),
        ("auto", {"cuda": True, "model": "flash_attention_3"}, "flash_attention_3"),
        ("auto", {"cuda": True, "model": "eager"}, "eager"),
        ("eager", {"cuda": True, "model": "neatpack_varlen"}, "eager"),  # named: as named
    ],
)
def test_the_choice_of_format(name: str, kw: dict[str, Any], want: str) -> None:
    if "model" in kw:
        kw = {**kw, "model": _config_with(kw["model"])}
    assert choose_attention_format(name, **kw) == want


def test_auto_refuses_a_model_attention_it_cannot_place() -> None:
    with pytest.raises(ValueError, match=r"cannot tell the batch format of .* 'my_attention'"):
        choose_attention_format("auto", model=_config_with("my_attention"))


def test_cuda_default_graph_and_helper_train_each_document_as_alone(
    corpus: Path, proc: Any, on_cuda: None, varlen_calls: list[bool]
) -> None:
    """The default config on CUDA: boundary batches (key says flash_attention_2); the helper
    switches the real model; its loss equals each sample alone."""
    loader = neat_vlm_graph(corpus, proc, config=_config(corpus))
    assert loader.config["attn_implementation"] == "flash_attention_2"
    batch = _packed(loader)
    assert batch["attention_mask"] is None
    assert batch["cu_seq_lens_q"].numel() > 2
    model = tiny_model("qwen2_vl", processor=proc)
    assert use_varlen_attention(model) == "neatpack_varlen"
    assert model.config._attn_implementation == "neatpack_varlen"
    with torch.no_grad():
        got = float(model(**model_inputs(batch, model=model)).loss)
    layers = model.config.text_config.num_hidden_layers
    assert varlen_calls.count(True) == layers
    assert varlen_calls.count(False) > 0
    want = _alone_loss(model, corpus, proc, batch["sample_ids"][0])
    assert abs(got - want) <= TOL * max(1.0, abs(want)), (got, want)


def test_helper_leaves_the_model_alone_on_cpu(proc: Any) -> None:
    model = tiny_model("qwen2_vl", processor=proc)
    assert use_varlen_attention(model, cuda=False) == "sdpa"
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    assert use_varlen_attention(model, cuda=True) == "neatpack_varlen"


def test_a_graph_given_the_model_follows_its_attention(
    corpus: Path, proc: Any, on_cuda: None
) -> None:
    model = tiny_model("qwen2_vl", processor=proc)  # sdpa: a dense mask, even on CUDA
    loader = neat_vlm_graph(corpus, proc, config=_config(corpus), model=model)
    assert loader.config["attn_implementation"] == "sdpa"
    use_varlen_attention(model)
    loader = neat_vlm_graph(corpus, proc, config=_config(corpus), model=model)
    assert loader.config["attn_implementation"] == "flash_attention_2"


@pytest.fixture(scope="module")
def boundary_batch(corpus: Path, proc: Any) -> dict[str, Any]:
    cfg = _config(corpus, attn_implementation="flash_attention_2")
    return _packed(neat_vlm_graph(corpus, proc, config=cfg))


def test_boundary_batch_on_sdpa_runs_when_the_positions_keep_documents_apart(
    boundary_batch: dict[str, Any], corpus: Path, proc: Any
) -> None:
    """transformers builds sdpa's mask from the restarting text positions (row 0 of the
    ``[4, B, S]`` positions): the check probes it, finds the documents apart, and the loss is
    the dense mask's."""
    model = tiny_model("qwen2_vl", processor=proc)
    with torch.no_grad():
        got = float(model(**model_inputs(boundary_batch, model=model)).loss)
    dense = _packed(neat_vlm_graph(corpus, proc, config=_config(corpus)))
    assert dense["sample_ids"] == boundary_batch["sample_ids"]
    with torch.no_grad():
        want = float(model(**model_inputs(dense, model=model)).loss)
    assert abs(got - want) <= TOL * max(1.0, abs(want)), (got, want)


def test_boundary_batch_on_sdpa_that_would_leak_raises(
    boundary_batch: dict[str, Any], corpus: Path, proc: Any
) -> None:
    """Without the text-position row (Qwen2-VL's own ``get_rope_index`` gives 3 rows),
    transformers cannot see the documents and sdpa attends across them: a measured leak. The
    check refuses it, naming the fix; the fix then trains each document as alone."""
    batch = dict(boundary_batch, position_ids=boundary_batch["position_ids"][1:])
    model = tiny_model("qwen2_vl", processor=proc)
    assert probe_packing_leak(model, batch).leaks  # really leaks: not a false alarm
    with pytest.raises(PackingLeakError, match=r"ignores them: its documents attend to each "
                       r"other.*use_varlen_attention\(model\)"):  # fmt: skip
        model_inputs(batch, model=model)
    use_varlen_attention(model, cuda=True)
    with torch.no_grad():
        got = float(model(**model_inputs(batch, model=model)).loss)
    want = _alone_loss(model, corpus, proc, batch["sample_ids"][0])
    assert abs(got - want) <= TOL * max(1.0, abs(want)), (got, want)


def test_dense_batch_for_a_boundary_attention_raises(corpus: Path, proc: Any) -> None:
    dense = _packed(neat_vlm_graph(corpus, proc, config=_config(corpus)))
    model = tiny_model("qwen2_vl", processor=proc)
    use_varlen_attention(model, cuda=True)
    with pytest.raises(ValueError, match=r"carries a dense 4D mask and no boundaries.*'auto'"):
        model_inputs(dense, model=model)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="eager', which adds the mask"):
        model_inputs(dense, model=model)  # sdpa's bool mask


def _trainer(model: Any, loader: Any, out: Path, **kw: Any) -> Any:
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from neatpack.graphs.hf_trainer import NeatTrainer

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=1, report_to=[],
                             use_cpu=True, max_steps=1, save_strategy="no")  # fmt: skip
    return NeatTrainer(model=model, args=args, train_loader=loader, **kw)


def test_neat_trainer_is_varlen_by_default_on_cuda(
    corpus: Path, proc: Any, on_cuda: None, varlen_calls: list[bool], tmp_path: Path
) -> None:
    model = tiny_model("qwen2_vl", processor=proc)
    trainer = _trainer(model, neat_vlm_graph(corpus, proc, config=_config(corpus)), tmp_path)
    assert model.config._attn_implementation == "neatpack_varlen"
    trainer.train()
    assert varlen_calls.count(True) >= model.config.text_config.num_hidden_layers
    kept = tiny_model("qwen2_vl", processor=proc)
    _trainer(kept, neat_vlm_graph(corpus, proc, config=_config(corpus)), tmp_path,
             varlen_attention=False)  # fmt: skip
    assert kept.config._attn_implementation == "sdpa"


def test_neat_trainer_leaves_the_model_alone_on_cpu(
    corpus: Path, proc: Any, tmp_path: Path
) -> None:
    model = tiny_model("qwen2_vl", processor=proc)
    _trainer(model, neat_vlm_graph(corpus, proc, config=_config(corpus)), tmp_path)
    assert model.config._attn_implementation == "sdpa"


def test_auto_keeps_a_mask_for_a_family_whose_mask_is_not_block_causal(
    on_cuda: None, proc: Any
) -> None:
    """Gemma 3's image runs attend both ways: no boundaries express that, so "auto" keeps
    sdpa's mask there on CUDA too (the family check would refuse flash_attention_2)."""
    from support import tiny

    from neatpack.graphs.families import family_attention

    gemma = tiny.load_tiny_gemma3_processor()
    assert family_attention(gemma, NeatVLMConfig()).attn_implementation == "sdpa"
    assert family_attention(proc, NeatVLMConfig()).attn_implementation == "flash_attention_2"


def test_a_state_saved_with_another_format_names_the_format_to_resume_with(
    corpus: Path, proc: Any, on_cuda: None
) -> None:
    """A state saved with sdpa batches (before "auto", or on CPU) loaded into a default graph
    on CUDA (varlen batches): refused by name, with the value that resumes it."""
    from neatpack.graphs import StateMismatchError

    saved = neat_vlm_graph(corpus, proc, config=_config(corpus, attn_implementation="sdpa"))
    next(iter(saved))
    fresh = neat_vlm_graph(corpus, proc, config=_config(corpus))
    with pytest.raises(StateMismatchError, match=r"pass attn_implementation='sdpa' to resume"):
        fresh.load_state_dict(saved.state_dict())
