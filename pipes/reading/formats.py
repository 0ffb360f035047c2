"""Hub dataset formats -> the raw forms ``to_record`` reads (``docs/data_contracts.md`` section 1).

``normalize_format(raw, sample_id)`` is called first by ``to_record``. It recognizes, and rewrites
into the plain ``messages`` / LLaVA forms:

* **HF / TRL conversational**: ``messages`` whose blocks are ``{"type": "image"}`` (or
  ``"video"``) placeholders, with the media in top-level ``images`` / ``videos`` columns,
  matched in order. A count mismatch is a ``RecordError`` naming the sample.
* **the_cauldron**: ``images`` + ``texts`` = ``[{"user": ..., "assistant": ...}, ...]``; the
  images go first in the first user turn (the_cauldron convention).
* **ShareGPT**: ``conversations`` with ``from: human/gpt/system`` and ``<image>`` placeholders;
  read by ``to_record``'s LLaVA path; here only its ``image(s)`` / ``video(s)`` values are
  normalized.
* **OpenAI**: ``{"type": "image_url", "image_url": {"url": ...}}`` blocks with a path,
  ``file://`` URL or ``data:`` URI. http(s) URLs are refused: nothing is fetched.

A media value is a path (resolved against the media root by ``to_record``), a PIL image, a
``{"bytes", "path"}`` dict (what the ``datasets`` Image feature gives with ``decode=False``) or
raw ``bytes``. Encoded image bytes become a *lazily opened* PIL image: ``Image.open`` reads the
header only (size and EXIF for the length estimate); the pixels are decoded by ``load_image``
in the worker that tokenizes the sample. Encoded video bytes stay ``bytes`` (decoded in the
worker by ``pipes/reading/video.py``).

>>> raw = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
...        "text": "What is it?"}]}, {"role": "assistant", "content": "A cat."}],
...        "images": ["cat.jpg"]}
>>> normalize_format(raw, 0)["messages"][0]["content"][0]
{'type': 'image', 'image': 'cat.jpg'}
>>> normalize_format({"images": [], "texts": [{"user": "Hi", "assistant": "Hello"}]}, 1)
{'messages': [{'role': 'user', 'content': [{'type': 'text', 'text': 'Hi'}]}, \
{'role': 'assistant', 'content': [{'type': 'text', 'text': 'Hello'}]}]}
"""

from __future__ import annotations

import base64
import binascii
import copy
import io
from collections.abc import Mapping
from typing import Any, Final

from neatpack.pipes.errors import RecordError

__all__ = ["FORMATS", "media_value", "normalize_format", "undecoded_dataset"]

FORMATS: Final = ("messages", "trl", "cauldron", "sharegpt", "llava", "openai")
"""The raw formats the readers accept (README, "Data formats")."""

_KINDS: Final = ("image", "video")
_URL_TYPES: Final = {"image_url": "image", "video_url": "video"}
_PASSTHROUGH: Final = (
    "images_meta",
    "videos_meta",
    "audios_meta",
    "_text_tokens",
    "mm_inputs_meta",
)


def _is_placeholder(block: Mapping[str, Any], kind: str) -> bool:
    """A media block with no value: ``{"type": "image"}`` (``datasets`` also fills every struct
    field of a block, so ``{"type": "image", "image": None, "text": None}`` is one too)."""
    return all(block.get(k) is None for k in (kind, "path", "url"))


def _open_image_bytes(data: bytes, hint: Any, sample_id: int) -> Any:
    from PIL import Image, UnidentifiedImageError

    name = f" ({hint!r})" if hint else ""
    try:
        return Image.open(io.BytesIO(data))  # lazy: header only; pixels decode in load_image
    except Image.DecompressionBombError as e:  # not an OSError
        raise RecordError(f"sample_id={sample_id}: image bytes{name}: {e}") from e
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise RecordError(
            f"sample_id={sample_id}: image bytes{name} of {len(data)} bytes have no readable "
            f"image header ({type(e).__name__}: {e}); re-encode the image or drop the sample"
        ) from e


def _data_uri(uri: str, sample_id: int) -> bytes:
    head, sep, body = uri.partition(",")
    if not sep or not head.endswith(";base64"):
        raise RecordError(
            f"sample_id={sample_id}: data URI {uri[:60]!r}... is not base64 "
            "('data:<mime>;base64,<payload>'); encode the media as base64"
        )
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RecordError(f"sample_id={sample_id}: data URI has a bad base64 payload: {e}") from e


