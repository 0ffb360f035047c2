"""``neat_vlm_graph`` for the families registered after the first graph families: Kimi K2.5,
Step3, SmolVLM, Qwen3-Omni, Nemotron-H Omni (attention-only stack) and Phi-4-multimodal
(refused at build time: ``Handler.graph_refused``).

As ``test_graph_families``: a batch of 2 packed rows from the graph is fed to the family's tiny
real model and each document's logits must equal the document run alone (max abs diff <= 1e-5
fp32); the length estimate the graph plans with equals the real length in exact mode.

Qwen3-Omni audio packs exactly only when every clip fills whole 100-frame encoder chunks
(multiples of 1 s): its audio tower zero-pads each call's partial chunks to the longest one and
its convolutions have a bias, so a partial chunk's features depend on the other clips of the
same forward (``test_qwen3_omni_partial_chunks_depend_on_the_batch`` measures it). That is the
model's own batching behaviour, not the graph's; records here use whole-second clips.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from support import tiny, tiny_family_models
from support.graph_records import _wav, jsonl_source, omni_corpus

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.families import tokenize_with_handler
from neatpack.pipes.indexing.handler_lengths import HandlerEstimator
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.synth import write_corpus

#: family: (module, media keys the model takes)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kimi_k25": ("families.kimi", ("pixel_values", "image_grid_thw")),
    "step3": ("families.step3", ("pixel_values", "pixel_values_local", "num_local_patches")),
    "smolvlm": ("families.smolvlm", ("pixel_values", "pixel_attention_mask")),
    "qwen3_omni": ("families.qwen3_omni",
                   ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask")),
    "nemotron_omni": ("families.nemotron_omni",
                      ("pixel_values", "image_grid_hw", "input_features", "input_features_mask")),
}  # fmt: skip
PACK_SIZE = 640


@cache
def _processor(family: str) -> Any:
    return getattr(tiny, f"load_tiny_{family}_processor")()


@cache
def _model(family: str) -> Any:
    if family == "nemotron_omni":  # attention-only by default (see the family module)
        from support.tiny_family_models import tiny_nemotron_omni_model

        return tiny_nemotron_omni_model(_processor(family))
    return getattr(tiny_family_models, f"tiny_{family}_model")(_processor(family))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = write_corpus(
        tmp_path_factory.mktemp("more_families"), num_samples=12, seed=3, max_images=2
    )
    return path


def _forward(family: str, batch: dict[str, Any], **over: Any) -> torch.Tensor:
    kw = {k: batch[k] for k in FAMILIES[family][1] if k in batch}
    kw.update(over)
    with torch.no_grad():
        out = _model(family)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"], **kw)  # fmt: skip
    return out.logits  # type: ignore[no-any-return]


def _alone(family: str, sample: dict[str, Any]) -> torch.Tensor:
    """One document's logits run alone (the model computes its own positions)."""
    ids = sample["input_ids"][:-1][None]
    kw = {k: sample[k] for k in FAMILIES[family][1] if k in sample}
    with torch.no_grad():
        out = _model(family)(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
    return out.logits[0]  # type: ignore[no-any-return]


def _worst(
    family: str, batch: dict[str, Any], logits: torch.Tensor, sample: Callable[[int], Any]
) -> tuple[float, int]:
    """Max abs diff of each document's logits in the batch vs the document alone; docs seen."""
    worst, docs = 0.0, 0
    for row, ids in enumerate(batch["sample_ids"]):
        for k, sid in enumerate(ids, start=1):
            where = batch["doc_ids"][row] == k
            ref = _alone(family, sample(sid))[: int(where.sum())]
            worst = max(worst, float((logits[row, where] - ref).abs().max()))
            docs += 1
    return worst, docs


def _config(**kw: Any) -> NeatVLMConfig:
    base: dict[str, Any] = {"pack_size": PACK_SIZE, "batch_size": 2, "estimate_mode": "exact",
                            "attn_implementation": "eager"}  # fmt: skip
    return NeatVLMConfig(**{**base, **kw})


@pytest.mark.parity
@pytest.mark.parametrize("family", ["kimi_k25", "smolvlm", "step3"])
def test_graph_batch_equals_separate_runs(corpus: Path, family: str) -> None:
    """2 packed rows from the graph == every document alone (<= 1e-5 fp32; observed <= 6e-7);
    halved pixels change the logits (the batch's media really feed the model)."""
    proc = _processor(family)
    media_root = str(corpus.parent / "media")
    batch = next(iter(neat_vlm_graph(corpus, proc, config=_config(media_root=media_root))))
    assert batch["input_ids"].shape == (2, PACK_SIZE)
    assert int(batch["n_media_samples"].sum()) >= 2
    source = JsonlSource(corpus, media_root=media_root)
    logits = _forward(family, batch)
    worst, docs = _worst(family, batch, logits, lambda i: tokenize_with_handler(source[i], proc))
    assert docs >= 3
    assert worst <= 1e-5, (family, worst)
    halved = _forward(family, batch, pixel_values=batch["pixel_values"] * 0.5)
    assert float((halved - logits).abs().max()) > 1e-4


def _whole_second_corpus(root: Path, n: int = 8, seconds: tuple[int, ...] = (1, 2)) -> JsonlSource:
    """n records: 0-2 clips of ``seconds`` s (whole encoder chunks) and 0-1 image per record."""
    rng = random.Random(5)
    words = ("tone", "red", "green", "sound", "the", "cat", "hears", "a", "loud", "note")
    records: list[dict[str, Any]] = []
    for i in range(n):
        lengths = [rng.choice(seconds) for _ in range(i % 3)]
        user: list[dict[str, Any]] = [
            {"type": "audio", "audio": _wav(root / f"s{i}_{k}.wav", rng, n * 16000)}
            for k, n in enumerate(lengths)
        ]
        if i % 2 == 0:
            name = str(root / f"p{i}.png")
            Image.new("RGB", (rng.randint(28, 100), rng.randint(28, 100)), (9, 9, 200)).save(name)
            user.append({"type": "image", "image": name})
        user.append({"type": "text", "text": " ".join(rng.choices(words, k=rng.randint(3, 12)))})
        answer = " ".join(rng.choices(words, k=rng.randint(2, 15)))
        records.append({"conversation": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})  # fmt: skip
    return jsonl_source(root, records)


def _omni_batch(
    source: JsonlSource, family: str = "qwen3_omni", **kw: Any
) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    proc = _processor(family)
    cfg = _config(**{"pack_size": 256, **kw})
    batch = next(iter(neat_vlm_graph(source, proc, config=cfg)))
    samples = {sid: tokenize_with_handler(source[sid], proc)
               for ids in batch["sample_ids"] for sid in ids}  # fmt: skip
    return batch, samples


@pytest.mark.parity
def test_qwen3_omni_graph_audio_positions_and_parity(tmp_path: Path) -> None:
    """Qwen3-Omni through the graph (images + whole-second audio): positions ``[3, B, S]`` ==
    ``qwen_omni_mrope`` per document (== the thinker's ``get_rope_index``), one feature row per
    clip in document order, and the 2 rows == each document alone (<= 1e-5 fp32)."""
    from neatpack.pipes.families.qwen_omni import qwen_omni_mrope

    proc = _processor("qwen3_omni")
    batch, samples = _omni_batch(_whole_second_corpus(tmp_path))
    assert batch["position_ids"].shape == (3, 2, 256)
    assert bool((batch["mm_token_type_ids"] == 3).any())  # audio tokens in the batch
    clips = [s for ids in batch["sample_ids"] for sid in ids
             if "input_features" in (s := samples[sid])]  # fmt: skip
    assert len(clips) >= 2
    assert int(batch["input_features"].shape[0]) == sum(len(s["input_features"]) for s in clips)
    for row, ids in enumerate(batch["sample_ids"]):
        for k, sid in enumerate(ids, start=1):
            where = batch["doc_ids"][row] == k
            want = qwen_omni_mrope(samples[sid], proc)[:, :-1]
            assert torch.equal(batch["position_ids"][:, row, where], want.long()), sid
    logits = _forward("qwen3_omni", batch)
    worst, docs = _worst("qwen3_omni", batch, logits, samples.__getitem__)
    assert docs >= 3
    assert worst <= 1e-5, worst
    halved = _forward("qwen3_omni", batch, input_features=batch["input_features"] * 0.5)
    assert float((halved - logits).abs().max()) > 1e-4  # the clips really feed the model


@pytest.mark.slow
def test_qwen3_omni_partial_chunks_depend_on_the_batch(tmp_path: Path) -> None:
    """The measured limit (module docstring): clips of 0.1-2 s (partial chunks) in one batch;
    the audio documents differ from their own runs (observed 0.14), text-only documents and
    the audio-free image documents do not."""
    batch, samples = _omni_batch(omni_corpus(tmp_path))
    logits = _forward("qwen3_omni", batch)
    audio_free = {sid for sid, s in samples.items() if "input_features" not in s}
    worst, _ = _worst("qwen3_omni", batch, logits, samples.__getitem__)
    assert worst > 1e-3
    for row, ids in enumerate(batch["sample_ids"]):
        for k, sid in enumerate(ids, start=1):
            if sid in audio_free:
                where = batch["doc_ids"][row] == k
                ref = _alone("qwen3_omni", samples[sid])[: int(where.sum())]
                assert float((logits[row, where] - ref).abs().max()) <= 1e-5, sid


@pytest.mark.parametrize("family", ["kimi_k25", "smolvlm", "step3", "gemma4"])
def test_the_planned_length_is_the_real_length(corpus: Path, family: str) -> None:
    """The graph's estimator for the family (``handler_estimator``, exact mode, image sizes from
    the file headers) == the real row length after the shift, for every record."""
    proc = _processor(family)
    source = JsonlSource(corpus, media_root=str(corpus.parent / "media"))
    est = HandlerEstimator(family, proc, "exact")
    for sid in range(len(source)):
        real = len(tokenize_with_handler(source[sid], proc)["input_ids"]) - 1
        assert est.estimate(source[sid])[0] == real, (family, sid)


@pytest.mark.parametrize("family", ["qwen3_omni", "nemotron_omni"])
def test_audio_family_planned_length_is_the_real_length(tmp_path: Path, family: str) -> None:
    """Audio (lengths from the WAV headers) and images: the graph's estimate == real length."""
    proc = _processor(family)
    source = omni_corpus(tmp_path)
    est = HandlerEstimator(family, proc, "exact")
    for sid in range(len(source)):
        sample = tokenize_with_handler(source[sid], proc)
        total, visual = est.estimate(source[sid])
        assert total == len(sample["input_ids"]) - 1, sid
        assert (visual > 0) == ("input_features" in sample or "pixel_values" in sample), sid


@pytest.mark.badinput
def test_phi4_is_refused_at_build(corpus: Path) -> None:
    """Phi-4-multimodal's forward cannot take a mixed batch exactly: refused naming the family,
    the reason and the fix, before any record is read."""
    from support.tiny import load_tiny_phi4_processor

    with pytest.raises(ValueError, match=r"cannot serve handler 'phi4': .*audio projection"):
        neat_vlm_graph(corpus, load_tiny_phi4_processor(), config=_config())


@pytest.mark.parity
def test_nemotron_omni_graph_parity_on_an_attention_only_stack(tmp_path: Path) -> None:
    """Nemotron-H Omni through the graph (images + 1 s clips: equal clip lengths, the family's
    documented limit) on an attention-only Nemotron-H stack: the 2 rows == each document alone
    (<= 1e-5 fp32). The hybrid stack's Mamba layers are not isolated per document and clips of
    unequal length see the encoder padding (both measured in ``test_family_nemotron_omni``)."""
    batch, samples = _omni_batch(_whole_second_corpus(tmp_path, seconds=(1,)), "nemotron_omni")
    assert set(batch["attention_mask"]) == {"full_attention", "linear_attention"}
    assert int(batch["input_features"].shape[0]) >= 2
    assert "pixel_values" in batch
    logits = _forward("nemotron_omni", batch)
    worst, docs = _worst("nemotron_omni", batch, logits, samples.__getitem__)
    assert docs >= 3
    assert worst <= 1e-5, worst
    halved = _forward("nemotron_omni", batch, input_features=batch["input_features"] * 0.5)
    assert float((halved - logits).abs().max()) > 1e-4  # the clips really feed the model
    flash = _omni_batch(_whole_second_corpus(tmp_path, seconds=(1,)), "nemotron_omni",
                        attn_implementation="flash_attention_2", max_packs=2)[0]  # fmt: skip
    assert flash["attention_mask"] is None  # block-causal attention layers: cu_seqlens
