"""Issue 18: the seed-named API called as a user of the seeds' framework would call it, with the
seeds' argument names, on records shaped as the seeds describe (``shared/seeds/``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Subset

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes import (
    LengthGroupedSampler,
    RecordError,
    SampleError,
    neat_pack_dataset_vlm,
)
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import LengthIndex, build_length_index
from neatpack.pipes.planning.source import StateMismatchError
from neatpack.pipes.reading.read import JsonlSource, to_record
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


@pytest.fixture(scope="module")
def processor() -> Any:
    return load_tiny_processor("qwen2_vl")  # patch 14, merge 2: 280x560 -> 200 tokens


def _seed_record(images_meta: Any = None, videos_meta: Any = None, **extra: Any) -> dict[str, Any]:
    """A record as the seeds plan from: media blocks with no path, sizes in mm_inputs_meta."""
    blocks: list[Any] = [{"type": "image"}] * len(images_meta or [None])
    blocks += [{"type": "video"}] * len(videos_meta or [])
    return {
        "conversation": [
            {"role": "user", "content": [*blocks, {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        ],
        "mm_inputs_meta": {"images_meta": images_meta, "videos_meta": videos_meta},
        **extra,
    }


# -- item 1: planning from metadata, not files ----------------------------------------------


def test_sampler_sizes_placeholder_media_from_mm_inputs_meta(processor: Any) -> None:
    records = [
        _seed_record([[280, 560]]),
        _seed_record([[280, 560], [560, 560]]),
        _seed_record([[280, 560]], videos_meta=[[16, 112, 112, 2.0, 8.0]]),
        _seed_record(),  # one image, no metadata at all
    ]
    s = LengthGroupedSampler(records, seed=0, processor=processor)
    # text: 19 chars // 3 = 6; template (probed from the processor): user 5 + assistant 7 +
    # default system 16 + 2 vision marks per media item; minus 1 for the shift
    image = 200  # (280/14) * (560/14) / 2**2, smart_resize keeps 280x560
    # 560x560 is over the tiny processor's max_pixels (200704): resized to 448x448 -> 256
    square = 256
    video = 128  # 16 frames / temporal patch 2 = 8, x (112/14)**2 / 2**2 = 16 tokens each
    assert s.lengths.tolist() == [
        6 + 30 + image - 1,
        6 + 32 + image + square - 1,
        6 + 32 + image + video - 1,
        6 + 30 + 500 - 1,  # the seed's per-item fallback, counted below
    ]
    assert dict(s.fallbacks.counts) == {"image_no_meta": 1}
    assert s.fallbacks.sample_ids == {"image_no_meta": [3]}


def test_sampler_without_processor_counts_the_seed_fallback_per_item() -> None:
    records = [_seed_record([[280, 560], [28, 28]], videos_meta=[[16, 112, 112, 2.0, 8.0]])]
    s = LengthGroupedSampler(records)
    # 19 // 3 = 6, default template 5 + 5 + 11 + 2 per media (3), 3 x 500, shift -1
    assert s.lengths.tolist() == [6 + 27 + 1500 - 1]
    assert dict(s.fallbacks.counts) == {"image_no_config": 2, "video_no_config": 1}
    assert s.fallbacks.sample_ids == {"image_no_config": [0], "video_no_config": [0]}


def test_neat_pack_dataset_vlm_plans_placeholder_records(processor: Any) -> None:
    records = [_seed_record([[280, 560]]) for _ in range(4)] + [_seed_record()]
    # with the processor a sized record is 6 + 30 + 200 - 1 = 235 tokens, the unsized one
    # 6 + 30 + 500 - 1 = 535: worst-fit decreasing in 1000 gives [4, 0] (770), [1, 2, 3] (705)
    packed = neat_pack_dataset_vlm(
        dataset=records, pack_size=1000, ds_raw=records, processor=processor
    )
    assert sorted(sorted(b) for b in packed.bins) == [[0, 4], [1, 2, 3]]
    assert dict(packed.fallbacks.counts) == {"image_no_meta": 1}
    assert packed.fallbacks.sample_ids == {"image_no_meta": [4]}
    # without a processor every media item is the seed's 500: two records per 1100
    plain = neat_pack_dataset_vlm(dataset=records, pack_size=1100, ds_raw=records)
    assert sorted(len(b) for b in plain.bins) == [1, 2, 2]
    assert plain.fallbacks.counts["image_no_config"] == 5


def test_placeholder_with_a_stray_key_is_still_refused() -> None:
    bad = _seed_record([[280, 560]])
    bad["conversation"][0]["content"][0] = {"type": "image", "img": "cat.jpg"}
    with pytest.raises(RecordError, match=r"sample_id=0: image block .* has \['img'\]"):
        LengthGroupedSampler([bad])


def test_materializing_a_placeholder_names_the_sample(processor: Any, tmp_path: Path) -> None:
    data = write_corpus(tmp_path, num_samples=6, seed=1)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    records.insert(2, _seed_record([[280, 560]]))
    cfg = NeatVLMConfig(pack_size=2048, media_root=str(tmp_path / "media"), prefetch=0,
                        shuffle=False)  # fmt: skip
    loader = neat_vlm_graph(records, processor, config=cfg)  # planning needs no pixels
    with pytest.raises(SampleError, match=r"sample_id=2 .*image block with no image to load"):
        list(loader)
    skip = neat_vlm_graph(
        records, processor, config=NeatVLMConfig(**{**cfg.__dict__, "on_bad_sample": "skip"})
    )
    list(skip)
    assert skip.ledgers[0].failed == [2]
    assert sorted(skip.ledgers[0].consumed) == [0, 1, 3, 4, 5, 6]


@pytest.mark.parametrize("handler", [None, "qwen_vl", "chat_template"])
def test_every_tokenize_path_refuses_a_placeholder_by_sample(processor: Any, handler: Any) -> None:
    from neatpack.pipes.materializing.materialize import MaterializeConfig, load_sample
    from neatpack.pipes.reading.read import SequenceSource

    source = SequenceSource([_seed_record([[280, 560]]), _seed_record([[280, 560]])])
    config = MaterializeConfig(pack_size=1024, handler=handler)
    with pytest.raises(SampleError, match=r"sample_id=1 .*image block with no image to load"):
        load_sample(source, 1, processor, config)


def test_fast_raw_estimate_agrees_on_placeholder_records(processor: Any) -> None:
    est = LengthEstimator.from_processor(processor)
    records = [
        _seed_record([[280, 560]]),
        _seed_record([[280, 560], [560, 560]], videos_meta=[[16, 112, 112, 2.0, 8.0]]),
        _seed_record(),  # no metadata: the full path decides (a fallback)
        _seed_record([[280, 560]], _media_tokens=9),
    ]
    total, visual, _, slow = est.estimate_raw_batch(records)
    assert slow == [2, 3]  # [0] and [1] decided on the fast path
    for k in (0, 1):
        full = est.estimate_sample(to_record(records[k], k, None))
        assert (int(total[k]), int(visual[k])) == (full.total, full.visual)


# -- item 2: precomputed _media_tokens --------------------------------------------------------


@pytest.mark.parametrize("block", [{"type": "image"}, {"type": "image", "image": "no.jpg"}])
def test_sampler_uses_precomputed_media_tokens(processor: Any, block: dict[str, str]) -> None:
    records = [_seed_record([[280, 560]]), _seed_record([[280, 560]], _media_tokens=1234),
               _seed_record(_media_tokens=7)]  # fmt: skip
    for rec in records:  # a placeholder, or a path that is never read
        rec["conversation"][0]["content"][0] = dict(block)
    s = LengthGroupedSampler(records, processor=processor)
    assert s.lengths.tolist() == [6 + 30 + 200 - 1, 6 + 30 + 1234 - 1, 6 + 30 + 7 - 1]
    assert not s.fallbacks.counts  # the count is given: nothing falls back
    plain = LengthGroupedSampler(records)  # no processor: the given counts still hold
    assert plain.lengths.tolist() == [6 + 23 + 500 - 1, 6 + 23 + 1234 - 1, 6 + 23 + 7 - 1]
    assert plain.fallbacks.sample_ids == {"image_no_config": [0]}


# -- item 3: plain records, wrappers ---------------------------------------------------------


PLAIN = [
    {"conversation": [{"role": "user", "content": ["What is this?", {"type": "image"}]},
                      {"role": "assistant", "content": "A cat."}],
     "mm_inputs_meta": {"images_meta": [[280, 560]]}},
    {"conversation": [{"role": "user", "content": "Hello there, how are you?"},
                      {"role": "assistant", "content": ["Fine.", " Thanks."]}]},
]  # fmt: skip


class Tokenizing(torch.utils.data.Dataset[Any]):
    """A seed-style tokenizing wrapper: raw records under ``.dataset``; tokenizing is costly."""

    def __init__(self, raw: Any) -> None:
        self.dataset = raw
        self.calls = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        self.calls += 1
        raise AssertionError("the sampler must not tokenize samples to estimate lengths")


def test_sampler_estimates_plain_string_content(processor: Any) -> None:
    s = LengthGroupedSampler(PLAIN, processor=processor)
    # [0]: 19 chars // 3 + template 30 + 200 image - 1; [1]: 38 chars // 3 + 5 + 7 + 16 - 1
    assert s.lengths.tolist() == [6 + 30 + 200 - 1, 12 + 28 - 1]


def test_sampler_reaches_raw_records_without_tokenizing(processor: Any) -> None:
    import datasets

    direct = LengthGroupedSampler(PLAIN, processor=processor).lengths.tolist()
    wrapped = Tokenizing(PLAIN)
    assert LengthGroupedSampler(wrapped, processor=processor).lengths.tolist() == direct
    twice = Tokenizing(Tokenizing(PLAIN))
    assert LengthGroupedSampler(twice, processor=processor).lengths.tolist() == direct
    picked = Subset(wrapped, [1, 0, 1])
    assert LengthGroupedSampler(picked, processor=processor).lengths.tolist() == [
        direct[1], direct[0], direct[1]]  # fmt: skip
    assert wrapped.calls == 0
    assert twice.calls == 0
    # an HF datasets.Dataset innermost (Arrow fills every block's missing keys with None)
    rows = [_seed_record([[280, 560]]), _seed_record([[560, 560]])]
    hf = Tokenizing(datasets.Dataset.from_list(rows))
    from_hf = LengthGroupedSampler(hf, processor=processor).lengths.tolist()
    assert from_hf == LengthGroupedSampler(rows, processor=processor).lengths.tolist()
    assert hf.calls == 0


# -- item 7: hostile nesting -----------------------------------------------------------------


def _with_deep_line(root: Path, at: int, depth: int = 5000) -> Path:
    data = write_corpus(root, num_samples=6, seed=2)
    lines = data.read_text().splitlines()
    deep = '{"messages": [{"role": "user", "content": ' + "[" * depth + "]" * depth + "}]}"
    lines.insert(at, deep)
    data.write_text("\n".join(lines) + "\n")
    return data


def test_deeply_nested_line_is_a_record_error(tmp_path: Path) -> None:
    data = _with_deep_line(tmp_path, at=2)
    src = JsonlSource(data, media_root=tmp_path / "media")
    where = rf"{data.name} line 3 \(sample_id=2\) is nested too deeply"
    with pytest.raises(RecordError, match=where):
        src[2]
    with pytest.raises(RecordError, match=where):
        build_length_index(src, LengthEstimator(), progress=False)
    est = LengthEstimator()
    index = build_length_index(src, est, progress=False, on_error="skip")
    assert index.fallback_counts["record_error"] == 1
    assert est.fallbacks.sample_ids["record_error"] == [2]


def test_deeply_nested_line_through_the_graph(processor: Any, tmp_path: Path) -> None:
    data = _with_deep_line(tmp_path, at=4)
    cfg = NeatVLMConfig(pack_size=2048, media_root=str(tmp_path / "media"), prefetch=0)
    with pytest.raises(RecordError, match=r"line 5 \(sample_id=4\) is nested too deeply"):
        neat_vlm_graph(data, processor, config=cfg)
    skip = neat_vlm_graph(
        data, processor, config=NeatVLMConfig(**{**cfg.__dict__, "on_bad_sample": "skip"})
    )
    list(skip)
    assert skip.ledgers[0].failed == [4]
    assert sorted(skip.ledgers[0].consumed) == [0, 1, 2, 3, 5, 6]


# -- item 8: resume after the data changed -----------------------------------------------------


def test_resume_on_changed_data_says_the_data_changed(processor: Any, tmp_path: Path) -> None:
    data = write_corpus(tmp_path, num_samples=12, seed=3)
    cfg = NeatVLMConfig(pack_size=1024, media_root=str(tmp_path / "media"), prefetch=0)
    loader = neat_vlm_graph(data, processor, config=cfg)
    next(iter(loader))
    state = loader.state_dict()
    old = JsonlSource(data).content_fingerprint()
    write_corpus(tmp_path, num_samples=12, seed=4)  # the same path, other records
    new = JsonlSource(data).content_fingerprint()
    assert old != new
    resumed = neat_vlm_graph(data, processor, config=cfg)
    with pytest.raises(StateMismatchError) as info:
        resumed.load_state_dict(state)
    msg = str(info.value)
    assert msg.startswith("the data changed since the state was saved")
    assert f"{data} has content fingerprint {new[:16]}" in msg
    assert f"saved on {data} with {old[:16]}" in msg
    assert "restore the file" in msg
    assert "without load_state_dict" in msg


def test_resume_with_another_length_estimate_says_so(processor: Any, tmp_path: Path) -> None:
    data = write_corpus(tmp_path, num_samples=12, seed=3)
    cfg = NeatVLMConfig(pack_size=1024, media_root=str(tmp_path / "media"), prefetch=0)
    loader = neat_vlm_graph(data, processor, config=cfg)
    next(iter(loader))
    state = loader.state_dict()
    source = JsonlSource(data, media_root=tmp_path / "media")
    estimator = LengthEstimator.from_processor(processor)
    index = build_length_index(source, estimator, progress=False)
    other = LengthIndex(total=index.total + 1, visual=index.visual, fingerprint="another")
    resumed = neat_vlm_graph(data, processor, config=cfg, lengths=other)  # same data
    with pytest.raises(StateMismatchError, match=r"^the length estimate changed .*same data"):
        resumed.load_state_dict(state)


# -- _text_tokens: the template on top, unless the count holds it ----------------------------


def test_text_tokens_include_template_option() -> None:
    records = [
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
         "_text_tokens": 100}
        for _ in range(2)
    ]  # fmt: skip
    # default: 100 + template (user 5, assistant 5, default system 11) - 1 shift
    assert LengthGroupedSampler(records).lengths.tolist() == [120, 120]
    whole = LengthGroupedSampler(records, text_tokens_include_template=True)
    assert whole.lengths.tolist() == [99, 99]
    assert len(neat_pack_dataset_vlm(records, pack_size=200, ds_raw=records).bins) == 2
    packed = neat_pack_dataset_vlm(
        records, pack_size=200, ds_raw=records, text_tokens_include_template=True
    )
    assert packed.bins == [[0, 1]]


# -- item 6: seed-named constants ------------------------------------------------------------


def test_seed_constants_import_from_pipes_with_the_seed_values() -> None:
    from neatpack.pipes import CROSS_ENTROPY_IGNORE_IDX, MEDIA_KEYS, VLM_PP_MEDIA_KEY

    assert CROSS_ENTROPY_IGNORE_IDX == -100  # seed 001
    assert MEDIA_KEYS == (  # seed 000 / peer notes 3
        "pixel_values",
        "image_grid_thw",
        "image_position_ids",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    )
    assert VLM_PP_MEDIA_KEY == "_vlm_pp_media_chunks"  # seed 004
