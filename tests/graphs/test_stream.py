"""The streaming graph: the planned graphs' batches from a stream packed online; three
kill/resume cycles in a row give the uninterrupted run's batches bit for bit (inline and with
process workers), a worker-count change mid-epoch loses and repeats nothing, overlong samples
are counted, and what cannot resume is refused by name."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from neatpack.graphs import NeatStreamConfig, StateMismatchError, neat_stream_graph
from neatpack.graphs.runtime.loader import NeatLoader
from neatpack.pipes.reading.stream import ListStream, sample_id
from neatpack.pipes.testing.resume import assert_exactly_once
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

NUM_SAMPLES = 36
SHARDS = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[ListStream, Path, Any]:
    root = tmp_path_factory.mktemp("stream")
    write_corpus(root, num_samples=NUM_SAMPLES, seed=5)
    rows = [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]
    per = -(-len(rows) // SHARDS)
    stream = ListStream([rows[i : i + per] for i in range(0, len(rows), per)])
    return stream, root / "media", load_tiny_processor()


def _all_ids(stream: ListStream) -> list[int]:
    return [
        sample_id(s, p)
        for s in range(len(stream.shards()))
        for p in range(len(list(stream.open(s))))
    ]


def _loader(corpus: tuple[ListStream, Path, Any], workers: int = 0, **kw: Any) -> NeatLoader:
    stream, media, processor = corpus
    opts: dict[str, Any] = {"pack_size": 1024, "buffer_size": 6, "batch_size": 2, "prefetch": 1}
    opts.update(kw)
    cfg = NeatStreamConfig(media_root=str(media), num_workers=workers, **opts)
    return neat_stream_graph(stream, processor, config=cfg)


def _digest(batch: dict[str, Any]) -> tuple[list[list[int]], str]:
    h = hashlib.sha256()
    for key in ("input_ids", "labels", "position_ids", "pixel_values"):
        if key in batch:
            h.update(batch[key].contiguous().numpy().tobytes())
    return [list(m["sample_ids"]) for m in batch["packs"]], h.hexdigest()[:16]


def _saved(loader: NeatLoader) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)  # plain values: a weights_only load takes it
    buf.seek(0)
    state: dict[str, Any] = torch.load(buf, weights_only=True)
    return state


def _run(loader: NeatLoader, epochs: int) -> list[tuple[int, Any]]:
    out = []
    for _ in range(epochs):
        out += [(loader.epoch, _digest(b)) for b in loader]
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_three_kill_resume_cycles_give_the_uninterrupted_batches(
    corpus: tuple[ListStream, Path, Any], workers: int
) -> None:
    reference = _run(_loader(corpus, workers), epochs=2)
    per_epoch = sum(1 for e, _ in reference if e == 0)
    assert per_epoch >= 4
    # mid-epoch, one step before the epoch's end, at its last step, in the next epoch
    cuts = [1, per_epoch - 1, per_epoch, per_epoch + 2]
    got: list[tuple[int, Any]] = []
    consumed: dict[int, list[int]] = {0: [], 1: []}
    state: dict[str, Any] | None = None
    for stop in [*cuts, len(reference)]:
        loader = _loader(corpus, workers)  # a new loader: what a restarted job builds
        if state is not None:
            loader.load_state_dict(state)
        while len(got) < stop and loader.epoch < 2:
            for batch in loader:
                got.append((_epoch_of(batch), _digest(batch)))
                if len(got) == stop:
                    break
        state = _saved(loader)
        for epoch, ledger in loader.ledgers.items():
            consumed[epoch] += ledger.consumed
        loader.close()
    assert got == reference
    for epoch in (0, 1):
        assert_exactly_once(consumed[epoch], _all_ids(corpus[0]))


def _epoch_of(batch: dict[str, Any]) -> int:
    return int(batch["packs"][0]["epoch"])


def test_every_sample_once_per_epoch_and_a_worker_change_mid_epoch(
    corpus: tuple[ListStream, Path, Any],
) -> None:
    stream = corpus[0]
    first = _loader(corpus, workers=0)
    it = iter(first)
    before = [_digest(next(it)) for _ in range(2)]
    state = _saved(first)
    consumed = list(first.ledgers[0].consumed)
    first.close()
    second = _loader(corpus, workers=2)
    second.load_state_dict(state)
    after = [_digest(b) for b in second]
    assert_exactly_once(consumed + second.ledgers[0].consumed, _all_ids(stream))
    reference = [_digest(b) for b in _loader(corpus, workers=0)]
    assert before + after == reference


def test_overlong_samples_are_dropped_and_counted(
    corpus: tuple[ListStream, Path, Any], tmp_path: Path
) -> None:
    _stream, _media, processor = corpus
    long_text = {"messages": [{"role": "user", "content": "word " * 400},
                              {"role": "assistant", "content": "ok"}]}  # fmt: skip
    short = {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]}  # fmt: skip
    data = ListStream([[short, long_text, short], [short, short]])
    cfg = NeatStreamConfig(pack_size=128, buffer_size=3, overlong="drop", estimate_mode="exact")
    loader = neat_stream_graph(data, processor, config=cfg)
    list(loader)
    ledger = loader.ledgers[0]
    assert ledger.overlong == [sample_id(0, 1)]
    assert_exactly_once(ledger.consumed + ledger.overlong, _all_ids(data))
    with pytest.raises(ValueError, match=r"shard 0, position 1\) is \d+ tokens"):
        list(neat_stream_graph(data, processor, config=NeatStreamConfig(pack_size=128)))


def test_what_cannot_resume_is_refused_by_name(corpus: tuple[ListStream, Path, Any]) -> None:
    stream, media, processor = corpus

    def build(rank: int, world: int, **kw: Any) -> NeatLoader:
        cfg = NeatStreamConfig(pack_size=1024, media_root=str(media), **kw)
        return neat_stream_graph(stream, processor, config=cfg, rank=rank, world_size=world)

    with pytest.raises(ValueError, match="has 3 shard\\(s\\) for 4 ranks"):
        build(0, 4)
    saved = [build(r, 2).state_dict() for r in range(2)]
    with pytest.raises(StateMismatchError, match="only from every rank's state"):
        build(0, 3).load_state_dict(saved[0])
    with pytest.raises(StateMismatchError, match="state of every rank"):
        build(0, 3).load_state_dict([saved[0], saved[0]])
    build(2, 3).load_state_dict(saved)  # every rank's state: accepted
    with pytest.raises(StateMismatchError, match="state of rank 1 loaded into rank 0"):
        build(0, 2).load_state_dict(saved[1])
    with pytest.raises(StateMismatchError, match="buffer_size"):
        build(0, 2, buffer_size=7).load_state_dict(saved[0])
    with pytest.raises(TypeError, match="no length"):
        len(build(0, 1))
    for bad in ({"tail": "drop"}, {"max_packs": 3}, {"on_bad_sample": "replace"}):
        with pytest.raises(ValueError, match="not available for a stream"):
            NeatStreamConfig(**bad)


def test_a_bad_record_follows_on_bad_sample_and_is_counted(
    corpus: tuple[ListStream, Path, Any],
) -> None:
    processor = corpus[2]
    good = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello"}]}  # fmt: skip
    bad = {"messages": []}  # an empty conversation: nothing to train on
    data = ListStream([[good, bad, good], [good]])
    with pytest.raises(ValueError, match="empty"):
        list(neat_stream_graph(data, processor, config=NeatStreamConfig(pack_size=128)))
    cfg = NeatStreamConfig(pack_size=128, buffer_size=2, on_bad_sample="skip")
    loader = neat_stream_graph(data, processor, config=cfg)
    list(loader)
    ledger = loader.ledgers[0]
    assert ledger.failed == [sample_id(0, 1)]
    assert_exactly_once(ledger.consumed + ledger.failed, _all_ids(data))


def test_several_ranks_without_a_process_group_are_refused_by_name(
    corpus: tuple[ListStream, Path, Any],
) -> None:
    processor = corpus[2]
    good = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello"}]}  # fmt: skip
    data = ListStream([[good], [good, good]])
    loader = neat_stream_graph(data, processor, config=NeatStreamConfig(pack_size=128),
                               rank=0, world_size=2)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"initialize torch\.distributed"):
        list(loader)


def test_the_module_example_runs() -> None:
    import doctest

    from neatpack.graphs import neat_stream

    result = doctest.testmod(neat_stream)
    assert result.attempted > 0
    assert result.failed == 0
