"""Audio blocks through the standard readers (``pipes/reading/_record.py``): JSONL / JSON list /
in-memory
records with audio come out as Records with paths resolved against, and confined to, the media
root; LLaVA form takes ``<audio>`` + ``audio(s)``; the length index's fast path leaves audio to the
full path; and one JSONL audio record tokenizes through the real ``qwen_omni`` handler."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.omni_records import RATE, _wave_form, write_wav
from support.tiny import load_tiny_qwen_omni_processor

from neatpack.pipes.families import tokenize_with_handler
from neatpack.pipes.families.qwen_omni import qwen_omni_estimate
from neatpack.pipes.reading._record import raw_text_stats
from neatpack.pipes.reading.media import SampleError
from neatpack.pipes.reading.read import (
    JsonListSource,
    JsonlSource,
    RecordError,
    SequenceSource,
    to_record,
)

MESSAGES = {
    "messages": [
        {"role": "user", "content": [
            {"type": "audio", "audio": "clips/a.wav", "sampling_rate": RATE},
            {"audio": "b.wav"},  # untyped: the key names the kind
            {"type": "audio", "path": "clips/c.wav"},
            {"type": "text", "text": "What do you hear?"}]},
        {"role": "assistant", "content": "Three tones."}],
    "audios_meta": [0.5, None, 1.25],
}  # fmt: skip
LLAVA = {
    "conversations": [
        {"from": "human", "value": "<audio>\nThen <image> and <audio>"},
        {"from": "gpt", "value": "ok"},
    ],
    "audios": ["a.wav", "clips/c.wav"],
    "image": "p.jpg",
}


def _user(record: dict[str, Any]) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = record["conversation"][0]["content"]
    return content


@pytest.mark.parametrize("reader", ["jsonl", "json_list", "memory"])
def test_audio_paths_are_resolved_in_every_reader(tmp_path: Path, reader: str) -> None:
    root = tmp_path / "media"
    (root / "clips").mkdir(parents=True)
    rows = [MESSAGES, LLAVA]
    if reader == "jsonl":
        (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        source: Any = JsonlSource(tmp_path / "d.jsonl", media_root=root)
    elif reader == "json_list":
        (tmp_path / "d.json").write_text(json.dumps(rows))
        source = JsonListSource(tmp_path / "d.json", media_root=root)
    else:
        source = SequenceSource(rows, media_root=root)
    real = os.path.realpath(root)
    msg = source[0]
    assert _user(msg)[:3] == [
        {"type": "audio", "audio": f"{real}/clips/a.wav", "sampling_rate": RATE},
        {"type": "audio", "audio": f"{real}/b.wav"},
        {"type": "audio", "audio": f"{real}/clips/c.wav"},
    ]
    assert msg["audios_meta"] == [0.5, None, 1.25]
    llava = source[1]
    assert _user(llava) == [
        {"type": "audio", "audio": f"{real}/a.wav"},
        {"type": "text", "text": "Then "},
        {"type": "image", "image": f"{real}/p.jpg"},
        {"type": "text", "text": " and "},
        {"type": "audio", "audio": f"{real}/clips/c.wav"},
    ]


def test_llava_audio_without_placeholders_goes_first_in_the_first_user_turn() -> None:
    raw = {"conversations": [{"from": "human", "value": "hi"}], "audio": "x.wav"}
    assert _user(to_record(raw, 0, None)) == [
        {"type": "audio", "audio": "x.wav"},
        {"type": "text", "text": "hi"},
    ]


def test_in_memory_audio_values_pass_through_unchanged(tmp_path: Path) -> None:
    """An array (or a plain list, which the family then refuses) is not a path: no root check."""
    wav = np.zeros(800, np.float32)
    samples = [0.0, 0.1]
    raw = {"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": wav}, {"type": "audio", "audio": samples}]}]}  # fmt: skip
    blocks = _user(SequenceSource([raw], media_root=tmp_path)[0])
    assert blocks[0]["audio"] is wav
    assert blocks[1]["audio"] is samples


@pytest.mark.badinput
@pytest.mark.parametrize("path", ["../out.wav", "/etc/passwd", "link/x.wav"])
def test_an_audio_path_escaping_the_root_is_refused(tmp_path: Path, path: str) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)  # a symlink out of the root
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "audio", "audio": path}]}]},
        {"conversations": [{"from": "human", "value": "<audio>"}], "audio": path},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    source = JsonlSource(tmp_path / "d.jsonl", media_root=root)
    for sid in (0, 1):
        with pytest.raises(RecordError, match=rf"sample_id={sid}: media path .*outside the media"):
            source[sid]


@pytest.mark.badinput
@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "has no 'audio'"),
        ({"conversations": [{"from": "human", "value": "<audio><audio>"}], "audio": "a"}, "more"),
        ({"conversations": [{"from": "human", "value": "<audio>"}], "audios": ["a", "b"]}, "1 <"),
        ({"conversations": [{"from": "gpt", "value": "x"}], "audio": "a"}, "no user turn"),
    ],
)
def test_bad_audio_records_name_the_sample(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(RecordError, match="sample_id=5") as e:
        to_record(raw, 5, None)
    assert match in str(e.value)


def test_the_fast_path_leaves_audio_to_the_full_path() -> None:
    """``raw_text_stats`` counts no audio, so any audio sends the record to ``to_record``; the
    same records without audio keep the fast path."""
    assert raw_text_stats(MESSAGES) is None
    assert raw_text_stats(LLAVA) is None
    text_only = {"conversations": [{"from": "human", "value": "<audio>"}]}
    assert raw_text_stats(text_only) is None  # the full path refuses it: no audio given
    with pytest.raises(RecordError, match="more <audio> placeholders than the 0 audio"):
        to_record(text_only, 0, None)
    plain = {"conversations": [{"from": "human", "value": "<image> hi"}], "image": "p.jpg"}
    assert raw_text_stats(plain) == (3, 0, 1, 0, 1, 0, False)


def _jsonl_audio_record(tmp_path: Path) -> tuple[dict[str, Any], np.ndarray]:
    root = tmp_path / "media"
    root.mkdir()
    tone = _wave_form(random.Random(7), 24000)
    write_wav(root / "tone.wav", tone)
    row = {"messages": [
        {"role": "user", "content": [{"type": "audio", "audio": "tone.wav"},
                                     {"type": "text", "text": "what is it"}]},
        {"role": "assistant", "content": "a tone"}]}  # fmt: skip
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    pcm = np.clip(np.round(tone * 32767), -32768, 32767).astype(np.int16) / 32768.0
    return JsonlSource(tmp_path / "d.jsonl", media_root=root)[0], pcm.astype(np.float32)


def test_a_jsonl_audio_record_tokenizes_through_qwen_omni(tmp_path: Path) -> None:
    """The record read from disk gives the sample the same record with the waveform in memory
    gives, and the handler's length estimate equals its real length."""
    omni = load_tiny_qwen_omni_processor()
    record, pcm = _jsonl_audio_record(tmp_path)
    got = tokenize_with_handler(record, omni)
    in_memory = {**record, "conversation": [
        {**record["conversation"][0], "content": [
            {"type": "audio", "audio": pcm}, *record["conversation"][0]["content"][1:]]},
        record["conversation"][1]]}  # fmt: skip
    want = tokenize_with_handler(in_memory, omni)
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["input_features"], want["input_features"])
    audio_id = omni.tokenizer.convert_tokens_to_ids(omni.audio_token)
    assert int((got["input_ids"] == audio_id).sum()) > 0
    assert qwen_omni_estimate(record, omni) == len(got["input_ids"]) - 1


@pytest.mark.badinput
@pytest.mark.parametrize("handler", [None, "chat_template"])
def test_a_jsonl_audio_record_is_refused_by_a_family_without_audio(
    tmp_path: Path, handler: str | None
) -> None:
    from neatpack.pipes.testing.tiny import load_tiny_processor

    record, _ = _jsonl_audio_record(tmp_path)
    qwen = load_tiny_processor("qwen2_vl")
    with pytest.raises(SampleError, match=r"sample_id=0 \[bad_media\].*'audio'.*Qwen2VLProcessor"):
        tokenize_with_handler(record, qwen, handler=handler)
