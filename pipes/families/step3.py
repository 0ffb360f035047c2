"""Step3-style crops (``Step3p7Processor`` / ``Step3p7ForConditionalGeneration``, Step-3.7).

What differs from the default path:

* image tokens: the image processor cuts each image into a square global view (``size``) plus
  0..k local crops (a sliding window of ``patch_size``, adapted to the aspect ratio), and the
  processor replaces the template's one ``<im_patch>`` by, per crop,
  ``<patch_start>`` + ``num_patch_feature_size`` x ``<im_patch>`` + ``<patch_end>`` (and
  ``<patch_newline>`` after the last crop of every row but the last), then ``<im_start>`` +
  ``num_image_feature_size`` x ``<im_patch>`` + ``<im_end>`` for the global view. Only the
  ``<im_patch>`` tokens carry features (``mm_token_type_ids`` 1); the processor has no
  ``_get_num_multimodal_tokens``, so the count is checked with ``step3_image_tokens`` and the
  whole block length (the estimate) comes from the processor's own ``replace_image_token``::

      200x90 image, tiny processor (112 px view -> 4 tokens, 56 px crops -> 1 token each)
      crops 4 x 2 (window 56, snapped 224x112):  8 x "<patch_start><im_patch><patch_end>",
      one "<patch_newline>" after the 4th,  "<im_start>" 4 x <im_patch> "<im_end>"
      -> 12 <im_patch> tokens, block of 8 * 3 + 1 + 6 = 31 tokens

* media keys, as the model's forward takes them: ``pixel_values`` ``[n_images, 3, S, S]`` (global
  views), ``pixel_values_local`` ``[sum crops, 3, P, P]`` (absent when no image has a crop),
  ``num_local_patches`` ``[n_images]``. The processor's ``patch_newline_masks`` only shape the
  text; the forward does not take them and they are not kept;
* packs concatenate the three in document order (``step3_pack_media``); the model puts each
  image's crop features before its global view, as the text does. Positions are 1-D and the
  mask block-causal;
* pipeline parallelism: ``step3_batch_media`` gathers a batch's media with per-row counts and
  ``step3_pp_media`` splits them per micro-batch with ``pp_media.chunk_step3_media``, on the
  same rows ``torch.tensor_split`` gives the text (one packed row owns several images).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._shared import images_meta_estimate
from .chat_template import tokenize_default
from .registry import Handler, register_handler

__all__ = [
    "STEP3_HANDLER",
    "step3_batch_media",
    "step3_estimate",
    "step3_image_block_tokens",
    "step3_image_tokens",
    "step3_pack_media",
    "step3_pp_media",
    "tokenize_step3",
]

STEP3_MEDIA_KEYS = ("pixel_values", "pixel_values_local", "num_local_patches")


def _layout(processor: Any, height: int, width: int) -> tuple[int, int]:
    """(crops along x, crops along y) of the image processor's own sliding-window plan."""
    ip = processor.image_processor
    nx, ny = ip._plan_patches(width, height, int(ip.size["height"]), int(ip.patch_size))[3:5]
    return int(nx), int(ny)


