"""Worker batches carry their pixels in shared memory from the start, so handing a batch to the
main process does not copy its largest tensor a second time."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
import torch.multiprocessing  # registers the tensor reductions ForkingPickler uses

from neatpack.graphs.runtime.stages import InWorker
from neatpack.pipes.collating.collate import neat_packed_vlm_collater
from neatpack.pipes.materializing._tensors import cat_shared
from neatpack.pipes.materializing.materialize import (
    MaterializeConfig,
    Materializer,
    materialize_pack,
)
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.steps import Collater, PackMaterializer, PerPack, StepChain
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[JsonlSource, Any, list[list[int]]]:
    d = tmp_path_factory.mktemp("corpus")
    src = JsonlSource(write_corpus(d, num_samples=12, seed=5), media_root=d / "media")
    with_images = [i for i in range(len(src)) if src[i].get("images_meta")]
    return src, load_tiny_processor("qwen2_vl"), [with_images[:2], with_images[2:4]]


def test_cat_shared_equals_cat_and_pickles_without_the_bytes() -> None:
    parts = [torch.randn(300, 64), torch.randn(200, 64)]
    out = cat_shared(parts)
    assert out.is_shared()
    assert torch.equal(out, torch.cat(parts))
    assert out.is_contiguous()
    assert out.untyped_storage().nbytes() == out.numel() * 4
    half = cat_shared(parts, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, torch.cat(parts).to(torch.bfloat16))
    assert len(ForkingPickler.dumps(out)) < 10_000  # a handle, not 128 KB of floats


def test_shared_collate_equals_plain_collate(setup: tuple[JsonlSource, Any, Any]) -> None:
    src, proc, groups = setup
    cfg = MaterializeConfig(pack_size=4096)
    packs = [materialize_pack(src, ids, proc, cfg)[0] for ids in groups]
    plain = neat_packed_vlm_collater(packs, attn_implementation="doc_ids")
    shared = neat_packed_vlm_collater(packs, attn_implementation="doc_ids", shared_memory=True)
    assert sorted(plain) == sorted(shared)
    for key, value in plain.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, shared[key]), key
    assert shared["pixel_values"].is_shared()
    assert not plain["pixel_values"].is_shared()


def _run_in_child(
    step: InWorker, refs: list[dict[str, Any]], q: Any, done: Any, transfer: str
) -> None:
    out = step(refs)
    if transfer == "torch":  # torch's path: the collater wrote the pixels into shared memory itself
        q.put((type(out).__name__, bool(out["pixel_values"].is_shared()), out))
    else:
        q.put(
            (type(out).__name__, None, out)
        )  # travels as one segment (pipes/materializing/transfer.py)
    done.wait(60)  # as a loader worker lives on: the receiver fetches descriptors from it


@pytest.mark.parametrize("transfer", ["segment", "torch"])
def test_a_worker_batch_reaches_the_main_process_equal(
    setup: tuple[JsonlSource, Any, list[list[int]]], transfer: str
) -> None:
    """The step as map_stage runs it in a worker process: its batch crosses a real queue to
    this process and equals the batch the same step makes here. Through a transfer segment
    (the default) or, with it off, with pixels the collater put in shared memory itself."""
    src, proc, groups = setup
    cfg = MaterializeConfig(pack_size=4096)
    estimated = torch.zeros(len(src), dtype=torch.long).numpy()
    collate = Collater(attn_implementation="sdpa")
    # as map_stage runs a step in its workers: the worker set-up (one torch thread) first
    step = InWorker(
        StepChain(PerPack(PackMaterializer(Materializer(src, proc, cfg), estimated)), collate),
        transfer,  # type: ignore[arg-type]
    )
    refs = [
        {"epoch": 0, "slot": k, "pack_index": k, "padded": False, "sample_ids": ids}
        for k, ids in enumerate(groups)
    ]
    inline = step([dict(r) for r in refs])
    assert isinstance(inline, dict)  # the owner process: the batch itself
    assert not inline["pixel_values"].is_shared()  # and no shared memory
    ctx = mp.get_context("fork")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_run_in_child, args=(step, refs, q, done, transfer))
    p.start()
    kind, shared, got = q.get(timeout=120)
    done.set()
    p.join(timeout=30)
    assert p.exitcode == 0
    assert os.getpid() == collate.owner_pid
    assert kind == ("TransferBatch" if transfer == "segment" else "dict")
    if transfer == "torch":
        assert shared
    assert type(got) is dict
    assert list(got) == list(inline)  # same keys, same order
    for key, value in inline.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key
