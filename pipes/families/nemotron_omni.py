"""Nemotron-H Omni (``NemotronH_Omni_Reasoning_V3Processor`` / ``NemotronH_Omni_Reasoning_V3``):
text, images and audio in one ChatML conversation (the seed's ``nemotron_omni_collate_fn``).

The shared flow is ``audio.tokenize_audio_family``; what is Nemotron's:

* an ``<image>`` placeholder becomes ``<img>`` + ``<image>`` x ``h * w / 4`` + ``</img>``, where
  ``(h, w)`` is the 16-pixel patch grid the image processor picks (``get_patch_grid_size``, the
  processor's own function, with its per-call patch budget: ``nemotron_image_tokens``); the
  Sample keeps ``pixel_values`` (flattened patches of all images) and ``image_grid_hw``;
* an audio block becomes ``<so_start>`` + ``<so_embedding>`` x n + ``<so_end>``, n from the
  Parakeet encoder's three stride-2 convolutions over ``1 + samples // 160`` mel frames
  (``nemotron_audio_tokens``), checked per clip against ``input_features_mask`` (the model's
  ``_get_subsampling_output_length(mask.sum() + 1)``); the Sample keeps ``input_features``
  ``[n_clips, frames, 128]`` and ``input_features_mask``;
* labels: the ChatML markers (``<|im_start|>assistant\\n`` ... ``<|im_end|>``);
* video is not handled here (a video block is a ``SampleError`` naming the sample).

Packing: ``nemotron_omni_pack_media`` concatenates the patches and grids and pads the clips'
frames (mask False); ``nemotron_omni_packed_masks`` gives the block-causal 4D mask for the
attention layers. The Mamba-2 layers of Nemotron-H, though, carry their state across the whole
row: transformers 5.23's ``NemotronHMamba2Mixer`` takes only a 2-D padding mask (no
``seq_idx`` / ``cu_seqlens``), so a packed row of the real hybrid model is NOT equal to separate
runs (measured in ``tests/families/test_family_nemotron_omni.py``); only a Nemotron-H stack
without Mamba layers packs exactly.

>>> nemotron_audio_tokens(16000)  # 1 s: 101 mel frames -> 51 -> 26 -> 13
13
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from torch import Tensor

from neatpack.pipes.collating.mask import to_4d_additive_mask
from neatpack.pipes.materializing.labels import resolve_role_markers

from .audio import AudioFamily, estimate_audio_family, tokenize_audio_family
from .registry import Handler, register_handler

__all__ = [
    "NEMOTRON_OMNI",
    "NEMOTRON_OMNI_HANDLER",
    "nemotron_audio_tokens",
    "nemotron_image_tokens",
    "nemotron_omni_estimate",
    "nemotron_omni_pack_media",
    "nemotron_omni_packed_masks",
    "tokenize_nemotron_omni",
]

_KEYS: Final = ("pixel_values", "image_grid_hw", "input_features", "input_features_mask")


def _subsample(frames: int, factor: int = 8) -> int:
    """The Parakeet encoder's conv subsampling (kernel 3, stride 2, padding 1 per stage)."""
    for _ in range(int(math.log2(factor))):
        frames = (frames - 1) // 2 + 1
    return frames


