"""The length index's fast path: estimate raw (unconverted) records in blocks, with exactly
the rules of ``LengthEstimator.estimate_sample`` on the converted Record, minus everything
that needs the full path (errors, fallbacks, header reads, exact mode).

Per record it reads only the counts that matter (``raw_text_stats``) and queues image sizes;
image tokens then come from one vectorized smart_resize over the block. Media files and paths
are not touched (complete metadata makes them unnecessary; the materializer checks paths).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from neatpack.pipes.indexing._media_meta import (
    MAX_TEXT_TOKENS,
    EstimateError,
    raw_meta,
    video_tokens,
)
from neatpack.pipes.reading._record import paused_gc, raw_text_stats

if TYPE_CHECKING:
    from neatpack.pipes.indexing.estimate import LengthEstimator

__all__ = ["estimate_raw_batch"]


def estimate_raw_batch(
    est: LengthEstimator, raws: Sequence[Any]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], list[int]]:
    """``(total, visual, items, slow)``: ``items`` the media items (image and video blocks) of
    each record; ``slow`` lists the positions this path does not decide (exact mode, missing or
    irregular metadata, fallbacks, any malformed input); estimate those with
    ``est.estimate_sample`` on the full Record, which also raises the proper errors. Decided
    entries equal ``estimate_sample`` exactly."""
    n = len(raws)
    if est.mode == "exact":
        zeros = np.zeros(n, np.int64)
        return zeros, zeros.copy(), zeros.copy(), list(range(n))
    with paused_gc():  # see paused_gc: no cycles are made here
        return _estimate(est, raws)


def _estimate(
    est: LengthEstimator, raws: Sequence[Any]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], list[int]]:
    n = len(raws)
    texts = [0] * n
    items = [0] * n
    videos: dict[int, int] = {}
    frame_text: dict[int, int] = {}
    slow: list[int] = []
    img_at: list[int] = []
    img_hw: list[int] = []
    ov, cpt, image, video = est.overhead, est.chars_per_token, est.image, est.video
    whole = est.text_tokens_include_template
    # Template tokens depend only on the six counts: one round(tokens_of(...)) per distinct
    # shape in the block (a handful), not per record (~0.5 us each).
    template: dict[tuple[int, int, int, int, int, bool], int] = {}
    stats = raw_text_stats
    floor = math.floor
    for k, raw in enumerate(raws):
        st = stats(raw)
        if st is None:
            slow.append(k)
            continue
        chars, n_sys, n_user, n_asst, n_img, n_vid, first_sys = st
        items[k] = n_img + n_vid
        nested = "mm_inputs_meta" in raw
        if ("_media_tokens" in raw or nested) and raw_meta(raw, "_media_tokens") is not None:
            slow.append(k)  # a precomputed visual count: the full path reads and checks it
            continue
        # Metadata for media the record lacks: the full path refuses it.
        if not n_img and ("images_meta" in raw or nested):
            meta = raw_meta(raw, "images_meta")
            if meta is not None and meta != []:
                slow.append(k)
                continue
        if not n_vid and ("videos_meta" in raw or nested):
            meta = raw_meta(raw, "videos_meta")
            if meta is not None and meta != []:
                slow.append(k)
                continue
        if n_img:
            meta = raw_meta(raw, "images_meta") if nested else raw.get("images_meta")
            if image is None or type(meta) is not list or len(meta) != n_img:
                slow.append(k)
                continue
            if n_img == 1 and type(m := meta[0]) is list and len(m) == 2:
                h, w = m
                if type(h) is not int or type(w) is not int or h <= 0 or w <= 0:
                    slow.append(k)
                    continue
                img_at.append(k)
                img_hw += m
            else:
                hw = [v for m in meta if type(m) is list and len(m) == 2 for v in m]
                if len(hw) != 2 * n_img or not all(type(v) is int and v > 0 for v in hw):
                    slow.append(k)
                    continue
                img_at.extend([k] * n_img)
                img_hw.extend(hw)
        if n_vid:
            vmeta = raw_meta(raw, "videos_meta")
            if video is None or type(vmeta) is not list or len(vmeta) != n_vid or None in vmeta:
                slow.append(k)
                continue
            try:
                plans = [video_tokens(video, -1, None, m) for m in vmeta]
            except EstimateError:
                slow.append(k)  # the full path raises it again, naming the sample
                continue
            videos[k] = sum(p[0] for p in plans)
            if video.timestamps:
                frame_text[k] = round(sum(p[1] for p in plans) * ov.per_video_frame)
        if "_text_tokens" in raw or nested:
            tt = raw_meta(raw, "_text_tokens")
            if tt is None:
                body = floor(chars / cpt)
            elif type(tt) is int and 0 <= tt < MAX_TEXT_TOKENS:
                body = tt
            else:
                slow.append(k)
                continue
        else:
            tt = None
            body = floor(chars / cpt)
        shape = (n_sys, n_user, n_asst, n_img, n_vid, first_sys)
        extra = template.get(shape)
        if extra is None:
            extra = template[shape] = round(ov.tokens_of(*shape))
        if tt is not None and whole:
            extra = 0  # the precomputed count already holds the template's tokens
        texts[k] = body + extra + (frame_text.get(k, 0) if n_vid else 0)
    total = np.asarray(texts, np.int64)
    visual = np.zeros(n, np.int64)
    if videos:
        visual[list(videos)] = list(videos.values())
    if img_at and image is not None:
        sizes = np.asarray(img_hw, np.int64).reshape(-1, 2)
        tok = image.tokens_array(sizes[:, 0], sizes[:, 1])
        at = np.asarray(img_at, np.int64)
        if (tok < 0).any():  # aspect ratio > 200: the slow path raises with the sample id
            bad = np.unique(at[tok < 0])
            slow.extend(bad.tolist())
            tok[np.isin(at, bad)] = 0
        np.add.at(visual, at, tok)
    total = np.maximum(total + visual - 1, 0)
    return total, visual, np.asarray(items, np.int64), sorted(set(slow))
