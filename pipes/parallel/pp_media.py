"""Split a batch's media into pipeline-parallel micro-batches that own the right samples.

``torch.distributed.pipelining`` splits every text tensor of a batch by rows with
``torch.tensor_split``: B=6 rows in n=4 micro-batches are rows ``[0,1] [2,3] [4] [5]``. Media
are not row-aligned (one sample may own 0..k images, each many patch rows), so they are pulled
out of the batch here and pre-split with *the same* row split, by sample ownership::

    n_images_per_sample = [1, 0, 2, 1, 0, 1]       patches per image (grid t*h*w) = 4 each
    micro-batch     0          1          2         3
    samples       [0, 1]     [2, 3]      [4]       [5]
    images        [0]        [1, 2, 3]   []        [4]
    patch rows    [0:4]      [4:16]      [16:16]   [16:20]

The seed splits with ``ceil(B/n)`` samples per micro-batch (``[2,2,2,0]`` for B=6, n=4, and
``torch.chunk`` in two layouts, which may return fewer than n chunks): its media then belong to
other samples than the text rows the schedule pairs them with (peer note B16). Here every
layout follows ``torch.tensor_split`` and always returns exactly ``n`` chunks; ``n > B`` is a
``ValueError`` (pipelining itself refuses it). Per-sample counts, when given, always win over
the shape heuristics (the seed ignores them when ``pixel_values.shape[0] == B``).

This module is the Qwen-VL path (patch rows counted from grids). The other families (Gemma 3/4,
LLaVA-OneVision, Idefics3, InternVL, Qwen2.5-Omni), whose media items are counted per row from
the packs' samples, and their fixed-length rows: ``pp_family_media``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "VLM_PP_MEDIA_KEY",
    "chunk_step3_media",
    "chunk_vlm_media",
    "microbatch_bounds",
    "prepare_vlm_media_for_pp",
    "stage_vlm_media_for_pp",
    "wrap_vlm_collate_for_pp",
]

VLM_PP_MEDIA_KEY = "_vlm_pp_media_chunks"
_GRID_KEYS = ("image_grid_hws", "image_grid_thw", "image_sizes", "image_position_ids")
_VLM_MEDIA_KEYS = (
    "pixel_values",
    "patch_pixel_values",
    "num_patches",
    "patch_newline_mask",
    *_GRID_KEYS,
    "n_images_per_sample",
    "pixel_values_videos",
    "video_grid_thw",
    "n_videos_per_sample",
    "second_per_grid_ts",  # not in the seed's list: a per-video tensor pipelining would mis-split
)
Media = Tensor | list[Tensor]


def microbatch_bounds(batch_size: int, n_microbatches: int) -> list[tuple[int, int]]:
    """Sample ranges ``[start, stop)`` of each micro-batch, as ``torch.tensor_split`` makes them.

    >>> microbatch_bounds(6, 4)
    [(0, 2), (2, 4), (4, 5), (5, 6)]
    """
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1; got {n_microbatches=}")
    if batch_size < n_microbatches:
        raise ValueError(
            f"{n_microbatches=} > {batch_size=}: some micro-batch would have no sample "
            "(torch.distributed.pipelining refuses this too); use a batch of at least "
            "n_microbatches rows."
        )
    q, r = divmod(batch_size, n_microbatches)
    sizes = [q + (i < r) for i in range(n_microbatches)]
    starts = [sum(sizes[:i]) for i in range(n_microbatches)]
    return [(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def _cum(counts: Sequence[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def _take(media: Media, start: int, stop: int) -> Media:
    return media[start:stop]


def chunk_vlm_media(
    pixel_values: Media,
    image_grid: Tensor,
    batch_size: int,
    n_microbatches: int,
    n_images_per_sample: Tensor | Sequence[int] | None = None,
) -> tuple[list[Media], list[Tensor]]:
    """Split ``pixel_values`` and ``image_grid`` into ``n_microbatches`` chunks by sample owner.

    Layouts: (1) ``[B,C,H,W]`` one full image per sample; (2) ``[B,P,D]`` padded patches per
    sample; (3) flat patches ``[sum P, D]`` (or per-image rows ``[N_img, ...]`` / a list of
    per-image tensors) with ``n_images_per_sample``; (4) legacy flat patches with exactly one
    image per sample (``image_grid.shape[0] == B``). Patch counts of flat layouts are
    ``image_grid.prod(-1)`` (thw or hw grids).
    """
    bounds = microbatch_bounds(batch_size, n_microbatches)
    n_rows = len(pixel_values) if isinstance(pixel_values, list) else int(pixel_values.shape[0])
    if n_images_per_sample is None:
        if (
            isinstance(pixel_values, Tensor)
            and pixel_values.dim() in (3, 4)
            and n_rows == batch_size
        ):
            counts = [1] * batch_size  # layouts 1 / 2: row i belongs to sample i
        elif int(image_grid.shape[0]) == batch_size:
            counts = [1] * batch_size  # layout 4: one image per sample, flat patches
        else:
            raise ValueError(
                "VLM PP chunking cannot align pixel_values with the batch: "
                f"pixel_values {tuple(getattr(pixel_values, 'shape', (n_rows,)))}, "
                f"image_grid {tuple(image_grid.shape)}, {batch_size=}; pass n_images_per_sample."
            )
    else:
        counts = [int(c) for c in torch.as_tensor(n_images_per_sample).reshape(-1).tolist()]
    if len(counts) != batch_size or sum(counts) != int(image_grid.shape[0]):
        raise ValueError(
            f"n_images_per_sample={counts} must have {batch_size=} entries summing to the "
            f"{int(image_grid.shape[0])} grid rows."
        )
    img_cum = _cum(counts)
    per_image = isinstance(pixel_values, list) or (
        pixel_values.dim() >= 3 and n_rows == sum(counts)
    )
    if per_image:
        row_cum = list(range(sum(counts) + 1))  # one row (or list item) per image
    else:
        patches = image_grid.long().prod(dim=-1).tolist()
        row_cum = _cum(patches)
        if row_cum[-1] != n_rows:
            raise ValueError(
                f"pixel_values has {n_rows} patch rows but image_grid implies {row_cum[-1]} "
                f"(grid {image_grid.tolist()}); the media do not match their grids."
            )
    pv_chunks: list[Media] = []
    grid_chunks: list[Tensor] = []
    for s0, s1 in bounds:
        i0, i1 = img_cum[s0], img_cum[s1]
        pv_chunks.append(_take(pixel_values, row_cum[i0], row_cum[i1]))
        grid_chunks.append(image_grid[i0:i1])
    return pv_chunks, grid_chunks


def chunk_step3_media(
    pixel_values: Tensor,
    batch_size: int,
    n_microbatches: int,
    num_patches: Tensor | None = None,
    patch_pixel_values: Tensor | None = None,
    patch_newline_mask: Tensor | None = None,
) -> dict[str, list[Tensor]]:
    """Step3-style media: one full image per sample plus ``num_patches[i]`` crop patches each.

    ``pixel_values`` is ``[B, ...]`` (split by sample) or flat ``[sum num_patches, ...]`` (split
    by patch); ``patch_pixel_values`` / ``patch_newline_mask`` are split by patch.
    """
    bounds = microbatch_bounds(batch_size, n_microbatches)
    counts = torch.zeros(batch_size, dtype=torch.long) if num_patches is None else num_patches
    if int(counts.numel()) != batch_size:
        raise ValueError(f"num_patches has {counts.numel()} entries; expected {batch_size=}")
    cum = _cum(counts.reshape(-1).tolist())
    flat = int(pixel_values.shape[0]) != batch_size
    if flat and cum[-1] != int(pixel_values.shape[0]):
        raise ValueError(
            f"flat pixel_values has {pixel_values.shape[0]} rows but sum(num_patches)={cum[-1]}"
        )
    for name, t in (
        ("patch_pixel_values", patch_pixel_values),
        ("patch_newline_mask", patch_newline_mask),
    ):
        if t is not None and int(t.shape[0]) != cum[-1]:
            raise ValueError(f"{name} has {t.shape[0]} rows but sum(num_patches)={cum[-1]}")
    out: dict[str, list[Tensor]] = {"pixel_values": [], "num_patches": []}
    if patch_pixel_values is not None:
        out["patch_pixel_values"] = []
    if patch_newline_mask is not None:
        out["patch_newline_mask"] = []
    for s0, s1 in bounds:
        p0, p1 = cum[s0], cum[s1]
        out["pixel_values"].append(pixel_values[p0:p1] if flat else pixel_values[s0:s1])
        out["num_patches"].append(counts[s0:s1])
        if patch_pixel_values is not None:
            out["patch_pixel_values"].append(patch_pixel_values[p0:p1])
        if patch_newline_mask is not None:
            out["patch_newline_mask"].append(patch_newline_mask[p0:p1])
    return out


def prepare_vlm_media_for_pp(
    batch: MutableMapping[str, Any], batch_size: int, n_microbatches: int
) -> MutableMapping[str, Any]:
    """Pop the media keys of ``batch`` and store per-micro-batch chunks at ``VLM_PP_MEDIA_KEY``.

    Image grids are stored under ``image_grid_hws`` whatever their source key (seed layout);
    videos under ``pixel_values_videos`` / ``video_grid_thw`` (+ ``second_per_grid_ts``).
    ``n_*_per_sample`` are consumed and their chunks kept too. A batch without media is
    returned unchanged.
    """
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1; got {n_microbatches=}")
    if not any(k in batch for k in _VLM_MEDIA_KEYS):
        return batch
    media = {k: batch.pop(k) for k in _VLM_MEDIA_KEYS if k in batch}
    media = {k: v for k, v in media.items() if v is not None}
    pp: dict[str, list[Any]] = {}
    bounds = microbatch_bounds(batch_size, n_microbatches)
    grid_key = next((k for k in _GRID_KEYS if k in media), None)
    n_img = media.get("n_images_per_sample")
    pv = media.get("pixel_values")
    if pv is not None and grid_key is None:
        pp.update(
            chunk_step3_media(
                pv,
                batch_size,
                n_microbatches,
                media.get("num_patches"),
                media.get("patch_pixel_values"),
                media.get("patch_newline_mask"),
            )
        )
    elif pv is not None and grid_key is not None:
        grid = media[grid_key]
        if grid_key == "image_sizes" and isinstance(pv, Tensor) and pv.dim() == 2:
            raise ValueError("flat pixel_values with only image_sizes: patch counts are unknown")
        pp["pixel_values"], pp["image_grid_hws"] = chunk_vlm_media(
            pv, grid, batch_size, n_microbatches, n_img
        )
    if n_img is not None:
        pp["n_images_per_sample"] = [n_img[a:b] for a, b in bounds]
    pvv = media.get("pixel_values_videos")
    if pvv is not None:
        vgrid = media.get("video_grid_thw")
        if vgrid is None:
            raise ValueError("pixel_values_videos without video_grid_thw cannot be split for PP")
        n_vid = media.get("n_videos_per_sample")
        pp["pixel_values_videos"], pp["video_grid_thw"] = chunk_vlm_media(
            pvv, vgrid, batch_size, n_microbatches, n_vid
        )
        counts = [int(g.shape[0]) for g in pp["video_grid_thw"]]
        if "second_per_grid_ts" in media:
            cum = _cum(counts)
            ts = media["second_per_grid_ts"]
            pp["second_per_grid_ts"] = [ts[cum[i] : cum[i + 1]] for i in range(len(counts))]
        if n_vid is not None:
            pp["n_videos_per_sample"] = [n_vid[a:b] for a, b in bounds]
    if pp:
        batch[VLM_PP_MEDIA_KEY] = pp
    return batch


def wrap_vlm_collate_for_pp(
    collate_fn: Callable[[Any], MutableMapping[str, Any]], n_microbatches: int
) -> Callable[[Any], MutableMapping[str, Any]]:
    """Wrap ``collate_fn`` so its batches carry media pre-split for ``n_microbatches``."""
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1; got {n_microbatches=}")

    def collate(examples: Any) -> MutableMapping[str, Any]:
        batch = collate_fn(examples)
        if not isinstance(batch, MutableMapping) or not any(k in batch for k in _VLM_MEDIA_KEYS):
            return batch
        ids = batch.get("input_ids")
        if not isinstance(ids, Tensor):
            raise ValueError("a VLM batch for PP needs input_ids to know its batch size")
        return prepare_vlm_media_for_pp(batch, int(ids.shape[0]), n_microbatches)

    return collate


_STAGE_ATTRS = {
    "pixel_values": "_vlm_pixel_values_chunks",
    "image_grid_hws": "_vlm_image_grid_hws_chunks",
    "num_patches": "_vlm_num_patches_chunks",
    "patch_pixel_values": "_vlm_patch_pixel_values_chunks",
    "patch_newline_mask": "_vlm_patch_newline_mask_chunks",
    "pixel_values_videos": "_vlm_pixel_values_videos_chunks",
    "video_grid_thw": "_vlm_video_grid_thw_chunks",
}


@contextmanager
def stage_vlm_media_for_pp(
    pp: Any, model_parts: list[torch.nn.Module], batch: MutableMapping[str, Any]
) -> Iterator[None]:
    """Attach the batch's media chunks to stage 0 (``model_parts[0]``) for one schedule call.

    Pops ``VLM_PP_MEDIA_KEY``; on the first stage (``pp.info.has_first_stage``) sets
    ``_vlm_<key>_chunks`` attributes and ``_vlm_chunk_idx = 0``, which the model's forward
    advances per micro-batch. If the schedule will first run a shape-inference forward
    (``pp.info.schedule`` stages not yet initialised), a one-shot forward hook resets the index
    after it. Every attribute is set back to ``None`` on exit.
    """
    chunks = batch.pop(VLM_PP_MEDIA_KEY, None) or {}
    info = getattr(pp, "info", None)
    stage0 = model_parts[0] if model_parts and getattr(info, "has_first_stage", False) else None
    handles: list[Any] = []
    if stage0 is not None:
        for key, attr in _STAGE_ATTRS.items():
            setattr(stage0, attr, chunks.get(key))
        stage0._vlm_chunk_idx = 0  # type: ignore[assignment]
        if _needs_shape_inference(info):

            def reset(module: torch.nn.Module, args: Any, output: Any) -> None:
                module._vlm_chunk_idx = 0  # type: ignore[assignment]
                for h in handles:
                    h.remove()

            handles.append(stage0.register_forward_hook(reset))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if stage0 is not None:
            for attr in (*_STAGE_ATTRS.values(), "_vlm_chunk_idx"):
                setattr(stage0, attr, None)


def _needs_shape_inference(info: Any) -> bool:
    schedule = getattr(info, "schedule", None)
    if schedule is None:
        return False
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    first = stages[0] if stages else None
    if first is None or hasattr(first, "_configure_outputs_meta"):
        return False
    if getattr(first, "_user_meta", None):
        return False
    flag = getattr(schedule, "_stages_forward_initialized", None)
    if flag is None:
        flag = getattr(schedule, "_stage_forward_initialized", True)
    return not flag
