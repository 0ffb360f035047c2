"""Hub dataset formats (pipes/reading/formats.py) read through ``neat_vlm_graph``: HF/TRL
``messages`` +
``images``, the_cauldron, ShareGPT, OpenAI ``image_url`` and a real ``datasets.Dataset`` with
an Image feature. Each format's batches equal those of the same data in neatpack's canonical
form; the ``datasets`` path plans without decoding a pixel."""

from __future__ import annotations

import base64
import random
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageFile

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes import RecordError, SequenceSource, to_record
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.reading.media import SampleError
from neatpack.pipes.testing.resume import same_item
from neatpack.pipes.testing.tiny import load_tiny_processor

N = 6
WORDS = ("red", "cat", "sits", "on", "a", "mat", "blue", "sky", "the", "dog")


@pytest.fixture(scope="module")
def processor() -> Any:
    return load_tiny_processor()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """N samples: (question, answer, [image paths]) with 0-2 PNGs of random sizes."""
    root = tmp_path_factory.mktemp("formats")
    rng = random.Random(3)
    samples = []
    for i in range(N):
        paths = []
        for k in range(i % 3):
            p = root / f"im{i}_{k}.png"
            size = (rng.randint(30, 90), rng.randint(30, 90))
            Image.new("RGB", size, (rng.randint(0, 255), 40, 90)).save(p)
            paths.append(str(p))
        q = " ".join(rng.choices(WORDS, k=rng.randint(3, 9)))
        a = " ".join(rng.choices(WORDS, k=rng.randint(2, 9)))
        samples.append({"q": q, "a": a, "images": paths})
    return root, samples


def canonical(s: dict[str, Any]) -> dict[str, Any]:
    user = [{"type": "image", "image": p} for p in s["images"]]
    user.append({"type": "text", "text": s["q"]})
    answer = [{"type": "text", "text": s["a"]}]
    return {"conversation": _user_assistant(user, answer)}


def trl(s: dict[str, Any], image: Any) -> dict[str, Any]:
    user: list[dict[str, Any]] = [{"type": "image"} for _ in s["images"]]
    user.append({"type": "text", "text": s["q"]})
    answer = [{"type": "text", "text": s["a"]}]
    return {"messages": _user_assistant(user, answer), "images": [image(p) for p in s["images"]]}


def png_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


def _user_assistant(user: list[dict[str, Any]], answer: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def openai(s: dict[str, Any], url: Any) -> dict[str, Any]:
    user = [{"type": "image_url", "image_url": {"url": url(p)}} for p in s["images"]]
    return {"messages": _user_assistant([*user, {"type": "text", "text": s["q"]}], s["a"])}


def data_uri(path: str) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(path)).decode()


def cauldron(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "images": [{"bytes": png_bytes(p), "path": Path(p).name} for p in s["images"]],
        "texts": [{"user": s["q"], "assistant": s["a"], "source": "x"}],
    }


def sharegpt(s: dict[str, Any]) -> dict[str, Any]:
    human = {"from": "human", "value": "<image>" * len(s["images"]) + s["q"]}
    return {
        "conversations": [human, {"from": "gpt", "value": s["a"]}],
        "images": [{"bytes": png_bytes(p), "path": None} for p in s["images"]],
    }


FORMATS = {
    "trl_paths": lambda s: trl(s, str),
    "trl_pil": lambda s: trl(s, lambda p: Image.open(p).convert("RGB")),
    "trl_bytes_dict": lambda s: trl(s, lambda p: {"bytes": png_bytes(p), "path": None}),
    "trl_path_dict": lambda s: trl(s, lambda p: {"bytes": None, "path": p}),
    "cauldron": cauldron,
    "sharegpt": sharegpt,
    "openai_data_uri": lambda s: openai(s, data_uri),
    "openai_path": lambda s: openai(s, lambda p: "file://" + p),
}

CFG = NeatVLMConfig(pack_size=512, batch_size=2, shuffle=False, estimate_mode="exact")


def batches(data: Any, processor: Any, cfg: NeatVLMConfig = CFG) -> list[dict[str, Any]]:
    return list(neat_vlm_graph(data, processor, config=cfg))


@pytest.fixture(scope="module")
def expected(corpus: Any, processor: Any) -> list[dict[str, Any]]:
    _, samples = corpus
    out = batches([canonical(s) for s in samples], processor)
    assert {i for b in out for ids in b["sample_ids"] for i in ids} == set(range(N))
    assert any(b.get("pixel_values") is not None for b in out)
    return out


def _strip(bs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k != "meta"} for b in bs]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_format_gives_the_canonical_batches(
    name: str, corpus: Any, processor: Any, expected: list[dict[str, Any]]
) -> None:
    _, samples = corpus
    got = batches([FORMATS[name](s) for s in samples], processor)
    assert same_item(_strip(got), _strip(expected)), name


def test_trl_record_converts_in_order(corpus: Any) -> None:
    _, samples = corpus
    s = samples[2]  # two images
    rec = to_record(trl(s, str), 2, None)
    blocks = rec["conversation"][0]["content"]
    assert [b.get("image") for b in blocks] == [*s["images"], None]


