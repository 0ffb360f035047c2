"""mRoPE position ids for one sample, without the model.

Qwen-VL models rotate each token by three position ids (temporal, height, width). Text
tokens get the same id on all three rows and count up by one; a block of vision tokens (one
image, one video, or one Qwen3-VL video frame) gets a `t x h x w` grid of ids starting at the
current position, after which text resumes at `start + max(h, w)`. This module computes the
same `[3, L]` tensor as `model.model.get_rope_index` (transformers 5.x) for Qwen2-VL,
Qwen2.5-VL and Qwen3-VL, so workers never hold a model. `tests/pipes/test_mrope.py` checks
`torch.equal` against the real method on tiny models.

Worked example, Qwen2-VL, merge 2, an image of grid `[1, 4, 8]` (8 tokens: 2 rows x 4 cols)
after 2 text tokens, then 2 more text tokens::

    mm_token_type_ids  0 0 | 1 1 1 1 1 1 1 1 | 0 0
    t                  0 1 | 2 2 2 2 2 2 2 2 | 6 7
    h                  0 1 | 2 2 2 2 3 3 3 3 | 6 7
    w                  0 1 | 2 3 4 5 2 3 4 5 | 6 7

>>> cfg = MRopeConfig(family="qwen2_vl", spatial_merge_size=2)
>>> tt = torch.tensor([0, 0] + [1] * 8 + [0, 0])
>>> mrope_position_ids(torch.zeros(12, dtype=torch.long), tt, torch.tensor([[1, 4, 8]]),
...                    config=cfg)[2].tolist()
[0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7]

Family differences (read from the transformers 5.23 sources):

* Qwen2-VL: video frames count up by 1 per temporal patch.
* Qwen2.5-VL: video temporal ids are `int(t * tokens_per_second * second_per_grid_ts[v])`;
  images are not scaled.
* Qwen3-VL: a video of `t` temporal patches is `t` separate blocks of `t=1` (timestamps are
  text tokens between frames), so every frame restarts the temporal row at the current
  position.

Audio tokens (`mm_token_type_ids == 3`, Qwen2.5-Omni) run in time like text: one position per
token on all three rows, as Omni's `get_rope_index` numbers standalone audio (its images follow
the Qwen2-VL rule, so `family="qwen2_vl"` gives Omni's positions for images and audio).

Tokens with `attention_mask == 0` (an injected fake image) are left out, as the model does:
they get position 0 and the others are numbered as if they were absent.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MROPE_FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
AUDIO_TOKEN_TYPE = 3  # mm_token_type_ids of an audio token (Qwen2.5-Omni)
FAMILY_BY_PROCESSOR = {
    "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
    "Qwen3_5Processor": "qwen3_vl",
}
# Released Qwen2.5-VL checkpoints use tokens_per_second=2 (the 5.x config class defaults to 4).
QWEN2_5_VL_TOKENS_PER_SECOND = 2


@dataclass(frozen=True, kw_only=True)
class MRopeConfig:
    """What `mrope_position_ids` needs to know about a model family.

    `family` picks the video convention (see the module docstring); `spatial_merge_size`
    divides grid `h` and `w`; `tokens_per_second` is used by Qwen2.5-VL videos only; the token
    ids are only needed to derive `mm_token_type_ids` from ids (`token_types`).
    """

    family: str
    spatial_merge_size: int = 2
    tokens_per_second: float = QWEN2_5_VL_TOKENS_PER_SECOND
    image_token_id: int | None = None
    video_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in MROPE_FAMILIES:
            raise ValueError(f"unknown mRoPE {self.family=}; valid: {MROPE_FAMILIES}")
        if self.spatial_merge_size < 1:
            raise ValueError(f"{self.spatial_merge_size=} must be >= 1")

    @classmethod
    def from_model_config(cls, config: Any) -> MRopeConfig:
        """From a `Qwen2VLConfig` / `Qwen2_5_VLConfig` / `Qwen3VLConfig` (or `model.config`)."""
        family = str(getattr(config, "model_type", ""))
        if family not in MROPE_FAMILIES:
            raise ValueError(f"model config {family=} has no mRoPE; valid: {MROPE_FAMILIES}")
        vision = config.vision_config
        return cls(
            family=family,
            spatial_merge_size=int(vision.spatial_merge_size),
            tokens_per_second=getattr(vision, "tokens_per_second", QWEN2_5_VL_TOKENS_PER_SECOND),
            image_token_id=getattr(config, "image_token_id", None),
            video_token_id=getattr(config, "video_token_id", None),
        )

    @classmethod
    def from_processor(
        cls, processor: Any, *, tokens_per_second: float = QWEN2_5_VL_TOKENS_PER_SECOND
    ) -> MRopeConfig:
        """From a Qwen-VL processor. Qwen2.5-VL's `tokens_per_second` lives in the *model*
        config, not the processor: pass it if your checkpoint differs from 2."""
        name = type(processor).__name__
        family = FAMILY_BY_PROCESSOR.get(name)
        if family is None:
            raise ValueError(
                f"cannot tell the mRoPE family of processor {name!r}; known: "
                f"{sorted(FAMILY_BY_PROCESSOR)}. Build MRopeConfig(family=...) yourself, or use "
                "1-D positions (mrope=False) for a text-only model."
            )
        tok = processor.tokenizer
        return cls(
            family=family,
            spatial_merge_size=int(processor.image_processor.merge_size),
            tokens_per_second=tokens_per_second,
            image_token_id=int(tok.convert_tokens_to_ids("<|image_pad|>")),
            video_token_id=int(tok.convert_tokens_to_ids("<|video_pad|>")),
        )

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`mm_token_type_ids` from ids: 0 text, 1 image token, 2 video token."""
        if self.image_token_id is None or self.video_token_id is None:
            raise ValueError("token_types needs image_token_id and video_token_id in MRopeConfig")
        ids = torch.as_tensor(input_ids)
        return (ids == self.image_token_id).long() + 2 * (ids == self.video_token_id).long()


