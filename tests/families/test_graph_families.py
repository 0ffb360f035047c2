"""``neat_vlm_graph`` for every registered family, not only Qwen-VL.

A batch of 2 packed rows from the graph (planning, materialize, collate, the family's media
merged over the batch and its mask) is fed to the family's tiny real model; each document's
logits must equal the document run alone (max abs diff <= 1e-5 fp32). Also: Qwen2.5-Omni with
audio (mRoPE positions == ``qwen_omni_mrope`` per document), configs that cannot work for a
family refused at build time, and checkpoint / resume through the graph with a worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from support import tiny, tiny_family_models
from support.graph_records import omni_corpus

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.collating.mask import to_4d_additive_mask
from neatpack.pipes.families import tokenize_with_handler
from neatpack.pipes.materializing.mrope import MRopeConfig, mrope_position_ids
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.resume import assert_exactly_once, same_item
from neatpack.pipes.testing.synth import write_corpus

#: family: (model builder, per-sample media keys, token-type kwarg of the model)
FAMILIES: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    "gemma3": ("tiny_gemma3_model", ("pixel_values",), "token_type_ids"),
    "gemma4": ("tiny_gemma4_model", ("pixel_values", "image_position_ids"), "mm_token_type_ids"),
    "llava_onevision": ("tiny_llava_onevision_model",
                        ("pixel_values", "image_sizes", "batch_num_images"), None),
    "idefics3": ("tiny_idefics3_model", ("pixel_values", "pixel_attention_mask"), None),
    "internvl": ("tiny_internvl_model", ("pixel_values",), None),
}  # fmt: skip
PACK_SIZE = 640


def _processor(family: str) -> Any:
    return getattr(tiny, f"load_tiny_{family}_processor")()


def _model(family: str, processor: Any) -> Any:
    model = getattr(tiny_family_models, FAMILIES[family][0])(processor)
    if family == "gemma3":
        # Gemma 3 initialises its image projection to zeros: every image would feed zero
        # features and a media mix-up could not show. Random weights make the pixels count.
        gen = torch.Generator().manual_seed(1)
        proj = model.model.multi_modal_projector.mm_input_projection_weight
        with torch.no_grad():
            proj.copy_(torch.randn(proj.shape, generator=gen) * 0.5)
    return model


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = write_corpus(
        tmp_path_factory.mktemp("families"), num_samples=12, seed=3, max_images=2
    )
    return path


def _config(corpus: Path, **kw: Any) -> NeatVLMConfig:
    base: dict[str, Any] = {
        "pack_size": PACK_SIZE, "batch_size": 2, "estimate_mode": "exact",
        "media_root": str(corpus.parent / "media"), "attn_implementation": "eager",
    }  # fmt: skip
    return NeatVLMConfig(**{**base, **kw})


def _forward(model: Any, batch: dict[str, Any], media: tuple[str, ...], types: str | None,
             **over: Any) -> torch.Tensor:  # fmt: skip
    kw: dict[str, Any] = {k: batch[k] for k in media if k in batch}
    if types is not None:
        kw[types] = batch["mm_token_type_ids"]
    kw.update(over)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=kw.pop("attention_mask",
                    batch["attention_mask"]), position_ids=batch["position_ids"], **kw)  # fmt: skip
    return out.logits  # type: ignore[no-any-return]


def _worst_vs_separate(
    model: Any, batch: dict[str, Any], logits: torch.Tensor, alone: Any
) -> tuple[float, int]:
    """Max abs diff of each document's logits in the batch vs ``alone(sample_id)``; docs seen.
    A document cut by ``overflow="truncate"`` (an estimate below the real length) is compared
    on the tokens it kept: attention is causal, so they see the same prefix."""
    worst, docs = 0.0, 0
    for row, ids in enumerate(batch["sample_ids"]):
        for k, sid in enumerate(ids, start=1):
            where = batch["doc_ids"][row] == k
            ref = alone(sid)[: int(where.sum())]
            worst = max(worst, float((logits[row, where] - ref).abs().max()))
            docs += 1
    return worst, docs


@pytest.mark.parity
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_graph_batch_equals_separate_runs(corpus: Path, family: str) -> None:
    """2 packed rows from the graph == every document alone on the family's tiny real model
    (<= 1e-5 fp32); the batch's media really feed the model (halved pixels differ); Gemma 3's
    mask is the handler's (a block-causal one over the same rows differs)."""
    proc = _processor(family)
    _, media, types = FAMILIES[family]
    batch = next(iter(neat_vlm_graph(corpus, proc, config=_config(corpus))))
    assert batch["input_ids"].shape == (2, PACK_SIZE)
    assert all(len(ids) >= 1 for ids in batch["sample_ids"])
    assert int(batch["n_media_samples"].sum()) >= 2  # images in the batch
    model = _model(family, proc)
    source = JsonlSource(corpus, media_root=str(corpus.parent / "media"))

    def alone(sid: int) -> torch.Tensor:
        s = tokenize_with_handler(source[sid], proc)
        kw: dict[str, Any] = {k: s[k] for k in media if k in s}
        if types is not None:
            kw[types] = s["mm_token_type_ids"][:-1][None]
        with torch.no_grad():
            return model(input_ids=s["input_ids"][:-1][None], **kw).logits[0]  # type: ignore[no-any-return]

    logits = _forward(model, batch, media, types)
    worst, docs = _worst_vs_separate(model, batch, logits, alone)
    assert docs >= 3
    assert worst <= 1e-5, (family, worst)
    # halved pixels (all-zero padding tiles stay padding for LLaVA-OneVision / Idefics3)
    halved = _forward(model, batch, media, types, pixel_values=batch["pixel_values"] * 0.5)
    assert float((halved - logits).abs().max()) > 1e-4
    if family == "gemma3":  # the handler's mask (image runs both ways), not a block-causal one
        assert set(batch["attention_mask"]) == {"full_attention", "sliding_attention"}
        causal = to_4d_additive_mask(batch["doc_ids"])
        both = {"full_attention": causal, "sliding_attention": causal}
        plain = _forward(model, batch, media, types, attention_mask=both)
        assert float((plain - logits).abs().max()) > 1e-4


