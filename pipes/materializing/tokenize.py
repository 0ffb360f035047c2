"""One conversation -> one Sample (``docs/data_contracts.md`` section 4) through the real processor.

>>> from neatpack.pipes.testing.tiny import load_tiny_processor
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

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from neatpack.pipes.contracts import Sample
from neatpack.pipes.materializing.labels import (
    IGNORE_INDEX,
    RoleMarkers,
    conversation_labels,
    resolve_role_markers,
)
from neatpack.pipes.reading._conversation import forbidden_tokens, parse_conversation
from neatpack.pipes.reading.media import SampleError, load_image, load_video

__all__ = [
    "FAKE_IMAGE_SIZE",
    "LABEL_POLICIES",
    "Prepared",
    "SampleError",
    "finish_conversations",
    "prepare_conversation",
    "tokenize_conversation",
    "tokenize_conversations",
]

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


def _known_fps(meta: Any, k: int, total: int, fps: float | None) -> float | None:
    """The block's ``fps``, else ``videos_meta[k][3]`` when that entry counts ``total`` frames."""
    m = meta[k] if isinstance(meta, list | tuple) and k < len(meta) else None
    if fps is None and isinstance(m, list | tuple) and len(m) >= 4 and m[0] == total:
        fps = float(m[3]) if isinstance(m[3], int | float) and m[3] > 0 else None
    return fps


def video_metadata_of(
    record: Mapping[str, Any], videos: list[Any], video_fps: list[float | None]
) -> list[dict[str, Any]] | None:
    """Frame-list videos with a known frame rate: the block's ``fps``, else ``videos_meta[k][3]``
    when that entry counts exactly these frames, else a decoded file's stream rate. ``None``
    (processor default, Qwen's 24 fps) when any video has no known rate. A file decoded to its
    kept frames only (``DecodedVideo.frames_indices``) keeps its place in the whole file:
    ``total_num_frames`` and ``frames_indices`` are the file's, as the processor's own sampling
    would have set them."""
    meta = record.get("videos_meta") or []
    out: list[dict[str, Any]] = []
    for k, (frames, fps) in enumerate(zip(videos, video_fps, strict=True)):
        if not isinstance(frames, list):
            return None
        total = getattr(frames, "total_frames", None) or len(frames)
        fps = _known_fps(meta, k, total, fps)
        if fps is None:  # a decoded file (pipes/reading/video.py): its stream's rate
            fps = getattr(frames, "fps", None)
        if fps is None:
            return None
        kept = getattr(frames, "frames_indices", None)
        indices = list(range(total)) if kept is None else list(kept)
        out.append({"fps": fps, "total_num_frames": total, "frames_indices": indices})
    return out


def _frame_picker(
    video_processor: Any, record: Mapping[str, Any], k: int, fps: float | None, sid: Any
) -> Callable[[int, float], list[int]]:
    """``keep(total_frames, stream_fps)`` for ``decode_video``: the indices the video processor's
    own ``sample_frames`` picks from a file of ``total_frames`` at the rate ``video_metadata_of``
    gives it (the block's ``fps`` / ``videos_meta`` / the stream's), i.e. the frames it would
    keep from the full decode. Its failure is the processor's (``video_error``)."""
    from transformers.video_utils import VideoMetadata

    def keep(total: int, stream_fps: float) -> list[int]:
        rate = _known_fps(record.get("videos_meta"), k, total, fps)
        md = VideoMetadata(
            total_num_frames=total,
            fps=stream_fps if rate is None else rate,
            frames_indices=list(range(total)),
        )
        try:
            return [int(i) for i in video_processor.sample_frames(metadata=md)]
        except Exception as exc:
            raise _processor_error(sid, True, exc) from exc

    return keep


@dataclass
class Prepared:
    """A Record checked, its media loaded and its chat template applied: everything before the
    processor call. ``processor_kwargs`` holds this sample's video options (none for images)."""

    sample_id: Any
    conversation: list[dict[str, Any]]
    text: str
    images: list[Any]
    videos: list[Any]
    processor_kwargs: dict[str, Any]
    markers: RoleMarkers
    n_fake: int


