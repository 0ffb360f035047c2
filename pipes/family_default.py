"""The processor-agnostic tokenizer: any processor with a chat template, no per-model code.

* text: ``processor.apply_chat_template(conversation, tokenize=False)`` then ``processor(text=...,
  images=..., videos=...)``;
* labels: the assistant role markers derived from the template (``labels.resolve_role_markers``),
  content + end marker labelled, media tokens never;
* ``mm_token_type_ids`` (0 text, 1 image, 2 video, 3 audio) from the processor's own
  ``image_token_ids`` / ``video_token_ids`` / ``audio_token_ids`` (the ids transformers 5.x uses
  to build the same array), checked against the processor's returned array when it gives one
  (Gemma 3 calls it ``token_type_ids``);
* media token counts: the image-token count must equal the processor's own
  ``_get_num_multimodal_tokens(image_sizes=...)`` total (and, when it returns ``*_grid_thw``,
  ``prod(grid) // merge**2``);
* every other tensor the processor returns (``pixel_values``, ``image_grid_thw``,
  ``token_type_ids``, ``num_crops``...) is kept in the Sample under its own name, batch dim
  removed for token-aligned ones.

>>> from neatpack.pipes.tiny import load_tiny_processor
>>> proc = load_tiny_processor("qwen2_vl")
>>> s = tokenize_default({"sample_id": 1, "conversation": [
...     {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, proc)
>>> proc.tokenizer.decode(s["input_ids"][s["labels"] != -100])
'yo<|im_end|>'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import torch
from torch import Tensor

from ._conversation import forbidden_tokens, parse_conversation
from .labels import (
    RoleMarkers,
    conversation_labels,
    resolve_role_markers,
    template_text,
)
from .media import SampleError, load_image, load_video

__all__ = [
    "check_modalities",
    "default_estimate",
    "has_chat_template",
    "media_token_ids",
    "tokenize_default",
]

MEDIA_KINDS: Final = ("image", "video", "audio")


def has_chat_template(processor: Any) -> bool:
    """True when the processor or its tokenizer carries a chat template string."""
    return bool(template_text(processor))


_AUDIO_SUBPROCESSORS: Final = ("feature_extractor", "audio_processor")


def processor_modalities(processor: Any) -> frozenset[str]:
    """Media kinds the processor can take: from its ``image_processor`` / ``video_processor`` /
    ``feature_extractor`` or ``audio_processor`` (audio) sub-processors. Both audio names are
    in use: Qwen-Omni / Gemma 4 say ``feature_extractor``, Phi-4-multimodal ``audio_processor``
    (a ``Phi4MultimodalFeatureExtractor``), so a check on one name alone refuses Phi-4's audio."""
    kinds = {"image"} if getattr(processor, "image_processor", None) is not None else set()
    if getattr(processor, "video_processor", None) is not None:
        kinds.add("video")
    if any(getattr(processor, a, None) is not None for a in _AUDIO_SUBPROCESSORS):
        kinds.add("audio")
    return frozenset(kinds)


def check_modalities(record: Mapping[str, Any], processor: Any, allowed: frozenset[str]) -> None:
    """SampleError naming the sample when a block's media kind is one the family cannot take
    (the handler's ``allowed`` kinds intersected with the processor's sub-processors)."""
    conv = record.get("conversation") if isinstance(record, Mapping) else None
    if not isinstance(conv, list):
        return  # parse_conversation reports it
    can = allowed & processor_modalities(processor)
    for k, msg in enumerate(conv):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            if not isinstance(block, Mapping):
                continue
            kind = block.get("type") or next((m for m in MEDIA_KINDS if m in block), None)
            if kind in MEDIA_KINDS and kind not in can:
                raise SampleError(
                    record.get("sample_id"),
                    "bad_media",
                    f"message {k} block {j} is {kind!r} but {type(processor).__name__} takes "
                    f"only {sorted(can) or 'text'}; drop the {kind} or use a family with {kind}",
                )


def media_token_ids(processor: Any) -> dict[int, list[int]]:
    """``{1: image ids, 2: video ids, 3: audio ids}`` from the processor (None entries dropped)."""
    out: dict[int, list[int]] = {}
    for code, kind in ((1, "image"), (2, "video"), (3, "audio")):
        try:
            ids = getattr(processor, f"{kind}_token_ids", None) or []
        except AttributeError:
            ids = []
        if isinstance(ids, int):  # transformers 5.17 tokenizers: one id, not a list
            ids = [ids]
        out[code] = [int(i) for i in ids if i is not None]
    return out


def processor_failure(sid: Any, exc: Exception, kind: str = "processor_error") -> SampleError:
    """The ``SampleError`` for a processor call that raised ``exc`` on sample ``sid``."""
    return SampleError(sid, kind, f"the processor failed: {type(exc).__name__}: {exc}")


def _mm_types(ids: Tensor, processor: Any) -> Tensor:
    mm = torch.zeros_like(ids)
    for code, tids in media_token_ids(processor).items():
        if tids:
            mm[torch.isin(ids, torch.tensor(tids, dtype=ids.dtype))] = code
    return mm


def _forbidden(processor: Any, tok: Any, markers: RoleMarkers) -> tuple[str, ...]:
    names = set(forbidden_tokens(processor, tok, markers))
    for attr in ("image_token", "video_token", "audio_token", "boi_token", "eoi_token"):
        for obj in (processor, tok):
            value = getattr(obj, attr, None)
            if isinstance(value, str) and value:
                names.add(value)
    return tuple(sorted(names))


def _expected_image_tokens(processor: Any, images: list[Any]) -> int | None:
    fn = getattr(processor, "_get_num_multimodal_tokens", None)
    if fn is None or not images:
        return None
    try:
        data = fn(image_sizes=[(im.height, im.width) for im in images])
    except (NotImplementedError, TypeError):
        return None
    counts = getattr(data, "num_image_tokens", None)
    return None if counts is None else int(sum(counts))


