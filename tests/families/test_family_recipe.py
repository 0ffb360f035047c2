"""docs/families.md "Adding a family", followed to the letter: one ``register_handler`` call is
the whole recipe. A toy family (its own processor class name, tokenizer and length estimate,
built on the default path as the recipe shows) is then served by ``neat_vlm_graph`` end to end,
and the graph plans its packs with the toy family's own estimate (before issue #15 a newly
registered family got no estimate: the graph refused it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from support.tiny import load_tiny_internvl_processor

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.families import HANDLERS, PROCESSOR_HANDLERS, Handler, register_handler
from neatpack.pipes.families.chat_template import default_estimate, tokenize_default
from neatpack.pipes.indexing.handler_lengths import handler_estimator
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.synth import write_corpus

PACK_SIZE = 640


def _toy_processor() -> Any:
    """A real processor (InternVL's tiny one) whose class is called ``ToyProcessor``: a class
    name no built-in family knows, as a new model's processor would be."""
    proc = load_tiny_internvl_processor()
    proc.__class__ = type("ToyProcessor", (type(proc),), {})
    return proc


@pytest.fixture
def toy() -> Iterator[dict[str, Any]]:
    """Register the toy family exactly as docs/families.md shows; unregister it afterwards.
    ``calls`` records the sample ids the toy estimate saw; ``extra`` is added to it."""
    seen: dict[str, Any] = {"calls": [], "extra": 0}

    def tokenize_toy(record: Mapping[str, Any], processor: Any, **options: Any) -> Any:
        return tokenize_default(record, processor, **options)  # or anything returning a Sample

    def estimate_toy(record: Mapping[str, Any], processor: Any, *, mode: str = "exact") -> int:
        seen["calls"].append(record.get("sample_id"))
        return default_estimate(record, processor, mode=mode) + int(seen["extra"])

    register_handler(
        Handler("toy", tokenize_toy, modalities=frozenset({"image"}), estimate=estimate_toy),
        processor_classes=("ToyProcessor",),
    )
    try:
        yield seen
    finally:
        HANDLERS.pop("toy", None)
        PROCESSOR_HANDLERS.pop("ToyProcessor", None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = write_corpus(tmp_path_factory.mktemp("toy"), num_samples=10, seed=5, max_images=2)
    return path


def _batches(corpus: Path, proc: Any) -> list[dict[str, Any]]:
    config = NeatVLMConfig(
        pack_size=PACK_SIZE,
        batch_size=2,
        estimate_mode="exact",
        media_root=str(corpus.parent / "media"),
        attn_implementation="eager",
        shuffle=False,
    )
    return list(neat_vlm_graph(str(corpus), proc, config=config))


def test_a_registered_toy_family_runs_through_the_graph_with_its_estimate(
    toy: dict[str, Any], corpus: Path
) -> None:
    proc = _toy_processor()
    source = JsonlSource(corpus, media_root=str(corpus.parent / "media"))
    real = {sid: len(tokenize_default(source[sid], proc)["input_ids"]) - 1 for sid in range(10)}

    # the graph picks the toy family from the processor's class and plans with its estimate
    batches = _batches(corpus, proc)
    assert set(toy["calls"]) >= set(range(10))  # every record was sized by the toy estimate
    docs = [ids for b in batches for ids in b["sample_ids"]]
    assert sorted(sid for ids in docs for sid in ids) == list(range(10))  # each sample once
    assert max(len(ids) for ids in docs) >= 2  # exact lengths: several documents share a row
    for b in batches:
        for row, ids in enumerate(b["sample_ids"]):
            n = int((b["doc_ids"][row] > 0).sum())
            assert n == sum(real[sid] for sid in ids) <= PACK_SIZE, (row, ids)

    # the estimate really drives the plan: inflated past half a pack, no two samples share one
    toy["calls"].clear()
    toy["extra"] = PACK_SIZE // 2 + 1 - min(real.values())
    inflated = _batches(corpus, proc)
    assert set(toy["calls"]) >= set(range(10))
    assert all(len(ids) == 1 for b in inflated for ids in b["sample_ids"])


def test_a_family_without_an_estimate_is_refused_naming_the_fix(toy: dict[str, Any]) -> None:
    register_handler(Handler("toy_no_estimate", tokenize_default))
    try:
        with pytest.raises(ValueError, match=r"toy_no_estimate.*estimate=.*lengths="):
            handler_estimator(_toy_processor(), "toy_no_estimate", "exact")
    finally:
        HANDLERS.pop("toy_no_estimate", None)


@pytest.mark.parametrize(
    ("fields", "options", "error"),
    [
        ({"graph_refused": "toy forwards mix documents"}, {}, r"'toy_misfit'.*toy forwards mix"),
        ({"mrope": True}, {}, r"'toy_misfit' needs mRoPE positions.*positions="),
        ({"pp_refused": "toy media are one blob"}, {"batch_size": 2, "pp_microbatches": 2},
         r"handler 'toy_misfit' declares no pipeline-parallel media split \(Handler.pp_refused: "
         r"toy media are one blob\)"),
        ({}, {"fake_image": True}, r"fake_image=True needs a handler .*'toy_misfit'"),
    ],
)  # fmt: skip
def test_the_graph_asks_the_handler_what_it_refuses(
    corpus: Path, fields: dict[str, Any], options: dict[str, Any], error: str
) -> None:
    """``Handler.graph_refused``, an mRoPE family without ``Handler.positions``, ``pp_refused``
    with ``pp_microbatches`` and ``fake_image=True`` for a handler without ``Handler.fake_image``
    are refused when the graph is built, naming the handler and the reason (no table to edit
    elsewhere)."""
    register_handler(Handler("toy_misfit", tokenize_default, estimate=default_estimate, **fields))
    try:
        config = NeatVLMConfig(
            pack_size=PACK_SIZE, handler="toy_misfit", estimate_mode="exact", **options
        )
        with pytest.raises(ValueError, match=error):
            neat_vlm_graph(str(corpus), _toy_processor(), config=config)
    finally:
        HANDLERS.pop("toy_misfit", None)


def test_a_registered_toy_family_splits_its_media_per_pipeline_microbatch(
    toy: dict[str, Any], corpus: Path
) -> None:
    """No ``Handler.pp_split`` needed: registered as the recipe shows, the toy family's batches
    carry their media per micro-batch (``pp_microbatches=2``), every image of the batch once, in
    order, each chunk holding its own rows' images."""
    from neatpack.pipes.parallel.pp_media import VLM_PP_MEDIA_KEY

    proc = _toy_processor()
    base = {"pack_size": PACK_SIZE, "batch_size": 2, "estimate_mode": "exact", "shuffle": False,
            "media_root": str(corpus.parent / "media"), "attn_implementation": "eager"}  # fmt: skip
    whole = list(neat_vlm_graph(str(corpus), proc, config=NeatVLMConfig(**base)))
    split = list(neat_vlm_graph(str(corpus), proc, config=NeatVLMConfig(**base, pp_microbatches=2)))
    assert len(split) == len(whole) >= 2
    image = proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    chunks_seen = 0
    for w, s in zip(whole, split, strict=True):
        chunks = s.pop(VLM_PP_MEDIA_KEY)["pixel_values"]
        assert "pixel_values" not in s
        assert torch.equal(torch.cat([c for c in chunks if c is not None]), w["pixel_values"])
        for row, chunk in enumerate(chunks):  # InternVL: 1 pixel tile -> image_seq_length tokens
            tokens = int((s["input_ids"][row] == image).sum())
            assert (0 if chunk is None else chunk.shape[0]) * proc.image_seq_length == tokens
            chunks_seen += chunk is not None
    assert chunks_seen >= 2
