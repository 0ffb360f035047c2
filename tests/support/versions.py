"""Known behaviour differences between transformers 5.x releases, detected by running the
library (never by its version string), so a test can say which release it compares against.

>>> import torch
>>> class Config:
...     model_type = "qwen2_vl"
>>> class Model:
...     config = Config()
>>> rope_index_truncates_video_time(Model())  # only Qwen2.5-VL had the bug
False
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "TRUNCATED_VIDEO_TIME",
    "batches_unequal_videos",
    "counts_tokens",
    "knows_its_media_ids",
    "rope_index_truncates_video_time",
]

TRUNCATED_VIDEO_TIME = (
    "this transformers' Qwen2.5-VL get_rope_index truncates second_per_grid_ts to an int "
    "(transformers 5.17.0; not 5.0.0, 5.10.1, 5.18+): 1.5 s per frame pair becomes 1 s, "
    "0.5 s becomes 0, so the model's own positions differ from the model's design, which "
    "neatpack follows"
)


def rope_index_truncates_video_time(model: Any) -> bool:
    """Whether ``model.model.get_rope_index`` (Qwen2.5-VL) drops the fraction of
    ``second_per_grid_ts``: a 2-frame-pair video at 0.5 s per pair must advance time."""
    if getattr(model.config, "model_type", None) != "qwen2_5_vl":
        return False
    types = torch.tensor([[0, 2, 2, 0]])
    ids = torch.tensor([[1, int(model.config.video_token_id)] * 2])
    pos, _ = model.model.get_rope_index(
        ids, types, video_grid_thw=torch.tensor([[2, 2, 2]]), second_per_grid_ts=torch.tensor([0.5])
    )
    per_second = float(model.config.vision_config.tokens_per_second)
    return bool(per_second * 0.5 >= 1 and pos[0, 0, 1] == pos[0, 0, 2])


def knows_its_media_ids(processor: Any) -> bool:
    """False where the processor has no media token ids of its own (transformers 5.17's Omni
    processors: ``image_token_ids == [None]``, so their ``create_mm_token_type_ids`` marks
    nothing); neatpack then takes the ids from the tokenizer."""
    return None not in list(getattr(processor, "image_token_ids", [None]))


def counts_tokens(processor: Any) -> bool:
    """Whether the processor has ``_get_num_multimodal_tokens`` (5.17's Omni ones do not)."""
    return hasattr(processor, "_get_num_multimodal_tokens")


def batches_unequal_videos(processor: Any) -> bool:
    """Whether the video processor takes videos of different frame counts in one call
    (transformers 5.17's Gemma 4 one stacks them and raises)."""
    from PIL import Image

    frame = Image.new("RGB", (32, 32))
    try:
        processor.video_processor(videos=[[frame], [frame, frame]], return_tensors="pt")
    except RuntimeError:
        return False
    return True