def nemotron_audio_tokens(n_samples: int, *, hop: int = 160, factor: int = 8) -> int:
    """``<so_embedding>`` tokens of one clip (the processor's ``_estimate_audio_num_embeddings``:
    at least 1)."""
    return max(1, _subsample(1 + n_samples // hop, factor))


def _audio_rule(processor: Any) -> dict[str, int]:
    return {
        "hop": int(processor.audio_hop_length),
        "factor": int(processor.audio_subsampling_factor),
    }


def nemotron_image_tokens(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """``<image>`` tokens per image of ONE processor call, from ``(height, width)`` sizes: the
    image processor's patch budget (it depends on how many images share the call) and its own
    ``get_patch_grid_size``, then ``h * w / merge**2``."""
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import (
        get_patch_grid_size,
    )

    ip = processor.image_processor
    merge = round(1 / ip.downsample_ratio)
    budget = max((ip.max_model_len - 4) * merge**2, ip.min_num_patches * len(sizes))
    if ip.max_num_patches:
        budget = min(budget, ip.max_num_patches)
    budget = max(budget, ip.min_num_patches)
    out = []
    for h, w in sizes:
        gh, gw = get_patch_grid_size(h, w, ip.patch_size, merge, ip.min_num_patches, budget)
        out.append(gh * gw // merge**2)
    return out


def _clip_tokens(processor: Any, out: Mapping[str, Any]) -> list[int]:
    frames = out["input_features_mask"].sum(-1) + 1  # what the model feeds its subsampling
    factor = int(processor.audio_subsampling_factor)
    return [max(1, _subsample(int(f), factor)) for f in frames.tolist()]


NEMOTRON_OMNI: Final = AudioFamily(
    audio_tokens=lambda p, n: nemotron_audio_tokens(n, **_audio_rule(p)),
    clip_tokens=_clip_tokens,
    image_tokens=lambda p, ims: sum(nemotron_image_tokens(p, [(i.height, i.width) for i in ims])),
    markers=resolve_role_markers,
    keys=_KEYS,
    image_expansion=lambda p, sizes: [n + 2 for n in nemotron_image_tokens(p, sizes)],
    audio_expansion=lambda p, n: nemotron_audio_tokens(n, **_audio_rule(p)) + 2,
)
"""Nemotron-H Omni's rules for the shared flow (``<img>``/``</img>`` and ``<so_start>``/
``<so_end>`` are the + 2 of each expansion)."""


def tokenize_nemotron_omni(
    record: Mapping[str, Any], processor: Any, **options: Any
) -> dict[str, Any]:
    """One Record with text, image and audio blocks -> one Sample (module docstring);
    ``options``: ``label_policy``, ``markers``, ``max_image_pixels``."""
    return tokenize_audio_family(record, processor, NEMOTRON_OMNI, **options)


def nemotron_omni_estimate(
    record: Mapping[str, Any], processor: Any, *, mode: str = "exact"
) -> int:
    """``audio.estimate_audio_family`` with Nemotron's rules; exact mode == the real
    length (a test checks it)."""
    return estimate_audio_family(record, processor, NEMOTRON_OMNI, mode=mode)


def nemotron_omni_pack_media(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The model's media inputs for the documents of one pack, in document order: patches and
    grids concatenated, clips padded to the row's longest (zero features, mask False)."""
    out: dict[str, Any] = {}
    imgs = [s for s in samples if s.get("pixel_values") is not None]
    if imgs:
        out["pixel_values"] = torch.cat([s["pixel_values"] for s in imgs], dim=0)
        out["image_grid_hw"] = torch.cat([s["image_grid_hw"] for s in imgs], dim=0)
    auds = [s for s in samples if s.get("input_features") is not None]
    if auds:
        width = max(int(s["input_features"].shape[1]) for s in auds)
        feats: list[Tensor] = []
        masks: list[Tensor] = []
        for s in auds:
            f, m = s["input_features"], s["input_features_mask"]
            pad = width - f.shape[1]
            feats.append(torch.nn.functional.pad(f, (0, 0, 0, pad)))
            masks.append(torch.nn.functional.pad(m, (0, pad), value=False))
        out["input_features"] = torch.cat(feats, dim=0)
        out["input_features_mask"] = torch.cat(masks, dim=0)
    return out


def nemotron_omni_packed_masks(doc_ids: Tensor, mm_token_type_ids: Tensor) -> dict[str, Any]:
    """Per-layer-type masks of a packed row: the block-causal 4D additive mask for the attention
    layers; the Mamba layers get None (no padding), which does NOT isolate documents (module
    docstring)."""
    return {"full_attention": to_4d_additive_mask(doc_ids), "linear_attention": None}


NEMOTRON_OMNI_HANDLER = register_handler(
    Handler(
        "nemotron_omni",
        tokenize_nemotron_omni,
        modalities=frozenset({"image", "audio"}),
        pack_media=nemotron_omni_pack_media,
        packed_mask=nemotron_omni_packed_masks,
        min_transformers="5.18",  # NemotronH_Omni_Reasoning_V3Processor is new in 5.18
        description="Nemotron-H Omni: images (<img> runs from image_grid_hw) + audio (Parakeet "
        "features, 16 kHz checked); packs need nemotron_omni.nemotron_omni_pack_media; "
        "Mamba layers are not isolated per document (pipes/families/nemotron_omni.py)",
        estimate=nemotron_omni_estimate,
        pp_refused="its media split per pipeline micro-batch is not verified (README family "
        "table: PP 'not done')",
    ),
    ("NemotronH_Omni_Reasoning_V3Processor",),
)
