"""materialize_pack / Materializer / truncate_sample / seed-compat PackedDatasetWrapper."""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from neatpack.pipes.compat.packed_dataset import PackedDatasetWrapper, neat_pack_dataset_vlm
from neatpack.pipes.materializing.materialize import (
    MaterializeConfig,
    Materializer,
    materialize_pack,
    replacement_id,
)
from neatpack.pipes.materializing.mrope import MRopeConfig
from neatpack.pipes.materializing.pack import build_pack, truncate_sample
from neatpack.pipes.materializing.tokenize import tokenize_conversation
from neatpack.pipes.reading.media import SampleError
from neatpack.pipes.reading.read import JsonlSource, SequenceSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import tiny_model

IDS = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def proc() -> Any:
    return load_tiny_processor("qwen2_vl")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> JsonlSource:
    d = tmp_path_factory.mktemp("corpus")
    return JsonlSource(write_corpus(d, num_samples=12, seed=3), media_root=d / "media")


def _text(sid: int, words: int = 5) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello " * words},
                         {"role": "assistant", "content": f"answer {sid}"}]}  # fmt: skip


def _lengths(source: Any, proc: Any, ids: list[int]) -> list[int]:
    return [len(tokenize_conversation(source[i], proc)["input_ids"]) - 1 for i in ids]


def test_pack_equals_build_pack_of_tokenized_samples(source: JsonlSource, proc: Any) -> None:
    pack, report = materialize_pack(source, IDS, proc, MaterializeConfig(pack_size=4096))
    ref = build_pack([tokenize_conversation(source[i], proc) for i in IDS], pack_size=4096,
                     mrope=MRopeConfig.from_processor(proc))  # fmt: skip
    for key in ("input_ids", "labels", "attention_mask", "position_ids", "pixel_values"):
        assert torch.equal(pack[key], ref[key]), key
    assert pack["position_ids"].shape == (3, 4096)
    assert report.planned == report.packed == tuple(IDS)
    assert report.real_tokens == sum(pack["seq_lens"]) == sum(_lengths(source, proc, IDS))
    assert not (report.dropped)
    assert not (report.truncated)
    assert not (report.failed)


def test_overflow_policies(source: JsonlSource, proc: Any) -> None:
    lens = _lengths(source, proc, IDS)
    size = sum(lens) - 5  # the real pack is 5 tokens too long
    with pytest.raises(ValueError, match=rf"samples \[0, 1, 2, 3\] is {sum(lens)} .*{size}"):
        materialize_pack(source, IDS, proc, MaterializeConfig(pack_size=size))

    pack, rep = materialize_pack(source, IDS, proc, MaterializeConfig(pack_size=size,
                                                                      overflow="drop"))  # fmt: skip
    assert rep.dropped == (3,)
    assert pack["sample_ids"] == [0, 1, 2]
    assert pack["input_ids"].shape == (size,)

    pack, rep = materialize_pack(
        source, IDS, proc, MaterializeConfig(pack_size=size, overflow="truncate")
    )
    assert rep.truncated == (3,)
    assert pack["sample_ids"] == IDS
    assert sum(pack["seq_lens"]) <= size
    assert rep.truncated_tokens >= 5
    # media stay consistent with the (possibly shortened) tokens
    grid = pack["image_grid_thw"]
    assert int((pack["mm_token_type_ids"] == 1).sum()) == int(grid.prod(1).sum()) // 4
    assert pack["pixel_values"].shape[0] == int(grid.prod(1).sum())


def test_truncate_never_cuts_an_image(proc: Any) -> None:
    rec = {"sample_id": 0, "conversation": [
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image", "image": _img(56, 56)},
                                     {"type": "image", "image": _img(56, 84)}]},
        {"role": "assistant", "content": [{"type": "text", "text": "two images"}]}]}  # fmt: skip
    s = tokenize_conversation(rec, proc)
    img = torch.nonzero(s["mm_token_type_ids"] == 1).reshape(-1).tolist()  # 4 + 6 tokens
    cut = truncate_sample(s, img[6])  # inside the second image
    assert len(cut["input_ids"]) == img[4]  # moved back to the second image's start
    assert cut["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert cut["pixel_values"].shape[0] == 16
    cut0 = truncate_sample(s, img[1])
    assert cut0["image_grid_thw"] is None
    assert cut0["pixel_values"] is None
    assert len(cut0["input_ids"]) == img[0]


def _img(h: int, w: int) -> Any:
    from PIL import Image

    return Image.new("RGB", (w, h), (10, 200, 30))


def _bad_source(n: int = 20, bad: tuple[int, ...] = (2,)) -> SequenceSource:
    recs = [_text(i) for i in range(n)]
    for b in bad:
        recs[b] = {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "/nonexistent/x.png"}]},
                {"role": "assistant", "content": "no"},
            ]
        }
    return SequenceSource(recs)


