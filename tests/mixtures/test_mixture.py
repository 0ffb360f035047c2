"""Weighted mixtures (#16): per-epoch selection, the plan's token shares per window, the graph's
ledger per source, resume, and blend changes at the next epoch and from the cursor."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.mixtures.mixture import (
    Mixture,
    MixtureSource,
    epoch_counts,
    fill_counts,
    source_targets,
)
from neatpack.pipes.mixtures.mixture_plan import plan_mixture, replan_from_cursor
from neatpack.pipes.mixtures.mixture_report import mixture_ledger, realized_shares, target_shares
from neatpack.pipes.mixtures.mixture_source import MixtureLayout, MixturePackSource
from neatpack.pipes.planning.source import StateMismatchError
from neatpack.pipes.testing.resume import assert_resumable
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

NAMES = ("caption", "ocr", "charts")
WEIGHTS = (0.6, 0.3, 0.1)  # the window test (plan level)
GRAPH = (0.5, 0.25, 0.25)  # the graph tests: 3 charts records, upsampled about 2.5x


# ---------------------------------------------------------------- selection (pure)


@pytest.mark.parametrize("seed", range(5))
def test_epoch_counts_whole_repeats_then_a_seeded_partial(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 50, 4).tolist()
    targets = [int(n * f) + 1 for n, f in zip(sizes, rng.uniform(0.2, 4.5, 4), strict=True)]
    for epoch in range(3):
        counts = epoch_counts(targets, sizes, ["a", "b", "c", "d"], seed, epoch)
        for c, n, t in zip(counts, sizes, targets, strict=True):
            assert c.size == n
            assert int(c.sum()) == t
            # no sample used r + 1 times before every sample was used r times
            assert set(c.tolist()) <= {t // n, -(-t // n)}
    partial = [epoch_counts(targets, sizes, ["a", "b", "c", "d"], seed, e)[0] for e in range(4)]
    if targets[0] % sizes[0] and sizes[0] > 2:  # the partial repeat is drawn per epoch
        assert len({p.tobytes() for p in partial}) > 1


def test_fill_counts_tops_up_the_least_used_first_within_caps() -> None:
    rng = np.random.default_rng(0)
    base = np.array([3, 0, 1, 0, 2])
    add = fill_counts(base, 4, rng)
    assert sorted((base + add).tolist()) == [1, 2, 2, 2, 3]  # the unseen first, then level 2
    assert add[0] == 0  # the most used gets nothing
    assert add[4] == 0
    assert int(add.sum()) == 4
    assert (base + add).max() - (base + add).min() <= 2
    capped = fill_counts([0, 0, 0], 2, rng, cap=[0, 1, 5])
    assert capped.tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="allow 6"):
        fill_counts([0, 0, 0], 7, rng, cap=[1, 0, 5])


@pytest.mark.parametrize("seed", range(30))
def test_fill_counts_is_a_level_fill_within_caps(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    base = rng.integers(0, 4, n)
    cap = rng.integers(0, 5, n) if seed % 2 else None
    room = int(cap.sum()) if cap is not None else 40
    extra = int(rng.integers(0, room + 1))
    add = fill_counts(base, extra, np.random.default_rng(seed), cap=cap)
    assert int(add.sum()) == extra
    assert (add >= 0).all()
    if cap is not None:
        assert (add <= cap).all()
    after = base + add
    # level fill: a sample topped up never ends more than one above one that still had room
    grown = after[add > 0]
    open_ = after[add < cap] if cap is not None else after
    if grown.size and open_.size:
        assert grown.max() <= open_.min() + 1


def test_spec_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match="exactly one of weight"):
        MixtureSource(name="a", data=[], weight=0.5, samples=3)
    with pytest.raises(ValueError, match=r"unique: \['a'\]"):
        Mixture(sources=[MixtureSource(name="a", data=[], weight=1.0)] * 2)
    with pytest.raises(ValueError, match="on_change"):
        Mixture(sources=[MixtureSource(name="a", data=[], weight=1.0)], on_change="later")
    with pytest.raises(ValueError, match="shuffle"):
        NeatVLMConfig(mixture=Mixture(sources=[MixtureSource(name="a", data=[], weight=1)]),
                      shuffle=False)  # fmt: skip
    with pytest.raises(ValueError, match="max_packs"):
        NeatVLMConfig(mixture=Mixture(sources=[MixtureSource(name="a", data=[], weight=1)]),
                      max_packs=3)  # fmt: skip


# ---------------------------------------------------------------- token shares (pure plan)


def _blend() -> dict[str, Any]:
    pairs = zip(NAMES, WEIGHTS, strict=True)
    return {"epoch_tokens": None, "sources": [[n, w, None] for n, w in pairs]}


def _generated(seed: int = 1) -> tuple[list[int], np.ndarray, list[int]]:
    """Three sources: 20k captions, 10k long OCR pages, 2k charts (10x smaller: upsampled)."""
    rng = np.random.default_rng(seed)
    lengths = [rng.integers(50, 400, 20000), rng.integers(100, 900, 10000),
               rng.integers(30, 200, 2000)]  # fmt: skip
    return [x.size for x in lengths], np.concatenate(lengths), [int(x.sum()) for x in lengths]


@pytest.mark.parametrize("single_source", [False, True])
@pytest.mark.parametrize("group_size", [1, 2, 3])
def test_token_share_per_source_within_one_percent_in_every_window_of_1000_packs(
    group_size: int, single_source: bool
) -> None:
    sizes, total, tokens = _generated()
    blend = Mixture(sources=[MixtureSource(name=n, data=[], weight=w)
                             for n, w in zip(NAMES, WEIGHTS, strict=True)]).blend()  # fmt: skip
    targets = source_targets(blend, sizes, tokens)
    assert targets[2] > 3 * sizes[2]  # charts: 10x smaller, upsampled (3 whole repeats +)
    assert targets[1] < sizes[1]  # ocr: downsampled
    for epoch in range(2):
        counts = epoch_counts(targets, sizes, NAMES, seed=0, epoch=epoch)
        plan = plan_mixture(counts, total, np.zeros_like(total), capacity=4096, epoch=epoch,
                            group_size=group_size, single_source=single_source)  # fmt: skip
        assert len(plan) > 2000
        if single_source:
            assert all(len(set(plan.pack_sources(p))) == 1 for p in range(len(plan)))
        assert all(len(set(plan.pack(p))) == len(plan.pack(p)) for p in range(len(plan)))
        report = realized_shares(plan, total, NAMES, WEIGHTS, window=1000, stride=100)
        assert report["worst"] <= 0.01, report
        assert np.allclose(report["epoch"], WEIGHTS, atol=0.002)


def test_plain_shuffle_would_miss_the_window_target() -> None:
    """The check above can fail: the same packs in storage (load) order miss it badly."""
    sizes, total, tokens = _generated()
    blend = _blend()
    counts = epoch_counts(source_targets(blend, sizes, tokens), sizes, NAMES, 0, 0)
    plan = plan_mixture(counts, total, np.zeros_like(total), capacity=4096, epoch=0)
    unordered = dataclasses.replace(plan, order=np.arange(len(plan)))
    assert realized_shares(unordered, total, NAMES, WEIGHTS, stride=100)["worst"] > 0.05


def test_replan_from_cursor_keeps_served_packs_and_lists_what_it_drops() -> None:
    sizes, total, tokens = _generated()
    blend = _blend()
    old_targets = source_targets(blend, sizes, tokens)
    counts = epoch_counts(old_targets, sizes, NAMES, 0, 0)
    plan = plan_mixture(counts, total, np.zeros_like(total), capacity=4096, epoch=0)
    cursor = len(plan) // 3
    new_targets = old_targets.copy()
    new_targets[1] //= 2  # ocr halved
    new_targets[2] *= 2  # charts doubled
    new = replan_from_cursor(plan, cursor, new_targets, NAMES, total, np.zeros_like(total),
                             capacity=4096)  # fmt: skip
    served = [i for p in plan.order[:cursor] for i in plan.pack(int(p))]
    assert [i for p in new.order[:cursor] for i in new.pack(int(p))] == served
    old_uses = Counter(plan.ids.tolist())
    new_uses = Counter(new.ids.tolist())
    bounds = plan.bounds
    for s in range(3):

        def mine(c: Counter[int], s: int = s) -> Counter[int]:
            return Counter({i: n for i, n in c.items() if bounds[s] <= i < bounds[s + 1]})

        assert sum(mine(new_uses).values()) == new_targets[s]
        dropped = mine(Counter(new.replan_dropped.tolist()))
        if s == 1:  # fewer: every old use either served, still planned, or listed as dropped
            assert mine(new_uses) + dropped == mine(old_uses)
        else:  # the same or more: nothing dropped, every old use still there
            assert not dropped
            assert not (mine(old_uses) - mine(new_uses))
    charts = np.array([new_uses[i] for i in range(int(bounds[2]), int(bounds[3]))])
    assert charts.max() - charts.min() <= 1  # topped up least-used first


def test_mixture_pack_source_passes_assert_resumable() -> None:
    rng = np.random.default_rng(0)
    total = np.concatenate([rng.integers(5, 60, 30), rng.integers(5, 60, 4)])
    layout = MixtureLayout(
        names=("big", "small"), sizes=(30, 4), total=total, visual=np.zeros_like(total),
        capacity=100, packing_ratio=1.0, overlong="raise", seed=0, single_source=False,
        lengths_fingerprint="t",
    )  # fmt: skip
    blend = {"epoch_tokens": None, "sources": [["big", 0.7, None], ["small", 0.3, None]]}
    for world_size, rank in ((1, 0), (2, 1)):

        def make(rank: int = rank, world_size: int = world_size) -> MixturePackSource:
            return MixturePackSource(layout, blend, rank=rank, world_size=world_size, tail="pad")

        assert assert_resumable(make, epochs=2) > 0


# ---------------------------------------------------------------- the graph


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mix")
    data = {}
    for name, n, seed in zip(NAMES, (16, 10, 3), (1, 2, 3), strict=True):
        data[name] = write_corpus(root / name, num_samples=n, seed=seed)  # own media root each
    processor = load_tiny_processor()
    w = {"root": root, "data": data, "processor": processor}
    neat_vlm_graph(None, processor, config=_config(w))  # builds the cached length indexes
    return w


def _mixture(w: dict[str, Any], weights: tuple[float, ...] = GRAPH, **kw: Any) -> Mixture:
    return Mixture(
        sources=[
            MixtureSource(
                name=n, data=w["data"][n], media_root=str(w["root"] / n / "media"), weight=wt
            )
            for n, wt in zip(NAMES, weights, strict=True)
        ],
        **kw,
    )


def _config(w: dict[str, Any], weights: tuple[float, ...] = GRAPH, **kw: Any) -> NeatVLMConfig:
    mix_kw = {k: kw.pop(k) for k in ("on_change", "single_source_packs") if k in kw}
    return NeatVLMConfig(pack_size=1024, mixture=_mixture(w, weights, **mix_kw),
                         cache_dir=str(w["root"] / "cache"), **kw)  # fmt: skip


def _run(loader: Any, epochs: int = 1, stop: int | None = None) -> list[list[int]]:
    out = []
    for _ in range(epochs):
        for batch in loader:
            out.append([i for m in batch["packs"] for i in m["sample_ids"]])
            if stop is not None and len(out) == stop:
                loader.close()  # stop its threads now, not at garbage collection
                return out
    return out


def _selection(loader: Any, epoch: int, blend: Any = None) -> Counter[int]:
    """The uses epoch ``epoch`` asks for, computed from the spec, not from the plan."""
    layout = loader.source.layout
    targets = layout.targets(blend or loader.source.blend)
    counts = epoch_counts(targets, layout.sizes, layout.names, layout.seed, epoch)
    bounds = np.concatenate([[0], np.cumsum(layout.sizes)])
    return Counter({int(bounds[s]) + i: int(c) for s, cs in enumerate(counts)
                    for i, c in enumerate(cs) if c})  # fmt: skip


def test_graph_ledger_is_exactly_once_per_repeat_per_source_and_tags_documents(
    world: dict[str, Any],
) -> None:
    loader = neat_vlm_graph(None, world["processor"], config=_config(world, tail="drop"))
    sizes = loader.source.layout.sizes
    for epoch in range(2):
        for batch in loader:
            names = batch["source_names"]
            for row, meta in enumerate(batch["packs"]):
                packed = meta["report"]["packed"]
                tags = batch["doc_sources"][row].tolist()
                assert tags[: len(packed)] == [loader.source.plan_for(1).source_of([i])[0]
                                               for i in packed]  # fmt: skip
                assert all(t == -1 for t in tags[len(packed) :])
                assert names == list(NAMES)
                assert meta["epoch"] == epoch
        ledger = loader.ledgers[epoch]
        got = Counter(ledger.consumed) + Counter(ledger.tail_dropped)
        assert got == _selection(loader, epoch)
        report = mixture_ledger([ledger], loader.source.plan_for(1).bounds, NAMES)
        assert report["charts"]["unique"] + report["charts"]["dropped"] >= sizes[2]
        assert report["charts"]["repeated"] > 0  # the small source is upsampled
        assert report["caption"]["repeated"] == 0
    assert _selection(loader, 0) != _selection(loader, 1)  # the partial repeat is per epoch


def test_single_source_packs(world: dict[str, Any]) -> None:
    cfg = _config(world, single_source_packs=True)
    loader = neat_vlm_graph(None, world["processor"], config=cfg)
    for batch in loader:
        tags = batch["doc_sources"][0]
        assert len(set(tags[tags >= 0].tolist())) == 1


def test_kill_and_resume_mid_epoch_gives_the_uninterrupted_batches(
    world: dict[str, Any],
) -> None:
    cfg = _config(world, batch_size=2)
    reference = _run(neat_vlm_graph(None, world["processor"], config=cfg), epochs=2)
    first = neat_vlm_graph(None, world["processor"], config=cfg)
    head = _run(first, stop=2)
    state = first.state_dict()
    del first
    resumed = neat_vlm_graph(None, world["processor"], config=cfg)
    resumed.load_state_dict(state)
    assert head + _run(resumed, epochs=2) == reference


def _saved_mid_epoch(world: dict[str, Any], steps: int = 3) -> tuple[dict[str, Any], list[int]]:
    first = neat_vlm_graph(None, world["processor"], config=_config(world))
    _run(first, stop=steps)
    return first.state_dict(), list(first.ledgers[0].consumed)


NEW = (0.5, 0.1, 0.4)  # ocr down, charts up


def test_blend_change_is_refused_when_asked(world: dict[str, Any]) -> None:
    state, _ = _saved_mid_epoch(world)
    loader = neat_vlm_graph(
        None, world["processor"], config=_config(world, NEW, on_change="refuse")
    )
    with pytest.raises(StateMismatchError, match="on_change='next_epoch'"):
        loader.load_state_dict(state)


def test_blend_change_at_the_next_epoch(world: dict[str, Any]) -> None:
    state, head = _saved_mid_epoch(world)
    old = neat_vlm_graph(None, world["processor"], config=_config(world))
    loader = neat_vlm_graph(None, world["processor"], config=_config(world, NEW))  # the default
    loader.load_state_dict(state)
    torch.save(loader.state_dict(), world["root"] / "st.pt")  # stays a plain, loadable dict
    _run(loader, epochs=2)
    pad = Counter(loader.ledgers[0].padded)
    assert Counter(head) + Counter(loader.ledgers[0].consumed) == _selection(old, 0)
    assert pad.keys() <= _selection(old, 0).keys()
    new_blend = loader.source.blend
    assert Counter(loader.ledgers[1].consumed) == _selection(loader, 1, new_blend)


def test_two_blend_changes_in_one_epoch_chain_their_replans(world: dict[str, Any]) -> None:
    state, head = _saved_mid_epoch(world, steps=2)
    second = neat_vlm_graph(
        None, world["processor"], config=_config(world, NEW, on_change="cursor")
    )
    second.load_state_dict(state)
    middle = _run(second, stop=2)
    state = second.state_dict()
    third_blend = (0.2, 0.4, 0.4)
    third = neat_vlm_graph(
        None, world["processor"], config=_config(world, third_blend, on_change="cursor")
    )
    third.load_state_dict(state)
    assert [c for c, _ in third.state_dict()["source"]["mixture"]["segments"]] == [0, 2, 4]
    _run(third)
    consumed = Counter(head) + Counter(i for ids in middle for i in ids)
    consumed += Counter(third.ledgers[0].consumed)
    layout = third.source.layout
    bounds = np.concatenate([[0], np.cumsum(layout.sizes)])
    targets = layout.targets(third.source.blend)
    for s in range(3):
        mine = sum(n for i, n in consumed.items() if bounds[s] <= i < bounds[s + 1])
        assert mine == targets[s], NAMES[s]
    for s in range(3):  # every source's uses stay level: nothing repeated before all were used
        uses = [consumed[i] for i in range(int(bounds[s]), int(bounds[s + 1]))]
        assert max(uses) - min(uses) <= 1, NAMES[s]


@pytest.mark.parametrize("on_change", ["next_epoch", "cursor"])
def test_blend_change_saved_at_an_epoch_end_takes_the_whole_next_epoch(
    world: dict[str, Any], on_change: str
) -> None:
    first = neat_vlm_graph(None, world["processor"], config=_config(world))
    _run(first)
    state = first.state_dict()  # after the loop: epoch 1, nothing of it served
    loader = neat_vlm_graph(
        None, world["processor"], config=_config(world, NEW, on_change=on_change)
    )
    loader.load_state_dict(state)
    _run(loader)
    assert list(loader.ledgers) == [1]
    got = Counter(loader.ledgers[1].consumed)
    assert got == _selection(loader, 1, loader.source.blend)
    assert got != _selection(first, 1)


def test_blend_change_from_the_cursor_replans_the_rest_of_the_epoch(
    world: dict[str, Any],
) -> None:
    state, head = _saved_mid_epoch(world)
    old = neat_vlm_graph(None, world["processor"], config=_config(world))
    loader = neat_vlm_graph(
        None, world["processor"], config=_config(world, NEW, on_change="cursor")
    )
    loader.load_state_dict(state)
    saved = loader.state_dict()["source"]["mixture"]["segments"]
    assert [c for c, _ in saved] == [0, 3]
    _run(loader)
    consumed = Counter(head) + Counter(loader.ledgers[0].consumed)
    dropped = Counter(loader.source.replan_dropped(0))
    layout = loader.source.layout
    bounds = np.concatenate([[0], np.cumsum(layout.sizes)])
    before, targets = _selection(old, 0), layout.targets(loader.source.blend)

    def part(c: Counter[int], s: int) -> Counter[int]:
        return Counter({i: n for i, n in c.items() if bounds[s] <= i < bounds[s + 1]})

    for s in range(3):
        assert sum(part(consumed, s).values()) == targets[s], NAMES[s]
    # ocr went down: every use the old blend planned was consumed or listed as dropped
    assert part(consumed, 1) + part(dropped, 1) == part(before, 1)
    assert sum(dropped.values()) > 0
    # caption unchanged, charts up: nothing of the old selection lost, nothing dropped
    for s in (0, 2):
        assert not part(before, s) - part(consumed, s)
        assert not part(dropped, s)
    uses = [consumed[i] for i in range(int(bounds[2]), int(bounds[3]))]
    assert max(uses) - min(uses) <= 1  # the extra charts uses went to the least used first
    report = mixture_ledger([loader.ledgers[0]], bounds, NAMES,
                            replan_dropped=loader.source.replan_dropped(0))  # fmt: skip
    assert report["ocr"]["replan_dropped"] == sum(part(dropped, 1).values())


def test_target_shares_and_other_sources_refused(world: dict[str, Any]) -> None:
    assert target_shares({"epoch_tokens": None, "sources": [["a", 1, None], ["b", 1, None]]},
                         [10, 30]) == [0.5, 0.5]  # fmt: skip
    state, _ = _saved_mid_epoch(world, steps=1)
    # 'charts' now reads the caption records, with their own media (under the charts media
    # root they do not exist: the length index, not reusing the cache, says so)
    swap = {n: "caption" if n == "charts" else n for n in NAMES}
    mix = Mixture(sources=[
        MixtureSource(name=n, data=world["data"][swap[n]],
                      media_root=str(world["root"] / swap[n] / "media"), weight=wt)
        for n, wt in zip(NAMES, GRAPH, strict=True)
    ])  # fmt: skip
    cfg = NeatVLMConfig(pack_size=1024, mixture=mix, cache_dir=str(world["root"] / "cache"))
    loader = neat_vlm_graph(None, world["processor"], config=cfg)
    with pytest.raises(StateMismatchError):
        loader.load_state_dict(state)


def test_data_and_mixture_together_are_refused(world: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="data=None"):
        neat_vlm_graph(Path("x.jsonl"), world["processor"], config=_config(world))


def _with_bad_record(world: dict[str, Any], tmp_path: Path, policy: str) -> Any:
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    bad = [{"role": "user", "content": [{"type": "image", "image": "missing.png"}]},
           {"role": "assistant", "content": "x"}]  # fmt: skip
    path = tmp_path / "chat.jsonl"
    lines = [{"messages": conv}] * 2 + [{"messages": bad}] + [{"messages": conv}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    mix = Mixture(sources=[
        MixtureSource(name="caption", data=world["data"]["caption"],
                      media_root=str(world["root"] / "caption" / "media"), weight=0.8),
        MixtureSource(name="chat", data=path, media_root=str(tmp_path), weight=0.2),
    ])  # fmt: skip
    cfg = NeatVLMConfig(pack_size=1024, mixture=mix, on_bad_sample=policy)
    return neat_vlm_graph(None, world["processor"], config=cfg)


def test_bad_record_is_named_or_counted_once_per_use(world: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(Exception, match="sample_id=2") as info:
        _with_bad_record(world, tmp_path, "raise")
    assert any("mixture source 'chat'" in note for note in info.value.__notes__)
    loader = _with_bad_record(world, tmp_path, "skip")
    _run(loader)
    plan = loader.source.plan_for(1)
    bad = int(plan.bounds[1]) + 2
    uses = int((plan.ids == bad).sum())
    assert uses >= 2  # chat is upsampled: the bad record is planned several times
    report = mixture_ledger([loader.ledgers[0]], plan.bounds, ["caption", "chat"])
    assert report["chat"]["failed"] == uses  # once per use, not once per record
    assert bad not in loader.ledgers[0].consumed


def test_max_record_bytes_reaches_every_source(world: dict[str, Any]) -> None:
    cfg = NeatVLMConfig(pack_size=1024, mixture=_mixture(world), max_record_bytes=64)
    with pytest.raises(ValueError, match=r"line 1 \(sample_id=0\) is \d+ bytes, over max_record_"
                       "bytes=64") as info:  # fmt: skip
        neat_vlm_graph(None, world["processor"], config=cfg)
    assert any("mixture source" in note for note in info.value.__notes__)


def _visual_per_row(loader: Any, image_token: int) -> tuple[list[int], list[int]]:
    """Image tokens in each pack row the loader serves, and every sample id served."""
    rows, ids = [], []
    for batch in loader:
        rows += (batch["input_ids"] == image_token).sum(dim=1).tolist()
        ids += [i for m in batch["packs"] for i in m["sample_ids"]]
    return rows, ids


@pytest.mark.parametrize("balance", ["tokens", "cost"])
def test_a_mixture_keeps_the_visual_budget_and_takes_the_cost_balance(
    world: dict[str, Any], balance: str
) -> None:
    """A mixture's plan applies ``max_visual_tokens`` (no pack row over it, the same uses of
    the same samples as without it) and ``balance`` (they were refused for a Mixture before),
    through the graph and through the deprecated ``config(mixture=...)`` form alike."""
    image_token = world["processor"].tokenizer.convert_tokens_to_ids("<|image_pad|>")
    mix = _mixture(world)
    base = NeatVLMConfig(pack_size=1024, cache_dir=str(world["root"] / "cache"))
    plain, plain_ids = _visual_per_row(neat_vlm_graph(mix, world["processor"], config=base),
                                       image_token)  # fmt: skip
    budget = 530  # the largest sample alone has 525
    assert max(plain) > budget  # the budget binds: some packs hold more without it
    cfg = dataclasses.replace(base, max_visual_tokens=budget, balance=balance)
    rows, ids = _visual_per_row(neat_vlm_graph(mix, world["processor"], config=cfg), image_token)
    assert max(rows) <= budget
    assert Counter(ids) == Counter(plain_ids)  # every use served, none dropped or repeated
    with pytest.warns(DeprecationWarning, match="a mixture is data"):
        legacy = dataclasses.replace(cfg, mixture=mix)
    assert _visual_per_row(neat_vlm_graph(None, world["processor"], config=legacy),
                           image_token) == (rows, ids)  # fmt: skip


def test_a_mixture_keeps_the_images_budget(world: dict[str, Any]) -> None:
    """``max_images`` through a mixture's plan, with ``max_visual_tokens`` and the cost balance:
    no pack row holds more images (counted in the batch: one ``<|vision_start|>`` each) than
    the budget, and the same uses of the same samples are served as without it."""
    tok = world["processor"].tokenizer
    image_token = tok.convert_tokens_to_ids("<|image_pad|>")
    start = tok.convert_tokens_to_ids("<|vision_start|>")
    mix = _mixture(world)
    base = NeatVLMConfig(pack_size=1024, cache_dir=str(world["root"] / "cache"))

    def served(cfg: NeatVLMConfig) -> tuple[list[int], list[int], list[int]]:
        items, visual, ids = [], [], []
        for batch in neat_vlm_graph(mix, world["processor"], config=cfg):
            items += (batch["input_ids"] == start).sum(dim=1).tolist()
            visual += (batch["input_ids"] == image_token).sum(dim=1).tolist()
            ids += [i for m in batch["packs"] for i in m["sample_ids"]]
        return items, visual, ids

    plain_items, _, plain_ids = served(base)
    assert max(plain_items) > 3  # the budget binds
    cfg = dataclasses.replace(base, max_images=3, max_visual_tokens=530, balance="cost")
    items, visual, ids = served(cfg)
    assert max(items) <= 3
    assert max(visual) <= 530
    assert Counter(ids) == Counter(plain_ids)  # every use served, none dropped or repeated
    assert sum(items) == sum(plain_items)
