"""The seed's names, kept so code written against the seed's API runs unchanged.

Each is a thin wrapper over (or an alias of) the core function named in its docstring, with
the seed's signature and return convention; where the seed had a bug the docstring says what
differs. New code should call the core functions. Every name here is importable from
``neatpack.pipes`` (``from neatpack.pipes import _estimate_sample_length``).

>>> _smart_resize_image(1080, 1920)
(728, 1316)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from neatpack.pipes.collating.expand_tokens import expand_image_tokens
from neatpack.pipes.contracts import Pack
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.estimate_types import TemplateOverhead
from neatpack.pipes.indexing.media_tokens import (
    image_config_from_seed,
    smart_resize,
    smart_resize_video,
    video_config_from_seed,
)
from neatpack.pipes.materializing.pack import concat_shifted

# No __all__: the seed's names are listed once, in neatpack.pipes._EXPORTS["compat.seed_compat"]
# (tests/test_layout.py checks that every name defined here is listed there).

_expand_image_tokens = expand_image_tokens  # the seed's name (datasets.vlm.collate_fns)


# Seed name for ``smart_resize`` (same signature and defaults). Unlike the seed, an aspect
# ratio over 200 raises ``ValueError`` as transformers does (the seed returned a size the
# processor refuses).
_smart_resize_image = smart_resize


def _smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int = 2,
    factor: int = 32,
    min_pixels: int = 128 * 128,
    max_pixels: int = 16 * 16 * 2 * 2 * 2 * 6144,
) -> tuple[int, int]:
    """Seed name for ``smart_resize_video``, with transformers' semantics (``round`` for t,
    small-side upscaling, the aspect and ``num_frames`` checks), which the seed lacked."""
    return smart_resize_video(
        num_frames, height, width, temporal_factor, factor, min_pixels, max_pixels
    )


def _estimate_image_tokens(img_meta: Any, image_cfg: dict[str, Any]) -> int:
    """Seed signature: tokens of one ``[height, width]`` image under a seed-style config dict
    (``patch_size``, ``merge_size``, ``min_pixels``, ``max_pixels``).

    >>> _estimate_image_tokens([280, 560], {"patch_size": 14, "merge_size": 2})
    200
    """
    return image_config_from_seed(image_cfg).tokens(int(img_meta[0]), int(img_meta[1]))


def _estimate_video_tokens(vid_meta: Any, video_cfg: dict[str, Any]) -> int:
    """Seed signature for ``[total_frames, height, width, fps, duration]`` with Qwen3-VL frame
    sampling. Like transformers (not the seed), the frame count is clamped to the video's
    frames last, so a 3-frame clip keeps 3 frames, not ``min_frames``.

    >>> cfg = {"patch_size": 16, "min_pixels": 100, "max_pixels": 10**8, "max_frames": 128}
    >>> _estimate_video_tokens([100, 320, 640, 25, 4], cfg)
    800
    """
    frames, h, w, fps, duration = (float(v) for v in vid_meta[:5])
    total = int(frames) or int(duration * fps)
    return video_config_from_seed(video_cfg).tokens(total, int(h), int(w), fps or None)


def _estimate_sample_length(
    example: Mapping[str, Any],
    image_cfg: dict[str, Any] | None = None,
    video_cfg: dict[str, Any] | None = None,
    return_media_tokens: bool = False,
) -> int | tuple[int, int]:
    """The seed's signature and return convention: ``text + media`` (no shift, no chat-template
    tokens), or ``(total, media)``; ``example`` is a Record. Differences from the seed (bugs
    there): a video without a video config counts the 500-token fallback instead of 0, image
    aspect ratios over 200 raise, and video frames are clamped as transformers does; a
    precomputed ``_media_tokens`` is the media count.
    ``LengthEstimator`` is the full version (template overhead, shift, calibration).

    ``_text_tokens``, when present, is the text count as given: like the seed, this function
    adds no chat-template tokens to it (nor to ``chars // 3``), so it is a lower bound.
    ``LengthGroupedSampler`` and ``neat_pack_dataset_vlm`` do add the template's tokens
    (role markers, default system prompt, vision start/end) to a ``_text_tokens``; pass them
    ``text_tokens_include_template=True`` when your count already holds them.

    >>> rec = {"conversation": [{"role": "user", "content": [{"type": "text", "text": "abcdef"},
    ...        {"type": "image", "image": "x"}]}], "images_meta": [[280, 560]]}
    >>> _estimate_sample_length(rec, {"patch_size": 14}, return_media_tokens=True)
    (202, 200)
    """
    zero = TemplateOverhead(per_system=0, per_user=0, per_assistant=0, per_image=0,
                            per_video=0, no_system=0, per_video_frame=0)  # fmt: skip
    est = LengthEstimator(
        image=None if image_cfg is None else image_config_from_seed(image_cfg),
        video=None if video_cfg is None else video_config_from_seed(video_cfg),
        overhead=zero,
        on_missing_media="fallback",
    )
    out = est.estimate_sample({"sample_id": -1, **example})
    total = out.total + 1  # the seed applies no shift here
    return (total, out.visual) if return_media_tokens else total


def build_packed_vlm_sample(
    samples: Sequence[dict[str, Any]],
    pack_size: int,
    padding_idx: int,
    has_mrope: bool = False,
    sequence_alignment: int = 1,
) -> Pack:
    """Seed-compatible public `_build_packed_vlm_sample`: ALREADY-SHIFTED samples in, one pack
    out, no tail padding (`pack_size` unused, as in the seed; the collater pads). Unlike the seed
    it supports mRoPE with alignment and keeps fake-image tokens masked (module docstring)."""
    del pack_size
    return concat_shifted(
        samples, padding_idx=padding_idx, alignment=sequence_alignment, mrope=has_mrope
    )