def prepare_conversation(
    record: Mapping[str, Any],
    processor: Any,
    *,
    fake_image: bool = False,
    max_image_pixels: int | str | None = "pil",
    markers: RoleMarkers | None = None,
    sample_frames: bool | None = None,
) -> Prepared:
    """Validate ``record``, load its media and render its template (the per-sample part that can
    fail on bad data). See ``tokenize_conversation`` for the arguments."""
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
    vp = getattr(processor, "video_processor", None)
    if sample_frames is None:
        sample_frames = bool(getattr(vp, "do_sample_frames", False))
    # Files only (a frame list is already in memory): decode just the frames the processor keeps
    pick = (
        sample_frames
        and callable(getattr(vp, "sample_frames", None))
        and all(isinstance(v, str | os.PathLike | bytes) for v in video_src)
    )
    videos = [
        load_video(
            v, sample_id=sid, keep=_frame_picker(vp, record, k, video_fps[k], sid) if pick else None
        )
        for k, v in enumerate(video_src)
    ]
    kwargs: dict[str, Any] = {}
    if videos:
        presampled = all(getattr(v, "frames_indices", None) is not None for v in videos)
        kwargs["videos"], kwargs["do_sample_frames"] = videos, sample_frames and not presampled
        metadata = video_metadata_of(record, videos, video_fps)
        if metadata is not None:
            kwargs["video_metadata"] = metadata
    try:
        text = processor.apply_chat_template(conv, tokenize=False)
    except Exception as exc:
        raise _processor_error(sid, bool(videos), exc) from exc
    return Prepared(sid, conv, text, images, videos, kwargs, markers, n_fake)


def _processor_error(sid: Any, video: bool, exc: Exception) -> SampleError:
    return SampleError(
        sid,
        "video_error" if video else "processor_error",
        f"the processor failed: {type(exc).__name__}: {exc}; "
        "check the media files (videos need a decoder such as torchcodec or a list of frames)",
    )


def _call(processor: Any, batch: Sequence[Prepared]) -> list[dict[str, Any]]:
    """One processor call for ``batch`` (at most one sample when it has videos), split back
    into one output dict per sample. Media rows are views into the call's tensors, in order,
    so ``build_pack`` can take a pack's pixels without copying them again."""
    images = [im for p in batch for im in p.images]
    kwargs: dict[str, Any] = {}
    if len(batch) == 1:  # rows of equal length: tensors straight from the processor
        kwargs = {"return_tensors": "pt", **batch[0].processor_kwargs}
    if images:
        kwargs["images"] = images
    out = processor(text=[p.text for p in batch], **kwargs)
    rows: list[dict[str, Any]] = [{} for _ in batch]
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in out:
            for row, v in zip(rows, out[key], strict=True):
                row[key] = torch.as_tensor(v).long()
    for kind, pv_key, count in (
        ("image", "pixel_values", [len(p.images) for p in batch]),
        ("video", "pixel_values_videos", [len(p.videos) for p in batch]),
    ):
        grid = out.get(f"{kind}_grid_thw")
        if grid is None:
            continue
        grid = torch.as_tensor(grid)
        pixels = _pixel_rows(out.get(pv_key))
        if len(batch) == 1 or pixels is None or sum(count) != grid.shape[0]:
            if len(batch) != 1:  # cannot split by sample; the caller falls back to one by one
                raise ValueError(f"{kind} grid {tuple(grid.shape)} vs {count} {kind}s per sample")
            rows[0][f"{kind}_grid_thw"], rows[0][pv_key] = grid, pixels
            continue
        per_item = grid.long().prod(dim=-1).tolist()
        at = 0
        g = 0
        for row, n in zip(rows, count, strict=True):
            if n:
                r = sum(per_item[g : g + n])
                row[f"{kind}_grid_thw"] = grid[g : g + n]
                row[pv_key] = pixels[at : at + r]
                at, g = at + r, g + n
    if "second_per_grid_ts" in out and len(batch) == 1:
        rows[0]["second_per_grid_ts"] = out["second_per_grid_ts"]
    return rows