ImageTokenCount = Callable[[Any, list[Any]], "int | None"]


def _check_counts(
    sid: Any,
    processor: Any,
    out: Mapping[str, Any],
    mm: Tensor,
    images: list[Any],
    count: ImageTokenCount | None = None,
) -> None:
    found = int((mm == 1).sum())
    want = (count or _expected_image_tokens)(processor, images) if images else None
    if want is not None and found != want:
        raise SampleError(
            sid,
            "media_token_mismatch",
            f"{found} image token(s) in the text but the processor's "
            f"_get_num_multimodal_tokens gives {want} for {len(images)} image(s)",
        )
    for code, kind, sub in ((1, "image", "image_processor"), (2, "video", "video_processor")):
        grid = out.get(f"{kind}_grid_thw")
        if grid is None:
            continue
        merge = int(getattr(getattr(processor, sub, None), "merge_size", 1) or 1)
        need = int(torch.as_tensor(grid).long().prod(dim=-1).sum()) // merge**2
        got = int((mm == code).sum())
        if got != need:
            raise SampleError(
                sid,
                "media_token_mismatch",
                f"{got} {kind} token(s) but {kind}_grid_thw {torch.as_tensor(grid).tolist()} "
                f"needs {need}",
            )


def tokenize_default(
    record: Mapping[str, Any],
    processor: Any,
    *,
    label_policy: str = "assistant",
    markers: RoleMarkers | None = None,
    max_image_pixels: int | str | None = "pil",
    modalities: frozenset[str] = frozenset({"image", "video"}),
    text_hook: Callable[[str], str] | None = None,
    image_token_count: ImageTokenCount | None = None,
) -> dict[str, Any]:
    """One Record -> one Sample through any chat-template processor (module docstring).

    ``text_hook``: rewrites the templated text before the processor sees it (a family hook,
    e.g. Gemma 4's thinking-channel prefix); ``markers`` must then describe the rewritten turns.
    ``image_token_count(processor, images)``: the family's expected image-token total (default:
    the processor's ``_get_num_multimodal_tokens``; None skips the check).
    """
    if label_policy not in ("assistant", "last_assistant"):
        raise ValueError(f"{label_policy=} is not one of ('assistant', 'last_assistant')")
    check_modalities(record, processor, modalities)
    tok = getattr(processor, "tokenizer", processor)
    markers = markers or resolve_role_markers(processor)
    sid, conv, image_src, video_src, _fps = parse_conversation(
        record, _forbidden(processor, tok, markers)
    )
    images = [load_image(s, sample_id=sid, max_image_pixels=max_image_pixels) for s in image_src]
    videos = [load_video(v, sample_id=sid) for v in video_src]
    kwargs: dict[str, Any] = {"return_tensors": "pt"}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = videos
    try:
        text = processor.apply_chat_template(conv, tokenize=False)
        if text_hook is not None:
            text = text_hook(text)
        out = processor(text=[text], **kwargs)
    except Exception as exc:
        raise processor_failure(sid, exc) from exc
    ids = out["input_ids"][0].long()
    mm = _mm_types(ids, processor)
    theirs = out.get("mm_token_type_ids", out.get("token_type_ids"))
    if theirs is not None and not torch.equal((theirs[0].long() != 0), (mm != 0)):
        raise SampleError(
            sid, "media_token_mismatch", "the processor's token types disagree with its media ids"
        )
    for code, n, kind in ((1, len(images), "image"), (2, len(videos), "video")):
        if n == 0 and bool((mm == code).any()):
            raise SampleError(
                sid, "media_token_mismatch", f"{kind} tokens in the text but no {kind}s"
            )
    _check_counts(sid, processor, out, mm, images, image_token_count)
    labels = conversation_labels(
        ids, conv, markers, sample_id=sid, mm_token_type_ids=mm, label_policy=label_policy
    )
    sample: dict[str, Any] = {"sample_id": sid, "input_ids": ids}
    length = ids.shape[0]
    for key, value in out.items():
        if key in ("input_ids", "attention_mask", "mm_token_type_ids") or value is None:
            continue
        value = torch.as_tensor(value)
        token_aligned = value.dim() == 2 and value.shape == (1, length)
        sample[key] = value[0] if token_aligned else value
    attention = out["attention_mask"][0].long() if "attention_mask" in out else torch.ones_like(ids)
    sample.update(labels=labels, attention_mask=attention, mm_token_type_ids=mm)
    return sample


def default_estimate(record: Mapping[str, Any], processor: Any, *, mode: str = "exact") -> int:
    """Processor-agnostic length after the shift: the text (``LengthEstimator`` in ``mode``;
    the media placeholder tokens excluded) plus, per image of ``record["images_meta"]``
    (``[height, width]``), the processor's own ``_get_num_multimodal_tokens`` count. Exact when
    that count is the placeholder's whole expansion (InternVL, LLaVA-OneVision, Idefics3);
    Gemma 3 adds newlines around each image: use ``family_gemma3.gemma3_estimator``."""
    from ._template_probe import probe_overhead
    from .estimate import LengthEstimator

    kw: dict[str, Any] = {} if mode == "exact" else {"overhead": probe_overhead(processor)}
    est = LengthEstimator(
        mode=mode, processor=processor, media_fallback=0, on_missing_media="fallback", **kw
    )
    sizes = [[int(m[0]), int(m[1])] for m in record.get("images_meta") or []]
    blocks = (
        processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens if sizes else []
    )
    return int(est.estimate(record)[0]) + sum(int(b) for b in blocks)
