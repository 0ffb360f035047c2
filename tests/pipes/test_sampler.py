"""LengthGroupedSampler: grouping, per-epoch chunk shuffle, rank agreement, real Records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.planning.sampler import LengthGroupedSampler
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


def chunks_of(order: list[int], sorted_ids: list[int], batch_size: int) -> list[list[int]]:
    """Split ``order`` at the chunk boundaries of ``sorted_ids``."""
    chunk = {i: k // batch_size for k, i in enumerate(sorted_ids)}
    out: list[list[int]] = []
    for i in order:
        if out and chunk[out[-1][-1]] == chunk[i]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def test_sort_and_chunks_literal() -> None:
    lengths = [0, 10, 20, 30, 40, 50, 60, 70, 500]  # the peer notes' smoke lengths
    s = LengthGroupedSampler(None, seed=42, batch_size=2, lengths=lengths)
    assert s.sorted_ids.tolist() == [8, 7, 6, 5, 4, 3, 2, 1, 0]
    assert len(s) == 9
    order = list(s)
    assert sorted(order) == list(range(9))
    groups = chunks_of(order, s.sorted_ids.tolist(), 2)
    assert sorted(groups) == sorted([[8, 7], [6, 5], [4, 3], [2, 1], [0]])  # whole, in order
    s.set_epoch(1)
    assert list(s) != order  # 5 chunks: another epoch, another chunk order
    ties = LengthGroupedSampler(None, batch_size=3, lengths=[5, 9, 5, 9, 5])
    assert ties.sorted_ids.tolist() == [1, 3, 0, 2, 4]  # stable: equal lengths keep id order


def test_epochs_ranks_and_seeds() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4000, size=500)
    rank0 = LengthGroupedSampler(None, seed=7, batch_size=4, lengths=lengths)
    rank1 = LengthGroupedSampler(None, seed=7, batch_size=4, lengths=lengths.copy())
    other = LengthGroupedSampler(None, seed=8, batch_size=4, lengths=lengths)
    seen = []
    for epoch in range(3):
        for s in (rank0, rank1, other):
            s.set_epoch(epoch)
        a = list(rank0)
        assert a == list(rank1)  # identical on every rank, no collective needed
        assert a != list(other)
        assert sorted(a) == list(range(500))
        for chunk in chunks_of(a, rank0.sorted_ids.tolist(), 4):
            assert len(chunk) == 4  # 500 = 125 whole chunks
            spread = lengths[chunk]
            assert list(spread) == sorted(spread, reverse=True)
        seen.append(a)
    assert seen[0] != seen[1] != seen[2]


def test_max_length_filter_is_counted() -> None:
    s = LengthGroupedSampler(None, max_length=100, lengths=[10, 600, 2000, 612, 613])
    assert s.dropped_ids.tolist() == [2, 4]  # the seed's slack: keep <= max_length + 512
    assert sorted(s) == [0, 1, 3]
    assert len(s) == 3
    strict = LengthGroupedSampler(None, max_length=100, length_slack=0, lengths=[10, 600])
    assert strict.dropped_ids.tolist() == [1]


def test_truncate_to_aligns_sharded_ranks() -> None:
    shard0 = LengthGroupedSampler(None, max_length=100, lengths=[10, 900, 30, 20, 40])
    shard1 = LengthGroupedSampler(None, max_length=100, lengths=[50, 60, 70])
    common = min(len(shard0), len(shard1))
    aligned = LengthGroupedSampler(
        None, max_length=100, lengths=[10, 900, 30, 20, 40], truncate_to=common
    )
    assert len(aligned) == 3
    assert aligned.sorted_ids.tolist() == [4, 2, 3]  # the longest kept, as the seed did
    assert aligned.truncated_ids.tolist() == [0]
    assert aligned.dropped_ids.tolist() == [1]


@given(
    st.lists(st.integers(0, 50), max_size=40),
    st.integers(-1, 6),
    st.integers(0, 3),
    st.integers(0, 4),
)
def test_every_epoch_is_a_chunked_permutation(
    lengths: list[int], batch_size: int, seed: int, epoch: int
) -> None:
    s = LengthGroupedSampler(None, seed=seed, batch_size=batch_size, lengths=lengths)
    s.set_epoch(epoch)
    order = list(s)
    assert sorted(order) == list(range(len(lengths)))
    bs = max(1, batch_size)
    chunks = chunks_of(order, s.sorted_ids.tolist(), bs)
    sorted_ids = s.sorted_ids.tolist()
    expected = {tuple(sorted_ids[k : k + bs]) for k in range(0, len(lengths), bs)}
    assert {tuple(c) for c in chunks} == expected
    assert len(chunks) == len(expected)
    assert [lengths[i] for i in sorted_ids] == sorted(lengths, reverse=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lengths": [1, 2], "truncate_to": -1}, "truncate_to=-1"),
        ({"lengths": [1.5, 2.0]}, "1-D ints"),
        ({"lengths": [1, 2], "seed": -1}, "seed=-1"),
        ({"lengths": [1, 2], "max_length": 0}, "max_length=0"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LengthGroupedSampler(None, **kwargs)  # type: ignore[arg-type]


def test_length_count_mismatch_and_non_records() -> None:
    with pytest.raises(ValueError, match="one per sample"):
        LengthGroupedSampler([{}, {}, {}], lengths=[1, 2])
    with pytest.raises(ValueError, match=r"sample_id=0: no conversation.*pass lengths="):
        LengthGroupedSampler([{"input_ids": [1, 2]}])
    with pytest.raises(ValueError, match="epoch=-1"):
        LengthGroupedSampler(None, lengths=[1]).set_epoch(-1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> JsonlSource:
    root: Path = tmp_path_factory.mktemp("corpus")
    path = write_corpus(root, num_samples=40, seed=3)
    return JsonlSource(path, media_root=root / "media")


def test_estimates_real_records(corpus: JsonlSource) -> None:
    s = LengthGroupedSampler(corpus, seed=1, batch_size=4)
    est = LengthEstimator()
    expected = [est.estimate(corpus[i])[0] for i in range(len(corpus))]
    assert s.lengths.tolist() == expected
    assert len(s) == len(corpus)
    with_images = [i for i in range(len(corpus)) if "image" in str(corpus[i]["conversation"])]
    assert with_images  # the corpus mixes text-only and image samples


def test_real_processor_estimates_and_dataloader(corpus: JsonlSource) -> None:
    processor = load_tiny_processor("qwen2_vl")
    s = LengthGroupedSampler(corpus, seed=1, processor=processor, batch_size=4)
    est = LengthEstimator.from_processor(processor)
    assert s.lengths.tolist() == [est.estimate(corpus[i])[0] for i in range(len(corpus))]
    lengths = torch.as_tensor(s.lengths)
    loader = DataLoader(range(len(corpus)), sampler=s, batch_size=4)
    batches = list(loader)
    assert sorted(torch.cat(batches).tolist()) == list(range(len(corpus)))
    # each batch is one chunk of the length-sorted order: its spread is far below the corpus's
    spread = max(float(lengths[b].max() - lengths[b].min()) for b in batches)
    assert spread < float(lengths.max() - lengths.min())
    assert [b.tolist() for b in batches] == list(chunks_of(list(s), s.sorted_ids.tolist(), 4))


def test_empty_conversation_is_ordered_last_and_counted(tmp_path: Path) -> None:
    """Issue 25: a record with an empty conversation stopped the sampler; the seed's heuristic
    sizes it 0. It is ordered (last), yielded once and counted by id; a record that is not a
    conversation at all still raises naming it."""
    path = write_corpus(tmp_path, num_samples=12, seed=4)
    with open(path, "a") as f:
        f.write('{"messages": []}\n')
    corpus = JsonlSource(path, media_root=tmp_path / "media")
    empty = len(corpus) - 1
    s = LengthGroupedSampler(corpus, seed=1, processor=load_tiny_processor(), batch_size=4)
    assert s.lengths[empty] == 0
    assert s.lengths[:empty].min() > 0
    assert s.sorted_ids[-1] == empty
    assert s.fallbacks.sample_ids["empty_conversation"] == [empty]
    batches = list(DataLoader(range(len(corpus)), sampler=s, batch_size=4))
    assert sorted(torch.cat(batches).tolist()) == list(range(len(corpus)))
    with open(path, "a") as f:
        f.write('{"messages": "not a list"}\n')
    with pytest.raises(ValueError, match=rf"sample_id={empty + 1}: .*non-list.*pass lengths="):
        LengthGroupedSampler(JsonlSource(path, media_root=tmp_path / "media"))
