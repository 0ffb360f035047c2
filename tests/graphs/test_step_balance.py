"""``balance="cost"`` through the user's path: ``plan_packs`` evens the ranks' compute (its
packs made for their step groups where that beats best fit's, fill within 0.2 points), and
``neat_vlm_graph`` with it resumes mid-epoch and on a new world size with
every sample exactly once (the plan is a pure function of lengths, config and group size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.states import pack_ids as ids
from support.states import roundtrip

from neatpack.graphs.command.report import imbalance
from neatpack.graphs.config import checkpoint_key
from neatpack.graphs.neat_llm import NeatLLMConfig
from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.planning.balance import pack_cost_terms, pack_costs
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.planning.plan_file import load_plan
from neatpack.pipes.testing.resume import assert_exactly_once
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

NUM_SAMPLES = 40


def vlm_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(total, visual) per sample, shaped like VLM SFT data: a third text-only, the rest with
    one to four images of 64..1280 visual tokens (``benchmarks/bench_balance.py``'s draw)."""
    rng = np.random.default_rng(seed)
    text_only = rng.random(n) < 0.35
    images = np.where(text_only, 0, rng.integers(1, 5, size=n))
    visual = (rng.integers(64, 1281, size=(n, 4)) * (np.arange(4) < images[:, None])).sum(1)
    text = np.rint(rng.lognormal(np.log(300.0), 0.9, size=n)).astype(np.int64) + 1  # >= 1
    return np.minimum(text + visual, 8192), visual


def step_ratios(plan: Any, total: np.ndarray, visual: np.ndarray, world: int) -> np.ndarray:
    """``[2, steps]``: max/mean over ranks of (attention, vision) cost, epoch 1's order."""
    terms = pack_cost_terms(plan.offsets, plan.ids, total, visual)
    attention, vision = terms[:, 1], pack_costs(terms)[1]
    order = plan.epoch_order(1)
    take = order[: order.size // world * world].reshape(-1, world)
    return np.stack([imbalance(c[take]) for c in (attention, vision)])  # a step without load: 1.0


@pytest.mark.parametrize("world", [8, 64])
def test_cost_balance_keeps_the_fill_and_evens_the_slowest_rank(world: int) -> None:
    total, visual = vlm_lengths(20_000, seed=world)
    tokens = plan_packs(total, 8192, visual=visual, world_size=world)
    cost = plan_packs(total, 8192, visual=visual, world_size=world, balance="cost")
    assert np.array_equal(np.sort(cost.ids), np.arange(total.size))  # every sample once
    if cost.free_from == 0:  # best fit's packs, only reordered
        assert sorted(map(tuple, cost.packs())) == sorted(map(tuple, tokens.packs()))
    assert cost.utilization() >= tokens.utilization() - 0.002  # 0.2 points at most
    assert cost.fingerprint != tokens.fingerprint
    assert cost.balance == "cost"
    before = step_ratios(tokens, total, visual, world)
    after = step_ratios(cost, total, visual, world)
    # the slowest rank's attention cost over the mean rank's, p95 over steps, and the worse
    # of the two terms per step (what the strips are chosen on)
    assert np.percentile(after[0], 95) < 0.6 * np.percentile(before[0], 95)
    assert np.percentile(after.max(0), 95) < 0.6 * np.percentile(before.max(0), 95)
    for epoch in (0, 3):  # every pack served once per epoch, in whole groups
        assert sorted(cost.epoch_order(epoch).tolist()) == list(range(len(cost)))


@pytest.mark.parametrize("balance", ["lm", "vision", "cost"])
def test_one_term_balance_sorts_neighbours_alike(balance: str) -> None:
    total, visual = vlm_lengths(3000, seed=1)
    plan = plan_packs(total, 8192, visual=visual, world_size=4, balance=balance)  # type: ignore[arg-type]
    lm, vision = pack_costs(pack_cost_terms(plan.offsets, plan.ids, total, visual))
    if balance != "cost":
        stored = lm if balance == "lm" else vision
        assert (np.diff(stored) >= 0).all()  # stored in cost order: groups are neighbours
    with pytest.raises(ValueError, match="balance='speed' must be one of"):
        plan_packs(total, 8192, visual=visual, balance="speed")  # type: ignore[arg-type]


def test_the_default_balance_is_cost_and_tokens_keeps_the_old_key() -> None:
    """cost is the graphs' default and enters the key; tokens, the default states were saved
    under before it, stays out of the key, so those states still load with it set."""
    assert NeatVLMConfig().balance == "cost"
    assert NeatLLMConfig().balance == "cost"
    assert checkpoint_key(NeatVLMConfig())["balance"] == "cost"
    assert "balance" not in checkpoint_key(NeatVLMConfig(balance="tokens"))
    assert checkpoint_key(NeatVLMConfig(balance="lm"))["balance"] == "lm"
    with pytest.raises(ValueError, match="balance"):
        NeatVLMConfig(balance="speed")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root, num_samples=NUM_SAMPLES, seed=0)  # one where made groups win (below)
    return root


