"""Compose your own graph (issue #14): public steps, hand-built == prebuilt, the whole graph's
state checkpointed (user nodes with state, inline and in workers), elastic resume over real
gloo ranks, the bookkeeping guard rail and the hooks."""

from __future__ import annotations

import copy
import io
import multiprocessing as mp
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchdata.nodes import BaseNode, Batcher, Mapper

from neatpack.graphs import (
    BookkeepingError,
    NeatLLMConfig,
    NeatLoader,
    NeatVLMConfig,
    StateMismatchError,
    map_stage,
    neat_llm_parts,
    neat_vlm_graph,
    open_source,
)
from neatpack.pipes import (
    Collater,
    LengthEstimator,
    LengthSource,
    MaskConverter,
    MaterializeConfig,
    Materializer,
    PackMaterializer,
    PackSource,
    PerPack,
    PPMediaSplitter,
    RecordReader,
    SequenceSource,
    Shifter,
    StepChain,
    build_length_index,
    load_tiny_processor,
    plan_packs,
    write_corpus,
)
from neatpack.pipes.testing.resume import assert_exactly_once, assert_resumable, same_item

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
NUM_TEXT = 60


# ---------------------------------------------------------------- user nodes and steps


class CountingFilter(BaseNode[dict[str, Any]]):
    """A user filter with state: drops a pack ref when a hash of (seen count) says so, so what
    it drops depends on its counter; a resume that restarts the counter drops other packs."""

    SOURCE_KEY, SEEN_KEY, KEPT_KEY = "source", "seen", "kept"

    def __init__(self, source: BaseNode[dict[str, Any]]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.source = source
        self.seen = self.kept = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset()  # counters carry over epochs
        else:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self.seen, self.kept = initial_state[self.SEEN_KEY], initial_state[self.KEPT_KEY]

    def next(self) -> dict[str, Any]:
        while True:
            ref = next(self.source)
            self.seen += 1
            if (self.seen * 7919) % 5 != 0:
                self.kept += 1
                return ref

    def get_state(self) -> dict[str, Any]:
        return {
            self.SOURCE_KEY: self.source.state_dict(),
            self.SEEN_KEY: self.seen,
            self.KEPT_KEY: self.kept,
        }


class StepCounter(BaseNode[dict[str, Any]]):
    """A user node with state after the worker stage: numbers the batches it hands on."""

    SOURCE_KEY, COUNT_KEY = "source", "count"

    def __init__(self, source: BaseNode[dict[str, Any]]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.source, self.count = source, 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset()
        else:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self.count = initial_state[self.COUNT_KEY]

    def next(self) -> dict[str, Any]:
        batch = next(self.source)
        self.count += 1
        return {**batch, "user_step": self.count}

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.COUNT_KEY: self.count}


def mark_pack(pack: dict[str, Any]) -> dict[str, Any]:
    """A user map step: no loss on each pack's first token."""
    pack["labels"] = pack["labels"].clone()
    pack["labels"][0] = -100
    return pack


def text_records(n: int = NUM_TEXT) -> list[dict[str, Any]]:
    return [{"input_ids": list(range(1, 5 + (7 * i) % 23))} for i in range(n)]


def text_loader(
    placement: str,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    stateful: bool = True,
    workers: int = 2,
) -> NeatLoader:
    """neat_llm's pieces with a user map step and a user stateful filter; ``placement``:
    "main" (every step inline, one node each) or "workers" (the steps in a StepChain run in
    worker processes, the stateful nodes around them in the main process)."""
    cfg = NeatLLMConfig(pack_size=48, batch_size=2, tail="pad", attn_implementation="doc_ids")
    parts = neat_llm_parts(text_records(), config=cfg, rank=rank, world_size=world_size)

    def build(source: BaseNode[Any]) -> BaseNode[Any]:
        refs: BaseNode[Any] = CountingFilter(source) if stateful else source
        batches = Batcher(refs, cfg.batch_size, drop_last=False)
        if placement == "main":
            node: BaseNode[Any] = Mapper(batches, PerPack(parts.materialize))
            node = Mapper(node, PerPack(mark_pack))
            node = Mapper(node, parts.collate)
        else:
            chain = StepChain(PerPack(parts.materialize), PerPack(mark_pack), parts.collate)
            node = map_stage(batches, chain, num_workers=workers, prefetch=2)
        return StepCounter(node) if stateful else node

    return parts.loader(build)


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(copy.deepcopy(state), buf)
    buf.seek(0)
    out: dict[str, Any] = torch.load(buf, weights_only=True)
    return out


def _view(batch: dict[str, Any]) -> tuple[Any, ...]:
    return (
        batch["input_ids"].tolist(),
        batch["labels"].tolist(),
        [m["sample_ids"] for m in batch["packs"]],
        batch.get("user_step"),
    )


# ---------------------------------------------------------------- README and hand-built


def _readme_block() -> str:
    section = README.split("## Compose your own graph", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    return code.group(1)


def test_readme_compose_section_runs() -> None:
    exec(compile(_readme_block(), "README-compose", "exec"), {})


@pytest.fixture(scope="module")
def vlm_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    root = tmp_path_factory.mktemp("compose")
    write_corpus(root, num_samples=24, seed=4)
    return root, load_tiny_processor()


def test_hand_built_graph_equals_neat_vlm_graph(vlm_corpus: tuple[Path, Any]) -> None:
    root, processor = vlm_corpus
    cfg = NeatVLMConfig(pack_size=1024, batch_size=2, media_root=str(root / "media"), prefetch=0)
    data = root / "data.jsonl"
    prebuilt = list(neat_vlm_graph(data, processor, config=cfg))

    # Every piece from the public API, nothing copied from the graph's module.
    records = open_source(data, cfg.media_root)
    estimator = LengthEstimator.from_processor(processor, mode=cfg.estimate_mode)
    index = build_length_index(records, estimator)

    def plan_for(group_size: int) -> Any:
        return plan_packs(
            index.total, cfg.pack_size, visual=index.visual, world_size=group_size, seed=cfg.seed
        )

    source = PackSource(plan_for, rank=0, world_size=1, batch_size=cfg.batch_size)
    pad = int(processor.tokenizer.pad_token_id)
    materialize = PackMaterializer(
        Materializer(
            records,
            processor,
            MaterializeConfig(
                pack_size=cfg.pack_size, padding_idx=pad, overflow=cfg.overflow, seed=cfg.seed
            ),
        ),
        index.total,
    )
    collate = Collater(padding_idx=pad, attn_implementation=cfg.attn_implementation)

    def build(src: BaseNode[Any]) -> BaseNode[Any]:
        refs = Batcher(src, cfg.batch_size, drop_last=False)
        return map_stage(refs, StepChain(PerPack(materialize), collate), num_workers=0)

    by_hand = list(NeatLoader(source, build, pack_size=cfg.pack_size))
    assert len(by_hand) == len(prebuilt) > 3
    for i, (a, b) in enumerate(zip(by_hand, prebuilt, strict=True)):
        assert same_item(a, b), f"batch {i} differs"

    # The README's recipe (parts, a worker stage, a node of one's own between materialize
    # and collate) gives the batches of the prebuilt graph with that step as its pack hook.
    ns: dict[str, Any] = {}
    exec(compile(_readme_block().split("loader = graph(", 1)[0], "README-compose", "exec"), ns)
    ns.update(data=data, processor=processor, config=cfg)
    readme = list(ns["graph"](rank=0, world_size=1))
    step = ns["last_document_only"]
    hooked = list(neat_vlm_graph(data, processor, config=cfg, pack_transform=step))
    assert len(readme) == len(hooked) == len(prebuilt)
    for i, (a, b) in enumerate(zip(readme, hooked, strict=True)):
        assert same_item(a, b), f"README graph: batch {i} differs"
    assert not same_item([b["labels"] for b in readme], [b["labels"] for b in prebuilt])


# ---------------------------------------------------------------- whole-graph resume


def _reference(placement: str, epochs: int = 2) -> tuple[list[list[Any]], NeatLoader]:
    loader = text_loader(placement)
    return [[_view(b) for b in loader] for _ in range(epochs)], loader


@pytest.mark.parametrize("placement", ["main", "workers"])
def test_user_nodes_resume_exactly_everywhere(placement: str) -> None:
    reference, ref_loader = _reference(placement)
    n = len(reference[0])
    assert n >= 4
    filtered = ref_loader.ledgers[0].filtered
    assert filtered, "the filter must drop packs for this test to mean anything"
    # A resume that lost the filter's counter would drop other packs: make sure it matters.
    assert reference[0] != reference[1]
    for epoch, k in [(0, 0), (0, n // 2), (0, n), (0, "end"), (1, n // 2)]:
        first = text_loader(placement)
        head: list[Any] = []
        for _ in range(epoch):
            head += [_view(b) for b in first]
        it = iter(first)
        if k == "end":
            head += [_view(b) for b in it]
        else:
            head += [_view(next(it)) for _ in range(int(k))]
        state = _roundtrip(first.state_dict())
        ledger = {e: copy.deepcopy(vars(x)) for e, x in first.ledgers.items()}
        del it, first
        resumed = text_loader(placement)
        resumed.load_state_dict(state)
        rest: list[Any] = []
        while resumed.epoch < 2:
            rest += [_view(b) for b in resumed]
        want = reference[0] + reference[1]
        assert head + rest == want, f"{placement}: resume at epoch {epoch}, batch {k}"
        for e in range(2):
            got = ledger.get(e, {}).get("consumed", []) + ledger.get(e, {}).get("filtered", [])
            if e in resumed.ledgers:
                got += resumed.ledgers[e].consumed + resumed.ledgers[e].filtered
            assert_exactly_once(got, range(NUM_TEXT))


def test_every_public_step_passes_assert_resumable() -> None:
    cfg = NeatLLMConfig(pack_size=48, batch_size=2, tail="pad", attn_implementation="doc_ids")

    def make() -> BaseNode[Any]:
        parts = neat_llm_parts(text_records(24), config=cfg)
        refs = Batcher(parts.source, 2, drop_last=False)
        chain = StepChain(
            PerPack(parts.materialize),
            PerPack(mark_pack),
            parts.collate,
            MaskConverter("sdpa"),
            PPMediaSplitter(1),
        )
        return Mapper(refs, chain)

    assert assert_resumable(make, epochs=2) >= 3
    assert (
        assert_resumable(
            lambda: StepCounter(
                CountingFilter(neat_llm_parts(text_records(24), config=cfg).source)
            ),
            epochs=2,
        )
        >= 5
    )
    chats = [
        {
            "messages": [
                {"role": "user", "content": "hi " * n},
                {"role": "assistant", "content": "ok"},
            ]
        }
        for n in range(1, 10)
    ]
    records = SequenceSource(chats)
    assert assert_resumable(lambda: RecordReader(records), epochs=2) == 9
    assert assert_resumable(lambda: LengthSource(records, LengthEstimator()), epochs=1) == 9


def test_mask_converter_equals_collating_in_that_format() -> None:
    cfg = NeatLLMConfig(pack_size=48, batch_size=2, attn_implementation="doc_ids")
    parts = neat_llm_parts(text_records(), config=cfg)
    parts.source.reset()
    packs = [parts.materialize(parts.source.next()) for _ in range(2)]
    for fmt in ("sdpa", "eager"):
        direct = Collater(padding_idx=0, max_length=48, attn_implementation=fmt)(packs)
        converted = MaskConverter(fmt)(parts.collate(packs))
        assert torch.equal(direct["attention_mask"], converted["attention_mask"]), fmt
        assert torch.equal(direct["input_ids"], converted["input_ids"])
    with pytest.raises(ValueError, match="not one of"):
        MaskConverter("flash_attention_2")


def test_shifter_is_the_default_shift_and_replaceable(vlm_corpus: tuple[Path, Any]) -> None:
    root, processor = vlm_corpus
    records = open_source(root / "data.jsonl", str(root / "media"))
    mcfg = MaterializeConfig(pack_size=2048, overflow="truncate")
    ref = {"epoch": 0, "slot": 0, "pack_index": 0, "padded": False, "sample_ids": [0, 1]}
    default = Materializer(records, processor, mcfg)(ref)
    explicit = Materializer(records, processor, mcfg, shift=Shifter())(ref)
    assert same_item(default, explicit)

    def shift_no_loss(sample: dict[str, Any]) -> dict[str, Any]:
        out = Shifter()(sample)
        out["labels"] = torch.full_like(out["labels"], -100)
        return out

    replaced = Materializer(records, processor, mcfg, shift=shift_no_loss)(ref)
    assert torch.equal(replaced["input_ids"], default["input_ids"])
    assert bool((default["labels"] != -100).any())
    assert bool((replaced["labels"] == -100).all())


# ---------------------------------------------------------------- elastic


def test_elastic_resume_refuses_a_stateful_node_by_name() -> None:
    loader = text_loader("main", rank=0, world_size=2)
    it = iter(loader)
    next(it)
    state = _roundtrip(loader.state_dict())
    other = text_loader("main", rank=1, world_size=3)
    with pytest.raises(
        StateMismatchError, match=re.escape("CountingFilter at root.source.source.source")
    ):
        other.load_state_dict(state)
    # the same state on the same layout resumes
    text_loader("main", rank=0, world_size=2).load_state_dict(state)


class DropEveryFifth(BaseNode[dict[str, Any]]):
    """A stateless user filter (ELASTIC: its state is only its source's)."""

    ELASTIC = True

    def __init__(self, source: BaseNode[dict[str, Any]]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.source = source

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state["source"])

    def next(self) -> dict[str, Any]:
        while True:
            ref = next(self.source)
            if ref["pack_index"] % 5 != 4:
                return ref

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict()}


def test_elastic_refuses_a_mid_epoch_state_after_drops() -> None:
    cfg = NeatLLMConfig(pack_size=48, batch_size=1, attn_implementation="doc_ids")

    def loader(rank: int, world: int) -> NeatLoader:
        parts = neat_llm_parts(text_records(), config=cfg, rank=rank, world_size=world)
        return parts.loader(lambda s: parts.build(DropEveryFifth(s)))

    first = loader(0, 2)
    it = iter(first)
    while not first.ledgers.get(0) or not first.ledgers[0].filtered:
        next(it)
    state = _roundtrip(first.state_dict())
    with pytest.raises(StateMismatchError, match=r"dropped \d+ pack\(s\) on rank 0"):
        loader(0, 3).load_state_dict(state)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(phase: str, rank: int, world: int, port: int, root: str, steps: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        loader = text_loader("workers", stateful=False, workers=1)  # rank/world from dist
        out: dict[str, Any] = {}
        if phase == "resume":
            loader.load_state_dict(torch.load(f"{root}/state_{rank % 2}.pt", weights_only=True))
        taken = 0
        while loader.epoch < 2:
            for batch in loader:
                assert (batch["labels"][:, 0] == -100).all()  # the user step ran
                taken += 1
                if phase == "first" and taken == steps:
                    torch.save(loader.state_dict(), f"{root}/state_{rank}.pt")
                    break
            if phase == "first":
                break
        out["ledgers"] = {e: vars(x) for e, x in loader.ledgers.items()}
        out["batches"] = taken
        torch.save(out, f"{root}/{phase}_{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(phase: str, world: int, root: Path, steps: int = 0) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(phase, r, world, port, str(root), steps))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"{phase}: exit codes {codes}"
    return [torch.load(root / f"{phase}_{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_elastic_two_to_three_gloo_ranks_with_a_user_step(tmp_path: Path) -> None:
    first = _run("first", 2, tmp_path, steps=3)
    resumed = _run("resume", 3, tmp_path)
    assert len({o["batches"] for o in resumed}) == 1  # ranks in lockstep
    for epoch in range(2):
        consumed = [
            i for o in first + resumed for i in o["ledgers"].get(epoch, {}).get("consumed", [])
        ]
        assert_exactly_once(consumed, range(NUM_TEXT))


# ---------------------------------------------------------------- guard rails and hooks


def test_a_batch_without_packs_is_an_error_naming_it() -> None:
    cfg = NeatLLMConfig(pack_size=48, batch_size=2, attn_implementation="doc_ids")
    parts = neat_llm_parts(text_records(), config=cfg)

    def forgetful(packs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = parts.collate(packs)
        del batch["packs"]
        return batch

    def build(src: BaseNode[Any]) -> BaseNode[Any]:
        return Mapper(
            Batcher(src, 2, drop_last=False), StepChain(PerPack(parts.materialize), forgetful)
        )

    loader = parts.loader(build)
    with pytest.raises(BookkeepingError, match=r"without 'packs'.*Collater.*pack\.pop\('meta'\)"):
        next(iter(loader))


def test_step_chain_refuses_a_stateful_step() -> None:
    class Stateful:
        def __call__(self, x: Any) -> Any:
            return x

        def get_state(self) -> dict[str, Any]:
            return {}

    with pytest.raises(TypeError, match=r"Stateful.*get_state.*main process"):
        StepChain(PerPack(Stateful()))


def test_hooks_on_neat_vlm_graph(vlm_corpus: tuple[Path, Any]) -> None:
    root, processor = vlm_corpus
    cfg = NeatVLMConfig(pack_size=1024, batch_size=2, media_root=str(root / "media"))
    data = root / "data.jsonl"
    plain = list(neat_vlm_graph(data, processor, config=cfg))

    def no_first_label(sample: dict[str, Any]) -> dict[str, Any]:
        sample["labels"] = sample["labels"].clone()
        if sample["sample_id"] % 2 == 0:  # no loss on even samples
            sample["labels"][:] = -100
        return sample

    hooked_loader = neat_vlm_graph(
        data,
        processor,
        config=cfg,
        sample_transform=no_first_label,
        pack_transform=lambda p: {**p, "seq_lens": p["seq_lens"]},
        batch_transform=lambda b: {**b, "tag": len(b["packs"])},
    )
    hooked = list(hooked_loader)
    assert len(hooked) == len(plain)
    assert all(b["tag"] == len(b["packs"]) for b in hooked)
    assert all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(plain, hooked, strict=True)
    )
    lost = sum(
        int((a["labels"] != -100).sum() - (b["labels"] != -100).sum())
        for a, b in zip(plain, hooked, strict=True)
    )
    assert lost > 0  # the per-sample hook reached the labels
    assert_exactly_once(hooked_loader.ledgers[0].consumed, range(24))
