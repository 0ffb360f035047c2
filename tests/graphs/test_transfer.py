"""Worker batches reach the trainer's process through segments the worker reuses
(``pipes/materializing/transfer.py``): the same batches as without workers, never overwritten while
the
trainer holds them (or a slice of them), and reused once it lets them go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torchdata.nodes import IterableWrapper

from neatpack.graphs import (
    GroupedConfig,
    NeatLLMConfig,
    NeatVLMConfig,
    grouped_vlm_graph,
    neat_llm_graph,
    neat_vlm_graph,
)
from neatpack.graphs.runtime.stages import map_stage
from neatpack.pipes import transfer
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    d = tmp_path_factory.mktemp("transfer")
    return write_corpus(d, num_samples=72, seed=4), d / "media", load_tiny_processor("qwen2_vl")


def _cfg(media: Path, workers: int, **kw: Any) -> NeatVLMConfig:
    return NeatVLMConfig(
        pack_size=1024, batch_size=2, media_root=str(media), num_workers=workers, prefetch=1, **kw
    )


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype, k
            assert torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def test_held_batches_are_never_overwritten(corpus: tuple[Path, Path, Any]) -> None:
    """Every batch of the epoch kept in a list: each holds its own segment (none is reused
    while held), and all equal the batches made without workers."""
    data, media, proc = corpus
    ref = list(neat_vlm_graph(data, proc, config=_cfg(media, 0)))
    before = transfer.segments_seen()
    held = list(neat_vlm_graph(data, proc, config=_cfg(media, 2)))
    assert len(held) == len(ref) > 6
    assert transfer.segments_seen() - before == len(held)  # one live segment per held batch
    for a, b in zip(held, ref, strict=True):
        _same(a, b)


def test_released_segments_are_reused_and_slices_outlive_their_batch(
    corpus: tuple[Path, Path, Any],
) -> None:
    """Batches dropped as they come: the workers cycle through a few segments, not one per
    batch. A slice kept from an early batch keeps that segment leased: its values stay put
    while later batches are written."""
    data, media, proc = corpus
    ref = list(neat_vlm_graph(data, proc, config=_cfg(media, 0)))
    before = transfer.segments_seen()
    kept, n = None, 0
    for i, batch in enumerate(neat_vlm_graph(data, proc, config=_cfg(media, 2))):
        _same(batch, ref[i])
        if i == 1:
            kept = batch["pixel_values"][3:9]  # a view into the segment
        n += 1
        del batch
    used = transfer.segments_seen() - before
    assert n == len(ref) > 6
    assert used < n  # reused: without reuse every batch would take a new one
    assert kept is not None
    assert torch.equal(kept, ref[1]["pixel_values"][3:9])


def test_torch_transfer_gives_the_same_batches(corpus: tuple[Path, Path, Any]) -> None:
    """``worker_transfer="torch"`` reaches the two worker processes as an argument of their
    step: torch's own path carries every batch (no segment arrives), and the batches equal
    those made without workers."""
    data, media, proc = corpus
    ref = list(neat_vlm_graph(data, proc, config=_cfg(media, 0)))
    before = transfer.segments_seen()
    got = list(neat_vlm_graph(data, proc, config=_cfg(media, 2, worker_transfer="torch")))
    assert transfer.segments_seen() == before  # torch's own path carried them
    assert len(got) == len(ref) > 6
    for a, b in zip(got, ref, strict=True):
        _same(a, b)


def _token_records(n: int) -> list[dict[str, Any]]:
    return [{"input_ids": list(range(1, 5 + (i * 7) % 40))} for i in range(n)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("worker_transfer", ["segment", "torch"])
def test_the_transfer_choice_reaches_spawned_workers(worker_transfer: str) -> None:
    """Spawned workers start from a fresh interpreter: the choice travels pickled with their
    step, not through this process's state or environment. The text graph, 2 spawned workers:
    segments arrive only for ``"segment"``, and the batches equal those without workers."""
    records = _token_records(60)
    kw: dict[str, Any] = {"pack_size": 64, "batch_size": 2, "attn_implementation": "doc_ids"}
    ref = list(neat_llm_graph(records, config=NeatLLMConfig(**kw, num_workers=0)))
    cfg = NeatLLMConfig(
        **kw, num_workers=2, multiprocessing_context="spawn", worker_transfer=worker_transfer
    )
    before = transfer.segments_seen()
    got = list(neat_llm_graph(records, config=cfg))
    assert (transfer.segments_seen() > before) == (worker_transfer == "segment")
    assert len(got) == len(ref) > 4
    for a, b in zip(got, ref, strict=True):
        _same(a, b)


def test_the_grouped_graph_takes_the_transfer_choice(corpus: tuple[Path, Path, Any]) -> None:
    data, media, proc = corpus
    kw: dict[str, Any] = {"batch_size": 4, "media_root": str(media), "prefetch": 1}
    ref = list(grouped_vlm_graph(data, proc, config=GroupedConfig(**kw)))
    before = transfer.segments_seen()
    got = list(
        grouped_vlm_graph(
            data, proc, config=GroupedConfig(**kw, num_workers=2, worker_transfer="torch")
        )
    )
    assert transfer.segments_seen() == before
    assert len(got) == len(ref) > 6
    for a, b in zip(got, ref, strict=True):
        _same(a, b)


def test_a_bad_transfer_is_refused_at_construction_listing_the_choices() -> None:
    for config in (NeatVLMConfig, NeatLLMConfig, GroupedConfig):
        valid = r"worker_transfer='shm'\): not one of \['segment', 'torch'\]"
        with pytest.raises(ValueError, match=valid):
            config(worker_transfer="shm")  # type: ignore[arg-type]


def test_the_retired_variable_is_an_error_naming_the_config_field(
    corpus: tuple[Path, Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``NEATPACK_WORKER_ARENA`` is no longer read; a job that still sets it is told which
    field replaced it when its graph with worker processes is built, instead of silently
    getting the other transfer."""
    data, media, proc = corpus
    monkeypatch.setenv("NEATPACK_WORKER_ARENA", "0")
    with pytest.raises(RuntimeError, match="NEATPACK_WORKER_ARENA='0' is no longer read") as e:
        neat_vlm_graph(data, proc, config=_cfg(media, 2))
    assert "worker_transfer (NeatVLMConfig" in str(e.value)
    assert '"torch" for torch\'s own path' in str(e.value)
    # no worker processes, nothing it could switch: the graph is built
    assert len(neat_vlm_graph(data, proc, config=_cfg(media, 0))) > 0