def _pixel_rows(pixels: Any) -> Any:
    """A processor's pixels as one ``[rows, C*T*P*P]`` tensor. Without ``return_tensors`` (a
    batched call) ``Qwen2VLImageProcessorPil`` returns a list of numpy rows, one per patch, which
    the model refuses; the torchvision processor already returns a tensor. Ragged values (per
    image arrays of different widths) stay as they are, for the caller that handles them."""
    if pixels is None or isinstance(pixels, Tensor):
        return pixels
    if isinstance(pixels, np.ndarray):
        return torch.from_numpy(pixels)
    rows = [np.asarray(r) for r in pixels]
    if not rows or len({(r.dtype, r.ndim, r.shape[-1]) for r in rows}) != 1:
        return pixels
    return torch.from_numpy(np.stack(rows) if rows[0].ndim == 1 else np.concatenate(rows))


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
    _check_policy(label_policy)
    prep = prepare_conversation(
        record, processor, fake_image=fake_image, max_image_pixels=max_image_pixels,
        markers=markers, sample_frames=sample_frames,
    )  # fmt: skip
    return finish_conversations([prep], processor, label_policy=label_policy)[0]


def tokenize_conversations(
    records: Sequence[Mapping[str, Any]], processor: Any, **options: Any
) -> list[Sample]:
    """``tokenize_conversation`` for several Records with ONE processor call for all of those
    without videos (the image processor resizes same-size images together, and the per-call
    overhead is paid once). Each Sample equals ``tokenize_conversation``'s for its record, and the
    samples' pixel rows are consecutive views of one tensor (``clone()`` a sample's
    ``pixel_values`` before keeping it alone: a view pickles with the whole tensor). Same
    keyword options."""
    label_policy = options.pop("label_policy", "assistant")
    _check_policy(label_policy)
    preps = [prepare_conversation(r, processor, **options) for r in records]
    samples = finish_conversations(preps, processor, label_policy=label_policy)
    return cast(list[Sample], samples)  # docs/data_contracts.md section 4


def _check_policy(label_policy: str) -> None:
    if label_policy not in LABEL_POLICIES:
        raise ValueError(f"{label_policy=} is not one of {LABEL_POLICIES}")


def finish_conversations(
    preps: Sequence[Prepared], processor: Any, *, label_policy: str = "assistant"
) -> list[dict[str, Any]]:
    """Run the processor on prepared samples and check and label each one. Samples without
    videos share one call; if that call fails, each sample is retried alone so the error names
    its own sample id."""
    rows: list[dict[str, Any] | None] = [None] * len(preps)
    batch = [k for k, p in enumerate(preps) if not p.videos]
    if len(batch) > 1:
        try:
            for k, got in zip(batch, _call(processor, [preps[k] for k in batch]), strict=True):
                rows[k] = got
        except Exception:  # retried one by one below, so the error names its sample
            rows = [None] * len(preps)
    out: list[dict[str, Any]] = []
    for prep, row in zip(preps, rows, strict=True):
        if row is None:
            try:
                row = _call(processor, [prep])[0]
            except Exception as exc:
                raise _processor_error(prep.sample_id, bool(prep.videos), exc) from exc
        out.append(_finish(prep, row, processor, label_policy))
    return out


def _finish(
    prep: Prepared, row: Mapping[str, Any], processor: Any, label_policy: str
) -> dict[str, Any]:
    """One sample's processor output -> a checked, labelled Sample."""
    sid, tok = prep.sample_id, getattr(processor, "tokenizer", processor)
    ids = row["input_ids"]
    image_id, video_id = (
        getattr(processor, f"{k}_token_id", None) or tok.convert_tokens_to_ids(f"<|{k}_pad|>")
        for k in ("image", "video")
    )
    mm = (ids == image_id).long() + 2 * (ids == video_id).long()
    if "mm_token_type_ids" in row and not torch.equal(row["mm_token_type_ids"], mm):
        raise SampleError(
            sid,
            "media_token_mismatch",
            "the processor's mm_token_type_ids "
            "disagree with the image/video pad tokens in input_ids",
        )
    sample: dict[str, Any] = {"sample_id": sid, "input_ids": ids}
    _media(sample, row, sid, processor, mm, len(prep.images), len(prep.videos))

    labels = conversation_labels(
        ids, prep.conversation, prep.markers, sample_id=sid, mm_token_type_ids=mm,
        label_policy=label_policy,
    )  # fmt: skip
    attention = row["attention_mask"] if "attention_mask" in row else torch.ones_like(ids)
    if prep.n_fake:
        grid = sample["image_grid_thw"][0]
        merge = int(processor.image_processor.merge_size)
        block = _fake_block(ids, mm, int(grid.prod()) // merge**2, tok)
        attention = attention.clone()
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