def media_value(kind: str, value: Any, sample_id: int) -> Any:
    """One media value in the canonical form ``to_record`` takes: a path ``str``, a PIL image,
    a frame list, or (videos) encoded ``bytes``. Encoded image bytes open lazily (header only).

    >>> media_value("image", {"bytes": None, "path": "a.png"}, 0)
    'a.png'
    """
    if isinstance(value, Mapping):
        data, path = value.get("bytes"), value.get("path")
        if data is None:
            if not isinstance(path, str) or not path:
                raise RecordError(
                    f"sample_id={sample_id}: {kind} {dict(value)!r:.120} has neither 'bytes' nor "
                    "a 'path'; give one of them"
                )
            return media_value(kind, path, sample_id)
        value = data if isinstance(data, bytes) else bytes(data)
        return _open_image_bytes(value, path, sample_id) if kind == "image" else value
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return _open_image_bytes(data, None, sample_id) if kind == "image" else data
    if isinstance(value, str):
        if value.startswith("data:"):
            return media_value(kind, _data_uri(value, sample_id), sample_id)
        if value.startswith("file://"):
            return value[len("file://") :]
        if value.split("://", 1)[0].lower() in ("http", "https", "s3", "gs", "ftp"):
            raise RecordError(
                f"sample_id={sample_id}: {kind} URL {value!r:.120} is remote; neatpack never "
                "fetches remote media: download it under the media root and give the path"
            )
        return value
    if value is None:
        raise RecordError(f"sample_id={sample_id}: {kind} value is None; give the {kind}")
    return value  # a PIL image, a frame list, an array: load_image / load_video decide


def _url_block(block: Mapping[str, Any], kind: str, sample_id: int) -> dict[str, Any]:
    url = block.get(f"{kind}_url")
    if isinstance(url, Mapping):
        url = url.get("url")
    if not isinstance(url, str):
        raise RecordError(
            f"sample_id={sample_id}: {kind}_url block {dict(block)!r:.120} needs "
            f"{{'{kind}_url': {{'url': ...}}}} with a path, file:// URL or data: URI"
        )
    return {"type": kind, kind: media_value(kind, url, sample_id)}


def _columns(raw: Mapping[str, Any], sample_id: int) -> dict[str, list[Any] | None]:
    out: dict[str, list[Any] | None] = {}
    for kind in _KINDS:
        col = raw.get(kind + "s")
        if col is None:
            out[kind] = None
        elif isinstance(col, list | tuple):
            out[kind] = list(col)
        else:
            raise RecordError(
                f"sample_id={sample_id}: top-level {kind}s={col!r:.80} is a "
                f"{type(col).__name__}; expected a list (one entry per {{'type': '{kind}'}} block)"
            )
    return out


def _has_url_block(turns: list[Any]) -> bool:
    for msg in turns:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list):
            for block in content:
                if isinstance(block, Mapping) and block.get("type") in _URL_TYPES:
                    return True
    return False


def _messages(raw: Mapping[str, Any], key: str, sample_id: int) -> dict[str, Any] | None:
    """HF/TRL placeholders filled from the columns, OpenAI URL blocks converted; None when the
    record needs neither (it then goes to ``to_record`` unchanged)."""
    turns = raw[key]
    if not isinstance(turns, list):
        return None
    cols = _columns(raw, sample_id)
    has_cols = any(c is not None for c in cols.values())
    if not has_cols and not _has_url_block(turns):
        return None
    used = dict.fromkeys(_KINDS, 0)
    changed = False
    messages: list[Any] = []
    for msg in turns:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            messages.append(msg)
            continue
        blocks: list[Any] = []
        for block in content:
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind in _URL_TYPES:
                blocks.append(_url_block(block, _URL_TYPES[kind], sample_id))
                changed = True
            elif kind in _KINDS and has_cols and _is_placeholder(block, kind):
                col = cols[kind] or []
                if used[kind] >= len(col):
                    raise RecordError(
                        f"sample_id={sample_id}: more {{'type': '{kind}'}} placeholders than "
                        f"the {len(col)} entries of its {kind}s column; make them match"
                    )
                new = {"type": kind, kind: media_value(kind, col[used[kind]], sample_id)}
                if kind == "video" and block.get("fps") is not None:
                    new["fps"] = block["fps"]
                blocks.append(new)
                used[kind] += 1
                changed = True
            elif kind == "text" and isinstance(block, Mapping) and len(block) > 2:
                blocks.append({"type": "text", "text": block.get("text")})  # drop null fields
            else:
                blocks.append(block)
        messages.append({**msg, "content": blocks})
    for kind in _KINDS:
        given = cols[kind]
        if given is not None and used[kind] != len(given):
            raise RecordError(
                f"sample_id={sample_id}: {used[kind]} {{'type': '{kind}'}} placeholders but "
                f"{len(given)} entries in the {kind}s column; make them match"
            )
    if not (changed or has_cols):
        return None
    out = {k: raw[k] for k in _PASSTHROUGH if k in raw}
    out[key] = messages
    return out