def _runs(types: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal values: (value, start, end)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            runs.append((types[start], start, i))
            start = i
    return runs


def _vision_block(
    start: int, t: int, h: int, w: int, interval: Any, device: torch.device
) -> torch.Tensor:
    # Same arithmetic (and dtype promotion) as transformers' get_vision_position_ids, so
    # Qwen2.5-VL's float temporal ids truncate identically.
    pos_t = (torch.arange(t, device=device) * interval).long()
    pos_h = torch.arange(h, device=device) + start
    pos_w = torch.arange(w, device=device) + start
    grid_t, grid_h, grid_w = torch.meshgrid(pos_t, pos_h, pos_w, indexing="ij")
    block = torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1)
    block[0] += start
    return block


def _vision_positions(
    types: torch.Tensor,
    grids: dict[int, list[tuple[int, int, int]]],
    intervals: list[Any],
    config: MRopeConfig,
    device: torch.device,
) -> torch.Tensor:
    merge = config.spatial_merge_size
    cursor = {1: 0, 2: 0}
    pieces: list[torch.Tensor] = []
    pos = 0
    for kind, start, end in _runs(types.tolist()):
        if kind in (0, AUDIO_TOKEN_TYPE):  # text, and audio: both advance one step per token
            pieces.append(torch.arange(end - start, device=device).expand(3, -1) + pos)
            pos += end - start
            continue
        if kind not in (1, 2):
            raise ValueError(
                f"mm_token_type_ids value {kind} at {start}: only 0, 1, 2, "
                f"{AUDIO_TOKEN_TYPE} are valid (text, image, video, audio)"
            )
        left = end - start
        while left > 0:  # adjacent blocks with no text between them share one run
            if cursor[kind] >= len(grids[kind]):
                name = "image_grid_thw" if kind == 1 else "video_grid_thw"
                raise ValueError(
                    f"{name} has {len(grids[kind])} rows but the ids hold more "
                    f"{'image' if kind == 1 else 'video'} tokens (run at {start}:{end})"
                )
            t, h, w = grids[kind][cursor[kind]]
            interval = intervals[cursor[kind]] if kind == 2 else 1
            cursor[kind] += 1
            block = _vision_block(pos, t, h // merge, w // merge, interval, device)
            if block.shape[1] > left:
                raise ValueError(
                    f"a vision grid {[t, h, w]} needs {block.shape[1]} tokens but only {left} "
                    f"remain in the run at {start}:{end}; ids and grids disagree"
                )
            pieces.append(block)
            left -= block.shape[1]
            pos += max(h, w) // merge
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long, device=device)
    return torch.cat(pieces, dim=1)


