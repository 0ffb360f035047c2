"""What every ``tiny_<family>_model`` does after its config: one place for the shared tail.

Each family's tiny random model differs only in its config (sizes, token ids, the family's own
fields); the rest is the same four steps, kept here so that a change (say, a new sub-config)
is made once: the attention implementation on the top config and each named sub-config
(a sub-config that is ``None``, e.g. an optional audio tower, is skipped), the seed, the
fp32 model from the config, no KV cache (packed rows are whole sequences) and eval mode::

    cfg = InternVLConfig(...)  # the family's part
    return init_tiny_model(InternVLForConditionalGeneration, cfg, seed=0, attn="eager")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["WITH_AUDIO", "init_tiny_model"]

#: the sub-configs of a model with an audio tower (Qwen-Omni thinkers, Gemma 4 with audio)
WITH_AUDIO = ("text_config", "vision_config", "audio_config")


def init_tiny_model(
    model_cls: Any,
    cfg: Any,
    *,
    seed: int,
    attn: str,
    subconfigs: Sequence[str] = ("text_config", "vision_config"),
) -> Any:
    """``model_cls(cfg)`` seeded with ``seed``, ``attn`` set on ``cfg`` and its
    ``subconfigs``, ``use_cache`` off, in eval mode."""
    for c in (cfg, *(getattr(cfg, name) for name in subconfigs)):
        if c is not None:
            c._attn_implementation = attn
    torch.manual_seed(seed)  # init only: tests own the process
    model = model_cls(cfg)
    model.config.use_cache = False
    model.eval()
    return model
