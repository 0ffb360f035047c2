"""Raw record -> Record (``docs/data_contracts.md`` section 1): role/content-list form, media
paths resolved against (and confined to) the media root.

Media blocks are images, videos and audio (``{"type": "audio", "audio": "clip.wav"}``). A video's
``"fps"`` and an audio's ``"sampling_rate"`` are kept as given (the tokenizers check them: the
timestamps, the WAV header and extractor rate), every other key of a media block is dropped.
A path is resolved and confined whatever its kind; any other value (an in-memory numpy array,
a list of frames) is passed through as is, for the family to accept or refuse naming the sample.
LLaVA form takes ``<image>`` / ``<video>`` / ``<audio>`` placeholders with the ``image(s)`` /
``video(s)`` / ``audio(s)`` keys, by the same rules for each kind.

An image or video block with no ``image`` / ``video``, ``path`` or ``url`` value is a
*placeholder*, kept as ``{"type": "image"}`` (``is_placeholder``): the seeds plan from such
records (sizes in ``mm_inputs_meta``), so planning counts it; materializing it refuses the
sample by id until something fills in the media (e.g. from a top-level column).

>>> to_record({"messages": [{"role": "user", "content": "Hi"}]}, 3, None)["conversation"]
[{'role': 'user', 'content': [{'type': 'text', 'text': 'Hi'}]}]
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

from neatpack.pipes.contracts import Record
from neatpack.pipes.errors import EmptyConversationError, RecordError

__all__ = [
    "MEDIA_TYPES",
    "RecordError",
    "is_placeholder",
    "raw_text_stats",
    "resolve_media_path",
    "to_record",
]

MEDIA_TYPES = ("image", "video", "audio")
ROLES = ("system", "user", "assistant")
# Media that planning can size from metadata alone (images_meta / videos_meta): a block of these
# may be a placeholder. Audio has no such metadata, so an audio block needs its sound.
_PLACEHOLDER_TYPES = ("image", "video")
_LLAVA_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                "assistant": "assistant"}  # fmt: skip
_CONVERSATION_KEYS = ("conversation", "messages", "conversations")
_PASSTHROUGH = ("images_meta", "videos_meta", "audios_meta", "_text_tokens", "_media_tokens")
# Media block keys kept as given (the tokenizers check them, naming the sample): a video's frame
# rate (timestamps) and an audio's sampling rate (checked against the WAV header / extractor).
_BLOCK_KEYS = {"video": ("fps",), "audio": ("sampling_rate",)}


def resolve_media_path(path: str, sample_id: int, media_root: str | None) -> str:
    """Join a relative path to ``media_root`` (already ``realpath``-ed) and refuse any path whose
    real location (symlinks followed) is outside it. Without a root the path is unchanged."""
    if media_root is None:
        return path
    full = os.path.join(media_root, path)  # an absolute path stays absolute
    real = os.path.realpath(full)
    if real != media_root and not real.startswith(media_root + os.sep):
        raise RecordError(
            f"sample_id={sample_id}: media path {path!r} resolves to {real!r}, outside the media "
            f"root {media_root!r}; move the file under the root or pass a different media_root"
        )
    return real


def _media_block(kind: str, value: Any, sample_id: int, media_root: str | None) -> dict[str, Any]:
    if isinstance(value, str):
        value = resolve_media_path(value, sample_id, media_root)
    return {"type": kind, kind: value}


def is_placeholder(block: Mapping[str, Any]) -> bool:
    """A Record image or video block with no picture or clip of its own (``{"type": "image"}``):
    planning counts it (its size from ``images_meta`` / ``videos_meta``), materializing needs
    the media, which a reader that knows where they are puts into the block first."""
    kind = block.get("type")
    return kind in _PLACEHOLDER_TYPES and block.get(kind) is None


def _typed_media_block(
    kind: str, item: Mapping[str, Any], sample_id: int, media_root: str | None
) -> dict[str, Any]:
    value = next((item[k] for k in (kind, "path", "url") if item.get(k) is not None), None)
    if value is None and kind not in _PLACEHOLDER_TYPES:
        raise RecordError(
            f"sample_id={sample_id}: {kind} block {dict(item)!r:.120} has no {kind!r}, 'path' "
            "or 'url' key"
        )
    if value is None:
        # A placeholder (the seeds plan from these, HF/TRL records put the pictures in a column
        # of their own): kept as {"type": kind}. Any other key with a value is a typo, not one.
        extra = {k: v for k, v in item.items()
                 if v is not None and k not in ("type", *_BLOCK_KEYS.get(kind, ()))}  # fmt: skip
        if extra:
            raise RecordError(
                f"sample_id={sample_id}: {kind} block {dict(item)!r} has no {kind!r}, 'path' or "
                f"'url' key but has {sorted(extra)}; name the media under {kind!r}, or give a "
                f"placeholder {{'type': {kind!r}}} with its size in {kind}s_meta"
            )
        block: dict[str, Any] = {"type": kind}
    else:
        block = _media_block(kind, value, sample_id, media_root)
    for key in _BLOCK_KEYS.get(kind, ()):
        if item.get(key) is not None:
            block[key] = item[key]
    return block


def _block(item: Any, sample_id: int, media_root: str | None) -> dict[str, Any]:
    if isinstance(item, str):
        return {"type": "text", "text": item}
    if not isinstance(item, Mapping):
        raise RecordError(
            f"sample_id={sample_id}: content item {item!r:.80} is a {type(item).__name__}; "
            "expected a str or a dict block"
        )
    kind = item.get("type")
    if kind == "text" or (kind is None and "text" in item):
        text = item.get("text")
        if not isinstance(text, str):
            raise RecordError(f"sample_id={sample_id}: text block has {text=!r}; expected a str")
        return {"type": "text", "text": text}
    for media in MEDIA_TYPES:
        if kind == media or (kind is None and media in item):
            return _typed_media_block(media, item, sample_id, media_root)
    raise RecordError(
        f"sample_id={sample_id}: content block type {kind!r} is not one of {('text', *MEDIA_TYPES)}"
    )


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _llava(raw: Mapping[str, Any], sample_id: int, media_root: str | None) -> list[dict[str, Any]]:
    media = {kind: _as_list(raw.get(kind + "s", raw.get(kind))) for kind in MEDIA_TYPES}
    used = dict.fromkeys(MEDIA_TYPES, 0)
    conv: list[dict[str, Any]] = []
    for turn in raw["conversations"]:
        if not isinstance(turn, Mapping) or "from" not in turn or "value" not in turn:
            raise RecordError(
                f"sample_id={sample_id}: LLaVA turn {turn!r} needs 'from' and 'value' keys"
            )
        role = _LLAVA_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
        if role is None:
            raise RecordError(
                f"sample_id={sample_id}: LLaVA role {turn['from']!r} is not one of "
                f"{tuple(_LLAVA_ROLES)}"
            )
        value = turn["value"]
        if not isinstance(value, str):
            raise RecordError(f"sample_id={sample_id}: LLaVA {value=!r} is not a str")
        content: list[dict[str, Any]] = []
        # Split on <image>/<video>/<audio>; a newline next to a placeholder is layout, not text.
        pieces = value
        for kind in MEDIA_TYPES:
            pieces = pieces.replace(f"<{kind}>", f"\x00{kind}\x00")
        for i, piece in enumerate(pieces.split("\x00")):
            if i % 2 == 1:
                kind = piece
                if used[kind] >= len(media[kind]):
                    raise RecordError(
                        f"sample_id={sample_id}: more <{kind}> placeholders than the "
                        f"{len(media[kind])} {kind} paths given"
                    )
                content.append(_media_block(kind, media[kind][used[kind]], sample_id, media_root))
                used[kind] += 1
            elif text := piece.strip("\n"):
                content.append({"type": "text", "text": text})
        conv.append({"role": role, "content": content})
    for kind in MEDIA_TYPES:
        if used[kind] == 0 and media[kind]:
            # No placeholders at all: LLaVA convention puts the media first in the first user turn.
            first = next((m for m in conv if m["role"] == "user"), None)
            if first is None:
                raise RecordError(f"sample_id={sample_id}: {kind} given but no user turn")
            blocks = [_media_block(kind, v, sample_id, media_root) for v in media[kind]]
            first["content"][:0] = blocks
        elif used[kind] != len(media[kind]):
            raise RecordError(
                f"sample_id={sample_id}: {used[kind]} <{kind}> placeholders but "
                f"{len(media[kind])} {kind} paths; make them match"
            )
    return conv


def to_record(raw: Mapping[str, Any], sample_id: int, media_root: str | None) -> Record:
    """Convert one raw record into a Record dict (see the module docstring)."""
    if not isinstance(raw, Mapping):
        raise RecordError(f"sample_id={sample_id}: record is a {type(raw).__name__}, not a dict")
    from neatpack.pipes.reading.formats import (
        normalize_format,  # hub formats (TRL, the_cauldron, OpenAI, ...)
    )

    raw = normalize_format(raw, sample_id)
    key = next((k for k in _CONVERSATION_KEYS if k in raw), None)
    if key is None:
        raise RecordError(
            f"sample_id={sample_id}: no conversation; expected one of the keys "
            f"{_CONVERSATION_KEYS}, got {sorted(raw)}"
        )
    turns = raw[key]
    if not isinstance(turns, list) or not turns:
        raise (EmptyConversationError if turns == [] else RecordError)(
            f"sample_id={sample_id}: empty or non-list conversation {key}={turns!r}; "
            "every record needs at least one message"
        )
    if key == "conversations" and isinstance(turns[0], Mapping) and "from" in turns[0]:
        conv = _llava(raw, sample_id, media_root)
    else:
        conv = []
        for msg in turns:
            if not isinstance(msg, Mapping) or "role" not in msg:
                raise RecordError(f"sample_id={sample_id}: message {msg!r} has no 'role'")
            role, content = msg["role"], msg.get("content")
            if role not in ROLES:
                raise RecordError(f"sample_id={sample_id}: {role=!r} is not one of {ROLES}")
            items = [content] if isinstance(content, str) else _as_list(content)
            blocks = [_block(c, sample_id, media_root) for c in items]
            conv.append({"role": role, "content": blocks})
    record: dict[str, Any] = {"sample_id": sample_id, "conversation": conv}
    meta = raw.get("mm_inputs_meta")  # the peer's nesting of the two meta lists
    for k in _PASSTHROUGH:
        v = raw.get(k)
        if v is None and isinstance(meta, Mapping):
            v = meta.get(k)
        if v is not None:
            record[k] = v
    from neatpack.pipes.reading.video import (
        fill_video_meta,  # video files: videos_meta from the container header
    )

    return cast(Record, fill_video_meta(record))  # the keys of the contract, set above


RawStats = tuple[int, int, int, int, int, int, bool]


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector (if on) for a block of record parsing/estimation.

    Those make ~10 containers per record and no reference cycles, yet the allocations start a
    collection every ~70 records: with it off the length index builds ~20-30% faster (e.g.
    21 -> 17 us a record). Reference counting still frees everything; the collector is back
    on when the block ends, even on error."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def raw_text_stats(raw: Any) -> RawStats | None:
    """Fast path for length estimation: ``(chars, system, user, assistant, images, videos,
    first_is_system)`` straight from a raw record, with exactly the counting rules of
    ``to_record`` (LLaVA newline stripping included), without building blocks or touching
    media paths. ``None`` when the record is anything but plainly well formed, or has audio
    (an audio block, an ``<audio>`` placeholder, an ``audio(s)`` key: audio is not in these
    counts): the caller then takes the full ``to_record`` path, which raises the proper error.

    Written for speed (the length index calls it per record, ~1.5 us): counters are locals,
    not a list, and the key lookups are spelled out."""
    if not isinstance(raw, dict):
        return None
    if "conversation" in raw:
        turns = raw["conversation"]
    elif "messages" in raw:
        turns = raw["messages"]
    elif "conversations" in raw:
        return _raw_llava_stats(raw)
    else:
        return None
    if type(turns) is not list or not turns:
        return None
    chars = n_sys = n_user = n_asst = n_img = n_vid = 0
    for msg in turns:
        if type(msg) is not dict:
            return None
        role = msg.get("role")
        if role == "user" and type(role) is str:
            n_user += 1
        elif role == "assistant" and type(role) is str:
            n_asst += 1
        elif role == "system" and type(role) is str:
            n_sys += 1
        else:
            return None
        content = msg.get("content")
        if type(content) is str:
            chars += len(content)
            continue
        if content is None:
            continue
        if type(content) is not list:
            return None
        for item in content:
            if type(item) is str:
                chars += len(item)
                continue
            if type(item) is not dict:
                return None
            kind = item.get("type")
            if kind == "text":
                text = item.get("text")
                if type(text) is not str:
                    return None
                chars += len(text)
            elif kind == "image" and (item.get("image") is not None or len(item) == 1):
                n_img += 1  # a path, or a placeholder {"type": "image"}
            elif kind == "video" and (item.get("video") is not None or len(item) == 1):
                n_vid += 1
            else:
                return None  # implicit types, path/url keys, bad blocks: the full path decides
    return chars, n_sys, n_user, n_asst, n_img, n_vid, turns[0].get("role") == "system"


def _raw_llava_stats(raw: dict[str, Any]) -> RawStats | None:
    turns = raw.get("conversations")
    if type(turns) is not list or not turns or "audio" in raw or "audios" in raw:
        return None
    chars = n_img = n_vid = n_sys = n_user = n_asst = 0
    first = None
    for turn in turns:
        if type(turn) is not dict:
            return None
        who = turn.get("from")
        role = _LLAVA_ROLES.get(who if type(who) is str else str(who))
        value = turn.get("value")
        if role is None or type(value) is not str:
            return None
        if first is None:
            first = role
        if role == "user":
            n_user += 1
        elif role == "assistant":
            n_asst += 1
        else:
            n_sys += 1
        if "<" in value:
            if "<audio>" in value:
                return None  # audio is not in these counts: the full path (and family) decides
            n_img += value.count("<image>")
            n_vid += value.count("<video>")
            # A plain loop: a list comprehension costs a frame per turn (~2k instructions).
            for piece in value.replace("<video>", "\x00").replace("<image>", "\x00").split("\x00"):
                chars += len(piece.strip("\n"))
        else:
            chars += len(value.strip("\n"))
    # media given without placeholders go to the first user turn; with them, counts must match
    given = raw["images"] if "images" in raw else raw.get("image")
    n = 0 if given is None else len(given) if isinstance(given, (list, tuple)) else 1
    if n_img == 0:
        if n and not n_user:
            return None
        n_img = n
    elif n_img != n:
        return None
    given = raw["videos"] if "videos" in raw else raw.get("video")
    n = 0 if given is None else len(given) if isinstance(given, (list, tuple)) else 1
    if n_vid == 0:
        if n and not n_user:
            return None
        n_vid = n
    elif n_vid != n:
        return None
    return chars, n_sys, n_user, n_asst, n_img, n_vid, first == "system"