def mrope_position_ids(
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
    *,
    config: MRopeConfig,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """mRoPE ids `LongTensor[3, L]` of ONE sample (`input_ids` `[L]` or `[1, L]`).

    Equal to `model.model.get_rope_index(input_ids[None], mm_token_type_ids[None], ...)[0][:, 0]`.
    Raises ValueError when the vision tokens and the grids disagree.
    """
    ids = torch.as_tensor(input_ids)
    types = torch.as_tensor(mm_token_type_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if types.dim() == 2 and types.shape[0] == 1:
        types = types[0]
    if ids.dim() != 1 or types.shape != ids.shape:
        raise ValueError(
            f"one sample expected: input_ids {tuple(ids.shape)} and mm_token_type_ids "
            f"{tuple(types.shape)} must both be [L] (or [1, L])"
        )
    grids: dict[int, list[tuple[int, int, int]]] = {1: [], 2: []}
    if image_grid_thw is not None:
        grids[1] = [
            (int(a), int(b), int(c)) for a, b, c in torch.as_tensor(image_grid_thw).tolist()
        ]
    intervals: list[Any] = []
    if video_grid_thw is not None:
        vg = [(int(a), int(b), int(c)) for a, b, c in torch.as_tensor(video_grid_thw).tolist()]
        if config.family == "qwen3_vl":
            # Qwen3-VL: timestamps split each video into t single-frame blocks.
            grids[2] = [(1, h, w) for t, h, w in vg for _ in range(t)]
        else:
            grids[2] = vg
        if config.family == "qwen2_5_vl":
            seconds = list(second_per_grid_ts) if second_per_grid_ts is not None else [1] * len(vg)
            if len(seconds) < len(vg):
                raise ValueError(
                    f"second_per_grid_ts has {len(seconds)} entries for {len(vg)} videos"
                )
            intervals = [config.tokens_per_second * s for s in seconds]
        else:
            intervals = [1] * len(grids[2])
    out = torch.zeros(3, ids.shape[0], dtype=ids.dtype, device=ids.device)
    if attention_mask is None:
        out[:] = _vision_positions(types, grids, intervals, config, ids.device)
        return out
    keep = torch.as_tensor(attention_mask).reshape(-1).bool()
    if keep.shape != ids.shape:
        raise ValueError(
            f"attention_mask {tuple(keep.shape)} must match input_ids {tuple(ids.shape)}"
        )
    out[:, keep] = _vision_positions(types[keep], grids, intervals, config, ids.device)
    return out


def compute_mrope_position_ids(
    sample: dict[str, Any], get_rope_index: Callable[..., Any]
) -> torch.Tensor | None:
    """Seed-compatible: `[3, L]` ids of a sample from a user-supplied `get_rope_index`.

    The public form of the seed's `_compute_mrope_position_ids`: it reads the callable's
    signature and passes only the arguments it accepts (`input_ids`, `mm_token_type_ids`,
    grids, `second_per_grid_ts`, `attention_mask`), each as a batch of one. Returns None when
    the signature cannot be read or has no `input_ids`. When the callable wants
    `mm_token_type_ids` and the sample has none, they are derived from the bound model's
    `config.image_token_id` / `video_token_id`. The rope deltas are discarded.
    """
    try:
        params = inspect.signature(get_rope_index).parameters
    except (TypeError, ValueError):
        return None
    if "input_ids" not in params:
        return None
    ids = torch.as_tensor(sample["input_ids"]).reshape(1, -1)
    kw: dict[str, Any] = {"input_ids": ids}
    if "mm_token_type_ids" in params:
        types = sample.get("mm_token_type_ids")
        if types is None:
            cfg = get_rope_index.__self__.config  # type: ignore[attr-defined]
            types = (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()
        kw["mm_token_type_ids"] = torch.as_tensor(types).reshape(1, -1)
    for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts"):
        if key in params and sample.get(key) is not None:
            kw[key] = sample[key]
    if "attention_mask" in params and sample.get("attention_mask") is not None:
        kw["attention_mask"] = torch.as_tensor(sample["attention_mask"]).reshape(1, -1)
    with torch.no_grad():
        pos: torch.Tensor = get_rope_index(**kw)[0]
    return pos[:, 0, :] if pos.dim() == 3 else pos
