"""Issue #29, memory per node: the length index, the plan and the JSONL line index are mapped
from their cache files, and give exactly what the in-memory arrays gave."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing as mp
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.indexing.lengths import LengthIndex
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.planning.plan_file import load_plan, shared_plan
from neatpack.pipes.planning.source import StateMismatchError
from neatpack.pipes.reading.npz_files import MappedArray, read_npz, write_npz
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mapped")
    write_corpus(root, num_samples=24, seed=11)
    return root


def _batches(loader: Any, n: int) -> list[tuple[list[list[int]], list[int]]]:
    out = []
    for _, batch in zip(range(n), loader, strict=False):
        ids = [list(p["sample_ids"]) for p in batch["packs"]]
        out.append((ids, batch["input_ids"].reshape(-1).tolist()))
    return out


def test_mapped_index_and_plan_give_the_in_memory_batches(corpus: Path, tmp_path: Path) -> None:
    processor = load_tiny_processor()
    media = str(corpus / "media")
    data = corpus / "data.jsonl"
    cached = NeatVLMConfig(pack_size=1024, batch_size=2, media_root=media, cache_dir=str(tmp_path))
    plain = NeatVLMConfig(pack_size=1024, batch_size=2, media_root=media)
    first = neat_vlm_graph(data, processor, config=cached)  # builds and saves the index
    index_file = next(p for p in tmp_path.glob("*.npz") if len(p.stem) == 64)
    mapped = LengthIndex.load(index_file)
    assert isinstance(mapped.total, MappedArray)
    assert mapped.total.dtype == np.int32
    in_memory = LengthIndex(
        total=np.array(mapped.total, np.int64),  # an index built by hand, as before #29
        visual=np.array(mapped.visual, np.int64),
        fingerprint=mapped.fingerprint,
        fallback_ids=mapped.fallback_ids,
        fallback_counts=mapped.fallback_counts,
    )
    want = _batches(neat_vlm_graph(data, processor, config=plain, lengths=in_memory), 4)
    assert len(want) == 4
    assert _batches(first, 4) == want  # mapped index, plan written to the cache and mapped
    again = neat_vlm_graph(data, processor, config=cached, lengths=mapped)
    assert _batches(again, 4) == want  # the mapped plan file, loaded a second time
    (plan_file,) = tmp_path.glob("plan-*.npz")  # planned once, by the first loader
    assert isinstance(load_plan(plan_file).ids, MappedArray)


def test_a_mapped_array_pickles_as_its_place_in_the_file(tmp_path: Path) -> None:
    index = LengthIndex(
        total=np.arange(100_000), visual=np.zeros(100_000, np.int32), fingerprint="f"
    )
    index.save(tmp_path / "i.npz")
    mapped = LengthIndex.load(tmp_path / "i.npz").total
    blob = pickle.dumps(mapped)
    assert len(blob) < 1_000  # a path and an offset, not 400 kB of lengths
    back = pickle.loads(blob)
    assert isinstance(back, MappedArray)
    assert back.tolist() == list(range(100_000))
    assert len(pickle.dumps(mapped[10:20])) < 1_000
    assert pickle.loads(pickle.dumps(mapped[5:7]))[1] == 6
    assert isinstance(mapped + 1, np.ndarray)
    assert not isinstance(mapped + 1, MappedArray)
    (tmp_path / "i.npz").unlink()
    index.save(tmp_path / "i.npz")  # replaced: another inode, so that place is gone
    with pytest.raises(ValueError, match="replaced after it was mapped"):
        pickle.loads(blob)


def _legacy_save(path: Path, total: np.ndarray, visual: np.ndarray, fp: str) -> None:
    """The length index file as neatpack wrote it before #29 (int64, checksum over int64)."""
    h = hashlib.sha256(fp.encode())
    empty = np.zeros(0, np.int64)
    for a in (total, visual, empty, np.zeros(0, np.uint8), empty, empty):
        h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
    h.update(json.dumps({}, sort_keys=True).encode())
    meta = {"format_version": 1, "fingerprint": fp, "fallback_counts": {},
            "checksum": h.hexdigest(), "media_root": None}  # fmt: skip
    write_npz(
        path, total=total, visual=visual, fallback_ids=empty,
        meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
        media_paths=np.zeros(0, np.uint8), media_sizes=empty, media_mtimes=empty,
    )  # fmt: skip