# -- Qwen2.5-Omni: audio + images, mRoPE ------------------------------------------------------


@pytest.mark.parity
def test_qwen_omni_graph_audio_positions_and_parity(tmp_path: Path) -> None:
    """Omni through the graph: positions ``[3, B, S]`` == ``qwen_omni_mrope`` per document
    (shifted; also == ``mrope_position_ids`` given the audio token type 3 as it is),
    ``input_features`` / ``feature_attention_mask`` one row per clip in document order, and a
    2-row batch on the tiny Thinker == each document alone (<= 1e-5 fp32)."""
    from support.tiny import load_tiny_qwen_omni_processor
    from support.tiny_family_models import tiny_qwen_omni_model

    from neatpack.pipes.families.qwen_omni import qwen_omni_mrope

    proc = load_tiny_qwen_omni_processor()
    qwen2_vl = MRopeConfig(family="qwen2_vl", spatial_merge_size=proc.image_processor.merge_size)
    source = omni_corpus(tmp_path)
    cfg = NeatVLMConfig(pack_size=512, batch_size=2, estimate_mode="exact",
                        attn_implementation="eager")  # fmt: skip
    batch = next(iter(neat_vlm_graph(source, proc, config=cfg)))
    samples = {sid: tokenize_with_handler(source[sid], proc)
               for ids in batch["sample_ids"] for sid in ids}  # fmt: skip
    assert batch["position_ids"].shape == (3, 2, 512)
    assert bool((batch["mm_token_type_ids"] == 3).any())  # audio tokens in the batch
    clips = [s for ids in batch["sample_ids"] for sid in ids
             if "input_features" in (s := samples[sid])]  # fmt: skip
    assert len(clips) >= 2
    assert torch.equal(batch["input_features"], torch.cat([s["input_features"] for s in clips]))
    assert torch.equal(
        batch["feature_attention_mask"], torch.cat([s["feature_attention_mask"] for s in clips])
    )
    for row, ids in enumerate(batch["sample_ids"]):
        for k, sid in enumerate(ids, start=1):
            where = batch["doc_ids"][row] == k
            want = qwen_omni_mrope(samples[sid], proc)[:, :-1]
            assert torch.equal(batch["position_ids"][:, row, where], want), sid
            s = samples[sid]  # mrope.py takes audio (type 3) as it is: the same positions
            plain = mrope_position_ids(s["input_ids"], s["mm_token_type_ids"],
                                       s.get("image_grid_thw"), config=qwen2_vl)  # fmt: skip
            assert torch.equal(plain[:, :-1], want), sid
    model = tiny_qwen_omni_model(proc)
    keys = ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask")

    def alone(sid: int) -> torch.Tensor:
        s = samples[sid]
        ids = s["input_ids"][:-1][None]
        kw = {k: s[k] for k in keys if k in s}
        with torch.no_grad():  # the mask makes the model compute its own mRoPE
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        return out.logits[0]  # type: ignore[no-any-return]

    logits = _forward(model, batch, keys, None)
    worst, docs = _worst_vs_separate(model, batch, logits, alone)
    assert docs >= 3
    assert worst <= 1e-5, worst


# -- configs that cannot work for the family: refused at build time ----------------------------


