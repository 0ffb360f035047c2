"""Record sources: JSONL offset index, conversions, media-root confinement, bad input."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neatpack.pipes.reading.read import (
    HFDatasetSource,
    JsonListSource,
    JsonlSource,
    RecordError,
    SequenceSource,
    to_record,
)

LLAVA = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "<image>\nWhat is this?\n<image>"},
        {"from": "gpt", "value": "Two cats."},
    ],
    "images": ["a.jpg", "sub/b.png"],
    "images_meta": [[480, 640], None],
}
MESSAGES = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}


def write_jsonl(path: Path, rows: list[Any], sep: str = "\n") -> Path:
    path.write_text(sep.join(r if isinstance(r, str) else json.dumps(r) for r in rows) + sep)
    return path


def test_llava_conversion_literal(tmp_path: Path) -> None:
    rec = SequenceSource([LLAVA], media_root=tmp_path)[0]
    root = os.path.realpath(tmp_path)
    assert rec == {
        "sample_id": 0,
        "conversation": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": f"{root}/a.jpg"},
                    {"type": "text", "text": "What is this?"},
                    {"type": "image", "image": f"{root}/sub/b.png"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Two cats."}]},
        ],
        "images_meta": [[480, 640], None],
    }


def test_llava_without_placeholders_puts_media_first_in_first_user_turn() -> None:
    raw = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "A"}],
           "image": "x.jpg"}  # fmt: skip
    content = to_record(raw, 0, None)["conversation"][0]["content"]
    assert content == [{"type": "image", "image": "x.jpg"}, {"type": "text", "text": "Hi"}]


def test_messages_and_conversation_keys_and_blocks() -> None:
    raw = {"conversation": [{"role": "user", "content": [
        "plain", {"type": "text", "text": "t"}, {"type": "video", "path": "v.mp4"}]}],
        "mm_inputs_meta": {"videos_meta": [[8, 64, 64, 4.0, 2.0]]}, "_text_tokens": 7}  # fmt: skip
    rec = to_record(raw, 4, None)
    assert rec["conversation"][0]["content"] == [
        {"type": "text", "text": "plain"},
        {"type": "text", "text": "t"},
        {"type": "video", "video": "v.mp4"},
    ]
    assert rec["videos_meta"] == [[8, 64, 64, 4.0, 2.0]]
    assert rec["_text_tokens"] == 7
    assert to_record(MESSAGES, 1, None)["conversation"][1] == {
        "role": "assistant", "content": [{"type": "text", "text": "Yo"}]}  # fmt: skip


def test_jsonl_random_access_blank_lines_and_line_numbers(tmp_path: Path) -> None:
    rows = [MESSAGES, "", "   ", LLAVA, "\t", {"messages": [{"role": "user", "content": "é✓"}]}]
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", rows))
    assert len(src) == 3
    assert src.blank_lines == 3
    assert [src.line_number(i) for i in range(3)] == [1, 4, 6]
    assert src[2]["conversation"][0]["content"][0]["text"] == "é✓"  # multibyte offsets
    assert src[1]["sample_id"] == 1
    assert src[0] == to_record(MESSAGES, 0, None)
    with pytest.raises(IndexError, match="sample_id=3"):
        src[3]


def test_jsonl_crlf_and_no_trailing_newline(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"messages": [{"role": "user", "content": "a"}]}\r\n'
                  b'{"messages": [{"role": "user", "content": "b"}]}')  # fmt: skip
    src = JsonlSource(p)
    assert len(src) == 2
    assert [src[i]["conversation"][0]["content"][0]["text"] for i in range(2)] == ["a", "b"]


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "e.jsonl"
    p.write_bytes(b"")
    assert len(JsonlSource(p)) == 0


@given(
    texts=st.lists(st.text(max_size=30), min_size=0, max_size=20),
    blanks=st.lists(st.booleans(), min_size=20, max_size=20),
)
def test_jsonl_matches_in_memory_sources(texts: list[str], blanks: list[bool]) -> None:
    import tempfile

    raws = [{"messages": [{"role": "user", "content": t}]} for t in texts]
    rows: list[Any] = []
    for r, blank in zip(raws, blanks, strict=False):
        rows += ["", r] if blank else [r]
    with tempfile.TemporaryDirectory() as d:
        src = JsonlSource(write_jsonl(Path(d) / "d.jsonl", rows))
        (Path(d) / "l.json").write_text(json.dumps(raws))
        lst = JsonListSource(Path(d) / "l.json")
        seq = SequenceSource(raws)
        assert len(src) == len(lst) == len(seq) == len(raws)
        for i in range(len(raws)):
            assert src[i] == lst[i] == seq[i] == to_record(raws[i], i, None)
        assert list(src.iter_raw(0, len(src))) == raws


def test_pickle_reopens_lazily(tmp_path: Path) -> None:
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", [MESSAGES, LLAVA]))
    src[0]  # opens a descriptor in this process
    clone = pickle.loads(pickle.dumps(src))
    assert clone._fd is None
    assert clone[1] == src[1]


def test_fingerprint_changes_with_content(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", [MESSAGES])
    before = JsonlSource(p).content_fingerprint()
    assert JsonlSource(p).content_fingerprint() == before
    p.write_text(p.read_text().replace("Hi", "Ho"))  # same size, one byte differs
    assert JsonlSource(p).content_fingerprint() != before
    seq = SequenceSource([MESSAGES]).content_fingerprint()
    assert SequenceSource([LLAVA]).content_fingerprint() != seq


def test_parsing_is_lazy(tmp_path: Path) -> None:
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", [MESSAGES, "{broken", MESSAGES]))
    assert len(src) == 3
    assert src[2]["sample_id"] == 2
    assert list(src.iter_raw(0, 3))[1] is None


@pytest.mark.badinput
def test_malformed_json_names_file_line_and_sample(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", [MESSAGES, "", '{"messages": [}'])
    src = JsonlSource(p)
    with pytest.raises(RecordError, match=r"d\.jsonl line 3 \(sample_id=1\)"):
        src[1]


@pytest.mark.badinput
@pytest.mark.parametrize(
    "raw",
    [
        {"messages": []},
        {"conversation": None},
        {"conversations": []},
        {"text": "no conversation"},
    ],
)
def test_empty_or_missing_conversation_names_sample(raw: dict[str, Any]) -> None:
    with pytest.raises(RecordError, match="sample_id=9"):
        to_record(raw, 9, None)


@pytest.mark.badinput
@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "role='robot'"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "'alien'"),
        ({"conversations": [{"from": "human", "value": "<image><image>"}], "image": "a"}, "more"),
        ({"conversations": [{"from": "human", "value": "<image>"}], "images": ["a", "b"]}, "1 <"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "'audio'"),
        ({"messages": [{"role": "user", "content": [3]}]}, "int"),
    ],
)
def test_bad_records_name_sample(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(RecordError, match="sample_id=5") as e:
        to_record(raw, 5, None)
    assert match in str(e.value)


@pytest.mark.badinput
def test_media_path_escaping_root_with_dotdot(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    raw = {"conversations": [{"from": "human", "value": "<image>x"}], "image": "../secret.jpg"}
    with pytest.raises(RecordError, match=r"sample_id=2: media path '\.\./secret\.jpg'"):
        SequenceSource([MESSAGES, MESSAGES, raw], media_root=root)[2]
    absolute = {"messages": [{"role": "user", "content": [{"type": "image", "image": "/etc/x"}]}]}
    with pytest.raises(RecordError, match="outside the media root"):
        SequenceSource([absolute], media_root=root)[0]
    inside = {"messages": [{"role": "user", "content": [
        {"type": "image", "image": str(root / "ok.jpg")}]}]}  # fmt: skip
    img = SequenceSource([inside], media_root=root)[0]["conversation"][0]["content"][0]
    assert img["image"] == os.path.join(os.path.realpath(root), "ok.jpg")


@pytest.mark.badinput
def test_media_path_escaping_root_through_symlink(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (tmp_path / "outside.jpg").write_bytes(b"x")
    (root / "link.jpg").symlink_to(tmp_path / "outside.jpg")
    (root / "dir").symlink_to(tmp_path)
    for path in ("link.jpg", "dir/outside.jpg"):
        raw = {"messages": [{"role": "user", "content": [{"type": "image", "image": path}]}]}
        with pytest.raises(RecordError, match=r"sample_id=0.*outside the media root"):
            SequenceSource([raw], media_root=root)[0]


def test_json_list_source_rejects_non_list(tmp_path: Path) -> None:
    p = tmp_path / "d.json"
    p.write_text(json.dumps(MESSAGES))
    with pytest.raises(RecordError, match="expects a JSON list"):
        JsonListSource(p)


def test_hf_dataset_source() -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}])
    src = HFDatasetSource(ds)
    assert len(src) == 1
    assert src[0]["conversation"][0]["content"][0]["text"] == "hi"
    assert len(src.content_fingerprint()) == 64


def test_a_video_blocks_fps_survives_the_reader(tmp_path: Path) -> None:
    """A JSONL video block's ``fps`` (the rate its timestamps use) reaches the Record, and so the
    tokenizers, as it does for an in-memory Record; other extra keys of a media block are
    dropped."""
    from neatpack.pipes.reading._conversation import parse_conversation

    row = {"messages": [{"role": "user", "content": [
        {"type": "video", "video": "v.mp4", "fps": 2.5, "note": "x"},
        {"type": "image", "image": "a.jpg", "fps": 9}]},
        {"role": "assistant", "content": "a dog"}]}  # fmt: skip
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    rec = JsonlSource(path, media_root=tmp_path)[0]
    root = os.path.realpath(tmp_path)
    assert rec["conversation"][0]["content"] == [
        {"type": "video", "video": f"{root}/v.mp4", "fps": 2.5},
        {"type": "image", "image": f"{root}/a.jpg"},
    ]
    assert parse_conversation(rec, ()).video_fps == [2.5]


def test_jsonl_line_index_is_cached_by_file_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``cache_dir`` the line index and content hash of an unchanged file come from the
    cache (the file is not read again); any write to the file, even one that keeps its size
    and sets its mtime back, changes its ctime and so is read afresh."""
    import hashlib
    import time

    from neatpack.pipes import read as read_mod

    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"t{i}"}]}) for i in range(6)]
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")  # a blank line
    cache = tmp_path / "cache"
    first = JsonlSource(path, cache_dir=cache)
    assert len(list(cache.glob("jsonl-index-*.npz"))) == 1
    scans: list[Path] = []
    real = read_mod._index_jsonl

    def counting(p: Path) -> Any:
        scans.append(p)
        return real(p)

    monkeypatch.setattr(read_mod, "_index_jsonl", counting)
    again = JsonlSource(path, cache_dir=cache)
    assert scans == []  # from the cache
    assert again.content_fingerprint() == first.content_fingerprint()
    assert again.content_fingerprint() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert [again.raw(i) for i in range(6)] == [json.loads(x) for x in lines]
    assert again.line_number(3) == 5  # the blank line kept its place
    assert again.blank_lines == 1

    st = os.stat(path)
    time.sleep(0.01)
    path.write_text(path.read_text().replace("t1", "X1"))  # same size, new content
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back: ctime still moved
    changed = JsonlSource(path, cache_dir=cache)
    assert scans == [path]
    assert changed.content_fingerprint() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert changed.content_fingerprint() != first.content_fingerprint()
    assert changed.raw(1)["messages"][0]["content"] == "X1"

    for f in cache.glob("jsonl-index-*.npz"):
        f.write_bytes(b"torn")  # a torn cache file: rebuilt, not trusted
    JsonlSource(path, cache_dir=cache)
    assert len(scans) == 2
    JsonlSource(path, cache_dir=cache)
    assert len(scans) == 2  # and cached again


def test_the_graph_reads_an_unchanged_jsonl_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``neat_vlm_graph`` with a ``cache_dir``: the second start takes the line index
    and hash from the cache (the file is not scanned again) and plans the same packs."""
    from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
    from neatpack.pipes import read as read_mod
    from neatpack.pipes.testing.synth import write_corpus
    from neatpack.pipes.testing.tiny import load_tiny_processor

    data = write_corpus(tmp_path / "c", num_samples=30, seed=1)
    cfg = NeatVLMConfig(pack_size=2048, media_root=str(tmp_path / "c" / "media"),
                        cache_dir=str(tmp_path / "cache"))  # fmt: skip
    proc = load_tiny_processor("qwen2_vl")
    scans: list[Path] = []
    real = read_mod._index_jsonl

    def counting(p: Path) -> Any:
        scans.append(p)
        return real(p)

    monkeypatch.setattr(read_mod, "_index_jsonl", counting)
    first = neat_vlm_graph(data, proc, config=cfg)
    again = neat_vlm_graph(data, proc, config=cfg)
    assert scans == [Path(data)]
    plan = [first.source.plan_for(1).pack(k) for k in range(len(first))]
    assert plan == [again.source.plan_for(1).pack(k) for k in range(len(again))]
