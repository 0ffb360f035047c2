"""A mixture through the text graph (``neat_llm_graph(mixture, ...)``): every document's tokens
come from the source its ``doc_sources`` tag names, each epoch's ledger is exactly the
selection, and a resume mid-epoch gives the uninterrupted batches."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from neatpack.graphs.neat_llm import NeatLLMConfig, neat_llm_graph
from neatpack.pipes.mixtures.mixture import Mixture, MixtureSource, epoch_counts

SIZES = {"web": 40, "code": 20, "math": 4}


def _records(source: int, n: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(source)
    # every token of source k lies in [1000 k + 1, 1000 k + 999]: a document names its source
    return [
        {"input_ids": (1000 * source + rng.integers(1, 1000, int(rng.integers(3, 30)))).tolist()}
        for _ in range(n)
    ]


def _mixture() -> Mixture:
    return Mixture(
        sources=[
            MixtureSource(name=name, data=_records(k + 1, n), weight=w)
            for k, ((name, n), w) in enumerate(zip(SIZES.items(), (0.5, 0.3, 0.2), strict=True))
        ]
    )


def _config(**kw: Any) -> NeatLLMConfig:
    return NeatLLMConfig(pack_size=64, attn_implementation="doc_ids", **kw)


def test_documents_carry_their_source_and_ledger_is_the_selection() -> None:
    loader = neat_llm_graph(_mixture(), config=_config(tail="drop"))
    layout = loader.source.layout
    bounds = np.concatenate([[0], np.cumsum(layout.sizes)])
    documents = 0
    for epoch in range(2):
        for batch in loader:
            for row in range(batch["input_ids"].shape[0]):
                doc_ids, ids = batch["attention_mask"][row], batch["input_ids"][row]
                tags = batch["doc_sources"][row]
                for d in range(int(doc_ids.max())):
                    tokens = ids[doc_ids == d + 1]
                    assert int(tags[d]) == int(tokens[-1]) // 1000 - 1  # source k: 1000 (k + 1)
                    documents += 1
        counts = epoch_counts(layout.targets(loader.source.blend), layout.sizes, layout.names,
                              layout.seed, epoch)  # fmt: skip
        want = Counter({int(bounds[s]) + i: int(c) for s, cs in enumerate(counts)
                        for i, c in enumerate(cs) if c})  # fmt: skip
        ledger = loader.ledgers[epoch]
        assert Counter(ledger.consumed) + Counter(ledger.tail_dropped) == want
        assert max(want[i] for i in range(int(bounds[2]), int(bounds[3]))) >= 2  # math upsampled
    assert documents > 50


def test_text_mixture_resumes_mid_epoch_exactly() -> None:
    def run(loader: Any, stop: int | None = None) -> list[torch.Tensor]:
        out = []
        for _ in range(2 if stop is None else 1):
            for batch in loader:
                out.append(batch["input_ids"])
                if stop is not None and len(out) == stop:
                    loader.close()
                    return out
        return out

    reference = run(neat_llm_graph(_mixture(), config=_config()))
    first = neat_llm_graph(_mixture(), config=_config())
    head = run(first, stop=3)
    resumed = neat_llm_graph(_mixture(), config=_config())
    resumed.load_state_dict(first.state_dict())
    got = head + run(resumed)
    assert len(got) == len(reference)
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))


def test_data_beside_a_mixture_is_refused() -> None:
    mix = Mixture(sources=[MixtureSource(name="a", data=[{"input_ids": [1, 2, 3]}], weight=1.0)])
    with pytest.warns(DeprecationWarning, match="a mixture is data"):
        cfg = NeatLLMConfig(pack_size=16, mixture=mix)
    with pytest.raises(ValueError, match=r"NeatLLMConfig\(mixture=\.\.\.\) names the data"):
        neat_llm_graph([{"input_ids": [1, 2, 3]}], config=cfg)


def test_the_deprecated_config_mixture_gives_the_batches_of_the_mixture_as_data() -> None:
    """``NeatLLMConfig(mixture=...)`` with ``data=None`` (before mixtures became data) still
    serves the same batches as the mixture passed as the data."""
    with pytest.warns(DeprecationWarning, match="pass it where the data goes"):
        legacy = NeatLLMConfig(pack_size=64, attn_implementation="doc_ids", mixture=_mixture())
    old = [b["input_ids"] for b in neat_llm_graph(None, config=legacy)]
    new = [b["input_ids"] for b in neat_llm_graph(_mixture(), config=_config())]
    assert len(old) == len(new) > 0
    assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))
