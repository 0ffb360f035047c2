"""The stream sources through the streaming graph (``neat_stream_graph``), end to end: a
``datasets`` streaming dataset over local JSONL files (with images by path) and tar shards in
moto's S3 server. Each epoch delivers every sample exactly once (ledger and batches), and
three kill / resume cycles in a row (what huggingface/datasets issue 8308 broke: its second
resume restarted the stream) give the uninterrupted run's batches bit for bit."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.s3_server import moto_s3, s3_buckets, s3_options
from support.shard_records import WORDS, png_bytes, without_meta, write_tars

from neatpack.graphs import NeatStreamConfig, neat_stream_graph
from neatpack.pipes import HFStream, ShardStream
from neatpack.pipes.reading.stream import sample_id
from neatpack.pipes.testing.resume import assert_exactly_once, same_item
from neatpack.pipes.testing.tiny import load_tiny_processor

N = 24
CFG = NeatStreamConfig(pack_size=320, batch_size=1, buffer_size=4, seed=5, shuffle=True)


@pytest.fixture(scope="module")
def processor() -> Any:
    return load_tiny_processor()


@pytest.fixture(scope="module")
def samples() -> list[dict[str, Any]]:
    rng = random.Random(11)
    return [{"q": " ".join(rng.choices(WORDS, k=rng.randint(3, 12))),
             "a": " ".join(rng.choices(WORDS, k=rng.randint(2, 20))),
             "images": [png_bytes(rng) for _ in range(i % 2)]} for i in range(N)]  # fmt: skip


def ids_of(batches: list[dict[str, Any]]) -> list[int]:
    return [i for b in batches for row in b["sample_ids"] for i in row]


def check_epoch_and_resumes(
    make: Callable[[], Any], processor: Any, expected: list[int], config: NeatStreamConfig
) -> None:
    """One whole epoch: every sample once; then three kills in a row (after 1, 2 and 2 more
    batches), each resumed by a fresh source and loader from the last state: the batches
    equal the uninterrupted run's."""
    reference = list(neat_stream_graph(make(), processor, config=config))
    ledger = neat_stream_graph(make(), processor, config=config)
    assert same_item(without_meta(list(ledger)), without_meta(reference))  # deterministic
    assert_exactly_once(ledger.ledgers[0].consumed, expected)
    assert_exactly_once(ids_of(reference), expected)
    assert len(reference) >= 5
    got: list[dict[str, Any]] = []
    state = None
    for take in (1, 2, 2):
        loader = neat_stream_graph(make(), processor, config=config)  # a restarted process
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        got += [next(it) for _ in range(take)]
        state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint stores it
    last = neat_stream_graph(make(), processor, config=config)
    last.load_state_dict(state)
    got += list(last)
    assert same_item(without_meta(got), without_meta(reference))
    assert_exactly_once(ids_of(got), expected)


def write_jsonl(root: Path, samples: list[dict[str, Any]], per: int) -> list[str]:
    """LLaVA-free hub shape: ``messages`` with block lists, ``images`` as paths."""
    paths = []
    for k in range(0, len(samples), per):
        path = root / f"part-{k // per}.jsonl"
        with open(path, "w") as f:
            for i, s in enumerate(samples[k : k + per], k):
                names = []
                for j, png in enumerate(s["images"]):
                    (root / f"{i}-{j}.png").write_bytes(png)
                    names.append(f"{i}-{j}.png")
                user = [{"type": "image", "text": None} for _ in names]
                user.append({"type": "text", "text": s["q"]})
                answer = [{"type": "text", "text": s["a"]}]
                messages = [{"role": "user", "content": user},
                            {"role": "assistant", "content": answer}]  # fmt: skip
                row = {"messages": messages, "images": names}
                print(json.dumps(row), file=f)
        paths.append(str(path))
    return paths


def test_hub_streaming_dataset_through_the_stream_graph(
    samples: Any, processor: Any, tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    files = write_jsonl(tmp_path, samples, per=8)  # 8 + 8 + 8

    def make() -> HFStream:
        ds = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
        return HFStream(ds)

    sizes = [8, 8, 8]
    expected = [sample_id(k, p) for k, n in enumerate(sizes) for p in range(n)]
    config = dataclasses.replace(CFG, media_root=str(tmp_path))
    check_epoch_and_resumes(make, processor, expected, config)


@pytest.fixture(scope="module")
def s3_tars(samples: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    with moto_s3() as endpoint:
        options = s3_options(endpoint)
        fs = s3_buckets(options, "e2e")
        root = tmp_path_factory.mktemp("s3-e2e")
        for p in write_tars(root, samples, per=7):  # 7 + 7 + 7 + 3
            fs.put_file(str(p), f"e2e/set/{p.name}")
        yield "s3://e2e/set/*.tar", options


@pytest.mark.remote
def test_s3_tar_shards_through_the_stream_graph(
    s3_tars: Any, processor: Any, tmp_path: Path
) -> None:
    url, options = s3_tars

    def make() -> ShardStream:
        return ShardStream(url, storage_options=options, cache_dir=tmp_path)

    sizes = [7, 7, 7, 3]
    expected = [sample_id(k, p) for k, n in enumerate(sizes) for p in range(n)]
    check_epoch_and_resumes(make, processor, expected, CFG)


_DECODES: list[int] = []


def test_workers_decode_the_streamed_images_not_the_trainer_process(
    samples: list[dict[str, Any]], processor: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local tar shards (images as lazily opened PIL images over the tar members), read by the
    stream in this process, materialized by 2 worker processes: the batches equal the
    0-worker run's, and no image is decoded in this process (PIL pickles an image by its
    pixels, so without ``lazy_image.py`` every image was decoded here before crossing)."""
    from PIL import ImageFile

    paths = write_tars(tmp_path, samples, per=7)

    def make() -> ShardStream:
        return ShardStream([str(p) for p in paths])

    inline = list(neat_stream_graph(make(), processor, config=CFG))
    load = ImageFile.ImageFile.load

    def counted(self: Any) -> Any:
        _DECODES.append(1)  # this process's list: the workers count in their own copy
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    two = dataclasses.replace(CFG, num_workers=2)
    workers = list(neat_stream_graph(make(), processor, config=two))
    assert not _DECODES
    assert sum(len(s["images"]) for s in samples) > 0
    assert same_item(without_meta(workers), without_meta(inline))