def test_an_old_format_index_file_loads_and_is_rewritten_once(tmp_path: Path) -> None:
    total = np.array([5, 700, 12, 3000], np.int64)
    visual = np.array([0, 256, 0, 1024], np.int64)
    path = tmp_path / "old.npz"
    _legacy_save(path, total, visual, "f" * 64)
    old = LengthIndex.load(path, fingerprint="f" * 64)
    assert old.total.tolist() == total.tolist()
    assert old.visual.tolist() == visual.tolist()
    meta = json.loads(bytes(read_npz(path, ("meta",), what="t")["meta"]))
    assert meta["layout"] == 2  # rewritten: int32, mapped from now on
    assert read_npz(path, ("total",), what="t")["total"].dtype == np.int32
    stamp = path.stat().st_mtime_ns
    new = LengthIndex.load(path, fingerprint="f" * 64)
    assert isinstance(new.total, MappedArray)
    assert new.total.tolist() == total.tolist()
    assert path.stat().st_mtime_ns == stamp  # once only


def test_a_length_over_int32_is_refused_naming_the_sample() -> None:
    with pytest.raises(ValueError, match=r"total: sample 2 has 2147483648 tokens.*int32"):
        LengthIndex(total=np.array([1, 2, 2**31]), visual=np.zeros(3, int), fingerprint="f")
    with pytest.raises(ValueError, match="visual: sample 0"):
        LengthIndex(total=np.array([1]), visual=np.array([-(2**40)]), fingerprint="f")


