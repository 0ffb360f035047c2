"""Supervised tokens per sample (``pipes/indexing/supervised.py``) in the length index, and
``plan_packs(balance="supervised")``: the raw fast path counts what the Record path counts, the
column is stored (index file and pieces) only when asked and saturates at uint16, and the plan
orders best fit's packs by label tokens under a fingerprint that covers them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neatpack.pipes.errors import SampleError
from neatpack.pipes.families import Handler
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.handler_lengths import HandlerEstimator
from neatpack.pipes.indexing.index_parts import Piece, load_piece, save_piece
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.indexing.media_tokens import ImageTokenConfig
from neatpack.pipes.indexing.supervised import (
    label_marks,
    supervised_estimator,
    supervised_raw_batch,
    supervised_tokens,
)
from neatpack.pipes.planning.plan import plan_fingerprint, plan_packs
from neatpack.pipes.planning.plan_file import shared_plan
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.tiny import load_tiny_processor


def raw_records(n: int, seed: int) -> list[dict[str, Any]]:
    """The raw forms the fast path reads (``messages`` with string or block content,
    ``conversation``, LLaVA ``conversations``) and some it leaves to the Record path (an
    ``<image>`` placeholder inside an answer)."""
    rng = np.random.default_rng(seed)

    def text(k: int) -> str:
        return " ".join(["word"] * k)

    out: list[dict[str, Any]] = []
    for i in range(n):
        q, a = text(int(rng.integers(1, 60))), text(int(rng.integers(0, 90)))
        form = i % 5
        if form == 0:
            out.append({"messages": [{"role": "user", "content": q},
                                     {"role": "assistant", "content": a}]})  # fmt: skip
        elif form == 1:  # blocks, an image in the question, two answers
            out.append({"images_meta": [[200, 300]], "messages": [
                {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "content": [{"type": "image", "image": "a.jpg"},
                                             {"type": "text", "text": q}]},
                {"role": "assistant", "content": [{"type": "text", "text": a},
                                                  {"type": "text", "text": "!"}]},
                {"role": "user", "content": [{"type": "text", "text": q}]},
                {"role": "assistant", "content": [{"type": "text", "text": a + a}]}]})  # fmt: skip
        elif form == 2:
            out.append({"conversation": [{"role": "user", "content": [{"type": "text", "text": q}]},
                                         {"role": "assistant", "content": [
                                             {"type": "text", "text": a}]}]})  # fmt: skip
        elif form == 3:  # LLaVA, with the placeholder in the question
            out.append(
                {
                    "image": "b.jpg",
                    "images_meta": [[64, 64]],
                    "conversations": [
                        {"from": "human", "value": "<image>\n" + q},
                        {"from": "gpt", "value": a + "\n"},
                    ],
                }
            )
        else:  # LLaVA with a placeholder in the answer: the Record path counts it
            out.append(
                {
                    "image": "c.jpg",
                    "images_meta": [[64, 64]],
                    "conversations": [
                        {"from": "human", "value": q},
                        {"from": "gpt", "value": "<image>\n" + a},
                    ],
                }
            )
    return out


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in raw_records(60, seed=0)) + "\n")
    return path


@pytest.mark.parametrize("mode", ["estimate", "exact"])
def test_the_raw_fast_path_counts_what_the_record_path_counts(jsonl: Path, mode: str) -> None:
    processor = load_tiny_processor("qwen2_vl")
    base = LengthEstimator.from_processor(processor, mode=mode, on_missing_media="fallback")
    est = supervised_estimator(base, processor)
    assert est.supervised
    assert est.label_marks == label_marks(processor) == 1
    source = JsonlSource(jsonl)
    index = build_length_index(source, est, progress=False)
    assert index.supervised is not None
    assert index.supervised.dtype == np.uint16
    by_record = [min(supervised_tokens(est, source[i]), int(index.total[i]))
                 for i in range(len(source))]  # fmt: skip
    assert index.supervised.tolist() == by_record
    raws = [json.loads(line) for line in jsonl.read_text().splitlines()]
    slow = supervised_raw_batch(est, raws)[1]
    # estimate mode reads all but the answers with a placeholder raw; exact tokenizes them all
    assert slow == [i for i in range(len(raws)) if mode == "exact" or i % 5 == 4]
    # the other columns are those of the index without the counts
    plain = build_length_index(source, base, progress=False)
    assert plain.supervised is None
    np.testing.assert_array_equal(plain.total, index.total)
    np.testing.assert_array_equal(plain.visual, index.visual)
    assert plain.fingerprint != index.fingerprint  # counted under another fingerprint
    # 0 for a record without answers is allowed; these all have one (+ its end marker)
    assert int(index.supervised.min()) >= 1


def test_the_default_estimator_keeps_its_fingerprint_and_writes_no_column(
    jsonl: Path, tmp_path: Path
) -> None:
    default = LengthEstimator(image=ImageTokenConfig(), on_missing_media="fallback")
    assert "supervised" not in default.config_key()  # indexes cached before keep their key
    assert default.config_key() == repr(default)
    counting = supervised_estimator(default, None)
    assert counting.config_key() == repr(default) + ", supervised=True, label_marks=1"
    cache = tmp_path / "cache"
    for est in (default, counting):
        index = build_length_index(JsonlSource(jsonl), est, cache_dir=cache, progress=False)
        with np.load(cache / f"{index.fingerprint}.npz") as z:
            assert ("supervised" in z.files) is est.supervised  # 0 bytes unless asked
        again = build_length_index(JsonlSource(jsonl), est, cache_dir=cache, progress=False)
        assert again.fingerprint == index.fingerprint
        if est.supervised:
            assert index.supervised is not None
            assert again.supervised is not None
            np.testing.assert_array_equal(again.supervised, index.supervised)
        else:
            assert again.supervised is None


def test_an_estimator_without_counts_is_refused_by_name() -> None:
    class Lengths:  # a family's own estimator of another kind (Handler.estimator)
        mode = "exact"

    with pytest.raises(ValueError, match=r"\(Lengths\) has none: use balance='tokens'"):
        supervised_estimator(Lengths(), load_tiny_processor("qwen2_vl"))


def test_a_family_whose_tokenize_cannot_count_is_refused_naming_it() -> None:
    """A handler whose tokenize refuses the text-only probe (here: it needs an image) cannot
    count labels without the media: refused at build, naming the handler and the fix."""

    def needs_image(record: Any, processor: Any, **options: Any) -> dict[str, Any]:
        raise SampleError(record.get("sample_id"), "bad_media", "this family needs an image")

    handler = Handler("image_only", needs_image, estimate=lambda r, p, mode: 1)
    processor = load_tiny_processor("qwen2_vl")
    with pytest.raises(ValueError, match=r"handler 'image_only'.*needs an image.*Fix: use "
                                         r"balance='tokens'.*lengths="):  # fmt: skip
        supervised_estimator(HandlerEstimator(handler, processor, "exact"), processor)
    with pytest.raises(ValueError, match=r"handler 'image_only' probes the processor"):
        supervised_estimator(HandlerEstimator(handler, None, "exact"), None)


def test_the_column_saturates_at_uint16_and_refuses_negatives() -> None:
    index = LengthIndex(total=[70_000, 9], visual=[0, 0], fingerprint="x",
                        supervised=[70_000, 5])  # fmt: skip
    assert index.supervised is not None
    assert index.supervised.dtype == np.uint16
    assert index.supervised.tolist() == [65_535, 5]
    with pytest.raises(ValueError, match="sample 1 has -1 tokens"):
        LengthIndex(total=[3, 4], visual=[0, 0], fingerprint="x", supervised=[1, -1])
    with pytest.raises(ValueError, match="must equal total"):
        LengthIndex(total=[3, 4], visual=[0, 0], fingerprint="x", supervised=[1])
    with pytest.raises(ValueError, match="balance='supervised' needs the supervised"):
        LengthIndex(total=[3], visual=[0], fingerprint="x").require_supervised(
            "balance='supervised'"
        )


def test_a_piece_keeps_the_column_and_one_without_it_has_none(tmp_path: Path) -> None:
    ints = np.array([5, 7, 9], np.int64)
    zeros = np.zeros(3, np.int64)
    for sup in (np.array([1, 0, 4], np.int64), None):
        piece = Piece(0, 3, f"k{sup is None}")
        save_piece(tmp_path, piece, (ints, zeros, zeros, [], [], sup), None)
        part = load_piece(tmp_path, piece, None)
        assert part is not None
        if sup is None:
            assert part[5] is None
        else:
            assert part[5] is not None
            assert part[5].tolist() == [1, 0, 4]
        np.testing.assert_array_equal(part[0], ints)


def lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    total = rng.integers(20, 1500, size=n)
    share = np.where(rng.random(n) < 0.5, rng.random(n), rng.random(n) * 0.05)
    return total, np.floor(total * share).astype(np.int64)


def test_plan_orders_best_fit_packs_by_supervised_tokens(tmp_path: Path) -> None:
    total, sup = lengths(4000, seed=0)
    tokens = plan_packs(total, 4096, world_size=8)
    plan = plan_packs(total, 4096, world_size=8, balance="supervised", supervised=sup)
    assert sorted(map(tuple, plan.packs())) == sorted(map(tuple, tokens.packs()))  # same packs
    per_pack = np.add.reduceat(sup[plan.ids], plan.offsets[:-1])
    assert (np.diff(per_pack) >= 0).all()  # stored in label order: groups are neighbours
    for epoch in (0, 2):
        assert sorted(plan.epoch_order(epoch).tolist()) == list(range(len(plan)))
    # the fingerprint covers the counts; other policies ignore them (their plans unchanged)
    other = plan_packs(total, 4096, world_size=8, balance="supervised", supervised=sup + 1)
    assert other.fingerprint != plan.fingerprint != tokens.fingerprint
    kw: dict[str, Any] = {"world_size": 8, "balance": "supervised", "supervised": sup}
    assert plan_fingerprint(total, 4096, **kw) == plan.fingerprint
    assert plan_packs(total, 4096, world_size=8, supervised=sup).fingerprint == tokens.fingerprint
    with pytest.raises(ValueError, match="balance='supervised' needs supervised="):
        plan_packs(total, 4096, balance="supervised")
    # planned once per node through a file: the same plan, and not the token plan's file
    shared = shared_plan(tmp_path, total, 4096, key="idx", **kw)
    np.testing.assert_array_equal(shared.ids, plan.ids)
    shared_plan(tmp_path, total, 4096, key="idx", world_size=8)
    assert len(list(tmp_path.glob("plan-*.npz"))) == 2


def test_a_sharded_build_reuses_its_pieces_with_the_counts(tmp_path: Path) -> None:
    """Pieces of a sharded source outlive the index: a rebuild (the index file deleted, as the
    refusal's fix says) loads them, counts included, and estimates nothing again."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from neatpack.pipes.reading.shards import ParquetSource

    data = tmp_path / "data"
    data.mkdir()
    records = [r for r in raw_records(40, seed=1) if "messages" in r and "images_meta" not in r]
    for k in range(2):
        pq.write_table(pa.Table.from_pylist(records[k::2]), data / f"part-{k}.parquet")
    est = supervised_estimator(LengthEstimator(), None)
    cache = tmp_path / "cache"

    def build() -> LengthIndex:
        return build_length_index(ParquetSource(str(data / "*.parquet")), est, cache_dir=cache,
                                  progress=False)  # fmt: skip

    calls: list[int] = []
    real = est.estimate_raw_batch
    object.__setattr__(est, "estimate_raw_batch", lambda raws: calls.append(1) or real(raws))
    first = build()
    assert calls  # estimated
    assert len(list(cache.glob("length-piece-*.npz"))) == 2
    (cache / f"{first.fingerprint}.npz").unlink()
    calls.clear()
    again = build()
    assert not calls  # every piece loaded
    assert first.supervised is not None
    assert again.supervised is not None
    assert again.supervised.tolist() == first.supervised.tolist()
    assert int(first.supervised.min()) >= 1