def test_failure_policies_and_deterministic_replacement(proc: Any) -> None:
    src = _bad_source()
    cfg = MaterializeConfig(pack_size=512, mrope=False)
    with pytest.raises(SampleError, match="sample_id=2"):
        materialize_pack(src, [1, 2], proc, cfg)

    pack, rep = materialize_pack(src, [1, 2], proc, MaterializeConfig(
        pack_size=512, mrope=False, on_bad_sample="skip"))  # fmt: skip
    assert (rep.skipped, rep.failed, pack["sample_ids"]) == ((2,), (2,), [1])

    rcfg = MaterializeConfig(pack_size=512, mrope=False, on_bad_sample="replace", seed=5)
    random.seed(123)
    a, ra = materialize_pack(src, [1, 2], proc, rcfg, epoch=1)
    random.seed(999)  # the global RNG plays no part
    b, rb = materialize_pack(src, [1, 2], proc, rcfg, epoch=1)
    assert ra == rb
    assert torch.equal(a["input_ids"], b["input_ids"])
    (orig, new), = ra.replaced  # fmt: skip
    assert orig == 2
    assert new not in (1, 2)
    attempt = 1
    expected = replacement_id(5, 1, 2, attempt, len(src))
    while expected in (1, 2):
        attempt += 1
        expected = replacement_id(5, 1, 2, attempt, len(src))
    assert new == expected
    _, rc = materialize_pack(src, [1, 2], proc, rcfg, epoch=2)
    assert rc.replaced[0][0] == 2  # another epoch draws from another stream

    with pytest.raises(RuntimeError, match="sample 2 and its replacements failed"):
        materialize_pack(
            _bad_source(3, (0, 1, 2)),
            [2],
            proc,
            MaterializeConfig(pack_size=512, on_bad_sample="replace", max_retries=2),
        )


def test_materializer_is_a_picklable_map_fn(source: JsonlSource, proc: Any) -> None:
    m = Materializer(source, proc, MaterializeConfig(pack_size=4096))
    m2 = pickle.loads(pickle.dumps(m))
    ref = {"pack_index": 7, "epoch": 2, "sample_ids": [5, 1]}
    pack = m2(ref)
    assert (pack["pack_index"], pack["epoch"], pack["planned_sample_ids"]) == (7, 2, [5, 1])
    assert pack["report"]["packed"] == [5, 1]
    assert torch.equal(pack["input_ids"], m(ref)["input_ids"])


def test_fake_image_tokens_masked_in_pack(proc: Any) -> None:
    src = SequenceSource([_text(0), _text(1, 9)])
    pack, _ = materialize_pack(src, [0, 1], proc, MaterializeConfig(pack_size=512,
                                                                    fake_image=True))  # fmt: skip
    assert pack["n_images"] == 2
    start = 0
    for n in pack["seq_lens"]:
        doc = pack["mm_token_type_ids"][start : start + n]
        # the masked <|vision_start|> + 4 image pads + <|vision_end|> block closes the document
        assert doc[n - 6 :].tolist() == [0, 1, 1, 1, 1, 0]
        assert doc[: n - 6].eq(0).all()
        assert pack["labels"][start + n - 6 : start + n].eq(-100).all()
        assert pack["labels"][start : start + n - 6].ne(-100).any()
        start += n


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="overflow='cut'"):
        MaterializeConfig(pack_size=8, overflow="cut")
    with pytest.raises(ValueError, match="on_bad_sample='retry'"):
        MaterializeConfig(pack_size=8, on_bad_sample="retry")
    with pytest.raises(ValueError, match="alignment=3"):
        MaterializeConfig(pack_size=8, alignment=3)


class _Inner:
    """A tokenized inner dataset in the seed's shape (mm_token_type_ids [1, S])."""

    def __init__(self, source: Any, proc: Any, bad: tuple[int, ...] = ()) -> None:
        self.source, self.proc, self.bad = source, proc, bad

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i in self.bad:
            raise RuntimeError(f"broken {i}")
        s = tokenize_conversation(self.source[i], self.proc)
        s["mm_token_type_ids"] = s["mm_token_type_ids"][None]
        del s["sample_id"]
        return s