def test_a_corrupt_plan_file_is_detected_and_planned_again(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    total = rng.integers(1, 900, 5_000).astype(np.int32)
    visual = (total // 3).astype(np.int32)
    want = plan_packs(total, 2048, visual=visual, world_size=4, seed=2)
    got = shared_plan(tmp_path, total, 2048, visual=visual, world_size=4, seed=2)
    for name in ("offsets", "ids", "totals", "visual", "dropped_ids", "truncated_ids"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert got.fingerprint == want.fingerprint
    assert isinstance(got.ids, MappedArray)
    assert got.epoch_order(3).tolist() == want.epoch_order(3).tolist()
    path = tmp_path / f"plan-{want.fingerprint}.npz"
    data = bytearray(path.read_bytes())
    at = data.index(np.asarray(want.ids[100:104]).tobytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        load_plan(path, want.fingerprint)
    again = shared_plan(tmp_path, total, 2048, visual=visual, world_size=4, seed=2)
    assert np.array_equal(again.ids, want.ids)
    assert load_plan(path, want.fingerprint).ids.tolist() == want.ids.tolist()


def _plan_in_process(folder: str, q: Any) -> None:
    total = np.random.default_rng(1).integers(1, 900, 20_000).astype(np.int32)
    plan = shared_plan(folder, total, 2048, world_size=2)
    q.put((plan.fingerprint, hashlib.sha256(np.asarray(plan.ids).tobytes()).hexdigest()))


def test_processes_of_a_node_share_one_plan_file(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_plan_in_process, args=(str(tmp_path), q)) for _ in range(3)]
    for p in procs:
        p.start()
    got = {q.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
    assert len(got) == 1  # the same plan in every process
    assert len(list(tmp_path.glob("plan-*.npz"))) == 1
    total = np.random.default_rng(1).integers(1, 900, 20_000).astype(np.int32)
    plan = plan_packs(total, 2048, world_size=2)
    assert got == {(plan.fingerprint, hashlib.sha256(plan.ids.tobytes()).hexdigest())}


def test_jsonl_line_index_is_mapped_and_an_old_cache_rebuilt(tmp_path: Path) -> None:
    lines = [json.dumps({"messages": [{"role": "user", "content": "x" * i}]}) for i in range(40)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]) + "\n")
    plain = JsonlSource(path)
    cache = tmp_path / "cache"
    first = JsonlSource(path, cache_dir=cache)
    (cache_file,) = cache.glob("jsonl-index-*.npz")
    assert isinstance(first.lines.rel, MappedArray)
    assert first.lines.rel.dtype == np.uint32
    assert [first.raw(i) for i in range(40)] == [plain.raw(i) for i in range(40)]
    assert first.line_number(20) == 22 == plain.line_number(20)  # after the blank line
    assert list(first.iter_raw(0, 40)) == [json.loads(x) for x in lines]
    # a cache file of the first layout (starts, ends): rebuilt, not misread
    n = len(first)
    starts, ends = first.lines.starts(0, n), first.lines.ends(0, n)
    numbers = np.asarray([first.line_number(i) for i in range(n)])
    z = read_npz(cache_file, ("meta",), what="t")
    meta = json.loads(z["meta"].tobytes())
    write_npz(cache_file, starts=starts, ends=ends, lines=numbers, blanks=np.asarray(1),
              digest=np.asarray(meta["digest"]), identity=np.asarray(meta["identity"]))  # fmt: skip
    again = JsonlSource(path, cache_dir=cache)
    assert [again.raw(i) for i in range(40)] == [plain.raw(i) for i in range(40)]
    assert "meta" in np.load(cache_file).files


def test_a_plan_file_found_by_key_must_match_the_lengths(tmp_path: Path) -> None:
    total = np.arange(1, 3_000, dtype=np.int32) % 700 + 1
    a = shared_plan(tmp_path, total, 2048, key="index-fp", world_size=2)
    assert a.fingerprint == plan_packs(total, 2048, world_size=2).fingerprint
    assert shared_plan(tmp_path, total, 2048, key="index-fp", world_size=2).ids.tolist() == (
        a.ids.tolist()
    )
    other = total.copy()
    other[5] += 1  # another index that (wrongly) reuses the fingerprint: planned anew
    b = shared_plan(tmp_path, other, 2048, key="index-fp", world_size=2)
    assert b.fingerprint == plan_packs(other, 2048, world_size=2).fingerprint != a.fingerprint


def test_spawned_workers_map_the_index_and_give_the_same_batches(
    corpus: Path, tmp_path: Path
) -> None:
    processor = load_tiny_processor()
    kw: dict[str, Any] = {"pack_size": 1024, "batch_size": 2, "media_root": str(corpus / "media")}
    here = NeatVLMConfig(**kw, cache_dir=str(tmp_path))
    want = _batches(neat_vlm_graph(corpus / "data.jsonl", processor, config=here), 4)
    spawned = NeatVLMConfig(
        **kw, cache_dir=str(tmp_path), num_workers=1, multiprocessing_context="spawn"
    )
    # the mapped index reaches the worker (PackMaterializer) as its place in the file
    assert _batches(neat_vlm_graph(corpus / "data.jsonl", processor, config=spawned), 4) == want


def _media_records() -> list[dict[str, Any]]:
    """Records of 0, 1, 3 images, 2 videos, an image and a video, LLaVA form with 2 <image>,
    and one the fast path leaves to the full one (an image without size nor file)."""
    img = {"type": "image", "image": "a.jpg"}
    vid = {"type": "video", "video": "v.mp4"}

    def conv(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [*blocks, {"type": "text", "text": "hi there"}]},
                {"role": "assistant", "content": "ok"}]  # fmt: skip

    vmeta = [16, 224, 224, 8.0, 2.0]  # frames, height, width, fps, duration
    return [
        {"messages": conv()},
        {"messages": conv(img), "images_meta": [[280, 560]]},
        {"messages": conv(img, img, img), "images_meta": [[280, 560], [56, 56], [560, 280]]},
        {"messages": conv(vid, vid), "videos_meta": [vmeta, vmeta]},
        {"messages": conv(img, vid), "images_meta": [[280, 560]], "videos_meta": [vmeta]},
        {
            "conversations": [
                {"from": "human", "value": "<image>\n<image>\nboth?"},
                {"from": "gpt", "value": "yes"},
            ],
            "images": ["a.jpg", "b.jpg"],
            "images_meta": [[56, 56], [56, 56]],
        },
        {"messages": conv({"type": "image"}, {"type": "image"})},  # sizes unknown: full path
    ]


def test_the_media_item_counts_round_trip_through_save_and_map(tmp_path: Path) -> None:
    from neatpack.pipes.indexing.estimate import LengthEstimator
    from neatpack.pipes.indexing.lengths import build_length_index
    from neatpack.pipes.reading.read import SequenceSource

    estimator = LengthEstimator.from_processor(load_tiny_processor(), mode="estimate")
    src = SequenceSource(_media_records())
    built = build_length_index(src, estimator, cache_dir=tmp_path, progress=False)
    assert built.images is not None
    assert built.images.tolist() == [0, 1, 3, 2, 2, 2, 2]
    assert built.fallback_counts  # the last record went through the full path
    (path,) = tmp_path.glob("*.npz")
    loaded = LengthIndex.load(path, fingerprint=built.fingerprint)
    assert isinstance(loaded.images, MappedArray)
    assert loaded.images.dtype == np.uint16
    assert loaded.images.tolist() == built.images.tolist()
    assert pickle.loads(pickle.dumps(loaded.images)).tolist() == built.images.tolist()
    # the checksum covers the column: one flipped count is a corrupt file, rebuilt
    data = bytearray(path.read_bytes())
    at = data.index(np.asarray([0, 1, 3, 2], np.uint16).tobytes())
    data[at + 4] ^= 0x01  # 3 -> 2
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        LengthIndex.load(path)
    again = build_length_index(src, estimator, cache_dir=tmp_path, progress=False)
    assert again.images is not None
    assert again.images.tolist() == built.images.tolist()


def test_a_media_item_count_over_uint16_is_refused_naming_the_sample() -> None:
    with pytest.raises(ValueError, match=r"images: sample 1 has 65536 media items.*split"):
        LengthIndex(total=np.array([1, 2]), visual=np.zeros(2, int), fingerprint="f",
                    images=np.array([3, 65536]))  # fmt: skip


def _layout2_save(path: Path, index: LengthIndex) -> None:
    """The length index file as neatpack wrote it before the media-item counts (layout 2:
    int32 lengths, checksum over the stored bytes, no ``images``)."""
    h = hashlib.sha256(index.fingerprint.encode())
    for a in (index.total, index.visual):
        h.update(np.ascontiguousarray(a, dtype="<i4").data)
    media = index.media.arrays()
    for a in (index.fallback_ids, *media.values()):
        h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
    h.update(json.dumps(index.fallback_counts, sort_keys=True).encode())
    meta = {"format_version": 1, "layout": 2, "fingerprint": index.fingerprint,
            "fallback_counts": index.fallback_counts, "checksum": h.hexdigest(),
            "media_root": index.media.root}  # fmt: skip
    write_npz(
        path, total=np.asarray(index.total), visual=np.asarray(index.visual),
        fallback_ids=index.fallback_ids, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
        **media,
    )  # fmt: skip


def test_an_index_file_without_media_item_counts_loads_and_refuses_only_the_images_budget(
    corpus: Path, tmp_path: Path
) -> None:
    """A cache file written before the counts: it loads as it is (same fingerprint, so saved
    states resume and the same batches come), with ``images`` unknown; ``max_images`` then
    refuses naming the file and the fix, and deleting the file rebuilds it with the counts.
    Under ``balance="tokens"``: under cost the counts price the vision encoder, so a file
    without them is another plan, and a state saved with them is refused, not resumed on it."""
    processor = load_tiny_processor()
    data = corpus / "data.jsonl"
    cfg = NeatVLMConfig(pack_size=1024, media_root=str(corpus / "media"), cache_dir=str(tmp_path),
                        balance="tokens")  # fmt: skip
    cost_state = neat_vlm_graph(data, processor, config=dataclasses.replace(cfg, balance="cost"))
    _batches(cost_state, 1)
    saved_on_counts = cost_state.state_dict()
    first = neat_vlm_graph(data, processor, config=cfg)
    want = _batches(first, 3)
    state = first.state_dict()
    path = next(p for p in tmp_path.glob("*.npz") if len(p.stem) == 64)
    new = LengthIndex.load(path)
    _layout2_save(path, new)
    for plan_file in tmp_path.glob("plan-*.npz"):
        plan_file.unlink()  # planned again from the old file
    old = LengthIndex.load(path, fingerprint=new.fingerprint)
    assert old.images is None
    assert old.total.tolist() == new.total.tolist()
    assert json.loads(bytes(read_npz(path, ("meta",), what="t")["meta"]))["layout"] == 2  # kept
    again = neat_vlm_graph(data, processor, config=cfg)
    assert _batches(again, 3) == want
    resumed = neat_vlm_graph(data, processor, config=cfg)
    resumed.load_state_dict(state)  # the plan's fingerprint is unchanged
    cost = neat_vlm_graph(data, processor, config=dataclasses.replace(cfg, balance="cost"))
    with pytest.raises(StateMismatchError, match="different plan"):
        cost.load_state_dict(saved_on_counts)
    with pytest.raises(ValueError, match=rf"max_images needs .*{path.name}.*delete that file"):
        neat_vlm_graph(data, processor, config=dataclasses.replace(cfg, max_images=4))
    path.unlink()
    budgeted = neat_vlm_graph(data, processor, config=dataclasses.replace(cfg, max_images=4))
    assert next(iter(budgeted))["input_ids"].shape[0] == 1
    rebuilt = LengthIndex.load(path)
    assert rebuilt.images is not None
    assert rebuilt.images.tolist() == new.images.tolist()