def _cauldron(raw: Mapping[str, Any], sample_id: int) -> dict[str, Any]:
    texts = raw["texts"]
    if not isinstance(texts, list) or not texts:
        raise RecordError(
            f"sample_id={sample_id}: the_cauldron texts={texts!r:.80} must be a non-empty list "
            "of {'user': ..., 'assistant': ...} pairs"
        )
    images: list[Any] = _columns(raw, sample_id)["image"] or []
    messages: list[dict[str, Any]] = []
    for k, pair in enumerate(texts):
        user = pair.get("user") if isinstance(pair, Mapping) else None
        answer = pair.get("assistant") if isinstance(pair, Mapping) else None
        if not isinstance(user, str) or not isinstance(answer, str):
            raise RecordError(
                f"sample_id={sample_id}: the_cauldron texts[{k}]={pair!r:.120} needs str "
                "'user' and 'assistant' keys"
            )
        content: list[dict[str, Any]] = []
        if k == 0:
            content = [{"type": "image", "image": media_value("image", v, sample_id)}
                       for v in images]  # fmt: skip
        content.append({"type": "text", "text": user})
        messages.append({"role": "user", "content": content})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    out = {k: raw[k] for k in _PASSTHROUGH if k in raw}
    out["messages"] = messages
    return out


def _sharegpt(raw: Mapping[str, Any], sample_id: int) -> Mapping[str, Any]:
    out: dict[str, Any] | None = None
    for kind in _KINDS:
        for key in (kind + "s", kind):
            col = raw.get(key)
            if col is None:
                continue
            values = col if isinstance(col, list | tuple) else [col]
            if all(isinstance(v, str) and "://" not in v and not v.startswith("data:")
                   for v in values):  # fmt: skip
                continue  # plain paths: to_record reads them as they are
            out = dict(raw) if out is None else out
            new = [media_value(kind, v, sample_id) for v in values]
            out[key] = new if isinstance(col, list | tuple) else new[0]
    return raw if out is None else out


def normalize_format(raw: Mapping[str, Any], sample_id: int) -> Mapping[str, Any]:
    """``raw`` rewritten into a form ``to_record`` reads (see the module docstring), or ``raw``
    itself when it already is one. Pure: reads only the record (and the headers of encoded
    image bytes)."""
    if "conversation" in raw:
        key = "conversation"
    elif "messages" in raw:
        key = "messages"
    elif "conversations" in raw:
        turns = raw["conversations"]
        if (
            isinstance(turns, list)
            and turns
            and isinstance(turns[0], Mapping)
            and ("from" in turns[0])
        ):
            return _sharegpt(raw, sample_id)
        key = "conversations"
    elif "texts" in raw:
        return _cauldron(raw, sample_id)
    else:
        return raw
    turns = raw[key]
    if (
        "images" not in raw
        and "videos" not in raw
        and (not isinstance(turns, list) or not _has_url_block(turns))
    ):
        return raw  # the common case, kept cheap: the slow path calls this per record
    return _messages(raw, key, sample_id) or raw


def undecoded_dataset(ds: Any) -> Any:
    """A ``datasets.Dataset`` whose Image / Video features are cast to ``decode=False``, so that
    ``ds[i]`` gives ``{"bytes", "path"}`` dicts instead of decoding pixels (``datasets`` calls
    ``image.load()``). ``normalize_format`` then opens the bytes lazily: the length index reads
    headers only and the workers decode. Other datasets are returned unchanged."""
    features = getattr(ds, "features", None)
    if features is None or not hasattr(ds, "cast"):
        return ds
    import datasets

    kinds = tuple(getattr(datasets, n) for n in ("Image", "Video") if hasattr(datasets, n))

    def visit(f: Any) -> tuple[Any, bool]:
        if isinstance(f, kinds) and getattr(f, "decode", False):
            return type(f)(decode=False), True
        if isinstance(f, dict):
            pairs = {k: visit(v) for k, v in f.items()}
            return {k: v for k, (v, _) in pairs.items()}, any(c for _, c in pairs.values())
        if isinstance(f, list) and len(f) == 1:
            inner, changed = visit(f[0])
            return [inner], changed
        inner = getattr(f, "feature", None)
        if inner is not None and type(f).__name__ in ("List", "Sequence", "LargeList"):
            new, changed = visit(inner)
            if changed:
                f = copy.copy(f)
                f.feature = new
            return f, changed
        return f, False

    new, changed = visit(dict(features))
    if not changed:
        return ds
    # decode=False changes no Arrow type, only how rows are read, so only the features change.
    # ``ds.cast`` rewrites every row through ``map`` (a disk-backed dataset gained a whole
    # ``cache-*.arrow`` copy beside it: 151 MB became 302 MB), and ``cast_column`` avoids that
    # only for a top-level Image, not a ``List(Image())``. Like ``cast_column``'s own path: a
    # deep copy (the memory-mapped table is shared, not copied) with the new features.
    out = copy.deepcopy(ds)
    out.info.features = datasets.Features(new)
    return out
