"""The length index's fast parse and estimate give exactly the old results.

orjson (when installed) parses the JSONL lines; anything it refuses or would change (integers
past 64 bits become floats there) goes to ``json``. The fast estimate must equal the full path
(``estimate_sample`` on the converted Record) for every record of a generated corpus."""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neatpack.pipes import read as read_mod
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.indexing.media_tokens import ImageTokenConfig
from neatpack.pipes.reading._record import paused_gc
from neatpack.pipes.reading.read import JsonlSource, _parse_block, loads_exact
from neatpack.pipes.testing.synth import write_corpus

EDGE_LINES = [
    b'{"a": 123456789012345678901234567890}',  # past 64 bits: orjson would give a float
    b'{"a": -9999999999999999999}',  # 19 digits, below int64
    b'{"a": 18446744073709551615, "b": -9223372036854775808}',  # still exact in orjson
    b'{"a": "id 1234567890123456789012"}',  # a long digit run inside a string
    b'{"a": NaN, "b": Infinity}',  # json only
    b'{"a": 1e400}',  # json: inf
    b'{"a": "\\ud800"}',  # a lone surrogate: json only
    b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 BOM: json only
    b'{"a": 1, "a": 2, "b": [1.5, -0.0, 5e-324]}',  # duplicate keys: the last wins in both
    b'{"a": "\\u00e9\xc3\xa9\\ud83d\\ude00"}',
    b"{broken",
    b'{"a": "\xff"}',  # invalid UTF-8
    b"[1, 2]",
    b'"text"',
    b'  {"a": 1}  \r',
]


def json_or_none(line: bytes) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def same(a: Any, b: Any) -> bool:
    """Equal with types and key order (1 == 1.0 and nan != nan do not pass as equal here)."""
    return json.dumps(a, allow_nan=True) == json.dumps(b, allow_nan=True) and repr(a) == repr(b)


