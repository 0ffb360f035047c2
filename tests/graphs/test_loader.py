"""NeatLoader over a small literal graph: exact resume at every batch, epochs, elastic, refusals."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch
from support.states import roundtrip
from torchdata.nodes import Batcher, Mapper, ParallelMapper

from neatpack.graphs.runtime.loader import NeatLoader, StateMismatchError
from neatpack.pipes.planning.source import PackSource
from neatpack.pipes.testing.resume import assert_exactly_once, same_item


class ShufflePlan:
    def __init__(self, num_packs: int, seed: int = 0) -> None:
        self.num_packs, self.seed = num_packs, seed
        self.fingerprint = f"shuffle-{num_packs}-{seed}"

    def __len__(self) -> int:
        return self.num_packs

    def pack(self, index: int) -> list[int]:
        return [3 * index, 3 * index + 1, 3 * index + 2]

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_packs)


def materialize(ref: dict[str, Any]) -> dict[str, Any]:
    ids = torch.tensor(ref["sample_ids"])
    return {**ref, "x": ids * 2, "real_tokens": 3}


def collate(packs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"x": torch.stack([p["x"] for p in packs]), "packs": packs}


def make_loader(
    rank: int = 0,
    world_size: int = 1,
    workers: int = 0,
    batch_size: int = 2,
    num_packs: int = 13,
    tail: str = "drop",
    seed: int = 0,
    ledger_epochs: int | None = None,
) -> NeatLoader:
    source = PackSource(
        ShufflePlan(num_packs, seed),
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        tail=tail,
    )

    def build(src: Any) -> Any:
        node = (
            ParallelMapper(
                src,
                materialize,
                num_workers=workers,
                method="process",
                multiprocessing_context="fork",
            )
            if workers
            else Mapper(src, materialize)
        )
        return Mapper(Batcher(node, batch_size, drop_last=False), collate)

    return NeatLoader(
        source,
        build,
        pack_size=4,
        config={"seed": seed, "batch_size": batch_size},
        ledger_epochs=ledger_epochs,
    )


def run_epochs(loader: NeatLoader, epochs: int) -> list[list[dict[str, Any]]]:
    return [list(loader) for _ in range(epochs)]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_every_batch_is_exact(workers: int) -> None:
    reference = run_epochs(make_loader(workers=workers), 3)
    assert [len(e) for e in reference] == [6, 6, 6]
    assert len(make_loader()) == 6
    for epoch in range(2):
        for k in range(len(reference[epoch]) + 1):
            first = make_loader(workers=workers)
            for _ in range(epoch):
                list(first)
            it = iter(first)
            head = [next(it) for _ in range(k)]
            state = roundtrip(first.state_dict())
            resumed = make_loader(workers=(2 - workers))  # other worker count on purpose
            resumed.load_state_dict(state)
            assert resumed.epoch == epoch
            rest = list(resumed)
            assert same_item(head + rest, reference[epoch]), (epoch, k)
            assert same_item(list(resumed), reference[epoch + 1])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_new_iter_ends_the_previous_iterator(workers: int) -> None:
    reference = run_epochs(make_loader(workers=workers), 2)
    loader = make_loader(workers=workers)
    first = iter(loader)
    next(first)
    second = iter(loader)  # the next epoch; the first iterator ends here
    assert list(first) == []  # it no longer takes batches from the graph
    del first  # before the fix its cleanup stopped the second iterator's threads
    assert same_item(list(second), reference[1])


def test_state_after_the_loop_continues_with_next_epoch() -> None:
    reference = run_epochs(make_loader(), 2)
    loader = make_loader()
    list(loader)
    state = loader.state_dict()
    resumed = make_loader()
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    assert same_item(list(resumed), reference[1])


def test_resume_inside_loop_at_last_batch_keeps_epoch_count() -> None:
    reference = run_epochs(make_loader(), 2)
    loader = make_loader()
    it = iter(loader)
    for _ in range(len(reference[0])):
        next(it)
    resumed = make_loader()
    resumed.load_state_dict(loader.state_dict())
    assert resumed.epoch == 0
    assert list(resumed) == []
    assert same_item(list(resumed), reference[1])


@pytest.mark.parametrize(("world", "new_world"), [(4, 2), (2, 3), (1, 2), (3, 1)])
def test_elastic_resume_ledger_is_exactly_once(world: int, new_world: int) -> None:
    loaders = [make_loader(rank=r, world_size=world, num_packs=29) for r in range(world)]
    its = [iter(x) for x in loaders]
    for it in its:
        next(it)
    states = [x.state_dict() for x in loaders]
    resumed = [make_loader(rank=r, world_size=new_world, num_packs=29) for r in range(new_world)]
    for r, x in enumerate(resumed):
        x.load_state_dict(states[r % world])
    counts = {len(list(x)) for x in resumed}
    assert len(counts) == 1, "every rank yields the same number of batches"
    consumed = [i for x in loaders for i in x.ledgers[0].consumed]
    consumed += [i for x in resumed for i in x.ledgers[0].consumed]
    dropped = [i for x in resumed for i in x.ledgers[0].tail_dropped]
    assert_exactly_once(consumed, range(29 * 3), excused=dropped)
    # the next epoch is planned for the new world size and is exactly-once too
    for x in resumed:
        list(x)
    consumed = [i for x in resumed for i in x.ledgers[1].consumed]
    dropped = [i for x in resumed for i in x.ledgers[1].tail_dropped]
    assert_exactly_once(consumed, range(29 * 3), excused=dropped)


def test_refuses_other_config_rank_and_version() -> None:
    loader = make_loader(rank=0, world_size=2)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(StateMismatchError, match=r"config changed.*seed"):
        make_loader(rank=0, world_size=2, seed=1).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="rank 0 loaded into rank 1"):
        make_loader(rank=1, world_size=2).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="version"):
        make_loader(rank=0, world_size=2).load_state_dict({**state, "neatpack_loader_version": 7})


def die_on_pack_5(ref: dict[str, Any]) -> dict[str, Any]:
    if ref["pack_index"] == 5:
        os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
    return materialize(ref)


@pytest.mark.faults
@pytest.mark.timeout(60)
def test_dead_worker_raises_instead_of_hanging() -> None:
    source = PackSource(ShufflePlan(13), rank=0, world_size=1, batch_size=2, tail="drop")

    def build(src: Any) -> Any:
        node = ParallelMapper(
            src, die_on_pack_5, num_workers=2, method="process", multiprocessing_context="fork"
        )
        return Mapper(Batcher(node, 2, drop_last=False), collate)

    loader = NeatLoader(source, build, pack_size=4)
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"worker process \d+ of ParallelMapper died with exit code -9"
    ):
        list(loader)
    assert time.monotonic() - started < 30


def test_ledger_epochs_keeps_only_the_last_epochs() -> None:
    """A long run's ledgers stay bounded: with ledger_epochs=2 only the last two epochs are
    kept, and they hold exactly what an unbounded loader records for those epochs."""
    bounded, full = make_loader(ledger_epochs=2), make_loader()
    for _ in range(4):
        list(bounded), list(full)
        assert len(bounded.ledgers) <= 2
    assert sorted(bounded.ledgers) == [2, 3]
    assert sorted(full.ledgers) == [0, 1, 2, 3]
    for epoch in (2, 3):
        assert bounded.ledgers[epoch] == full.ledgers[epoch]
        assert bounded.ledgers[epoch].consumed  # the epoch really was recorded
    with pytest.raises(ValueError, match="ledger_epochs=0 must be >= 1"):
        make_loader(ledger_epochs=0)


def test_pin_memory_without_cuda_warns_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pin_memory=True`` on a machine without CUDA (a laptop, CI) is ignored with a warning,
    as torch's DataLoader does: the batches and the resume are the unpinned graph's. On CUDA,
    tests/parity/test_gpu.py checks the pinned path."""
    from neatpack.graphs.neat_llm import NeatLLMConfig, neat_llm_graph

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    g = torch.Generator().manual_seed(1)
    records = [{"input_ids": torch.randint(5, 90, (int(n),), generator=g).tolist()}
               for n in torch.randint(4, 30, (30,), generator=g)]  # fmt: skip
    plain = [b["sample_ids"] for b in neat_llm_graph(records, config=NeatLLMConfig(pack_size=64))]
    with pytest.warns(UserWarning, match="pin_memory=True is ignored: no CUDA"):
        pinned = neat_llm_graph(records, config=NeatLLMConfig(pack_size=64, pin_memory=True))
    got = [b["sample_ids"] for b in pinned]
    assert got == plain
    assert len(plain) > 2