def _odd_batch(i: int) -> dict[str, Any]:
    """Values of every kind a step may return."""
    g = torch.Generator().manual_seed(i)
    return {
        "ints": torch.arange(10 * (i + 1)).view(-1, 5),
        "flags": torch.rand(7, generator=g) > 0.5,
        "half": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5 + i),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "list": [torch.randn(2, 3, generator=g), torch.ones(5, dtype=torch.int32)],
        "mixed": [torch.ones(2), "text"],  # not all tensors: pickled as usual
        "meta": {"id": i, "t": torch.tensor([i])},
        "n": i,
    }


def _ident(x: int) -> dict[str, Any]:
    return _odd_batch(x)


def test_every_kind_of_value_arrives_equal() -> None:
    node = map_stage(IterableWrapper(range(6)), _ident, num_workers=2)
    before = transfer.segments_seen()
    got = list(node)
    assert transfer.segments_seen() > before  # they came through segments
    for i, b in enumerate(got):
        want = _odd_batch(i)
        assert list(b) == list(want)
        for k in ("ints", "flags", "half", "scalar", "empty", "transposed"):
            assert b[k].dtype == want[k].dtype, k
            assert b[k].shape == want[k].shape, k
            assert torch.equal(b[k], want[k]), k
        assert all(torch.equal(x, y) for x, y in zip(b["list"], want["list"], strict=True))
        assert torch.equal(b["mixed"][0], want["mixed"][0])
        assert b["mixed"][1] == "text"
        assert b["meta"]["id"] == i
        assert torch.equal(b["meta"]["t"], want["meta"]["t"])
        assert b["n"] == i


def test_only_worker_processes_use_segments() -> None:
    """In the trainer's own process (no workers, or thread workers) a step's batch is
    returned as it is."""
    assert not transfer.active()
    batch = _odd_batch(0)
    assert transfer.to_transfer(batch) is batch
    threads = list(map_stage(IterableWrapper(range(3)), _ident, num_workers=2, method="thread"))
    assert all(type(b) is dict for b in threads)