def step3_image_tokens(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """``<im_patch>`` tokens per image of ``(height, width)``: crops x the crop's features plus
    the global view's features."""
    out = []
    for h, w in sizes:
        nx, ny = _layout(processor, int(h), int(w))
        crops = nx * ny
        out.append(
            crops * int(processor.num_patch_feature_size) + int(processor.num_image_feature_size)
        )
    return out


def step3_image_block_tokens(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Every token the processor puts in place of each image's ``<im_patch>`` placeholder,
    from its own ``replace_image_token`` (crop brackets, newlines, global-view brackets)."""
    tok = processor.tokenizer
    out = []
    for h, w in sizes:
        nx, ny = _layout(processor, int(h), int(w))
        newlines = [x == nx - 1 and y < ny - 1 for y in range(ny) for x in range(nx)]
        inputs = {"num_local_patches": [nx * ny], "patch_newline_masks": [newlines]}
        text = processor.replace_image_token(inputs, 0)
        out.append(len(tok(text, add_special_tokens=False)["input_ids"]))
    return out


def _count(processor: Any, images: list[Any]) -> int:
    return sum(step3_image_tokens(processor, [(im.height, im.width) for im in images]))


def tokenize_step3(record: Mapping[str, Any], processor: Any, **options: Any) -> dict[str, Any]:
    """The default path with the Step3 crop rule as the image-token check; images only."""
    options.setdefault("image_token_count", _count)
    return tokenize_default(record, processor, modalities=frozenset({"image"}), **options)


def step3_estimate(record: Mapping[str, Any], processor: Any, *, mode: str = "exact") -> int:
    """Length after the shift: the text (``LengthEstimator`` in ``mode``, the ``<im_patch>``
    placeholder excluded) plus each image's whole block from ``record["images_meta"]``."""
    return images_meta_estimate(record, processor, step3_image_block_tokens, mode=mode)


def step3_pack_media(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``pixel_values`` / ``pixel_values_local`` / ``num_local_patches`` of one pack, in document
    order (``pixel_values_local`` only when some image has crops). Empty without images."""
    have = [s for s in samples if s.get("pixel_values") is not None]
    if not have:
        return {}
    out: dict[str, Any] = {
        "pixel_values": torch.cat([s["pixel_values"] for s in have]),
        "num_local_patches": torch.cat([torch.as_tensor(s["num_local_patches"]) for s in have]),
    }
    local = [s["pixel_values_local"] for s in have if s.get("pixel_values_local") is not None]
    if local:
        out["pixel_values_local"] = torch.cat(local)
    return out


def step3_batch_media(rows: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The media of a batch of packed rows (per row, its samples): ``step3_pack_media`` over
    all rows in order, plus ``images_per_row`` and ``crops_per_row`` (what each row owns)."""
    packs = [step3_pack_media(r) for r in rows]
    out = step3_pack_media([p for p in packs if p])
    zero = torch.zeros(0, dtype=torch.long)
    per_row = [p.get("num_local_patches", zero) for p in packs]
    out["images_per_row"] = torch.tensor([len(n) for n in per_row], dtype=torch.long)
    out["crops_per_row"] = torch.tensor([int(n.sum()) for n in per_row], dtype=torch.long)
    return out


def step3_pp_media(
    media: Mapping[str, Any], batch_size: int, n_microbatches: int
) -> dict[str, list[torch.Tensor]]:
    """Split ``step3_batch_media`` output into ``n_microbatches`` chunks, micro-batch ``i``
    owning exactly the images of the rows ``torch.tensor_split`` puts in it.

    ``pp_media.chunk_step3_media`` splits tensors by owner: sample ``i`` owns
    ``num_patches[i]`` consecutive rows of ``patch_pixel_values``. A packed row owns several
    images, so it is called once per owned kind, with the row as the owner: global views and
    ``num_local_patches`` (``images_per_row`` each), crops (``crops_per_row``)::

        images_per_row [2, 0, 1], crops_per_row [9, 0, 3], 2 micro-batches (rows [0, 1] [2])
        pixel_values [3 views] -> [views 0..1] [view 2];  pixel_values_local -> [0:9] [9:12]
    """
    from neatpack.pipes.parallel.pp_media import chunk_step3_media

    rows = torch.arange(batch_size)
    empty = torch.zeros(0, dtype=torch.long)
    if "pixel_values" not in media:
        none = [empty] * n_microbatches
        return {"pixel_values": none, "num_local_patches": none, "pixel_values_local": none}
    views = chunk_step3_media(
        rows, batch_size, n_microbatches, media["images_per_row"], media["pixel_values"]
    )
    counts = chunk_step3_media(
        rows, batch_size, n_microbatches, media["images_per_row"], media["num_local_patches"]
    )
    local = media.get("pixel_values_local")
    out = {
        "pixel_values": views["patch_pixel_values"],
        "num_local_patches": counts["patch_pixel_values"],
        "pixel_values_local": [empty] * n_microbatches,
    }
    if local is not None:
        crops = chunk_step3_media(rows, batch_size, n_microbatches, media["crops_per_row"], local)
        out["pixel_values_local"] = crops["patch_pixel_values"]
    return out


STEP3_HANDLER = register_handler(
    Handler(
        "step3",
        tokenize_step3,
        min_transformers="5.16",  # Step3p7Processor is new in 5.16
        modalities=frozenset({"image"}),
        pack_media=step3_pack_media,
        description="Step3 (Step-3.7) crops: global view + sliding-window crops per image, "
        "<im_patch> count checked (pipes/families/step3.py); packs need "
        "step3.step3_pack_media (pixel_values, pixel_values_local, num_local_patches)",
        estimate=step3_estimate,
    ),
    ("Step3p7Processor",),
)
