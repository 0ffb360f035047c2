"""What one pack costs a training step, as a few terms, per attention format.

A pack's step time is a sum of terms the planner can compute from lengths alone
(``pack_terms``, one row per pack, columns ``TERMS``)::

    tokens           the language model's linear part: every token goes through every layer
    attention        sum over documents of length^2 (a document-aware kernel attends within each)
    patches          the vision tower's linear part: every patch goes through every block
    patch_attention  sum over images of patches^2 (the tower attends within each image)

``CostModel`` weighs them: ``cost = per_pack + per_token * tokens + per_pair * A +
per_patch * patches + per_patch_pair * patch_attention``, where ``A`` is the attention
column for a document-aware format (``flash_attention_2/3``, ``flex_attention``, ``thd``,
``position_ids``, ``doc_ids``, neatpack's varlen function), but the *row's* length squared
for a dense 4D mask (``sdpa``, ``eager``): that kernel computes every query-key pair of the
row and masks afterwards, whatever the documents. Two packs of 8,192 tokens::

    documents          tokens   attention (varlen)            attention (dense 4D mask)
    [8192]             8192     8192^2        = 67.1 M        8192^2 = 67.1 M
    [1024] * 8         8192     8 * 1024^2    =  8.4 M        8192^2 = 67.1 M

>>> import numpy as np
>>> pack_terms(np.array([0, 1, 3]), np.array([0, 1, 2]), np.array([8, 3, 5]),
...            np.array([0, 2, 0])).tolist()
[[8.0, 64.0, 0.0, 0.0], [8.0, 34.0, 8.0, 64.0]]

Coefficients come from the model's config as FLOPs (``CostModel.from_config``) or from measured
step times (``calibrate``: a non-negative least-squares fit, seconds per unit).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from neatpack.pipes.collating.attention_formats import DENSE_FORMATS

__all__ = ["ATTENTION_KINDS", "DENSE_FORMATS", "TERMS", "CostModel", "grid_patches", "pack_terms"]

FloatArray = npt.NDArray[np.float64]
AttentionKind = Literal["documents", "dense"]
#: The columns of ``pack_terms`` (the planner's per-pack cost matrix), in this order.
TERMS = ("tokens", "attention", "patches", "patch_attention")
ATTENTION_KINDS: tuple[str, ...] = ("documents", "dense")
#: Formats whose kernel attends per document (a name containing "flash" counts too).
DOCUMENT_FORMATS = ("flex_attention", "thd", "position_ids", "doc_ids", "neatpack_varlen")


def _pack_sums(offsets: Any, values: FloatArray, pack_of: Any = None) -> FloatArray:
    off = np.asarray(offsets, dtype=np.int64)
    n = off.size - 1
    if pack_of is None:
        pack_of = np.repeat(np.arange(n), np.diff(off))
    return np.bincount(pack_of, weights=values, minlength=n).astype(np.float64)


def pack_terms(
    offsets: Any,
    ids: Any,
    lengths: Any,
    visual: Any = None,
    *,
    merge: int = 4,
    image_offsets: Any = None,
    image_patches: Any = None,
    images: Any = None,
) -> FloatArray:
    """Per-pack cost terms ``[n_packs, 4]`` (columns ``TERMS``) of packs in CSR form.

    ``ids[offsets[g]:offsets[g + 1]]`` are pack ``g``'s sample ids (``PackPlan.offsets`` /
    ``.ids``); ``lengths`` / ``visual`` are per sample id: tokens and visual tokens (the
    language model's image and video tokens). A visual token is ``merge`` patches in the tower
    (Qwen-VL: ``spatial_merge_size ** 2`` = 4). Where the per-image patch counts are known,
    ``image_patches[image_offsets[s]:image_offsets[s + 1]]`` are sample ``s``'s (see
    ``grid_patches``) and give both vision columns exactly. Otherwise ``images[s]`` (sample
    ``s``'s media items, ``LengthIndex.images``) splits its patches ``P`` into that many equal
    images: ``patch_attention`` is ``P^2 / images``, exact for equal images and a lower bound
    for unequal ones (``sum p_i^2 >= P^2 / n``); without ``images`` (or for a sample with 0
    items) the sample counts as one image, which overstates it for several images.

    >>> pack_terms(np.array([0, 1]), np.array([0]), np.array([9]), np.array([4]),
    ...            images=np.array([2])).tolist()  # 16 patches as 2 images of 8: 2 * 8^2
    [[9.0, 81.0, 16.0, 128.0]]
    """
    # gathered first, then made floats (the same values: a full float copy of every
    # sample's length was 80 MB at 10M samples, per call), in place; one pack id per sample
    idx = np.asarray(ids)
    if idx.dtype.kind not in "iu":  # ([] is float)
        idx = idx.astype(np.int64)
    off = np.asarray(offsets, dtype=np.int64)
    pack_of = np.repeat(np.arange(off.size - 1), np.diff(off))
    length = np.asarray(lengths)[idx].astype(np.float64)
    out = np.zeros((off.size - 1, len(TERMS)), dtype=np.float64)
    out[:, 0] = _pack_sums(off, length, pack_of)
    length *= length
    out[:, 1] = _pack_sums(off, length, pack_of)
    del length
    if image_patches is not None:
        if image_offsets is None:
            raise ValueError("image_patches needs image_offsets (sample s's images are "
                             "image_patches[image_offsets[s]:image_offsets[s + 1]])")  # fmt: skip
        img = np.asarray(image_patches, dtype=np.float64)
        io = np.asarray(image_offsets, dtype=np.int64)
        per_sample = np.stack([_pack_sums(io, img), _pack_sums(io, img * img)], axis=1)
        out[:, 2] = _pack_sums(off, per_sample[idx, 0], pack_of)
        out[:, 3] = _pack_sums(off, per_sample[idx, 1], pack_of)
    elif visual is not None:
        patches = np.asarray(visual)[idx].astype(np.float64)
        patches *= merge
        out[:, 2] = _pack_sums(off, patches, pack_of)
        patches *= patches  # (now the pairs)
        if images is not None:
            patches /= np.maximum(np.asarray(images)[idx], 1)
        out[:, 3] = _pack_sums(off, patches, pack_of)
    return out


def grid_patches(grid_thw: Any) -> npt.NDArray[np.int64]:
    """Patch count of each attention unit of a batch's ``image_grid_thw`` / ``video_grid_thw``.

    The Qwen-VL towers attend within each frame group: an image ``(1, h, w)`` is one unit of
    ``h * w`` patches, a video ``(t, h, w)`` is ``t`` units of ``h * w``.

    >>> grid_patches([[1, 4, 6], [2, 2, 2]]).tolist()
    [24, 4, 4]
    """
    g = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return np.repeat(g[:, 1] * g[:, 2], g[:, 0])


def attention_kind(attn_implementation: str) -> AttentionKind:
    """``"dense"`` for a 4D-mask format, ``"documents"`` for a document-aware one."""
    if attn_implementation in DENSE_FORMATS:
        return "dense"
    if "flash" in attn_implementation or attn_implementation in DOCUMENT_FORMATS:
        return "documents"
    raise ValueError(
        f"unknown {attn_implementation=}; valid: {DENSE_FORMATS + DOCUMENT_FORMATS} or a "
        "flash_attention_* name"
    )


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def _text_flops(text: Any) -> tuple[float, float]:
    """Forward FLOPs per token (linear) and per causal attention pair, summed over layers."""
    h = int(text.hidden_size)
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv = int(_get(text, "num_key_value_heads", default=heads))
    hd = int(_get(text, "head_dim", default=h // heads))
    attn_params = h * heads * hd * 2 + h * kv * hd * 2  # q, o; k, v
    k_active = _get(text, "num_experts_per_tok")
    if k_active:  # MoE: the router plus the experts each token goes through
        moe = int(_get(text, "moe_intermediate_size", "intermediate_size"))
        mlp_params = int(k_active) * 3 * h * moe + h * int(_get(text, "num_experts", default=0))
    else:
        mlp_params = 3 * h * int(text.intermediate_size)  # gate, up, down
    vocab = int(_get(text, "vocab_size", default=0))
    per_token = 2.0 * (layers * (attn_params + mlp_params) + h * vocab)  # + the LM head
    return per_token, 2.0 * layers * heads * hd  # 4 * heads * hd * L^2, halved by causality


def _vision_flops(vision: Any) -> tuple[float, float]:
    """Forward FLOPs per patch (linear, windowed attention included) and per image pair."""
    depth = int(vision.depth)
    d = int(_get(vision, "embed_dim", "hidden_size"))  # Qwen2-VL: embed_dim; later: hidden_size
    merge = int(_get(vision, "spatial_merge_size", default=2)) ** 2
    patch_in = (
        int(_get(vision, "in_channels", "in_chans", default=3))
        * int(_get(vision, "temporal_patch_size", default=2))
        * int(_get(vision, "patch_size", default=14)) ** 2
    )
    out = int(_get(vision, "out_hidden_size", "hidden_size"))
    if _get(vision, "intermediate_size") is None:  # Qwen2-VL: fc1, fc2 of mlp_ratio * d
        mlp = 2 * d * int(d * float(_get(vision, "mlp_ratio", default=4)))
    elif _get(vision, "window_size") is not None:  # Qwen2.5-VL: gated, gate/up/down
        mlp = 3 * d * int(vision.intermediate_size)
    else:  # Qwen3-VL: fc1, fc2
        mlp = 2 * d * int(vision.intermediate_size)
    mergers = 1 + len(_get(vision, "deepstack_visual_indexes", default=()))
    merger = mergers * ((d * merge) ** 2 + d * merge * out) / merge  # per patch
    per_patch = 2.0 * (patch_in * d + depth * (4 * d * d + mlp) + merger)
    full = depth
    window = _get(vision, "window_size")
    if window is not None:  # Qwen2.5-VL: windows of (window / patch)^2 patches
        full_blocks = list(_get(vision, "fullatt_block_indexes", default=()))
        full = len(full_blocks)
        window_patches = (int(window) // int(_get(vision, "patch_size", default=14))) ** 2
        per_patch += 4.0 * d * window_patches * (depth - full)  # each patch's window, at most
    return per_patch, 4.0 * d * full  # bidirectional: the whole square of each image


@dataclass(frozen=True)
class CostModel:
    """A pack's step cost from its ``pack_terms`` row (see the module): FLOPs or seconds.

    ``per_pair`` weighs the attention column for ``attention="documents"`` and the row's
    length squared for ``"dense"``. ``cost(terms, row_length=S)`` prices a pack padded to
    ``S`` tokens: the layers run over all ``S``, and the padding is one more document.
    """

    attention: AttentionKind = "documents"
    per_pack: float = 0.0
    per_token: float = 0.0
    per_pair: float = 0.0
    per_patch: float = 0.0
    per_patch_pair: float = 0.0
    unit: str = "flop"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"{self.attention=} is not one of {ATTENTION_KINDS}")
        for name in ("per_pack", "per_token", "per_pair", "per_patch", "per_patch_pair"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")

    @classmethod
    def from_config(
        cls, config: Any, attn_implementation: str = "sdpa", *, backward: bool = True
    ) -> CostModel:
        """FLOPs per term of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL (or text-only) config.

        Forward, per token: ``2 * (layers * (q, k, v, o + MLP params) + hidden * vocab)``
        (each weight is one multiply-add; MoE counts the router and the ``k`` active experts).
        Forward, per attention pair: ``4 * layers * heads * head_dim`` (``QK^T`` and ``AV``),
        halved for causal document-aware kernels, which skip the masked half; a dense 4D mask
        pays the whole square (``per_pair`` doubled). Vision tower, per patch: the patch
        embedding ``2 * C * T * P^2 * d``, per block ``2 * (4 d^2 + MLP)``, the merger per
        patch; per image pair ``4 * d`` per full-attention block, bidirectional. Qwen2.5-VL's
        windowed blocks attend within windows of ``(window_size / patch_size)^2`` patches
        (64): at most that many pairs per patch, so they add ``4 * d * 64`` per patch to the
        linear term (edge windows are smaller: an upper bound); only its
        ``fullatt_block_indexes`` blocks pay the image's square. Qwen3-VL: full attention in
        every block, one merger per deepstack layer. ``backward=True`` (training) triples
        every term (backward ~ 2x forward). Norms, rotary, softmax and the loss are left out.
        """
        kind = attention_kind(attn_implementation)
        text = _get(config, "text_config", default=config)
        per_token, per_pair = _text_flops(text)
        if kind == "dense":
            per_pair *= 2.0
        vision = _get(config, "vision_config")
        per_patch, per_patch_pair = _vision_flops(vision) if vision is not None else (0.0, 0.0)
        scale = 3.0 if backward else 1.0
        return cls(
            attention=kind,
            per_token=scale * per_token,
            per_pair=scale * per_pair,
            per_patch=scale * per_patch,
            per_patch_pair=scale * per_patch_pair,
        )

    def design(self, terms: Any, row_length: Any = None) -> FloatArray:
        """The ``[n, 5]`` quantities the coefficients multiply: 1, tokens, pairs, patches,
        patch pairs (tokens and pairs of the padded row when ``row_length`` is given)."""
        t = np.asarray(terms, dtype=np.float64).reshape(-1, len(TERMS))
        tokens = t[:, 0] if row_length is None else np.broadcast_to(
            np.asarray(row_length, dtype=np.float64), t[:, 0].shape
        )  # fmt: skip
        if np.any(tokens < t[:, 0]):
            raise ValueError(f"{row_length=} is shorter than a pack's tokens ({t[:, 0].max():.0f})")
        pairs = tokens**2 if self.attention == "dense" else t[:, 1] + (tokens - t[:, 0]) ** 2
        return np.stack([np.ones_like(tokens), tokens, pairs, t[:, 2], t[:, 3]], axis=1)

    @property
    def coefficients(self) -> FloatArray:
        return np.array([self.per_pack, self.per_token, self.per_pair, self.per_patch,
                         self.per_patch_pair])  # fmt: skip

    def per_term(self, terms: Any, row_length: Any = None) -> FloatArray:
        """``[n, 5]`` cost of each part: fixed, tokens, attention, patches, patch attention."""
        return self.design(terms, row_length) * self.coefficients

    def cost(self, terms: Any, row_length: Any = None) -> FloatArray:
        """``[n]`` cost of each pack (FLOPs for ``from_config``, seconds once calibrated)."""
        return self.design(terms, row_length) @ self.coefficients

    def calibrate(self, terms: Any, seconds: Any, row_length: Any = None) -> CostModel:
        """This model's coefficients refitted to measured step ``seconds`` of packs ``terms``:
        non-negative least squares (exact: every support of the 5 columns is tried), with a
        fixed per-pack time. Columns the packs never vary (no images) keep a coefficient 0.
        """
        x = self.design(terms, row_length)
        y = np.asarray(seconds, dtype=np.float64).reshape(-1)
        if y.shape[0] != x.shape[0] or y.shape[0] < 2:
            raise ValueError(f"{x.shape[0]} packs and {y.shape[0]} times: need >= 2 of each, equal")
        norm = np.linalg.norm(x, axis=0)
        live = [j for j in range(x.shape[1]) if norm[j] > 0]
        xs = x[:, live] / norm[live]
        best: tuple[float, npt.NDArray[np.float64], tuple[int, ...]] | None = None
        for r in range(1, len(live) + 1):
            for support in itertools.combinations(range(len(live)), r):
                sub = xs[:, list(support)]
                coef = np.linalg.lstsq(sub, y, rcond=None)[0]
                if np.any(coef < 0):
                    continue
                err = float(np.sum((sub @ coef - y) ** 2))
                if best is None or err < best[0]:
                    best = (err, coef, support)
        fitted = np.zeros(x.shape[1])
        if best is not None:
            for c, j in zip(best[1], best[2], strict=True):
                fitted[live[j]] = c / norm[live[j]]
        pack, token, pair, patch, patch_pair = (float(v) for v in fitted)
        return replace(self, unit="s", per_pack=pack, per_token=token, per_pair=pair,
                       per_patch=patch, per_patch_pair=patch_pair)  # fmt: skip
