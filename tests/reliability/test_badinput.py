"""The bad-input corpus (``tests/support/gen_badinput.py``) through the real reader, estimator and
tokenizer, then end to end through ``neat_vlm_graph`` under every policy: each bad record
either raises an error naming it and the fix, or is counted in the loader's ledger with its id.
Nothing is dropped silently: every sample id lands in exactly one ledger list."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
from support.gen_badinput import BOMB_LIMIT, CASES, Case, write_bad_corpus

from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.runtime.loader import EpochLedger
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.materializing.materialize import MaterializeConfig, materialize_pack
from neatpack.pipes.materializing.tokenize import tokenize_conversation
from neatpack.pipes.planning.plan import plan_packs
from neatpack.pipes.reading.media import SampleError
from neatpack.pipes.reading.read import JsonlSource, RecordError
from neatpack.pipes.testing.tiny import load_tiny_processor

pytestmark = [pytest.mark.badinput, pytest.mark.timeout(120)]

BY_NAME = {c.name: c for c in CASES}
BAD = [c.name for c in CASES if c.kind == "bad"]
OK = [c.name for c in CASES if c.kind == "ok"]
LEDGER_LISTS = ("consumed", "padded", "tail_dropped", "dropped", "failed", "overlong")


@pytest.fixture(autouse=True)
def _bomb_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", BOMB_LIMIT)


@pytest.fixture(scope="module")
def processor() -> Any:
    return load_tiny_processor("qwen2_vl")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Case]]:
    root = tmp_path_factory.mktemp("bad")
    return root, write_bad_corpus(root)


def _graph(root: Path, processor: Any, **kw: Any) -> Any:
    cfg = NeatVLMConfig(
        pack_size=kw.pop("pack_size", 2048), media_root=str(root / "media"), shuffle=False,
        tail="drop", **kw,
    )  # fmt: skip
    return neat_vlm_graph(root / "data.jsonl", processor, config=cfg)


def _names_the_record(message: str, case: Case) -> bool:
    sid = case.sample_id
    return bool(
        re.search(rf"sample_id={sid}\b", message)
        or re.search(rf"line {sid + 1}\b", message)
        or re.search(rf"samples? \[?[\d, ]*\b{sid}\b", message)
    )


# -- each case through the real components ------------------------------------------------
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_case_through_reader_estimator_tokenizer(
    name: str, corpus: tuple[Path, list[Case]], processor: Any
) -> None:
    root, cases = corpus
    case = next(c for c in cases if c.name == name)
    source = JsonlSource(root / "data.jsonl", media_root=root / "media")
    estimator = LengthEstimator.from_processor(processor)
    stage, error = None, None
    try:
        stage = "read"
        record = source[case.sample_id]
        stage = "estimate"
        total, visual = estimator.estimate(record)
        stage = "tokenize"
        sample = None if case.kind == "overlong" else tokenize_conversation(record, processor)
        stage = None
    except (RecordError, SampleError) as exc:
        error = exc
    if case.kind == "bad":
        assert stage == case.stage, f"{name}: refused at {stage}, expected at {case.stage}"
        assert error is not None
        assert re.search(case.error, str(error)), str(error)
        assert _names_the_record(str(error), case), str(error)
        if case.stage == "tokenize":
            assert isinstance(error, SampleError)
            assert error.reason in (case.reason, "corrupt_image")
        return
    assert stage is None, f"{name} must work, but {stage} raised {error}"
    if case.kind == "overlong":
        assert total > 100_000  # a 3 MiB line: the plan refuses it below
        with pytest.raises(ValueError, match=case.error) as info:
            plan_packs(np.asarray([10, total]), 4096)
        assert "sample 1 (length" in str(info.value)
        assert plan_packs(np.asarray([10, total]), 4096, overlong="drop").dropped_ids.tolist() == [
            1
        ]
        return
    assert sample is not None
    trained = sample["labels"] != -100
    assert trained.any(), f"{name}: nothing to train on"
    if b'"image"' in case.line:
        assert sample["image_grid_thw"].shape[0] == 1
        assert visual > 0
        assert torch.isfinite(sample["pixel_values"]).all()
    if case.kind == "overflow":
        assert total < 100 < len(sample["input_ids"]), "the overflow case needs a low estimate"


def test_cmyk_and_16bit_images_keep_their_content(corpus: tuple[Path, list[Case]]) -> None:
    from neatpack.pipes.reading.media import load_image

    root, _ = corpus
    grey = load_image(str(root / "media" / "grey16.png"), sample_id=3)
    values = np.asarray(grey)
    assert grey.mode == "RGB"
    assert values.min() < 100
    assert values.max() > 150
    cmyk = load_image(str(root / "media" / "cmyk.jpg"), sample_id=2)
    assert cmyk.mode == "RGB"
    assert np.asarray(cmyk).std(axis=(0, 1)).max() < 5


# -- end to end: raise names the record --------------------------------------------------
@pytest.mark.parametrize("name", [*BAD, "huge_line", "overflow"])
def test_graph_raise_names_the_record_and_the_fix(
    name: str, tmp_path: Path, processor: Any
) -> None:
    _ok, case = write_bad_corpus(tmp_path, ["ok_text", name])
    policies = {"on_bad_sample": "raise", "overlong": "raise", "overflow": "raise"}
    assert case.outcome(**policies) == "raise"
    # An estimate short of the real length (the overflow case lies in _text_tokens) exists in
    # estimate mode only: the default exact index knows the real length (next test).
    mode = {"estimate_mode": "estimate"} if case.kind == "overflow" else {}
    # RecordError, SampleError, the plan's and the materializer's errors: ValueError subclasses
    with pytest.raises(ValueError, match=case.error) as info:
        list(_graph(tmp_path, processor, pack_size=512, **policies, **mode))
    message = str(info.value)
    assert re.search(case.error, message), message
    assert _names_the_record(message, case), message


def test_default_exact_index_refuses_the_overflow_case_at_plan_time(
    tmp_path: Path, processor: Any
) -> None:
    """The record whose _text_tokens understate it overflows its pack in estimate mode; the
    default exact index measures it, so the plan names it as overlong before any pack."""
    _ok, case = write_bad_corpus(tmp_path, ["ok_text", "overflow"])
    with pytest.raises(ValueError, match=r"text: 1 sample, \d+ tokens.*samples \[1\]"):
        _graph(tmp_path, processor, pack_size=512, overflow="raise")  # at build, before a batch
    with pytest.warns(UserWarning, match="longer than pack_size=512"):
        loader = _graph(tmp_path, processor, pack_size=512, overlong="drop", overflow="raise")
    list(loader)
    assert loader.ledgers[0].overlong == [case.sample_id]
    assert loader.ledgers[0].truncated == []


# -- end to end: skip / replace count every bad record ------------------------------------
def _ledger_partition(ledger: EpochLedger, n: int) -> dict[int, str]:
    """Each id in 0..n-1 -> the one ledger list naming it (fails on duplicates / absences)."""
    where: dict[int, str] = {}
    for key in LEDGER_LISTS:
        ids = getattr(ledger, key)
        dupes = [i for i, c in Counter(ids).items() if c > 1 and key == "consumed"]
        assert not dupes, f"consumed more than once: {dupes}"
        for i in set(ids):
            if key == "failed" and i in where:  # a failed replacement draw of another pack
                continue
            assert i not in where, f"sample {i} is in both {where[i]!r} and {key!r}"
            where[i] = key
    missing = sorted(set(range(n)) - where.keys())
    assert not missing, f"samples in no ledger list (dropped silently): {missing}"
    return where


@pytest.mark.parametrize("workers", [0, 2])
def test_graph_skip_counts_every_bad_record(workers: int, tmp_path: Path, processor: Any) -> None:
    names = [c.name for c in CASES if c.kind != "overflow"]
    cases = write_bad_corpus(tmp_path, names)
    policies = {"on_bad_sample": "skip", "overlong": "drop", "overflow": "truncate"}
    loader = _graph(tmp_path, processor, num_workers=workers, **policies)
    batches = list(loader)
    assert batches, "no batch at all"
    where = _ledger_partition(loader.ledgers[0], len(cases))
    for case in cases:
        assert where[case.sample_id] == case.outcome(**policies), case.name
    assert loader.ledgers[0].replacements == []
    assert loader.ledgers[0].truncated == []


def test_graph_replace_stands_in_for_every_bad_record(tmp_path: Path, processor: Any) -> None:
    # Enough good records that 10 replacement draws in a row never all hit bad ones.
    cases = write_bad_corpus(tmp_path, [*BAD, *(OK * 12)])
    bad = {c.sample_id for c in cases if c.kind == "bad"}
    loader = _graph(tmp_path, processor, pack_size=2048, packing_ratio=0.5,
                    on_bad_sample="replace")  # fmt: skip
    list(loader)
    ledger = loader.ledgers[0]
    where = _ledger_partition(ledger, len(cases))
    assert {i for i, w in where.items() if w == "failed"} == bad
    assert {i for i, w in where.items() if w == "consumed"} == set(range(len(cases))) - bad
    assert len(ledger.replacements) == len(bad)
    assert not set(ledger.replacements) & bad
    assert ledger.dropped == []


# -- end to end: overlong and overflow policies ---------------------------------------------
@pytest.mark.parametrize("overlong", ["drop"])
def test_graph_overlong_drop_is_in_the_ledger(
    overlong: str, tmp_path: Path, processor: Any
) -> None:
    cases = write_bad_corpus(tmp_path, ["ok_text", "huge_line", "ok_image"])
    loader = _graph(tmp_path, processor, overlong=overlong)
    list(loader)
    assert _ledger_partition(loader.ledgers[0], 3) == {0: "consumed", 1: "overlong", 2: "consumed"}
    assert cases[1].outcome(on_bad_sample="raise", overlong="drop", overflow="raise") == "overlong"


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_graph_overflow_policy_is_counted(overflow: str, tmp_path: Path, processor: Any) -> None:
    (case,) = write_bad_corpus(tmp_path, ["overflow"])
    loader = _graph(tmp_path, processor, pack_size=512, overflow=overflow, estimate_mode="estimate")
    batches = list(loader)
    ledger = loader.ledgers[0]
    want = case.outcome(on_bad_sample="raise", overlong="raise", overflow=overflow)
    assert getattr(ledger, want) == [0]
    if overflow == "truncate":
        assert ledger.consumed == [0]
        assert batches[0]["input_ids"].shape[1] == 512
    else:  # the pack is empty: one pad token stands in, with no labels, so the step happens
        assert ledger.consumed == []
        assert ledger.dropped == [0]
        assert (batches[0]["labels"] == -100).all()
        assert batches[0]["sample_ids"] == [[]]


def test_materialize_overflow_raise_names_the_pack(tmp_path: Path, processor: Any) -> None:
    (case,) = write_bad_corpus(tmp_path, ["overflow"])
    source = JsonlSource(tmp_path / "data.jsonl", media_root=tmp_path / "media")
    with pytest.raises(ValueError, match=case.error):
        materialize_pack(source, [0], processor, MaterializeConfig(pack_size=512))


# -- the reader on its own ---------------------------------------------------------------
def test_blank_lines_are_counted_and_errors_quote_file_lines(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "a"}]}\n\n   \n{oops\n')
    source = JsonlSource(path)
    assert len(source) == 2
    assert source.blank_lines == 2
    with pytest.raises(RecordError, match=r"line 4 \(sample_id=1\).*fix or delete that line"):
        source[1]


def test_missing_data_file_says_what_to_pass(tmp_path: Path, processor: Any) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist: pass a \.jsonl or \.json"):
        neat_vlm_graph(tmp_path / "nope.jsonl", processor)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"input_ids": [5, "a", 7]}, r"sample_id=1: input_ids must be a flat list of ints.*'a'"),
        ({"input_ids": [5, float("nan"), 7]}, r"sample_id=1: input_ids .* got nan"),
        ({"input_ids": [5, 2**70, 7]}, r"sample_id=1: input_ids .* got 1180591620717411303424"),
        ({"input_ids": [5, -3, 7]}, r"sample_id=1: input_ids has -3 at position 1; .* >= 0"),
        ({"input_ids": [5, 6, 7], "labels": [6, -7, 8]}, r"sample_id=1: labels has -7 .* -100"),
    ],
)
def test_llm_graph_names_the_record_with_a_bad_token_id(
    bad: dict[str, Any], message: str, tmp_path: Path
) -> None:
    """A string, NaN, 2**70 or negative id in a pre-tokenized JSONL file: one error naming the
    record and the fix when the graph is built, not torch's overflow or a device-side index
    error; -100 stays a valid label."""
    import json

    from neatpack.graphs.neat_llm import NeatLLMConfig, neat_llm_graph

    good = {"input_ids": [1, 2, 3, 4], "labels": [2, 3, -100, 4]}
    path = tmp_path / "tokens.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, bad, good)))
    with pytest.raises(ValueError, match=message):
        neat_llm_graph(path, config=NeatLLMConfig(pack_size=16))
    fixed = tmp_path / "fixed.jsonl"
    fixed.write_text("".join(json.dumps(good) + "\n" for _ in range(3)))
    batch = next(iter(neat_llm_graph(fixed, config=NeatLLMConfig(pack_size=16))))
    assert int(batch["labels"].eq(-100).sum()) > 0


def test_graph_missing_image_error_names_options_that_exist(tmp_path: Path, processor: Any) -> None:
    """Issue 25: the graph's missing-image error suggested on_missing_media='fallback', which no
    graph config has. It now names the config's on_bad_sample, and following it works: the
    sample is left out and counted by id."""
    import dataclasses
    import json

    from neatpack.graphs.grouped import GroupedConfig, grouped_vlm_graph
    from neatpack.pipes.planning.sampler import LengthGroupedSampler

    def record(image: str | None) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": "what is in the picture?"}]
        if image:
            content.insert(0, {"type": "image", "image": image})
        return {"messages": [{"role": "user", "content": content},
                             {"role": "assistant", "content": "a cat"}]}  # fmt: skip

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(record(i)) + "\n" for i in (None, "gone.png", None)))
    cfg = NeatVLMConfig(pack_size=1024, media_root=str(tmp_path))
    for mode in ("exact", "estimate"):
        with pytest.raises(RecordError) as info:
            neat_vlm_graph(path, processor, config=dataclasses.replace(cfg, estimate_mode=mode))
        message = str(info.value)
        assert message.startswith("sample_id=1: image missing: ")
        assert "gone.png" in message
        assert "on_bad_sample='skip'" in message
        assert "media_root" in message
        assert "on_missing_media" not in message
    skip = dataclasses.replace(cfg, on_bad_sample="skip")
    loader = neat_vlm_graph(path, processor, config=skip)
    assert sorted(i for b in loader for row in b["sample_ids"] for i in row) == [0, 2]
    assert loader.ledgers[0].failed == [1]
    # the other user paths name their own options
    with pytest.raises(RecordError, match=r"sample_id=1: .*media_root\)$"):
        grouped_vlm_graph(path, processor, config=GroupedConfig(media_root=str(tmp_path)))
    with pytest.raises(RecordError, match=r"sample_id=1: .*pass estimator=LengthEstimator"):
        LengthGroupedSampler(JsonlSource(path, media_root=tmp_path), processor=processor)


def test_max_record_bytes_refuses_by_id_and_keys_the_cached_index(
    tmp_path: Path, processor: Any
) -> None:
    """A line over ``NeatVLMConfig.max_record_bytes`` is never parsed or tokenized: skipped
    and counted under ``on_bad_sample="skip"``. Lifting the limit on the same ``cache_dir``
    measures it anew instead of reusing the index built while it was refused (length 0)."""
    (tmp_path / "media").mkdir()
    lines = [_msgs_line("Hi."), _msgs_line("word " * 600), _msgs_line("Bye.")]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    assert len(lines[1]) > 2000 > max(len(lines[0]), len(lines[2]))
    cache = str(tmp_path / "cache")
    limited = _graph(tmp_path, processor, on_bad_sample="skip", max_record_bytes=2000,
                     cache_dir=cache)  # fmt: skip
    list(limited)
    assert _ledger_partition(limited.ledgers[0], 3) == {0: "consumed", 1: "failed", 2: "consumed"}
    lifted = _graph(tmp_path, processor, on_bad_sample="skip", max_record_bytes=None,
                    cache_dir=cache)  # fmt: skip
    batches = list(lifted)
    assert _ledger_partition(lifted.ledgers[0], 3) == dict.fromkeys(range(3), "consumed")
    assert lifted.ledgers[0].truncated == []
    metas = [m for b in batches for m in b["packs"]]
    assert sum(m["real_tokens"] for m in metas) > 600  # the long one is in
    # exact mode: the plan's lengths are the real ones (a reused index would say 0 for it)
    assert [m["estimated_tokens"] for m in metas] == [m["real_tokens"] for m in metas]
    with pytest.raises(RecordError, match=r"line 2 \(sample_id=1\) is \d+ bytes, over max_rec"):
        list(_graph(tmp_path, processor, max_record_bytes=2000, cache_dir=cache))


def _msgs_line(user: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": user},
                                    {"role": "assistant", "content": "Fine."}]})  # fmt: skip
