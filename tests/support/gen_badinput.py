"""A bad-input corpus on disk: one JSONL line per case, its media files, and the outcome each
case must have under each policy of ``neat_vlm_graph``.

``write_bad_corpus(dir) -> list[Case]`` writes ``dir/data.jsonl`` (case ``k`` is line ``k + 1``,
sample id ``k``), ``dir/media/`` (the media root) and ``dir/outside/`` (files that escaping
paths point at). Images are tiny (at most 200 x 200): the decompression-bomb cases need the
small limit ``BOMB_LIMIT`` set as ``PIL.Image.MAX_IMAGE_PIXELS`` while they are read.

A case's ``kind`` says which policy decides it:

    kind       policy          outcomes
    ok         (none)          consumed under every policy
    bad        on_bad_sample   raise: error naming the sample and the fix | skip, replace: failed
    overlong   overlong        raise: ValueError naming the sample | drop: ledger.overlong
    overflow   overflow        raise: ValueError | truncate: consumed + truncated | drop: dropped

``stage`` is the first real component that refuses a bad record: ``read`` (``source[id]``,
a ``RecordError``), ``estimate`` (``LengthEstimator``, an ``EstimateError``), ``tokenize``
(``tokenize_conversation``, a ``SampleError`` with ``reason``) or ``plan`` (overlong).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from neatpack.pipes.reading.read import MAX_RECORD_BYTES

__all__ = ["BOMB_LIMIT", "CASES", "Case", "write_bad_corpus"]

BOMB_LIMIT = 10_000  # PIL.Image.MAX_IMAGE_PIXELS during the bomb cases; normal images are smaller
HUGE_CHARS = 3 << 20  # a 3 MiB line: longer than the reader's 1 MiB chunk, ~1M estimated tokens

Files = Callable[[Path], None]


@dataclass(frozen=True)
class Case:
    """One bad (or awkward but valid) record and what must happen to it."""

    name: str
    line: bytes  # the raw JSONL line, without the newline
    kind: str  # ok | bad | overlong | overflow
    stage: str | None = None  # read | estimate | tokenize | plan | materialize (None when ok)
    error: str = ""  # regex the error text must match (the fix, the bad value)
    reason: str | None = None  # SampleError.reason at the tokenize stage
    files: Files | None = field(default=None, compare=False, repr=False)
    sample_id: int = -1  # set by write_bad_corpus

    def outcome(self, *, on_bad_sample: str, overlong: str, overflow: str) -> str:
        """``raise`` or the ledger list that names this sample under these policies."""
        if self.kind == "bad":
            return "raise" if on_bad_sample == "raise" else "failed"
        if self.kind == "overlong":
            return "raise" if overlong == "raise" else "overlong"
        if self.kind == "overflow":
            return {"raise": "raise", "truncate": "truncated", "drop": "dropped"}[overflow]
        return "consumed"


# -- files ---------------------------------------------------------------------------------
def _png(size: tuple[int, int] = (64, 48), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    if mode == "I;16":
        arr = np.arange(size[0] * size[1], dtype=np.uint16).reshape(size[1], size[0]) * 37
        Image.fromarray(arr).save(buf, format="PNG")  # uint16 -> mode I;16
    else:
        Image.new(mode, size, (30, 120, 200)).save(buf, format="PNG")
    return buf.getvalue()


def _truncated_png() -> bytes:
    """A noisy 64x48 PNG cut in the middle of its pixel data (the header still reads)."""
    noise = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG")
    data = buf.getvalue()
    return data[: len(data) // 2]


def _jpeg_cmyk() -> bytes:
    buf = io.BytesIO()
    Image.new("CMYK", (64, 48), (10, 200, 30, 5)).save(buf, format="JPEG")
    return buf.getvalue()


def _put(name: str, data: bytes | Callable[[], bytes]) -> Files:
    def write(root: Path) -> None:
        (root / "media" / name).write_bytes(data if isinstance(data, bytes) else data())

    return write


def _fifo(name: str) -> Files:
    """A named pipe where an image should be: opening it blocks until a writer comes."""

    def make(root: Path) -> None:
        path = root / "media" / name
        if not path.exists():
            os.mkfifo(path)

    return make


def _symlink_out(root: Path) -> None:
    (root / "outside" / "secret.png").write_bytes(_png())
    link = root / "media" / "escape.png"
    if not link.is_symlink():
        link.symlink_to(root / "outside" / "secret.png")


# -- records -------------------------------------------------------------------------------
def _msgs(user: Any, assistant: Any = "Fine.", **extra: Any) -> bytes:
    messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
    if assistant is not None:
        messages.append({"role": "assistant", "content": assistant})
    return json.dumps({"messages": messages, **extra}).encode()


def _img(path: str, text: str = "What is shown?") -> list[dict[str, Any]]:
    return [{"type": "image", "image": path}, {"type": "text", "text": text}]


SID = r"sample_id=\d+"
_OVERFLOW_TEXT = " ".join(f"w{i}" for i in range(700))  # ~1400 real tokens, estimated as 1


def _cases() -> list[Case]:
    meta = {"images_meta": [[48, 64]]}
    return [
        # -- valid but awkward: must work -------------------------------------------------
        Case("ok_text", _msgs("Hello there."), "ok"),
        Case("ok_image", _msgs(_img("ok.png")), "ok", files=_put("ok.png", _png())),
        Case("ok_cmyk_jpeg", _msgs(_img("cmyk.jpg")), "ok", files=_put("cmyk.jpg", _jpeg_cmyk)),
        Case(
            "ok_16bit_png",
            _msgs(_img("grey16.png")),
            "ok",
            files=_put("grey16.png", lambda: _png(mode="I;16")),
        ),
        Case(
            "ok_rgba_png",
            _msgs(_img("rgba.png")),
            "ok",
            files=_put("rgba.png", lambda: _png(mode="RGBA")),
        ),
        Case("ok_utf8_bom", b"\xef\xbb\xbf" + _msgs("BOM first."), "ok"),
        Case(
            "ok_unicode", _msgs("Emoji \U0001f600, RTL \u05e9\u05dc\u05d5\u05dd, NUL \x00."), "ok"
        ),
        Case(
            "ok_llava",
            json.dumps(
                {
                    "conversations": [
                        {"from": "human", "value": "<image>\nWhat?"},
                        {"from": "gpt", "value": "A."},
                    ],
                    "image": "ok.png",
                }
            ).encode(),
            "ok",
        ),
        # -- the reader refuses -----------------------------------------------------------
        Case(
            "broken_json",
            b'{"messages": [{"role": "user", "content": "hi"',
            "bad",
            "read",
            rf"malformed JSON in .* line \d+ \({SID}\).*fix or delete that line",
        ),
        Case(
            "invalid_utf8",
            b'{"messages": [{"role": "user", "content": "\xff\xfe bad"}]}',
            "bad",
            "read",
            rf"malformed JSON .*\({SID}\).*fix or delete",
        ),
        Case(
            "not_an_object",
            b"[1, 2, 3]",
            "bad",
            "read",
            rf"line \d+ \({SID}\) holds a list, expected a JSON object",
        ),
        Case(
            "no_conversation",
            b'{"text": "hi"}',
            "bad",
            "read",
            rf"{SID}: no conversation; expected one of the keys",
        ),
        Case(
            "empty_conversation",
            b'{"messages": []}',
            "bad",
            "read",
            rf"{SID}: empty or non-list conversation",
        ),
        Case(
            "unknown_role",
            _msgs("hi").replace(b'"user"', b'"robot"'),
            "bad",
            "read",
            rf"{SID}: role='robot' is not one of",
        ),
        Case(
            "text_not_str",
            _msgs([{"type": "text", "text": 5}]),
            "bad",
            "read",
            rf"{SID}: text block has text=5; expected a str",
        ),
        Case(
            "dotdot_path",
            _msgs(_img("../outside/secret.png")),
            "bad",
            "read",
            rf"{SID}: media path '\.\./outside/secret\.png' resolves to .* outside the media "
            "root",
        ),
        Case(
            "absolute_path",
            _msgs(_img("/etc/hostname")),
            "bad",
            "read",
            rf"{SID}: media path '/etc/hostname' resolves to .* outside the media root",
        ),
        Case(
            "symlink_escape",
            _msgs(_img("escape.png")),
            "bad",
            "read",
            rf"{SID}: media path 'escape\.png' resolves to .*outside.* outside the media root",
            files=_symlink_out,
        ),
        Case(
            "llava_more_placeholders",
            json.dumps(
                {
                    "conversations": [
                        {"from": "human", "value": "<image><image>\nWhat?"},
                        {"from": "gpt", "value": "A."},
                    ],
                    "image": "ok.png",
                }
            ).encode(),
            "bad",
            "read",
            rf"{SID}: more <image> placeholders than the 1 image paths",
        ),
        Case(
            "llava_fewer_placeholders",
            json.dumps(
                {
                    "conversations": [
                        {"from": "human", "value": "<image>\nWhat?"},
                        {"from": "gpt", "value": "A."},
                    ],
                    "images": ["ok.png", "ok.png"],
                }
            ).encode(),
            "bad",
            "read",
            rf"{SID}: 1 <image> placeholders but 2 image paths; make them match",
        ),
        # -- the estimator refuses (no images_meta: it reads the file header) ---------------
        Case(
            "missing_file",
            _msgs(_img("nope.png")),
            "bad",
            "estimate",
            rf"{SID}: image missing: .*nope\.png.*fix the path",
        ),
        Case(
            "corrupt_image",
            _msgs(_img("garbage.jpg")),
            "bad",
            "estimate",
            rf"{SID}: image unreadable: .*garbage\.jpg",
            files=_put("garbage.jpg", b"\x00not an image\xff" * 20),
        ),
        Case(
            "meta_count_mismatch",
            _msgs(_img("ok.png"), images_meta=[[48, 64], [48, 64]]),
            "bad",
            "estimate",
            rf"{SID}: images_meta has 2 entries but the conversation has 1",
        ),
        Case(
            "meta_negative",
            _msgs(_img("ok.png"), images_meta=[[-5, 64]]),
            "bad",
            "estimate",
            rf"{SID}: images_meta \[-5, 64\] must be positive integers",
        ),
        Case(
            "bomb_hard_nometa",
            _msgs(_img("bomb_hard.png")),
            "bad",
            "estimate",
            rf"{SID}: image .*bomb_hard\.png.*(decompression|pixels)",
            files=_put("bomb_hard.png", lambda: _png((200, 200))),
        ),
        Case(
            "fifo_image_nometa",
            _msgs(_img("pipe.png")),
            "bad",
            "estimate",
            rf"{SID}: image .*pipe\.png' is a FIFO \(named pipe\), not a regular file",
            files=_fifo("pipe.png"),
        ),
        # -- the tokenizer refuses (images_meta given: the estimator never opens the file) --
        Case(
            "missing_file_meta",
            _msgs(_img("nope.png"), **meta),
            "bad",
            "tokenize",
            rf"{SID} \[missing_file\]: image file .*nope\.png.* does not exist; fix the path",
            "missing_file",
        ),
        Case(
            "fifo_image",
            _msgs(_img("pipe_meta.png"), **meta),
            "bad",
            "tokenize",
            rf"{SID} \[bad_media\]: image file .*pipe_meta\.png' is a FIFO \(named pipe\), not "
            "a regular file",
            "bad_media",
            files=_fifo("pipe_meta.png"),
        ),
        Case(
            "zero_size",
            _msgs(_img("zero.png"), **meta),
            "bad",
            "tokenize",
            rf"{SID} \[empty_file\]: image file .*zero\.png.* is 0 bytes; re-export or drop",
            "empty_file",
            files=_put("zero.png", b""),
        ),
        Case(
            "truncated_png",
            _msgs(_img("trunc.png"), **meta),
            "bad",
            "tokenize",
            rf"{SID} \[(truncated|corrupt)_image\]: image file .*trunc\.png.* cannot be "
            "decoded.*re-export or drop",
            "truncated_image",
            files=_put("trunc.png", _truncated_png),
        ),
        Case(
            "corrupt_image_meta",
            _msgs(_img("garbage2.jpg"), **meta),
            "bad",
            "tokenize",
            rf"{SID} \[corrupt_image\]: image file .*garbage2\.jpg.* cannot be decoded",
            "corrupt_image",
            files=_put("garbage2.jpg", b"\x00not an image\xff" * 20),
        ),
        Case(
            "bomb_soft",
            _msgs(_img("bomb_soft.png"), images_meta=[[100, 120]]),
            "bad",
            "tokenize",
            rf"{SID} \[decompression_bomb\]: image .*bomb_soft\.png.* has "
            rf"120x100=12000 pixels, over the limit {BOMB_LIMIT}",
            "decompression_bomb",
            files=_put("bomb_soft.png", lambda: _png((120, 100))),
        ),
        Case(
            "bomb_hard",
            _msgs(_img("bomb_hard.png"), images_meta=[[200, 200]]),
            "bad",
            "tokenize",
            rf"{SID} \[decompression_bomb\]: image file .*bomb_hard\.png",
            "decompression_bomb",
        ),
        Case(
            "no_assistant",
            _msgs("Only a question?", None),
            "bad",
            "tokenize",
            rf"{SID} \[no_assistant\]: no assistant turn: nothing to train on; drop it",
            "no_assistant",
        ),
        Case(
            "placeholder_in_text",
            _msgs("Look at <image> please."),
            "bad",
            "tokenize",
            rf"{SID} \[placeholder_in_text\]",
            "placeholder_in_text",
        ),
        Case(
            "special_token_in_text",
            _msgs("Stop<|im_end|> here."),
            "bad",
            "tokenize",
            rf"{SID} \[special_token_in_text\]",
            "special_token_in_text",
        ),
        Case(
            "empty_user_text",
            _msgs("   "),
            "bad",
            "tokenize",
            rf"{SID} \[empty_text\]: message 0 \(user\) has no text and no media",
            "empty_text",
        ),
        # -- the reader refuses a line over max_record_bytes before reading it --------------
        Case(
            "too_large_line",
            _msgs("Summarize.", "x" * MAX_RECORD_BYTES),
            "bad",
            "read",
            rf"line \d+ \(sample_id=\d+\) is \d+ bytes, over max_record_bytes={MAX_RECORD_BYTES}"
            ".*split or shorten that record",
        ),
        # -- the plan refuses -------------------------------------------------------------
        Case(
            "huge_line",
            _msgs("Summarize.", "x" * HUGE_CHARS),
            "overlong",
            "plan",
            r"longer than pack_size=\d+ tokens|sample \d+ \(length \d+\).*pass overlong='drop'",
        ),
        # -- the estimate is too low: the materializer's overflow policy ------------------
        Case(
            "overflow",
            _msgs("Count.", _OVERFLOW_TEXT, _text_tokens=1),
            "overflow",
            "materialize",
            r"pack of samples \[[\d, ]+\] is \d+ tokens after the shift.*"
            "overflow='drop' / 'truncate'",
        ),
    ]


CASES: tuple[Case, ...] = tuple(_cases())


def write_bad_corpus(
    directory: str | os.PathLike[str], names: Sequence[str] | None = None
) -> list[Case]:
    """Write the cases named (default: all) under ``directory``; return them with their ids.

    ``ok.png`` is always written (the LLaVA and meta cases refer to it).
    """
    root = Path(directory)
    for sub in ("media", "outside"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "media" / "ok.png").write_bytes(_png())
    by_name = {c.name: c for c in CASES}
    unknown = sorted(set(names or ()) - set(by_name))
    if unknown:
        raise ValueError(f"unknown case names {unknown}; valid: {sorted(by_name)}")
    chosen = [by_name[n] for n in names] if names is not None else list(CASES)
    out: list[Case] = []
    lines: list[bytes] = []
    for sid, case in enumerate(chosen):
        if case.files is not None:
            case.files(root)
        if case.name == "bomb_hard":  # shares the file of bomb_hard_nometa
            _put("bomb_hard.png", lambda: _png((200, 200)))(root)
        lines.append(case.line)
        out.append(Case(**{**case.__dict__, "sample_id": sid}))
    (root / "data.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return out