@pytest.mark.badinput
@pytest.mark.parametrize(
    ("family", "options", "match"),
    [
        ("gemma3", {"fake_image": True},
         "fake_image=True needs a handler that injects a fake image .*handler 'gemma3'"),
        ("gemma3", {"attn_implementation": "flash_attention_2"},
         "attn_implementation='flash_attention_2' cannot express the 'gemma3'"),
        ("gemma3", {"attn_implementation": "doc_ids"}, r"use attn_implementation in \('sdpa'"),
        ("gemma4", {"attn_implementation": "position_ids",
                    "mask_options": {"bidirectional_vision": True}}, "cannot express the 'gemma4'"),
        ("llava_onevision", {"mask_options": {"x": 1}}, "has no packed_mask"),
        # the handler's declarations: Nemotron-H Omni has no PP split (Handler.pp_refused),
        # Gemma 3's estimator no calibrated mode (Handler.estimate_modes)
        ("nemotron_omni", {"pp_microbatches": 1},
         r"pp_microbatches=1 but handler 'nemotron_omni' declares no pipeline-parallel media "
         r"split.*Fix: set pp_microbatches=None"),
        ("gemma3", {"estimate_mode": "calibrated"},
         r"estimate_mode='calibrated' is not available for handler 'gemma3' \(its estimator has "
         r"no calibrated mode.*offers \('estimate', 'exact'\)"),
    ],
)  # fmt: skip
def test_config_that_cannot_work_is_refused_at_build(
    corpus: Path, family: str, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        neat_vlm_graph(corpus, _processor(family), config=_config(corpus, **options))


def test_calibrated_estimate_of_a_family_through_the_graph(corpus: Path) -> None:
    """``estimate_mode="calibrated"`` for InternVL (``chat_template``'s estimate, calibrated by
    ``HandlerEstimator.calibrated``; refused before #26): the length index the graph plans with
    is closer to the exact lengths than the uncalibrated estimate (least squares on the text
    tokens of these records), and the graph yields its batches."""
    from neatpack.graphs import neat_vlm_parts

    proc = _processor("internvl")
    total = {
        mode: np.asarray(
            neat_vlm_parts(
                corpus, proc, config=_config(corpus, estimate_mode=mode)
            ).materialize.estimated
        )
        for mode in ("estimate", "calibrated", "exact")
    }

    def squared_error(mode: str) -> float:
        return float(((total[mode] - total["exact"]) ** 2).sum())

    assert not np.array_equal(total["calibrated"], total["estimate"])
    assert squared_error("calibrated") < squared_error("estimate")
    cfg = _config(corpus, estimate_mode="calibrated", overflow="truncate")
    batch = next(iter(neat_vlm_graph(corpus, proc, config=cfg)))
    assert batch["input_ids"].shape == (2, PACK_SIZE)


def test_block_causal_families_take_the_mask_free_formats(corpus: Path) -> None:
    """Gemma 4 without bidirectional vision and LLaVA-OneVision are block-causal: flash gets
    cu_seqlens and 1-D positions reset per document."""
    for family in ("gemma4", "llava_onevision"):
        cfg = _config(corpus, attn_implementation="flash_attention_2", max_packs=2)
        batch = next(iter(neat_vlm_graph(corpus, _processor(family), config=cfg)))
        assert batch["attention_mask"] is None
        doc, pos = batch["doc_ids"][0], batch["position_ids"][0]
        starts = torch.nonzero(torch.diff(doc, prepend=doc[:1] - 1) != 0).reshape(-1)
        assert bool((pos[starts] == 0).all())
        assert int(batch["cu_seq_lens_q"][-1]) == 2 * PACK_SIZE


def test_handler_selection() -> None:
    """``handler=None`` picks the processor's family (Qwen-VL classes: ``qwen_vl``, a plan like
    every family's); an explicit name wins; an unknown name is refused listing the registered
    ones."""
    from neatpack.graphs.families import plan_family
    from neatpack.pipes.testing.tiny import load_tiny_processor

    def chosen(proc: Any, handler: str | None = None) -> str:
        return plan_family(proc, NeatVLMConfig(handler=handler)).handler.name

    assert chosen(load_tiny_processor("qwen2_vl")) == "qwen_vl"
    assert chosen(load_tiny_processor("qwen2_vl"), "qwen_vl") == "qwen_vl"
    assert chosen(_processor("internvl")) == "chat_template"
    assert chosen(_processor("gemma3")) == "gemma3"
    assert chosen(_processor("gemma3"), "chat_template") == "chat_template"
    with pytest.raises(ValueError, match=r"handler='nope' is not a registered handler; valid: \["):
        NeatVLMConfig(handler="nope")


# -- checkpoint / resume through the graph, with a worker ---------------------------------------


def test_family_graph_resumes_mid_epoch_with_a_worker(corpus: Path) -> None:
    """LLaVA-OneVision, 1 worker process: the state after 1 batch resumes into exactly the
    batches of an uninterrupted run (media included), each sample once."""
    proc = _processor("llava_onevision")
    cfg = _config(corpus, num_workers=1, pack_size=512, tail="drop")
    reference = list(neat_vlm_graph(corpus, proc, config=cfg))
    assert len(reference) >= 3
    first = neat_vlm_graph(corpus, proc, config=cfg)
    it = iter(first)
    head = [next(it)]
    state = first.state_dict()
    resumed = neat_vlm_graph(corpus, proc, config=cfg)
    resumed.load_state_dict(state)
    rest = list(resumed)
    strip = [{k: v for k, v in b.items() if k != "packs"} for b in head + rest]
    assert same_item(strip, [{k: v for k, v in b.items() if k != "packs"} for b in reference])
    ledger = resumed.ledgers[0]
    consumed = [i for b in head for m in b["packs"] for i in m["sample_ids"]] + ledger.consumed
    assert_exactly_once(consumed, range(12), excused=ledger.tail_dropped)


# -- overflow: a family sample is cut through text only ----------------------------------------


def test_family_overflow_cuts_text_but_never_media() -> None:
    """``overflow="truncate"`` on a family pack: a cut after the image keeps the image (its
    pixels stay in ``media_samples``); a cut through the image tokens drops the sample instead
    (tiles / crops cannot be cut per item), named in ``report.dropped``."""
    from neatpack.pipes.materializing.materialize import MaterializeConfig, materialize_pack

    proc = _processor("gemma3")
    words = " ".join(["cat sat on the mat"] * 20)
    image = Image.new("RGB", (40, 30), (9, 200, 9))
    source = [
        {"sample_id": 0, "conversation": [
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]},
        {"sample_id": 1, "conversation": [
            {"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "describe"}]},
            {"role": "assistant", "content": [{"type": "text", "text": words}]}]},
    ]  # fmt: skip
    first = len(tokenize_with_handler(source[0], proc)["input_ids"]) - 1
    second = tokenize_with_handler(source[1], proc)
    last_image = int(torch.nonzero(second["mm_token_type_ids"]).max())

    def pack(size: int) -> tuple[dict[str, Any], Any]:
        cfg = MaterializeConfig(pack_size=size, mrope=False, handler="gemma3", overflow="truncate")
        out: tuple[dict[str, Any], Any] = materialize_pack(source, [0, 1], proc, cfg)
        return out

    kept, report = pack(first + last_image + 10)
    assert report.truncated == (1,)
    assert report.dropped == ()
    assert kept["media_samples"][1]["pixel_values"].shape[0] == 1
    assert int((kept["mm_token_type_ids"] == 1).sum()) == int(second["mm_token_type_ids"].sum())
    cut, report = pack(first + last_image - 2)
    assert report.dropped == (1,)
    assert report.truncated == ()
    assert cut["sample_ids"] == [0]
    assert len(cut["media_samples"]) == 1


def test_the_grouped_graph_refuses_a_family_whose_rows_are_not_the_core_ones(
    tmp_path: Path,
) -> None:
    """The grouped graph's steps tokenize and pad the core (Qwen-VL) rows; a family with its own
    collate is refused by its handler's declaration (``Handler.core_rows``), naming it, instead
    of being tokenized the Qwen-VL way."""
    from neatpack.graphs import GroupedConfig, grouped_vlm_graph

    data = write_corpus(tmp_path, num_samples=4, seed=1)
    with pytest.raises(ValueError, match=r"handler 'gemma3', whose rows collate their own way"):
        grouped_vlm_graph(data, _processor("gemma3"), config=GroupedConfig(batch_size=2))


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_record_the_family_template_cannot_render_is_named_or_skipped(
    tmp_path: Path, policy: str
) -> None:
    """Idefics3's chat template reads ``content[0]`` of every turn, so a user turn with no
    blocks makes jinja raise ``UndefinedError`` while the length index is built. That is the
    record's error: named (sample id, the family, the fix) under ``raise``, skipped and counted
    in the ledger under ``skip``; before, the jinja error escaped both."""
    import json

    recs = [{"conversation": [
        {"role": "user", "content": [{"type": "text", "text": f"question {i}"}]},
        {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]},
    ]} for i in range(6)]  # fmt: skip
    recs[3]["conversation"][0]["content"] = []
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    config = NeatVLMConfig(pack_size=256, on_bad_sample=policy, num_workers=0, progress=False)
    processor = tiny.load_tiny_idefics3_processor()
    if policy == "raise":
        with pytest.raises(ValueError, match=r"sample_id=3: UndefinedError.*'idefics3'.*skip"):
            neat_vlm_graph(data, processor, config=config)
        return
    loader = neat_vlm_graph(data, processor, config=config)
    list(loader)
    assert loader.ledgers[0].failed == [3]
    assert sorted(loader.ledgers[0].consumed) == [0, 1, 2, 4, 5]
