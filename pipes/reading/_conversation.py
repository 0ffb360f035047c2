"""Validate a Record's conversation for tokenization (used by ``pipes/materializing/tokenize.py``).

``parse_conversation`` returns the conversation the chat template renders (media blocks reduced
to ``{"type": "image"}`` / ``{"type": "video"}``) plus the media sources in order; every problem is
a ``SampleError`` naming the sample id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, NamedTuple

from neatpack.pipes.materializing.labels import RoleMarkers
from neatpack.pipes.reading.media import SampleError

__all__ = [
    "ROLES",
    "Parsed",
    "check_no_placeholders",
    "forbidden_tokens",
    "parse_conversation",
    "placeholder_message",
]

ROLES: Final = ("system", "user", "assistant")
_PLACEHOLDERS: Final = ("<image>", "<video>")
_MEDIA_KEYS: Final = ("image", "video")
_STRUCTURAL: Final = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _blocks(sid: Any, k: int, content: Any) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise SampleError(
            sid,
            "bad_block",
            f"message {k} content is a {type(content).__name__}; "
            "expected a str or a list of blocks",
        )
    for j, b in enumerate(content):
        if not isinstance(b, Mapping):
            raise SampleError(
                sid, "bad_block", f"message {k} block {j} is {b!r:.80}; expected a dict"
            )
    return content


def _kind(sid: Any, k: int, j: int, block: Mapping[str, Any]) -> str:
    kind = block.get("type")
    if kind is None:
        kind = next((m for m in ("text", *_MEDIA_KEYS) if m in block), None)
    if kind not in ("text", *_MEDIA_KEYS):
        raise SampleError(
            sid,
            "bad_block",
            f"message {k} block {j} has type {kind!r}; valid types: ('text', 'image', 'video')",
        )
    return str(kind)


def _check_text(sid: Any, k: int, text: Any, forbidden: tuple[str, ...]) -> str:
    if not isinstance(text, str):
        raise SampleError(
            sid,
            "bad_text",
            f"message {k} has text {text!r:.80} of type {type(text).__name__}; text must be a str",
        )
    for tok in _PLACEHOLDERS:
        if tok in text:
            raise SampleError(
                sid,
                "placeholder_in_text",
                f"message {k} text contains {tok!r}; "
                "LLaVA placeholders must become media blocks (read the record with "
                "neatpack's reader) or be removed",
            )
    for tok in forbidden:
        if tok in text:
            raise SampleError(
                sid,
                "special_token_in_text",
                f"message {k} text contains the special token {tok!r}; strip it from the data",
            )
    return text


class Parsed(NamedTuple):
    """A validated conversation: what the template renders, and the media sources in order."""

    sample_id: Any
    conversation: list[dict[str, Any]]
    images: list[Any]
    videos: list[Any]
    video_fps: list[float | None]  # a video block's "fps" key: the frame rate of its frames


def _fps(sid: Any, k: int, j: int, block: Mapping[str, Any]) -> float | None:
    fps = block.get("fps")
    if fps is None:
        return None
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0:
        raise SampleError(
            sid, "bad_media", f"message {k} block {j} has {fps=!r}; expected a positive number"
        )
    return float(fps)


def parse_conversation(record: Mapping[str, Any], forbidden: tuple[str, ...]) -> Parsed:
    """Validate a Record; ``forbidden``: strings no text may contain (see ``forbidden_tokens``)."""
    if not isinstance(record, Mapping):
        raise SampleError(
            None, "bad_record", f"record is a {type(record).__name__}; expected a dict"
        )
    if "sample_id" not in record:
        raise SampleError(
            None,
            "bad_record",
            f"record without 'sample_id' (keys {sorted(record)}); "
            "records come from a RecordSource, which sets it",
        )
    sid = record["sample_id"]
    conv = record.get("conversation")
    if not isinstance(conv, list):
        raise SampleError(
            sid,
            "bad_record",
            f"'conversation' is {conv!r:.80}; expected a list of "
            "messages (read raw records with neatpack's reader)",
        )
    if not conv:
        raise SampleError(sid, "empty_conversation", "the conversation has no messages; drop it")
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    videos: list[Any] = []
    video_fps: list[float | None] = []
    for k, msg in enumerate(conv):
        role = msg.get("role") if isinstance(msg, Mapping) else None
        if role not in ROLES:
            raise SampleError(
                sid, "unknown_role", f"message {k} has role {role!r}; valid roles: {ROLES}"
            )
        blocks: list[dict[str, Any]] = []
        has_text = has_media = False
        for j, b in enumerate(_blocks(sid, k, msg.get("content"))):
            kind = _kind(sid, k, j, b)
            if kind == "text":
                text = _check_text(sid, k, b.get("text"), forbidden)
                has_text = has_text or bool(text.strip())
                blocks.append({"type": "text", "text": text})
                continue
            value = b.get(kind, b.get("path"))
            if value is None:
                raise SampleError(sid, "media_count_mismatch", placeholder_message(k, j, kind))
            if kind == "image":
                images.append(value)
            else:
                videos.append(value)
                video_fps.append(_fps(sid, k, j, b))
            blocks.append({"type": kind})
            has_media = True
        if role != "system" and not (has_text or has_media):
            raise SampleError(
                sid,
                "empty_text",
                f"message {k} ({role}) has no text and no media; drop the message or the sample",
            )
        out.append({"role": role, "content": blocks})
    if not any(m["role"] == "assistant" for m in out):
        raise SampleError(sid, "no_assistant", "no assistant turn: nothing to train on; drop it")
    return Parsed(sid, out, images, videos, video_fps)


def placeholder_message(k: int, j: int, kind: str) -> str:
    """Why a media block with nothing to load (``{"type": "image"}``) cannot be materialized."""
    return (
        f"message {k} block {j} is an {kind} block with no {kind} to load (a placeholder: "
        f"planning can size it from {kind}s_meta, building the sample needs the {kind} "
        f"itself); give the block its {kind} ({{'type': {kind!r}, {kind!r}: path}}) or fix the "
        f"record's {kind} list"
    )


def check_no_placeholders(record: Mapping[str, Any]) -> None:
    """Raise ``SampleError`` naming the sample at its first media block with nothing to load."""
    conv = record.get("conversation")
    for k, msg in enumerate(conv if isinstance(conv, list) else []):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        for j, b in enumerate(content if isinstance(content, list) else []):
            kind = b.get("type") if isinstance(b, Mapping) else None
            if kind in ("image", "video") and b.get(kind, b.get("path")) is None:
                raise SampleError(
                    record.get("sample_id"), "media_count_mismatch", placeholder_message(k, j, kind)
                )


def forbidden_tokens(processor: Any, tok: Any, markers: RoleMarkers) -> tuple[str, ...]:
    """Special tokens that must not occur in text: turn/vision structure and the role markers.
    Other specials (Qwen's ``<|box_start|>`` grounding tokens, tool tokens) stay allowed."""
    specials = set(tok.all_special_tokens)
    names = set(_STRUCTURAL)
    names.update(str(getattr(processor, a, "")) for a in ("image_token", "video_token"))
    names.update(tok.convert_ids_to_tokens([*markers.start, *markers.end]))
    return tuple(sorted(specials & names))
