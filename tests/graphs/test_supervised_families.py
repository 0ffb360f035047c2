"""``balance="supervised"`` for every family with a committed tiny processor, through the user's
path: ``neat_vlm_graph(..., balance="supervised")`` over a corpus of images, 1-3 turns and
answers with spaces and newlines at their ends (what Gemma 3's template trims and Idefics3's
merges); the length index's per-sample supervised count must equal ``labels != -100`` of that
sample in the graph's own batches (after the shift), exactly in ``exact`` mode and within a
stated bound in ``estimate`` mode. Phi-4-multimodal cannot build a graph
(``Handler.graph_refused``): its count is checked against its handler's labels directly. A
question that holds only an image (in the corpus) is also what Idefics3's length estimate
failed on before ``handler_lengths.text_record``."""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from support import tiny

from neatpack.graphs.families import plan_family
from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph, open_source
from neatpack.pipes.families import get_handler
from neatpack.pipes.indexing.handler_lengths import HandlerEstimator, handler_estimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.indexing.supervised import supervised_estimator
from neatpack.pipes.testing.tiny import FAMILIES as QWEN_VL
from neatpack.pipes.testing.tiny import load_tiny_processor

GRAPH_FAMILIES = (*QWEN_VL, *sorted(f for f in tiny.PROCESSORS if f != "phi4"))
WORDS = ("the", "cat", "sat", "on", "a", "mat", "while", "data", "flows", "through", "packed")
ENDS = ("", "", "", " ", "  ", "\n", "\n\n", " \n")  # what a template may trim or merge


@cache
def processor(family: str) -> Any:
    if family in QWEN_VL:
        return load_tiny_processor(family)
    return getattr(tiny, f"load_tiny_{family}_processor")()


def records(root: Path, n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))

    out = []
    for i in range(n):
        conv: list[dict[str, Any]] = []
        for t in range(rng.randint(1, 3)):
            user: list[dict[str, Any]] = []
            if rng.random() < 0.4:
                name = f"i{i}_{t}.png"
                size = (rng.randint(28, 84), rng.randint(28, 84))
                Image.new("RGB", size, (rng.randint(0, 255), 80, 20)).save(root / name)
                user.append({"type": "image", "image": name})
            if not user or rng.random() < 0.6:  # else an image-only question
                user.append({"type": "text", "text": text(2, 30)})
            answer = rng.choice(ENDS) + text(1, 60) + rng.choice(ENDS)
            reply = [{"type": "text", "text": answer}]
            conv += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        out.append({"conversation": conv})
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("supervised_families")
    lines = [json.dumps(r) for r in records(root, 24, seed=5)]
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root


def config(root: Path, family: str, mode: str) -> NeatVLMConfig:
    return NeatVLMConfig(
        pack_size=2048, batch_size=1, seed=1, cache_dir=str(root / "cache" / family),
        num_workers=0, progress=False, balance="supervised", estimate_mode=mode,
        media_root=str(root),
    )  # fmt: skip


def graph_labels(root: Path, family: str) -> dict[int, int]:
    """Each sample's label tokens in the graph's batches (one rank: every sample)."""
    out: dict[int, int] = {}
    for batch in neat_vlm_graph(root / "data.jsonl", processor(family),
                                config=config(root, family, "exact")):  # fmt: skip
        docs, labels = np.asarray(batch["doc_ids"]), np.asarray(batch["labels"])
        for r, row in enumerate(batch["sample_ids"]):
            for k, sid in enumerate(row):
                out[int(sid)] = int(((docs[r] == k + 1) & (labels[r] != -100)).sum())
    return out


def index_counts(root: Path, family: str, mode: str) -> np.ndarray:
    """The supervised column the graph's length index holds (same estimator, same cache)."""
    proc = processor(family)
    cfg = config(root, family, mode)
    source = open_source(root / "data.jsonl", str(root))
    plan = plan_family(proc, cfg)
    est = supervised_estimator(plan.estimator(proc, mode, source), proc, plan.handler)
    index = build_length_index(source, est, cache_dir=cfg.cache_dir, progress=False)
    assert index.supervised is not None
    return np.asarray(index.supervised, np.int64)


@pytest.mark.parametrize("family", GRAPH_FAMILIES)
def test_the_supervised_estimate_is_the_graphs_label_count(corpus: Path, family: str) -> None:
    real = graph_labels(corpus, family)
    ids = np.asarray(sorted(real))
    truth = np.asarray([real[i] for i in ids])
    assert ids.size == 24
    assert truth.min() >= 2
    assert np.array_equal(index_counts(corpus, family, "exact")[ids], truth)
    # estimate mode: 3 characters a token + the probed end marker a turn, no tokenizer.
    # Measured on this corpus: sum 0.85 (Gemma's vocabulary) to 1.08 of the labels,
    # correlation >= 0.996, median |error| 9-14 % of a sample's labels
    rough = index_counts(corpus, family, "estimate")[ids]
    assert np.corrcoef(rough, truth)[0, 1] > 0.99
    assert rough.sum() == pytest.approx(truth.sum(), rel=0.2)
    if "calibrated" in get_handler(processor(family)).estimate_modes:  # not Gemma 3
        # the characters a token fitted on the corpus: sum 0.95-0.97, median |error| 3-7 %
        fitted = index_counts(corpus, family, "calibrated")[ids]
        assert np.corrcoef(fitted, truth)[0, 1] > 0.99
        assert fitted.sum() == pytest.approx(truth.sum(), rel=0.08)


def test_phi4_counts_the_labels_its_handler_sets(corpus: Path) -> None:
    """Phi-4-multimodal has no graph (``Handler.graph_refused``); its length index counts
    what its handler labels on the same records, images loaded."""
    proc = tiny.load_tiny_phi4_processor()
    handler = get_handler(proc)
    assert handler.graph_refused
    source = open_source(corpus / "data.jsonl", str(corpus))
    est = supervised_estimator(handler_estimator(proc, handler, "exact"), proc, handler)
    assert isinstance(est, HandlerEstimator)
    index = build_length_index(source, est, progress=False)
    assert index.supervised is not None
    truth = [int((handler(source[i], proc)["labels"][1:] != -100).sum())
             for i in range(len(source))]  # fmt: skip
    assert index.supervised.tolist() == truth


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_an_image_only_question_is_estimated(corpus: Path, family: str) -> None:
    """Idefics3's template reads a turn's first block: the text-only record the estimate takes
    the visual part from failed on a question that held only an image (any balance). It now
    gets a stand-in text whose tokens come off the count: the same total as the real row, and
    the same visual part as the question with a one-token text after its image."""
    proc = processor(family)
    handler = get_handler(proc)
    source = open_source(corpus / "data.jsonl", str(corpus))
    est = handler_estimator(proc, handler, "exact")

    def bare(m: dict[str, Any]) -> bool:
        return m["role"] == "user" and all(b.get("type") == "image" for b in m["content"])

    image_only = [i for i in range(len(source)) if any(map(bare, source[i]["conversation"]))]
    assert image_only
    for i in image_only:
        record = source[i]
        got = est.estimate_sample(record)
        assert got.total == handler(record, proc)["input_ids"].shape[0] - 1
        worded = {**record, "conversation": [
            {**m, "content": [*m["content"], {"type": "text", "text": "x"}]} if bare(m) else m
            for m in record["conversation"]]}  # fmt: skip
        assert got.visual == est.estimate_sample(worded).visual
