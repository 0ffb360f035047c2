"""PNG pictures for ``neatpack plan`` and ``neatpack inspect``, drawn with pillow only.

Every picture is a pure function of arrays (no I/O); the command saves it. Downsampling is by
an integer factor ``f`` so one pixel is always ``f`` whole tokens (``f x f`` mask entries):

* :func:`mask_image` -- an ``[S, S]`` bool mask, pixel ``(x=j, y=i)`` "on" iff any entry of
  block ``(i, j)`` is True; on pixels take the colour of row ``i``'s document, off pixels are
  white, so a block-causal mask shows as a staircase of coloured triangles.
* :func:`batch_picture` -- one band per batch row (documents as coloured spans labelled with
  their sample ids, padding grey), a label-coverage strip under each band, then the mask.
* :func:`plan_picture` -- histogram of pack fill, per-rank loads of the first steps, and per
  step how much the slowest rank's cost exceeds the mean rank's (one bar per cost term).

>>> import numpy as np
>>> mask = np.tril(np.ones((4, 4), dtype=bool))
>>> img = mask_image(mask, max_side=2)  # factor 2: each pixel is a 2 x 2 block of the mask
>>> img.size, [img.getpixel((x, y)) != WHITE for y in range(2) for x in range(2)]
((2, 2), [True, False, True, True])
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageDraw, ImageFont

__all__ = [
    "COST_PANEL",
    "COVER",
    "GREY",
    "PALETTE",
    "PLAN_SIZE",
    "WHITE",
    "BatchLayout",
    "batch_picture",
    "block_factor",
    "doc_color",
    "mask_image",
    "plan_picture",
]

RGB = tuple[int, int, int]
WHITE: RGB = (255, 255, 255)
GREY: RGB = (200, 200, 200)  # padding
INK: RGB = (30, 30, 30)
COVER: RGB = (20, 120, 40)  # label coverage strip: tokens with label != -100
PALETTE: tuple[RGB, ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207), (90, 90, 160),
)  # fmt: skip
RANK_COLORS = PALETTE
PLAN_SIZE = (900, 1000)  # width, height of plan_picture
_LEFT, _RIGHT, _TOP = 70, 20, 40
_BAND, _STRIP, _ROW_GAP = 22, 6, 12
#: Where plan_picture draws the per-step cost panel (left, top, right, bottom).
COST_PANEL = (_LEFT + 10, 800, PLAN_SIZE[0] - _RIGHT, 960)


def doc_color(doc_id: int) -> RGB:
    """Colour of document ``doc_id`` (1..k) in a row; 0 (padding) is grey."""
    return GREY if doc_id <= 0 else PALETTE[(doc_id - 1) % len(PALETTE)]


def block_factor(size: int, max_side: int) -> int:
    """Smallest integer factor that brings ``size`` tokens within ``max_side`` pixels.

    >>> block_factor(1024, 1024), block_factor(1025, 1024), block_factor(4096, 1000)
    (1, 2, 5)
    """
    if max_side < 1:
        raise ValueError(f"{max_side=} must be >= 1 pixel")
    return max(1, -(-size // max_side))


def _blocks(a: npt.NDArray[Any], f: int, fill: int) -> npt.NDArray[Any]:
    """Pad the last axis to a multiple of ``f`` and split it into ``[..., n, f]`` blocks."""
    n = -(-a.shape[-1] // f)
    pad = [(0, 0)] * (a.ndim - 1) + [(0, n * f - a.shape[-1])]
    out: npt.NDArray[Any] = np.pad(a, pad, constant_values=fill)
    return out.reshape(*a.shape[:-1], n, f)


def mask_image(
    mask: npt.ArrayLike, *, max_side: int = 1024, doc_ids: npt.ArrayLike | None = None
) -> Image.Image:
    """An ``[S, S]`` bool mask as an ``n x n`` RGB image, ``n = ceil(S / f)``.

    Pixel ``(x=j, y=i)`` is "on" (not white) iff any of ``mask[i*f:(i+1)*f, j*f:(j+1)*f]``
    is True. ``doc_ids`` (``[S]``) colours on pixels by the document of row ``i*f``;
    without it they are dark grey.
    """
    m = np.asarray(mask, dtype=bool)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"mask must be square [S, S], got shape {m.shape}")
    f = block_factor(m.shape[0], max_side)
    cols = np.asarray(_blocks(m, f, 0).any(axis=-1))  # [S, n]
    on = np.asarray(_blocks(cols.T, f, 0).any(axis=-1)).T  # [n, n]
    n = on.shape[0]
    if doc_ids is None:
        row_rgb = np.tile(np.asarray(INK, np.uint8), (n, 1))
    else:
        docs = _blocks(np.asarray(doc_ids, np.int64), f, 0)[:, 0]
        row_rgb = np.asarray([doc_color(int(d)) if d > 0 else INK for d in docs], np.uint8)
    rgb = np.where(on[:, :, None], row_rgb[:, None, :], np.asarray(WHITE, np.uint8))
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def _font(size: int = 11) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size)


def _row_pixels(
    doc_ids: npt.NDArray[np.int64], labels: npt.NDArray[np.int64], f: int
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """One row's band and coverage strip colours per pixel column (``[n, 3]`` each)."""
    docs = _blocks(doc_ids, f, 0)[:, 0]
    band = np.asarray([doc_color(int(d)) for d in docs], np.uint8)
    real = _blocks(doc_ids > 0, f, 0)
    covered = _blocks((labels != -100) & (doc_ids > 0), f, 0)
    frac = covered.sum(-1) / np.maximum(real.sum(-1), 1)  # share of real tokens with a label
    white, cover = np.asarray(WHITE, float), np.asarray(COVER, float)
    strip = white + frac[:, None] * (cover - white)
    strip[real.sum(-1) == 0] = GREY
    return band, np.rint(strip).astype(np.uint8)


