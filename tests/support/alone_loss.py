"""The loss a packed batch must equal: each sample run alone, unpacked, through the model's
own sdpa path (shared by the varlen-attention and attention-default parity tests)."""

from __future__ import annotations

from typing import Any

import torch

from neatpack.pipes.materializing.tokenize import tokenize_conversation
from neatpack.pipes.reading.read import JsonlSource


@torch.no_grad()
def alone_loss(model: Any, source: JsonlSource, proc: Any, ids: list[int]) -> float:
    """Token-mean next-token CE of the samples ``ids``, each run alone with sdpa."""
    model.set_attn_implementation("sdpa")
    total, count = 0.0, 0
    for sid in ids:
        s = tokenize_conversation(source[sid], proc)
        one = {"input_ids": s["input_ids"][None], "labels": s["labels"][None],
               "pixel_values": s["pixel_values"], "image_grid_thw": s["image_grid_thw"],
               "mm_token_type_ids": s["mm_token_type_ids"][None]}  # fmt: skip
        n = int(s["labels"][1:].ne(-100).sum())
        if n:
            total += float(model(**one, num_items_in_batch=1, use_cache=False).loss)
            count += n
    return total / count
