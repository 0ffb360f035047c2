"""The processor-agnostic tokenizer: any processor with a chat template, no per-model code.

This is the ``chat_template`` family: every processor with a template and no registered class
(InternVL is served by it as is: labels from the derived ``<|im_start|>assistant\n`` markers,
``<IMG_CONTEXT>`` runs checked against ``_get_num_multimodal_tokens``, crops concatenated on
dim 0, a block-causal packed mask), and the base the other families' tokenizers wrap.

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

>>> from neatpack.pipes.testing.tiny import load_tiny_processor
>>> proc = load_tiny_processor("qwen2_vl")
>>> s = tokenize_default({"sample_id": 1, "conversation": [
...     {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, proc)
>>> proc.tokenizer.decode(s["input_ids"][s["labels"] != -100])
'yo<|im_end|>'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from neatpack.pipes.materializing.labels import (
    RoleMarkers,
    conversation_labels,
    resolve_role_markers,
)
from neatpack.pipes.reading._conversation import forbidden_tokens, parse_conversation
from neatpack.pipes.reading.media import SampleError, load_image, load_video

from ._shared import check_modalities
from .processor_compat import media_ids
from .registry import Handler, register_handler

__all__ = [
    "CHAT_TEMPLATE_HANDLER",
    "check_media_counts",
    "default_estimate",
    "forbidden_names",
    "media_token_ids",
    "media_token_types",
    "processor_failure",
    "tokenize_default",
]


MEDIA_CODES = ((1, "image"), (2, "video"), (3, "audio"))  # mm_token_type_ids code, modality


def media_token_ids(processor: Any) -> dict[int, list[int]]:
    """``{1: image ids, 2: video ids, 3: audio ids}`` from the processor, or its tokenizer
    where the processor knows no id (``processor_compat.media_ids``)."""
    return {code: media_ids(processor, kind) for code, kind in MEDIA_CODES}


def processor_failure(sid: Any, exc: Exception, kind: str = "processor_error") -> SampleError:
    """The ``SampleError`` for a processor call that raised ``exc`` on sample ``sid``."""
    return SampleError(sid, kind, f"the processor failed: {type(exc).__name__}: {exc}")


def media_token_types(ids: Tensor, processor: Any) -> Tensor:
    """``mm_token_type_ids`` of ``ids``: 0 text, 1 image, 2 video, 3 audio (``media_token_ids``)."""
    mm = torch.zeros_like(ids)
    for code, tids in media_token_ids(processor).items():
        if tids:
            mm[torch.isin(ids, torch.tensor(tids, dtype=ids.dtype))] = code
    return mm


def forbidden_names(processor: Any, tok: Any, markers: RoleMarkers) -> tuple[str, ...]:
    """Special-token strings a record's text must not contain: the role markers, structural
    tokens and the processor's media tokens (``image_token``, ``boi_token`` ...)."""
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


def check_media_counts(
    sid: Any,
    processor: Any,
    out: Mapping[str, Any],
    mm: Tensor,
    images: list[Any],
    count: ImageTokenCount | None = None,
) -> None:
    """SampleError naming sample ``sid`` when the media tokens of ``mm`` disagree with the
    expected image-token total (``count``, default the processor's
    ``_get_num_multimodal_tokens``) or with the ``*_grid_thw`` grids the processor returned."""
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
    call_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One Record -> one Sample through any chat-template processor (module docstring).

    ``call_kwargs``: extra keyword arguments of the processor call (e.g. Gemma 3's
    ``images_kwargs`` for pan-and-scan: call-time kwargs win on every transformers 5.x).

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
        record, forbidden_names(processor, tok, markers)
    )
    images = [load_image(s, sample_id=sid, max_image_pixels=max_image_pixels) for s in image_src]
    videos = [load_video(v, sample_id=sid) for v in video_src]
    kwargs: dict[str, Any] = {"return_tensors": "pt"}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = videos
    kwargs.update(call_kwargs or {})
    try:
        text = processor.apply_chat_template(conv, tokenize=False)
        if text_hook is not None:
            text = text_hook(text)
        out = processor(text=[text], **kwargs)
    except Exception as exc:
        raise processor_failure(sid, exc) from exc
    ids = out["input_ids"][0].long()
    mm = media_token_types(ids, processor)
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
    check_media_counts(sid, processor, out, mm, images, image_token_count)
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
    Gemma 3 adds newlines around each image: use ``gemma3.gemma3_estimator``."""
    from neatpack.pipes.indexing._template_probe import probe_overhead
    from neatpack.pipes.indexing.estimate import LengthEstimator

    kw: dict[str, Any] = {} if mode == "exact" else {"overhead": probe_overhead(processor)}
    est = LengthEstimator(
        mode=mode, processor=processor, media_fallback=0, on_missing_media="fallback", **kw
    )
    sizes = [[int(m[0]), int(m[1])] for m in record.get("images_meta") or []]
    blocks = (
        processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens if sizes else []
    )
    return int(est.estimate(record)[0]) + sum(int(b) for b in blocks)


CHAT_TEMPLATE_HANDLER = register_handler(
    Handler(
        "chat_template",
        tokenize_default,
        estimate=default_estimate,
        description="any processor with a chat template (pipes/families/chat_template.py)",
    )
)
