"""One conversation -> one Sample (``docs/data_contracts.md`` section 4) through the real processor.

>>> from neatpack.pipes.tiny import load_tiny_processor
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

``mm_token_type_ids`` (0 text, 1 image, 2 video) is computed from the image/video pad ids and
checked against the processor's own (transformers 5.x Qwen-VL processors return it because their
class sets ``return_mm_token_type_ids = True``); the models refuse media without it.

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

from ._conversation import forbidden_tokens, parse_conversation
from .labels import IGNORE_INDEX, RoleMarkers, conversation_labels, resolve_role_markers
from .media import SampleError, load_image, load_video

__all__ = ["FAKE_IMAGE_SIZE", "LABEL_POLICIES", "SampleError", "tokenize_conversation"]

LABEL_POLICIES: Final = ("assistant", "last_assistant")
"""``assistant``: every assistant turn; ``last_assistant``: only the final one."""
FAKE_IMAGE_SIZE: Final = 56


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


def _video_metadata(
    record: Mapping[str, Any], videos: list[Any], video_fps: list[float | None]
) -> list[dict[str, Any]] | None:
    """Frame-list videos with a known frame rate: the block's ``fps``, else ``videos_meta[k][3]``
    when that entry counts exactly these frames. ``None`` (processor default, Qwen's 24 fps)
    when any video is a file (its decoder reads the real metadata) or has no known rate."""
    meta = record.get("videos_meta") or []
    out: list[dict[str, Any]] = []
    for k, (frames, fps) in enumerate(zip(videos, video_fps, strict=True)):
        if not isinstance(frames, list):
            return None
        m = meta[k] if k < len(meta) else None
        if fps is None and isinstance(m, list | tuple) and len(m) >= 4 and m[0] == len(frames):
            fps = float(m[3]) if isinstance(m[3], int | float) and m[3] > 0 else None
        if fps is None:
            return None
        n = len(frames)
        out.append({"fps": fps, "total_num_frames": n, "frames_indices": list(range(n))})
    return out


def tokenize_conversation(
    record: Mapping[str, Any],
    processor: Any,
    *,
    fake_image: bool = False,
    label_policy: str = "assistant",
    max_image_pixels: int | str | None = "pil",
    markers: RoleMarkers | None = None,
    sample_frames: bool | None = None,
) -> dict[str, Any]:
    """Tokenize one Record into a Sample dict (unshifted labels, unpadded, batch dim removed).

    ``max_image_pixels``: the decompression-bomb limit (``"pil"`` = ``PIL.Image.MAX_IMAGE_PIXELS``).
    ``markers``: assistant role markers (default: derived from the processor's template, cached).
    ``sample_frames``: ``None`` follows the video processor's ``do_sample_frames`` (Qwen3-VL: on,
    at its ``fps``; the length estimator assumes the same), ``False`` keeps every given frame.
    """
    if label_policy not in LABEL_POLICIES:
        raise ValueError(f"{label_policy=} is not one of {LABEL_POLICIES}")
    tok = getattr(processor, "tokenizer", processor)
    markers = markers or resolve_role_markers(processor)
    forbidden = forbidden_tokens(processor, tok, markers)
    sid, conv, image_src, video_src, video_fps = parse_conversation(record, forbidden)
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
        if sample_frames is None:
            vp = getattr(processor, "video_processor", None)
            sample_frames = bool(getattr(vp, "do_sample_frames", False))
        kwargs["videos"], kwargs["do_sample_frames"] = videos, sample_frames
        metadata = _video_metadata(record, videos, video_fps)
        if metadata is not None:
            kwargs["video_metadata"] = metadata
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

    labels = conversation_labels(
        ids, conv, markers, sample_id=sid, mm_token_type_ids=mm, label_policy=label_policy
    )
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