@pytest.fixture(params=["orjson", "json"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "json":
        monkeypatch.setattr(read_mod, "_fast_loads", None)  # orjson not installed
    elif read_mod._fast_loads is None:
        pytest.skip("orjson is not installed")
    return str(request.param)


def test_edge_lines_parse_like_json(tmp_path: Path, parser: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(EDGE_LINES) + b"\n")
    src = JsonlSource(path)
    got = list(src.iter_raw(0, len(src)))
    assert len(got) == len(EDGE_LINES)
    for line, value in zip(EDGE_LINES, got, strict=True):
        assert same(value, json_or_none(line)), line
        if value is not None:
            assert same(loads_exact(line), value)


def test_only_real_long_digit_runs_go_to_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Image sizes (``[1234, 1156]``) put digits six bytes apart; the sampled scan flagged
    such lines, and one in six lines of a metadata corpus went to ``json`` (4x slower).
    Only a real run of 19+ digits does now, wherever it starts in the block."""
    if read_mod._fast_loads is None:
        pytest.skip("orjson is not installed")
    rnd = random.Random(0)
    lines = [
        json.dumps({"id": i, "images_meta": [[rnd.randint(64, 1600), rnd.randint(64, 1600)]
                                             for _ in range(4)]}).encode()
        for i in range(600)
    ]  # fmt: skip
    long_at = {7: 10**19 + 7, 301: -(10**25), 599: 12345678901234567890}
    for i, v in long_at.items():  # past 64 bits, at other offsets in the block
        lines[i] = lines[i][:-1] + b', "x": ' + str(v).encode() + b"}"
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    calls: list[bytes] = []
    real = read_mod.json.loads

    def spy(data: Any, **kw: Any) -> Any:
        calls.append(bytes(data))
        return real(data, **kw)

    monkeypatch.setattr(read_mod.json, "loads", spy)
    src = JsonlSource(path)
    got = list(src.iter_raw(0, len(src)))
    assert sorted(calls) == sorted(lines[i] for i in long_at)
    assert [got[i]["x"] for i in long_at] == list(long_at.values())  # exact ints
    assert all(same(g, json.loads(ln)) for g, ln in zip(got, lines, strict=True))
    # every start offset of a 19-digit run is found (one byte shifted each time)
    for pad in range(12):
        blob = b" " * pad + b"1234567890123456789" + b" " * 5
        assert read_mod._long_digit_runs(blob).size, pad
        assert not read_mod._long_digit_runs(blob.replace(b"9 ", b"  ")).size, pad


@settings(max_examples=60)
@given(
    st.lists(
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
            lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids),
            max_leaves=8,
        ),
        min_size=1,
        max_size=6,
    )
)
def test_random_values_parse_like_json(values: list[Any]) -> None:
    """Any JSON value (big integers, NaN, odd text included) reads back as ``json`` reads it."""
    lines = [json.dumps(v).encode() for v in values]
    for line in lines:
        assert same(loads_exact(line), json.loads(line))
    block = b"\n".join(lines)
    ends = np.cumsum([len(x) + 1 for x in lines]) - 1
    parsed = _parse_block(block, ends - [len(x) for x in lines], ends)
    assert all(same(p, json.loads(x)) for p, x in zip(parsed, lines, strict=True))


def full_path(src: JsonlSource, est: LengthEstimator) -> tuple[np.ndarray, np.ndarray]:
    pairs = [est.estimate_sample(src[i])[:2] for i in range(len(src))]
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def test_index_equals_full_path_on_synth_corpus(tmp_path: Path, parser: str) -> None:
    path = write_corpus(tmp_path, num_samples=120, seed=5, with_meta=0.8)
    src = JsonlSource(path, media_root=tmp_path / "media")
    est = LengthEstimator(image=ImageTokenConfig())
    index = build_length_index(src, est, progress=False)
    total, visual = full_path(src, est)
    assert np.array_equal(index.total, total)
    assert np.array_equal(index.visual, visual)


def test_index_equals_full_path_on_mixed_records(tmp_path: Path, parser: str) -> None:
    """LLaVA and messages records, systems, multi-image, nested meta, text tokens, plus lines
    the fast path must hand over (bad meta, floats, big integers)."""
    rnd = random.Random(7)
    rows: list[Any] = []
    for i in range(600):
        n = rnd.choice([0, 1, 1, 2, 3])
        meta = [[rnd.randint(28, 3000), rnd.randint(28, 3000)] for _ in range(n)]
        text = "".join(rnd.choices("ab <\n", k=rnd.randint(0, 60)))
        if i % 3 == 0:
            turns = [
                {"from": "human", "value": "<image>\n" * n + text},
                {"from": "gpt", "value": text},
            ]
            if rnd.random() < 0.3:
                turns.insert(0, {"from": "system", "value": "sys\n"})
            row: dict[str, Any] = {"conversations": turns, "images": [f"{j}.jpg" for j in range(n)]}
        else:
            content: list[Any] = [{"type": "image", "image": f"{j}.jpg"} for j in range(n)]
            content.append({"type": "text", "text": text} if i % 2 else text)
            row = {"messages": [{"role": "user", "content": content},
                                {"role": "assistant", "content": text}]}  # fmt: skip
            if rnd.random() < 0.2:
                row["messages"].insert(0, {"role": "system", "content": "be brief"})
        if n:
            if rnd.random() < 0.2:
                row["mm_inputs_meta"] = {"images_meta": meta}
            else:
                row["images_meta"] = meta
        if rnd.random() < 0.2:
            row["_text_tokens"] = rnd.choice([5, 123456789, 7.0, 0])
        rows.append(row)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = JsonlSource(path)
    est = LengthEstimator(image=ImageTokenConfig(), on_missing_media="fallback")
    index = build_length_index(src, est, progress=False)
    total, visual = full_path(src, est)
    assert np.array_equal(index.total, total)
    assert np.array_equal(index.visual, visual)


@pytest.mark.parametrize("initially", [True, False])
def test_paused_gc_restores_the_collector(initially: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if initially else gc.disable)()
        with paused_gc():
            assert not gc.isenabled()
        assert gc.isenabled() == initially
        with pytest.raises(KeyError), paused_gc():
            raise KeyError("boom")
        assert gc.isenabled() == initially
    finally:
        (gc.enable if was else gc.disable)()