def loader(root: Path, rank: int, world: int, balance: str = "cost") -> Any:
    config = NeatVLMConfig(
        pack_size=1024, batch_size=1, media_root=str(root / "media"),
        cache_dir=str(root / "cache"), tail="drop", balance=balance,  # type: ignore[arg-type]
    )  # fmt: skip
    return neat_vlm_graph(
        root / "data.jsonl", load_tiny_processor("qwen2_vl"), config=config,
        rank=rank, world_size=world,
    )  # fmt: skip


def test_cost_balanced_graph_resumes_mid_epoch_exactly(corpus: Path) -> None:
    reference = [ids(b) for b in loader(corpus, 0, 2)]
    first = loader(corpus, 0, 2)
    it = iter(first)
    got = [ids(next(it)) for _ in range(2)]
    resumed = loader(corpus, 0, 2)
    resumed.load_state_dict(roundtrip(first.state_dict()))
    got += [ids(b) for b in resumed]
    assert got == reference


def test_cost_balanced_graph_elastic_2_to_3_is_exactly_once(corpus: Path) -> None:
    first = [loader(corpus, r, 2) for r in range(2)]
    its = [iter(x) for x in first]
    for it in its:
        next(it)
    states = [roundtrip(x.state_dict()) for x in first]
    resumed = [loader(corpus, r, 3) for r in range(3)]
    for r, x in enumerate(resumed):
        x.load_state_dict(states[r % 2])
    assert len({len(list(x)) for x in resumed}) == 1, "every rank yields as many batches"
    consumed = [i for x in first + resumed for i in x.ledgers[0].consumed]
    dropped = [i for x in resumed for i in x.ledgers[0].tail_dropped]
    assert_exactly_once(consumed, range(NUM_SAMPLES), excused=dropped)
    for x in resumed:  # the next epoch is planned for three ranks, balanced on cost
        list(x)
    consumed = [i for x in resumed for i in x.ledgers[1].consumed]
    dropped = [i for x in resumed for i in x.ledgers[1].tail_dropped]
    assert_exactly_once(consumed, range(NUM_SAMPLES), excused=dropped)


def test_cost_balanced_graph_serves_packs_made_for_its_groups(corpus: Path) -> None:
    """The corpus is one where the made groups win, so the resume tests above go through
    ``group_pack``'s packs (``free_from > 0``) at both world sizes, and the plan file keeps
    ``free_from``."""
    for world in (2, 3):
        list(loader(corpus, 0, world))
    plans = [load_plan(p) for p in sorted((corpus / "cache").rglob("plan-*.npz"))]
    made = {p.group_size: p.free_from for p in plans if p.balance == "cost"}
    assert made.keys() >= {2, 3}
    assert all(free_from > 0 for free_from in made.values())


def test_cost_balanced_graph_plans_for_its_batch_size(corpus: Path, tmp_path: Path) -> None:
    """The graph passes its ``batch_size`` (packs per rank per step) to ``plan_packs`` as
    ``per_rank`` under ``balance="cost"``: another batch size is another plan (fingerprint),
    while the token order does not depend on it."""
    prints: dict[tuple[str, int], set[str]] = {}
    for balance in ("cost", "tokens"):
        for batch in (1, 2):
            cache = tmp_path / f"{balance}-{batch}"
            config = NeatVLMConfig(
                pack_size=1024, batch_size=batch, media_root=str(corpus / "media"),
                cache_dir=str(cache), tail="drop", balance=balance,  # type: ignore[arg-type]
            )  # fmt: skip
            graph = neat_vlm_graph(corpus / "data.jsonl", load_tiny_processor("qwen2_vl"),
                                   config=config, rank=0, world_size=2)  # fmt: skip
            next(iter(graph))
            prints[(balance, batch)] = {load_plan(p).fingerprint for p in cache.rglob("plan-*.npz")}
    assert prints[("cost", 1)].isdisjoint(prints[("cost", 2)])
    assert prints[("tokens", 1)] == prints[("tokens", 2)]
    assert all(len(p) == 1 for p in prints.values())


def test_neatpack_plan_prints_the_cost_plan_the_graph_trains_on(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``neatpack plan --balance cost --batch-size N`` plans for the step shape the graph's
    ``batch_size`` gives (``per_rank``): the plan it prints is the loader's, for each size."""
    import json

    from neatpack.graphs.command.cli import main

    for batch in (1, 2):
        cache = tmp_path / f"cost-{batch}"
        config = NeatVLMConfig(
            pack_size=1024, batch_size=batch, media_root=str(corpus / "media"),
            cache_dir=str(cache), tail="drop", balance="cost",
        )  # fmt: skip
        graph = neat_vlm_graph(corpus / "data.jsonl", load_tiny_processor("qwen2_vl"),
                               config=config, rank=0, world_size=2)  # fmt: skip
        next(iter(graph))
        (trained,) = {load_plan(p).fingerprint for p in cache.rglob("plan-*.npz")}
        args = ["plan", str(corpus / "data.jsonl"), "--processor", "qwen2_vl", "--pack-size",
                "1024", "--media-root",
                str(corpus / "media"), "--cache-dir", str(cache), "--world-size", "2",
                "--balance", "cost", "--batch-size", str(batch), "--json"]  # fmt: skip
        assert main(args) == 0
        assert json.loads(capsys.readouterr().out)["fingerprint"] == trained
    assert main([*args[:-2], "0", "--json"]) == 2  # --batch-size 0: a usage error