Box = tuple[int, int, int, int]  # left, top, right, bottom (right and bottom exclusive)


@dataclass(frozen=True)
class BatchLayout:
    """Where :func:`batch_picture` drew things: one pixel column is ``factor`` tokens."""

    factor: int
    mask: Box
    bands: list[Box]  # per row: documents as coloured spans
    strips: list[Box]  # per row: label coverage


def batch_picture(
    doc_ids: npt.ArrayLike,
    labels: npt.ArrayLike,
    sample_ids: Sequence[Sequence[int]],
    mask: npt.ArrayLike,
    *,
    max_side: int = 1024,
    title: str = "",
) -> tuple[Image.Image, BatchLayout]:
    """Rows of a batch and the mask of row 0; returns the image and where things are in it.

    ``doc_ids`` / ``labels`` are ``[B, S]``, ``mask`` is row 0's ``[S, S]``. Each column block
    of ``f = block_factor(S, max_side)`` tokens is one pixel wide in the bands, the strips and
    the mask. Band pixels take the colour of the block's first token's document
    (:func:`doc_color`; a white line marks where each document starts, the sample id is
    written in white where it fits); strip pixels blend white to ``COVER`` by the share of
    the block's real tokens that have a label, grey where the block is all padding.
    """
    docs = np.asarray(doc_ids, np.int64)
    labs = np.asarray(labels, np.int64)
    b, s = docs.shape
    f = block_factor(s, max_side)
    n = -(-s // f)
    font = _font()
    row_h = _BAND + 2 + _STRIP + _ROW_GAP
    mask_top = _TOP + b * row_h + 22
    width = _LEFT + max(n, 360) + _RIGHT
    height = mask_top + n + 20
    img = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(img)
    draw.text((_LEFT, 6), title or f"batch: {b} rows x {s} tokens", fill=INK, font=_font(13))
    draw.text((_LEFT, 23), f"1 px = {f} token(s); strip: labelled tokens (label != -100)",
              fill=INK, font=font)  # fmt: skip
    for r in range(b):
        y = _TOP + r * row_h
        band, strip = _row_pixels(docs[r], labs[r], f)
        img.paste(Image.fromarray(np.repeat(band[None], _BAND, 0), "RGB"), (_LEFT, y))
        img.paste(Image.fromarray(np.repeat(strip[None], _STRIP, 0), "RGB"), (_LEFT, y + _BAND + 2))
        draw.text((4, y + 5), f"row {r}", fill=INK, font=font)
        ids = list(sample_ids[r]) if r < len(sample_ids) else []
        for k in range(1, int(docs[r].max(initial=0)) + 1):
            where = np.flatnonzero(docs[r] == k)
            x0, x1 = _LEFT + int(where[0]) // f, _LEFT + int(where[-1]) // f + 1
            draw.line([(x0, y), (x0, y + _BAND - 1)], fill=WHITE)  # document boundary
            text = f"#{ids[k - 1]}" if k - 1 < len(ids) else f"doc {k}"
            if draw.textlength(text, font=font) + 4 <= x1 - x0:
                draw.text((x0 + 3, y + 5), text, fill=WHITE, font=font)
    draw.text((_LEFT, mask_top - 16), f"attention mask of row 0 ({n} x {n} px)", fill=INK,
              font=font)  # fmt: skip
    img.paste(mask_image(mask, max_side=max_side, doc_ids=docs[0]), (_LEFT, mask_top))
    bands = [(_LEFT, _TOP + r * row_h, _LEFT + n, _TOP + r * row_h + _BAND) for r in range(b)]
    strips = [(x0, y1 + 2, x1, y1 + 2 + _STRIP) for x0, _, x1, y1 in bands]
    return img, BatchLayout(f, (_LEFT, mask_top, _LEFT + n, mask_top + n), bands, strips)


def _bar_panel(
    draw: ImageDraw.ImageDraw,
    box: tuple[int, int, int, int],
    values: npt.NDArray[np.float64],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    xticks: Sequence[tuple[float, str]] = (),
) -> None:
    """Grouped bars: ``values[g, k]`` is bar ``k`` of group ``g``; axes, title, labels.

    Group ``g`` spans ``slot = (right - left - 2) / G`` pixels from ``left + 1``; its bars are
    ``max(1, slot / (K + 1))`` wide; a bar is ``round(v / max * (height - 1))`` pixels tall but
    at least 1 for any ``v > 0`` (0: nothing drawn), resting on the row above ``bottom``.
    """
    left, top, right, bottom = box
    font = _font()
    draw.text((left, top - 26), title, fill=INK, font=_font(13))
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=INK)
    draw.text((left - 62, top - 24), ylabel, fill=INK, font=font)
    draw.text(((left + right) // 2 - 20, bottom + 16), xlabel, fill=INK, font=font)
    vmax = float(values.max()) if values.size else 0.0
    for frac in (0.0, 0.5, 1.0):
        y = bottom - frac * (bottom - top)
        draw.line([(left - 4, y), (left, y)], fill=INK)
        draw.text((left - 56, y - 6), f"{vmax * frac:g}"[:8], fill=INK, font=font)
    g = values.shape[0]
    if g == 0 or vmax <= 0:
        draw.text((left + 10, top + 10), "nothing to show", fill=INK, font=font)
        return
    k = values.shape[1]
    slot = (right - left - 2) / g
    bar = max(1.0, slot / (k + 1))
    for i in range(g):
        for j in range(k):
            if values[i, j] <= 0:
                continue  # an empty bin draws nothing
            # Whole pixel columns, so narrow bars (64 steps x 8 ranks: 1.4 px each) never
            # overlap their neighbour: bar j of group i starts at floor(left+1+i*slot+j*bar).
            start = left + 1 + i * slot + j * bar
            x0 = math.floor(start)
            x1 = max(x0, math.floor(start + bar) - 1 - (1 if bar >= 3 else 0))
            # At least one pixel tall: a bin of 1 pack next to one of 10,000 is under a pixel
            # (and PIL refuses a rectangle whose top is below its bottom), but it is not empty.
            h = max(1, round(values[i, j] / vmax * (bottom - top - 1)))
            color = RANK_COLORS[j % len(RANK_COLORS)]
            draw.rectangle([x0, bottom - h, x1, bottom - 1], fill=color)
    for pos, label in xticks:
        x = left + 1 + pos * slot
        draw.line([(x, bottom), (x, bottom + 4)], fill=INK)
        draw.text((x - 8, bottom + 4), label, fill=INK, font=font)


def plan_picture(
    fill_pct: npt.ArrayLike,
    visual_loads: npt.ArrayLike,
    total_loads: npt.ArrayLike,
    *,
    title: str = "",
    bins: int = 20,
    step_cost: Mapping[str, npt.ArrayLike] | None = None,
) -> Image.Image:
    """Pack fill histogram (``bins`` bins over 0..100 %), per-rank loads per step, and the
    step cost panel.

    ``visual_loads`` / ``total_loads`` are ``[steps, world_size]`` (already cut to the steps
    to show); ``step_cost[term]`` is max/mean over ranks per step of each cost term, drawn
    at ``COST_PANEL`` as ``(max/mean - 1) %`` (to 0.001 %), one bar per term in
    ``RANK_COLORS`` order (an even step draws nothing). The image is always ``PLAN_SIZE``.
    """
    fill = np.clip(np.asarray(fill_pct, float), 0.0, 100.0)
    counts, _ = np.histogram(fill, bins=bins, range=(0.0, 100.0))
    vis = np.asarray(visual_loads, float).reshape(-1, np.shape(visual_loads)[-1] or 1)
    tot = np.asarray(total_loads, float).reshape(vis.shape)
    img = Image.new("RGB", PLAN_SIZE, WHITE)
    draw = ImageDraw.Draw(img)
    draw.text((10, 6), title, fill=INK, font=_font(14))
    right = PLAN_SIZE[0] - _RIGHT
    ticks = [(i * bins / 5, f"{i * 20}") for i in range(6)]
    _bar_panel(draw, (_LEFT + 10, 70, right, 250), counts[:, None].astype(float),
               title=f"pack fill: {fill.size} packs by % of pack size", xlabel="fill %",
               ylabel="packs", xticks=ticks)  # fmt: skip
    steps, ranks = vis.shape
    for j in range(min(ranks, len(RANK_COLORS))):  # legend: one colour per rank
        x = right - 60 * (min(ranks, len(RANK_COLORS)) - j)
        draw.rectangle([x, 300, x + 10, 310], fill=RANK_COLORS[j])
        draw.text((x + 14, 299), f"rank {j}", fill=INK, font=_font())
    every = max(1, steps // 8)
    sticks = [(i + 0.5, str(i)) for i in range(0, steps, every)]
    for top, loads, what in ((320, vis, "visual"), (545, tot, "total")):
        _bar_panel(draw, (_LEFT + 10, top, right, top + 170), loads,
                   title=f"{what} tokens per rank, first {steps} steps ({ranks} rank(s))",
                   xlabel="step", ylabel="tokens", xticks=sticks)  # fmt: skip
    if step_cost:
        names = list(step_cost)
        ratio = np.stack([np.asarray(step_cost[k], np.float64) for k in names], axis=1)
        excess = np.round(np.clip((ratio - 1.0) * 100.0, 0.0, None), 3).astype(np.float64)
        _, top, right_c, _ = COST_PANEL
        for j, name in enumerate(names):
            x = right_c - 90 * (len(names) - j)
            draw.rectangle([x, top - 44, x + 10, top - 34], fill=RANK_COLORS[j])
            draw.text((x + 14, top - 45), name, fill=INK, font=_font())
        ticks = [(i + 0.5, str(i)) for i in range(0, excess.shape[0], max(1, excess.shape[0] // 8))]
        _bar_panel(draw, COST_PANEL, excess,
                   title=f"cost: slowest rank over mean rank, first {excess.shape[0]} steps",
                   xlabel="step", ylabel="% over", xticks=ticks)  # fmt: skip
    return img