def test_a_worker_keeps_only_a_few_free_segments() -> None:
    """After the trainer held many batches at once and freed them, the worker keeps
    ``KEEP_FREE`` free segments (the largest) and closes the rest, instead of holding every
    segment it ever made."""
    pool = transfer._Pool()
    held = [pool.take(n << 20) for n in (1, 3, 2, 5, 4)]
    assert len(pool.segments) == 5  # all leased: one each
    for seg in held:
        seg.map[0] = 0  # the trainer's process freed them
    again = pool.take(1 << 20)
    assert again.leased()
    free = [s for s in pool.segments if not s.leased()]
    assert len(free) == transfer.KEEP_FREE
    assert sorted(s.capacity for s in free) == sorted(s.capacity for s in held)[-2:]
    for s in pool.segments:
        s.close()


@pytest.mark.timeout(120)  # the old code waited forever for the first batch
def test_flex_attention_batches_cross_from_workers(corpus: tuple[Path, Path, Any]) -> None:
    """Issue 25 item 12: ``flex_attention`` with a worker process. The batch's ``BlockMask``
    had a local mask function: the worker could not pickle it, and ``next()`` waited forever.
    Now every batch arrives, its mask equal to the one built without workers."""
    from torch.nn.attention.flex_attention import BlockMask

    data, media, proc = corpus
    cfg = {"pack_size": 1024, "batch_size": 2, "media_root": str(media), "prefetch": 1,
           "attn_implementation": "flex_attention"}  # fmt: skip
    ref = list(neat_vlm_graph(data, proc, config=NeatVLMConfig(**cfg, num_workers=0)))
    got = list(neat_vlm_graph(data, proc, config=NeatVLMConfig(**cfg, num_workers=1)))
    assert len(got) == len(ref) > 6
    for a, b in zip(got, ref, strict=True):
        assert isinstance(a["attention_mask"], BlockMask)
        assert torch.equal(a["attention_mask"].to_dense(), b["attention_mask"].to_dense())
        _same({k: v for k, v in a.items() if k != "attention_mask"},
              {k: v for k, v in b.items() if k != "attention_mask"})  # fmt: skip


def _unsendable(batch: dict[str, Any]) -> dict[str, Any]:
    batch["on_step"] = lambda: None  # a lambda cannot be pickled
    return batch


@pytest.mark.timeout(120)  # the old code waited forever for the first batch
def test_a_batch_a_worker_cannot_send_is_an_error_naming_it(
    corpus: tuple[Path, Path, Any],
) -> None:
    """Issue 25 item 12: a batch the worker's queue cannot pickle was printed and dropped, and
    the trainer's ``next()`` waited forever. Now the trainer gets the error in its place,
    naming the batch (epoch, pack slots), the value and the fix."""
    data, media, proc = corpus
    loader = neat_vlm_graph(data, proc, config=_cfg(media, 1), batch_transform=_unsendable)
    with pytest.raises(RuntimeError, match=r"could not send its batch \(epoch 0, pack slots") as e:
        next(iter(loader))
    assert "batch['on_step'] (function) cannot be pickled" in str(e.value)
    assert "num_workers=0" in str(e.value)
    loader.close()


def test_a_resume_may_change_the_worker_switches(corpus: tuple[Path, Path, Any]) -> None:
    """``worker_transfer`` and ``index_start_method`` are not in the checkpoint key: a state
    saved with the defaults loads into graphs that change them (and more workers), and the
    rest of the epoch is the same batches."""
    data, media, proc = corpus
    llm_kw: dict[str, Any] = {"pack_size": 64, "batch_size": 2, "attn_implementation": "doc_ids"}
    records = _token_records(60)
    graphs = [
        (
            lambda cfg: neat_vlm_graph(data, proc, config=cfg),
            _cfg(media, 0),
            _cfg(media, 2, worker_transfer="torch", index_start_method="spawn"),
        ),
        (
            lambda cfg: neat_llm_graph(records, config=cfg),
            NeatLLMConfig(**llm_kw),
            NeatLLMConfig(**llm_kw, num_workers=2, worker_transfer="torch"),
        ),
        (
            lambda cfg: grouped_vlm_graph(data, proc, config=cfg),
            GroupedConfig(batch_size=4, media_root=str(media)),
            GroupedConfig(
                batch_size=4, media_root=str(media), num_workers=2, worker_transfer="torch",
                index_start_method="spawn",
            ),
        ),
    ]  # fmt: skip
    for build, saved_cfg, resumed_cfg in graphs:
        ref = list(build(saved_cfg))
        first = build(saved_cfg)
        it = iter(first)
        for _ in range(2):
            next(it)
        state = first.state_dict()
        resumed = build(resumed_cfg)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert len(rest) == len(ref) - 2 > 2
        for a, b in zip(rest, ref[2:], strict=True):
            _same(a, b)
