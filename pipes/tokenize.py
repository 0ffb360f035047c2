"""One conversation -> one Sample (``docs/data_contracts.md`` section 4) through the real processor.

>>> proc = load_tiny_processor("qwen2_vl")
>>> s = tokenize_conversation({"sample_id": 3, "conversation": [
...     {"role": "user", "content": [{"type": "text", "text": "hi"}]},
...     {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]}, proc)
>>> sorted(s), proc.tokenizer.decode(s["input_ids"][s["labels"] != -100])
(['attention_mask', 'input_ids', 'labels', 'mm_token_type_ids', 'sample_id'], 'yo<|im_end|>')

Rules (each violation is a ``SampleError`` naming the sample id, a reason code and the fix):

* roles are ``system`` / ``user`` / ``assistant``; at least one assistant turn;
* text is a ``str``; a user or assistant message needs non-blank text or a media block (an empty
  text block next to an image is fine); a system message may be empty;
* text may not contain LLaVA placeholders (``<image>``, ``<video>``: the reader turns them into
  blocks) or structural special tokens (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, the
  vision tokens, the role-marker specials), which would desynchronise media and labels; other
  specials (Qwen's ``<|box_start|>`` grounding tokens) are allowed;
* every media block carries its image / video; after processing, the image-pad count must equal
  ``sum(prod(image_grid_thw)) // merge**2`` (same for video) and every assistant turn must be found.

``fake_image=True`` injects a white 56x56 image at the start of the first user turn of a
sample with no media, so every rank's vision tower runs. Its whole
``<|vision_start|>...<|vision_end|>`` block gets ``attention_mask=0`` and labels -100.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch
from PIL import Image
from torch import Tensor

from .labels import IGNORE_INDEX, RoleMarkers, assistant_spans, resolve_role_markers
from .media import SampleError, load_image, load_video

__all__ = ["FAKE_IMAGE_SIZE", "LABEL_POLICIES", "SampleError", "tokenize_conversation"]

ROLES: Final = ("system", "user", "assistant")
LABEL_POLICIES: Final = ("assistant", "last_assistant")
"""``assistant``: every assistant turn; ``last_assistant``: only the final one."""
FAKE_IMAGE_SIZE: Final = 56
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


def _parse(
    record: Mapping[str, Any], forbidden: tuple[str, ...]
) -> tuple[Any, list[dict[str, Any]], list[Any], list[Any]]:
    """Validate; return (sample_id, template conversation, image sources, video sources)."""
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
                raise SampleError(
                    sid,
                    "media_count_mismatch",
                    f"message {k} block {j} is an "
                    f"{kind} block with no {kind}; the conversation has more {kind} "
                    f"blocks than {kind}s (fix the record's {kind} list)",
                )
            (images if kind == "image" else videos).append(value)
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
    return sid, out, images, videos


def _forbidden(processor: Any, tok: Any, markers: RoleMarkers) -> tuple[str, ...]:
    """Special tokens that must not occur in text: turn/vision structure and the role markers.
    Other specials (Qwen's ``<|box_start|>`` grounding tokens, tool tokens) stay allowed."""
    specials = set(tok.all_special_tokens)
    names = set(_STRUCTURAL)
    names.update(str(getattr(processor, a, "")) for a in ("image_token", "video_token"))
    names.update(tok.convert_ids_to_tokens([*markers.start, *markers.end]))
    return tuple(sorted(specials & names))


def _fake_block(ids: Tensor, mm: Tensor, n_tokens: int, tok: Any) -> Tensor:
    """Positions of the first image's ``<|vision_start|> pads <|vision_end|>`` block."""
    pads = torch.nonzero(mm == 1).flatten()[:n_tokens]
    lo, hi = int(pads[0]), int(pads[-1]) + 1
    vs, ve = (tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    if lo > 0 and int(ids[lo - 1]) == vs:
        lo -= 1
    if hi < len(ids) and int(ids[hi]) == ve:
        hi += 1
    return torch.arange(lo, hi)


def tokenize_conversation(
    record: Mapping[str, Any],
    processor: Any,
    *,
    fake_image: bool = False,
    label_policy: str = "assistant",
    max_image_pixels: int | str | None = "pil",
    markers: RoleMarkers | None = None,
) -> dict[str, Any]:
    """Tokenize one Record into a Sample dict (unshifted labels, unpadded, batch dim removed).

    ``max_image_pixels``: the decompression-bomb limit (``"pil"`` = ``PIL.Image.MAX_IMAGE_PIXELS``).
    ``markers``: assistant role markers (default: derived from the processor's template, cached).
    """
    if label_policy not in LABEL_POLICIES:
        raise ValueError(f"{label_policy=} is not one of {LABEL_POLICIES}")
    tok = getattr(processor, "tokenizer", processor)
    markers = markers or resolve_role_markers(processor)
    forbidden = _forbidden(processor, tok, markers)
    sid, conv, image_src, video_src = _parse(record, forbidden)
    n_fake = 0
    if fake_image and not image_src and not video_src:
        first_user = next((m for m in conv if m["role"] == "user"), conv[0])
        first_user["content"].insert(0, {"type": "image"})
        image_src = [Image.new("RGB", (FAKE_IMAGE_SIZE, FAKE_IMAGE_SIZE), (255, 255, 255))]
        n_fake = 1
    images = [load_image(s, sample_id=sid, max_image_pixels=max_image_pixels) for s in image_src]
    videos = [load_video(v, sample_id=sid) for v in video_src]
    kwargs: dict[str, Any] = {"return_tensors": "pt"}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"], kwargs["do_sample_frames"] = videos, False
    try:
        text = processor.apply_chat_template(conv, tokenize=False)
        out = processor(text=[text], **kwargs)
    except Exception as exc:
        reason = "video_error" if videos else "processor_error"
        raise SampleError(
            sid,
            reason,
            f"the processor failed: {type(exc).__name__}: {exc}; "
            "check the media files (videos need a decoder such as torchcodec or "
            "a list of frames)",
        ) from exc
    ids = out["input_ids"][0].long()
    image_id, video_id = (
        getattr(processor, f"{k}_token_id", None) or tok.convert_tokens_to_ids(f"<|{k}_pad|>")
        for k in ("image", "video")
    )
    mm = (ids == image_id).long() + 2 * (ids == video_id).long()
    if "mm_token_type_ids" in out and not torch.equal(out["mm_token_type_ids"][0].long(), mm):
        raise SampleError(
            sid,
            "media_token_mismatch",
            "the processor's mm_token_type_ids "
            "disagree with the image/video pad tokens in input_ids",
        )
    sample: dict[str, Any] = {"sample_id": sid, "input_ids": ids}
    _media(sample, out, sid, processor, mm, len(images), len(videos))

    spans = assistant_spans(ids.tolist(), markers)
    n_assistant = sum(m["role"] == "assistant" for m in conv)
    if len(spans) != n_assistant:
        raise SampleError(
            sid,
            "label_mismatch",
            f"found {len(spans)} assistant turn(s) in the "
            f"tokens but the conversation has {n_assistant}; pass markers= for this "
            "template",
        )
    labels = torch.full_like(ids, IGNORE_INDEX)
    for a, b in spans[-1:] if label_policy == "last_assistant" else spans:
        labels[a:b] = ids[a:b]
    labels[mm != 0] = IGNORE_INDEX
    attention = out["attention_mask"][0].long() if "attention_mask" in out else torch.ones_like(ids)
    if n_fake:
        grid = sample["image_grid_thw"][0]
        merge = int(processor.image_processor.merge_size)
        block = _fake_block(ids, mm, int(grid.prod()) // merge**2, tok)
        attention[block] = 0
        labels[block] = IGNORE_INDEX
    sample.update(labels=labels, attention_mask=attention, mm_token_type_ids=mm)
    return sample


def _media(
    sample: dict[str, Any],
    out: Mapping[str, Any],
    sid: Any,
    processor: Any,
    mm: Tensor,
    n_images: int,
    n_videos: int,
) -> None:
    """Copy media tensors into ``sample`` and check grids against the placeholder counts."""
    for kind, code, n, sub in (
        ("image", 1, n_images, "image_processor"),
        ("video", 2, n_videos, "video_processor"),
    ):
        pv_key = "pixel_values" if kind == "image" else "pixel_values_videos"
        grid = out.get(f"{kind}_grid_thw")
        found = int((mm == code).sum())
        if n == 0:
            if found:
                raise SampleError(
                    sid,
                    "media_token_mismatch",
                    f"{found} {kind} token(s) but no "
                    f"{kind}s; the text carries {kind} special tokens",
                )
            continue
        if grid is None or grid.shape[0] != n:
            raise SampleError(
                sid,
                "media_count_mismatch",
                f"{n} {kind}(s) given but the processor "
                f"returned grid {None if grid is None else tuple(grid.shape)}",
            )
        merge = int(getattr(getattr(processor, sub, None), "merge_size", 2))
        want = int(grid.long().prod(dim=-1).sum()) // merge**2
        if found != want:
            raise SampleError(
                sid,
                "media_token_mismatch",
                f"{found} {kind} token(s) in the text "
                f"but the grids {grid.tolist()} need {want}; the template and the "
                "processor disagree",
            )
        sample[pv_key] = out[pv_key]
        sample[f"{kind}_grid_thw"] = grid.long()
    if n_videos and "second_per_grid_ts" in out:
        sample["second_per_grid_ts"] = torch.as_tensor(
            out["second_per_grid_ts"], dtype=torch.float32
        )