def test_hf_null_struct_fields_are_placeholders() -> None:
    # datasets fills every struct field of a block: {"type": "image", "text": None, "image": None}
    raw = {"messages": [
        {"role": "user", "content": [{"type": "image", "text": None, "image": None},
                                     {"type": "text", "text": "hi", "image": None}]},
        {"role": "assistant", "content": [{"type": "text", "text": "yo", "image": None}]}],
        "images": ["a.png"]}  # fmt: skip
    conv = to_record(raw, 0, None)["conversation"]
    assert conv[0]["content"] == [{"type": "image", "image": "a.png"},
                                  {"type": "text", "text": "hi"}]  # fmt: skip


@pytest.mark.parametrize("n_images", [0, 2])
def test_trl_count_mismatch_names_the_sample(n_images: int) -> None:
    raw = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
           "text": "q"}]}, {"role": "assistant", "content": "a"}],
           "images": ["a.png"] * n_images}  # fmt: skip
    with pytest.raises(RecordError, match=r"sample_id=7: .*placeholders.*images column"):
        to_record(raw, 7, None)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url":
          {"url": "https://evil.example/x.png"}}]}]}, "remote; neatpack never fetches"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url":
          {"url": "data:image/png,xyz"}}]}]}, "is not base64"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}],
          "images": [{"bytes": b"not an image", "path": "x.png"}]}, "no readable image header"),
        ({"texts": [{"user": "q"}], "images": []}, r"texts\[0\].*'assistant'"),
    ],
)  # fmt: skip
def test_bad_format_records_are_refused(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(RecordError, match=f"sample_id=4: .*{match}"):
        to_record(raw, 4, None)


def test_trl_paths_stay_confined_to_the_media_root(corpus: Any) -> None:
    root, samples = corpus
    raw = trl(samples[1], lambda p: "../../etc/passwd")
    with pytest.raises(RecordError, match="outside the media root"):
        to_record(raw, 1, str(root))


# -- a real datasets.Dataset with an Image feature --------------------------------------------


def _dataset(samples: list[dict[str, Any]], corrupt: int | None = None) -> Any:
    datasets = pytest.importorskip("datasets")
    rows = [trl(s, lambda p: {"bytes": png_bytes(p), "path": None}) for s in samples]
    if corrupt is not None:  # valid header, pixel data cut: only a decode notices
        img = rows[corrupt]["images"][0]
        img["bytes"] = img["bytes"][:60]
    features = datasets.Features({
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"),
                                   "text": datasets.Value("string")}]}],
        "images": datasets.List(datasets.Image())})  # fmt: skip
    return datasets.Dataset.from_list(rows, features=features)


def test_datasets_image_feature_plans_without_decoding(
    corpus: Any, processor: Any, expected: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, samples = corpus
    ds = _dataset(samples)
    assert isinstance(ds[1]["images"][0], Image.Image)  # datasets itself decodes by default
    from neatpack.pipes.reading.read import HFDatasetSource

    loads = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda im: loads.append(1) or real_load(im))
    source = HFDatasetSource(ds)
    est = LengthEstimator.from_processor(processor, mode="estimate")
    index = build_length_index(source, est, progress=False)
    assert index.total.shape == (N,)
    assert int(index.visual.sum()) > 0
    assert loads == []  # the whole plan read headers only
    assert same_item(_strip(batches(ds, processor)), _strip(expected))
    assert loads  # the workers did decode


def test_disk_backed_dataset_is_not_copied(
    corpus: Any, processor: Any, expected: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A dataset opened with ``load_from_disk``: turning decoding off changes only metadata;
    ``ds.cast`` wrote a whole ``cache-*.arrow`` copy beside it (151 MB became 302 MB)."""
    datasets = pytest.importorskip("datasets")
    _, samples = corpus
    _dataset(samples).save_to_disk(str(tmp_path / "ds"))
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    before = sorted(p.name for p in (tmp_path / "ds").iterdir())
    assert same_item(_strip(batches(ds, processor)), _strip(expected))
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == before


def test_datasets_corrupt_pixels_fail_in_the_worker_naming_the_sample(
    corpus: Any, processor: Any
) -> None:
    _, samples = corpus
    ds = _dataset(samples, corrupt=1)
    loader = neat_vlm_graph(ds, processor, config=CFG)  # plans fine: header is intact
    with pytest.raises(SampleError, match=r"sample_id=1 \[(truncated|corrupt)_image\]"):
        list(loader)
    skip = NeatVLMConfig(pack_size=512, batch_size=2, shuffle=False, on_bad_sample="skip")
    skipping = neat_vlm_graph(ds, processor, config=skip)
    got = [sid for b in skipping for ids in b["sample_ids"] for sid in ids]
    assert set(got) == set(range(N)) - {1}
    assert skipping.ledgers[0].failed == [1]  # counted, by id


def test_sequence_source_reads_every_format(corpus: Any) -> None:
    _, samples = corpus
    for name, fmt in FORMATS.items():
        src = SequenceSource([fmt(s) for s in samples])
        rec = src[2]
        assert [b["type"] for b in rec["conversation"][0]["content"]] == [
            "image", "image", "text"], name  # fmt: skip


def test_doctests_pass() -> None:
    import doctest

    from neatpack.pipes import formats

    result = doctest.testmod(formats)
    assert result.attempted >= 3
    assert result.failed == 0