def test_packed_dataset_wrapper_seed_compat(source: JsonlSource, proc: Any) -> None:
    model = tiny_model("qwen2_vl", processor=proc)
    inner = _Inner(source, proc, bad=(4,))
    al = [-(-n // 8) * 8 for n in _lengths(source, proc, list(range(6)))]
    big = max(range(1, 4), key=lambda i: al[i])
    small = min(range(1, 4), key=lambda i: al[i])
    assert al[big] > al[small]
    ds = PackedDatasetWrapper(inner, [[0, big, small], [4, 5], []], pack_size=al[0] + al[small],
                              sequence_alignment=8,
                              get_rope_index=model.model.get_rope_index)  # fmt: skip
    assert len(ds) == 3
    p0 = ds[0]
    assert p0["report"]["dropped"] == [big]  # first-fit in bin order; the short one still fits
    assert p0["sample_ids"] == [0, small]
    assert p0["position_ids"].shape[0] == 3
    assert all(n % 8 == 0 for n in p0["seq_lens_padded"])
    ref = build_pack([tokenize_conversation(source[i], proc) for i in (0, small)], alignment=8,
                     mrope=MRopeConfig.from_processor(proc))  # fmt: skip
    assert torch.equal(p0["position_ids"], ref["position_ids"])
    p1 = ds[1]
    assert p1["report"]["failed"] == [4]
    assert p1["report"]["replaced"][0][0] == 4
    empty = ds[2]
    assert empty["position_ids"].shape == (3, 0)  # B4: the rank survives an empty pack
    assert ds.robust_collate(len).dataset is ds  # B1: retries with this wrapper's packs
    with pytest.raises(ValueError, match="input_ids"):
        PackedDatasetWrapper(inner, [[0]], 64, get_rope_index=lambda x: x)


def test_neat_pack_dataset_vlm(source: JsonlSource, proc: Any, tmp_path: Path) -> None:
    inner = _Inner(source, proc)
    ds = neat_pack_dataset_vlm(inner, 4096, ds_raw=source, processor=proc)
    planned = sorted(i for b in ds.bins for i in b)
    assert planned == list(range(len(source)))
    assert ds[0]["report"]["planned"] == ds.bins[0]
    two = neat_pack_dataset_vlm(inner, 4096)
    assert two.bins[:2] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="drop_long_samples=True"):
        neat_pack_dataset_vlm(inner, 64, ds_raw=source, processor=proc)
    short = neat_pack_dataset_vlm(inner, 400, ds_raw=source, processor=proc,
                                  drop_long_samples=True, max_packs=2)  # fmt: skip
    assert len(short) <= 2


def test_truncate_keeps_media_consistent_at_every_cut(proc: Any) -> None:
    rec = {"sample_id": 0, "conversation": [
        {"role": "user", "content": [{"type": "image", "image": _img(56, 84)},
                                     {"type": "text", "text": "and"},
                                     {"type": "image", "image": _img(84, 56)}]},
        {"role": "assistant", "content": [{"type": "text", "text": "two"}]}]}  # fmt: skip
    s = tokenize_conversation(rec, proc)
    for length in range(1, len(s["input_ids"]) + 2):
        cut = truncate_sample(s, length)
        n = len(cut["input_ids"])
        assert n <= length
        grid = cut["image_grid_thw"]
        rows = 0 if grid is None else int(grid.prod(1).sum())
        assert int((cut["mm_token_type_ids"] == 1).sum()) == rows // 4
        assert (0 if cut["pixel_values"] is None else cut["pixel_values"].shape[0]) == rows
        assert torch.equal(cut["labels"], s["labels"][:n])


@pytest.mark.slow
def test_materializer_in_process_workers(source: JsonlSource, proc: Any) -> None:
    from torchdata.nodes import IterableWrapper, Loader, ParallelMapper

    m = Materializer(source, proc, MaterializeConfig(pack_size=4096))
    refs = [{"pack_index": k, "epoch": 0, "sample_ids": [2 * k, 2 * k + 1]} for k in range(4)]
    node = ParallelMapper(IterableWrapper(refs), m, num_workers=2, method="process",
                          multiprocessing_context="spawn")  # fmt: skip
    got = list(Loader(node))
    assert [p["pack_index"] for p in got] == [0, 1, 2, 3]
    for p, r in zip(got, refs, strict=True):
        assert torch.equal(p["input_ids"], m(r)["input_ids"])


def test_the_old_on_failure_keyword_is_on_bad_sample() -> None:
    """``MaterializeConfig(on_failure=...)`` became ``on_bad_sample=`` (the graphs' word, issue
    #26): the old keyword sets it, with a DeprecationWarning naming the new one."""
    with pytest.warns(DeprecationWarning, match="use on_bad_sample"):
        cfg = MaterializeConfig(pack_size=8, on_failure="skip")
    assert cfg == MaterializeConfig(pack_size=8, on_bad_sample="skip")
    with (
        pytest.raises(ValueError, match="on_bad_sample='retry'"),
        pytest.warns(DeprecationWarning, match="on_bad_sample"),
    ):
        MaterializeConfig(pack_size=8, on_failure="retry")
