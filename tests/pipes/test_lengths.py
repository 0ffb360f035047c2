"""Length index: equals per-record estimates, disk cache (atomic, fingerprinted, corruption
detected), fallbacks recorded, cooperative build on a real 2-process gloo group."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neatpack.pipes import lengths as lengths_mod
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import (
    LengthIndex,
    build_length_index,
    length_index_fingerprint,
)
from neatpack.pipes.indexing.media_tokens import ImageTokenConfig
from neatpack.pipes.reading.read import JsonlSource, RecordError, SequenceSource

EST = LengthEstimator(image=ImageTokenConfig(), on_missing_media="fallback")


def raws(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    for i in range(n):
        text = "word " * int(rng.integers(0, 60))
        if i % 3 == 0:
            out.append({"messages": [{"role": "user", "content": text},
                                     {"role": "assistant", "content": "ok"}]})  # fmt: skip
        else:
            h, w = (int(x) for x in rng.integers(20, 3000, 2))
            out.append({
                "conversations": [{"from": "human", "value": f"<image>\n{text}"},
                                  {"from": "gpt", "value": "fine"}],
                "image": f"{i}.jpg",
                **({"images_meta": [[h, w]]} if i % 7 else {}),  # no meta + no file: fallback
            })  # fmt: skip
    return out


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def expected(source: Any, est: LengthEstimator) -> tuple[np.ndarray, np.ndarray]:
    pairs = [est.estimate(source[i]) for i in range(len(source))]
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def test_index_equals_per_record_estimates_and_counts_fallbacks(tmp_path: Path) -> None:
    rows = raws(300)
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", rows), media_root=tmp_path)
    index = build_length_index(src, EST, progress=False)
    total, visual = expected(src, EST)
    np.testing.assert_array_equal(index.total, total)
    np.testing.assert_array_equal(index.visual, visual)
    assert index.total.dtype == np.int32  # 4 bytes a sample (docs/scale.md)
    assert len(index) == 300
    no_meta = [i for i in range(300) if i % 3 and not i % 7]
    assert index.fallback_ids.tolist() == no_meta
    assert index.fallback_counts == {"image_missing": len(no_meta)}
    assert (index.visual[no_meta] == 500).all()
    seq = build_length_index(SequenceSource(rows, media_root=tmp_path), EST, progress=False)
    np.testing.assert_array_equal(seq.total, index.total)


def test_progress_bar_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_length_index(SequenceSource(raws(10)), EST, progress=True)
    assert "length index" in capsys.readouterr().err


def test_cache_reload_and_rebuild_on_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", raws(50))
    cache = tmp_path / "cache"
    first = build_length_index(JsonlSource(path), EST, cache_dir=cache, progress=False)
    files = list(cache.iterdir())
    assert [f.name for f in files] == [f"{first.fingerprint}.npz"]  # no temp files left
    calls: list[int] = []
    real = lengths_mod.estimate_slice
    monkeypatch.setattr(lengths_mod, "estimate_slice", lambda *a: calls.append(1) or real(*a))
    again = build_length_index(JsonlSource(path), EST, cache_dir=cache, progress=False)
    assert calls == []  # served from the cache
    np.testing.assert_array_equal(again.total, first.total)
    np.testing.assert_array_equal(again.fallback_ids, first.fallback_ids)
    assert again.fallback_counts == first.fallback_counts
    # the source changes -> new fingerprint -> rebuilt
    write_jsonl(path, [*raws(50)[:-1], {"messages": [{"role": "user", "content": "x" * 300}]}])
    changed = build_length_index(JsonlSource(path), EST, cache_dir=cache, progress=False)
    assert calls == [1]
    assert changed.fingerprint != first.fingerprint
    assert changed.total[-1] == 300 // 3 + 5 + 11 - 1
    # the estimator config changes -> new fingerprint
    other = LengthEstimator(image=ImageTokenConfig(max_pixels=10**6), on_missing_media="fallback")
    assert length_index_fingerprint(JsonlSource(path), other) != changed.fingerprint


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_cache_is_detected_and_rebuilt(tmp_path: Path, damage: str) -> None:
    src = SequenceSource(raws(40))
    cache = tmp_path / "c"
    good = build_length_index(src, EST, cache_dir=cache, progress=False)
    f = cache / f"{good.fingerprint}.npz"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        at = data.index(good.total.astype("<i4").tobytes()[:16])  # inside the total array
        data[at] ^= 0xFF
    elif damage == "garbage":
        data = bytearray(b"not a zip file" * 10)
    else:
        data = bytearray()
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"unreadable|checksum|mismatch"):
        LengthIndex.load(f, fingerprint=good.fingerprint)
    rebuilt = build_length_index(src, EST, cache_dir=cache, progress=False)
    np.testing.assert_array_equal(rebuilt.total, good.total)
    assert LengthIndex.load(f, fingerprint=good.fingerprint).total.tolist() == good.total.tolist()


def test_load_rejects_wrong_fingerprint(tmp_path: Path) -> None:
    index = build_length_index(SequenceSource(raws(5)), EST, progress=False)
    index.save(tmp_path / "i.npz")
    with pytest.raises(ValueError, match="fingerprint"):
        LengthIndex.load(tmp_path / "i.npz", fingerprint="0" * 64)


@pytest.mark.badinput
def test_build_error_names_the_sample(tmp_path: Path) -> None:
    rows: list[Any] = [*raws(5), "{oops", *raws(2)]
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", rows))
    with pytest.raises(RecordError, match=r"line 6 \(sample_id=5\)"):
        build_length_index(src, EST, progress=False)


def test_world_size_without_process_group_builds_everything() -> None:
    src = SequenceSource(raws(20))
    index = build_length_index(src, EST, progress=False, rank=1, world_size=2)
    np.testing.assert_array_equal(index.total, expected(src, EST)[0])


# -- cooperative build on a real gloo group --------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, data: str, cache: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        est = LengthEstimator(image=ImageTokenConfig(), on_missing_media="fallback")
        src = JsonlSource(data)
        calls: list[int] = []
        real = lengths_mod.estimate_slice

        def spy(s: Any, e: Any, lo: int, hi: int, p: bool, *rest: Any) -> Any:
            calls.append(hi - lo)
            return real(s, e, lo, hi, p, *rest)

        lengths_mod.estimate_slice = spy  # type: ignore[assignment]
        result: dict[str, Any] = {}
        try:
            a = build_length_index(src, est, cache_dir=cache, progress=False, rank=rank,
                                   world_size=world)  # fmt: skip
            b = build_length_index(src, est, cache_dir=cache, progress=False, rank=rank,
                                   world_size=world)  # fmt: skip
            result = {"total": a.total.tolist(), "visual": a.visual.tolist(),
                      "fallback_ids": a.fallback_ids.tolist(), "cached_total": b.total.tolist(),
                      "slices": calls}  # fmt: skip
            try:  # a wrong rank on every process: all raise, none hangs
                build_length_index(src, est, progress=False, rank=1 - rank, world_size=world)
            except ValueError as e:
                result["mismatch"] = str(e)
        except Exception as e:  # reported to the parent
            result = {"error": f"{type(e).__name__}: {e}"}
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run_group(tmp_path: Path, rows: list[Any], world: int = 2) -> list[dict[str, Any]]:
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    ctx = mp.get_context("spawn")
    port = _free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [
        ctx.Process(
            target=_worker, args=(r, world, port, str(data), str(tmp_path / "cache"), str(outs[r]))
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("a rank hung in the length index build")
        assert p.exitcode == 0
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_cooperative_build_on_gloo_group(tmp_path: Path) -> None:
    rows = raws(101)
    r0, r1 = _run_group(tmp_path, rows)
    single = build_length_index(SequenceSource(rows), EST, progress=False)
    for r in (r0, r1):
        assert "error" not in r, r
        assert r["total"] == single.total.tolist()
        assert r["visual"] == single.visual.tolist()
        assert r["fallback_ids"] == single.fallback_ids.tolist()
        assert r["cached_total"] == r["total"]
        assert "process group says rank" in r["mismatch"]
    assert r0["slices"] == [50]  # each rank estimated its half once; the second call hit the cache
    assert r1["slices"] == [51]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_cooperative_build_error_on_one_rank_reaches_all(tmp_path: Path) -> None:
    rows: list[Any] = [*raws(30), "{broken json", *raws(9)]  # sample 30: rank 1's half
    r0, r1 = _run_group(tmp_path, rows)
    for r in (r0, r1):
        assert "rank 1: RecordError" in r["error"]
        assert "sample_id=30" in r["error"]


@pytest.mark.timeout(180)
def test_worker_processes_give_the_same_index(tmp_path: Path) -> None:
    rows: list[Any] = raws(20000)
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", rows), media_root=tmp_path)
    one = build_length_index(src, EST, progress=False)
    two = build_length_index(src, EST, progress=False, num_workers=2)
    np.testing.assert_array_equal(one.total, two.total)
    np.testing.assert_array_equal(one.visual, two.visual)
    np.testing.assert_array_equal(one.fallback_ids, two.fallback_ids)
    assert one.fingerprint == two.fingerprint
    with pytest.raises(ValueError, match="num_workers=-1"):
        build_length_index(src, EST, num_workers=-1)


@pytest.mark.badinput
@pytest.mark.timeout(180)
def test_worker_error_reaches_the_caller(tmp_path: Path) -> None:
    rows: list[Any] = [*raws(17000), "{bad", *raws(10)]
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", rows))
    with pytest.raises(RecordError, match=r"sample_id=17000"):
        build_length_index(src, EST, progress=False, num_workers=2)
