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
from neatpack.pipes.mixtures.mixture_plan import MixturePlan, plan_mixture

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


def test_a_cost_balanced_mixture_plans_for_its_batch_size() -> None:
    """Under ``balance="cost"`` the mixture plans for the step shape it trains on, as the
    single-source graph does: ``per_rank`` = its ``batch_size``. Its plan is
    ``plan_mixture(..., per_rank=batch_size)`` for each batch size (fingerprints), and on these
    lengths (the made groups score otherwise on 2 packs per rank than on the default shape)
    ``per_rank=None`` makes other packs: a mixture planned without it trained on another plan
    than the one that was scored. The layout's fingerprint (the state's) records it, and the
    batches are the plan's packs at each slot."""
    lengths = np.random.default_rng(0).integers(8, 400, 120)  # 2 ranks: per_rank moves packs
    mix = Mixture(
        sources=[
            MixtureSource(name=name, data=[{"input_ids": list(range(1, int(n) + 2))} for n in part],
                          samples=len(part))  # every sample once: one plan over all
            for name, part in (("a", lengths[:80]), ("b", lengths[80:]))
        ]
    )  # fmt: skip

    def graph(batch_size: int) -> Any:
        cfg = NeatLLMConfig(pack_size=512, batch_size=batch_size, balance="cost", tail="drop",
                            attn_implementation="doc_ids")  # fmt: skip
        return neat_llm_graph(mix, config=cfg, rank=0, world_size=2)

    def planned(layout: Any, blend: Any, per_rank: int | None) -> MixturePlan:
        counts = epoch_counts(layout.targets(blend), layout.sizes, layout.names, layout.seed, 0)
        return plan_mixture(counts, layout.total, layout.visual, capacity=512, epoch=0,
                            group_size=2, seed=layout.seed, balance="cost",
                            per_rank=per_rank)  # fmt: skip

    loaders = {b: graph(b) for b in (1, 2)}
    for b, loader in loaders.items():
        assert loader.source.layout.per_rank == b
        want = planned(loader.source.layout, loader.source.blend, b)
        assert loader.source.plan_for(2).fingerprint == want.fingerprint
    source = loaders[2].source
    plan, unscored = source.plan_for(2), planned(source.layout, source.blend, None)
    assert np.array_equal(np.sort(plan.ids), np.arange(120))  # every sample once
    assert not (np.array_equal(plan.offsets, unscored.offsets)
                and np.array_equal(plan.ids, unscored.ids))  # fmt: skip
    assert loaders[1].source.layout.fingerprint != source.layout.fingerprint
    served = 0
    for batch in loaders[2]:
        assert len(batch["packs"]) == 2
        for meta in batch["packs"]:
            assert meta["slot"] % 2 == 0  # rank 0's slots
            assert meta["pack_index"] == int(plan.order[meta["slot"]])
            assert sorted(meta["sample_ids"]) == sorted(plan.pack(meta["pack_index"]))
            served += 1
    assert served == len(plan) // 4 * 2  # whole steps of 2 ranks x 2 packs, the tail dropped
