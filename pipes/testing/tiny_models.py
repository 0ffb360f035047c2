"""Tiny random Qwen models built from configs: no hub, no weights, fp32, seeded.

They exist for tests and benchmarks that must run a *real* transformers forward (packed vs
separate parity, `get_rope_index` checks) on a laptop CPU in well under a second. Every model
has hidden size 64, 2 layers, 4 attention heads / 2 KV heads (head dim 16, so the mRoPE
sections sum to 8) and a 2-layer, 32-wide vision tower; about 0.7 M parameters.

Special token ids come from the tiny processor's tokenizer when one is given, so the model
and the processor agree on `<|image_pad|>` and friends:

>>> model = tiny_model("qwen2_vl", vocab_size=4110, image_token_id=4108, video_token_id=4109,
...                    vision_start_token_id=4105, vision_end_token_id=4106)  # doctest: +SKIP
>>> model.model.get_rope_index  # the real implementation  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from transformers import PreTrainedModel

TinyFamily = Literal["qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
TINY_FAMILIES: tuple[str, ...] = ("qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")

_SPECIAL_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}

_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "bos_token_id": None,
}


def token_ids_from_processor(processor: Any) -> dict[str, int]:
    """The vocab size and the vision special-token ids of a processor's tokenizer.

    Raises ValueError naming the missing token when the tokenizer lacks one.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    ids: dict[str, int] = {"vocab_size": len(tokenizer)}
    unk = getattr(tokenizer, "unk_token_id", None)
    for key, token in _SPECIAL_TOKENS.items():
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == unk:
            raise ValueError(f"tokenizer has no {token!r}; a Qwen-VL tokenizer is needed ({key=})")
        ids[key] = int(tid)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id
    ids["eos_token_id"] = int(eos) if eos is not None and eos != unk else 0
    ids["pad_token_id"] = int(pad) if pad is not None else 0
    return ids


def tiny_model(
    family: TinyFamily | str,
    *,
    processor: Any = None,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    vocab_size: int = 4110,
    image_token_id: int = 4108,
    video_token_id: int = 4109,
    vision_start_token_id: int = 4105,
    vision_end_token_id: int = 4106,
    eos_token_id: int = 4098,
    pad_token_id: int = 4096,
) -> PreTrainedModel:
    """Build a tiny, randomly initialised, fp32 model of `family` in eval mode.

    `processor` (if given) overrides the vocab size and the special ids. The same `seed` gives
    the same weights. `attn_implementation` is "sdpa" or "eager".
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model {family=}; valid: {TINY_FAMILIES}")
    ids: dict[str, int] = {
        "vocab_size": vocab_size,
        "image_token_id": image_token_id,
        "video_token_id": video_token_id,
        "vision_start_token_id": vision_start_token_id,
        "vision_end_token_id": vision_end_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    if processor is not None:
        ids.update(token_ids_from_processor(processor))
    text: dict[str, Any] = dict(
        _TEXT, vocab_size=ids["vocab_size"], eos_token_id=ids["eos_token_id"]
    )
    text["pad_token_id"] = ids["pad_token_id"]
    special: dict[str, Any] = {k: ids[k] for k in _SPECIAL_TOKENS}
    special["attn_implementation"] = attn_implementation
    torch.manual_seed(seed)  # only for init: tests own the process, the library never calls this
    model: PreTrainedModel
    if family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        text["attn_implementation"] = attn_implementation
        model = Qwen2ForCausalLM(Qwen2Config(**text))
    elif family == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        cfg = Qwen2VLConfig(
            text_config=dict(
                text, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}
            ),
            vision_config={
                "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
            },
            **special,
        )  # fmt: skip
        model = Qwen2VLForConditionalGeneration(cfg)
    elif family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        cfg25 = Qwen2_5_VLConfig(
            text_config=dict(
                text, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}
            ),
            vision_config={
                "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                "temporal_patch_size": 2, "tokens_per_second": 2, "window_size": 56,
                "fullatt_block_indexes": [1],
            },
            **special,
        )  # fmt: skip
        model = Qwen2_5_VLForConditionalGeneration(cfg25)
    else:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        cfg3 = Qwen3VLConfig(
            text_config=dict(
                text,
                head_dim=16,
                rope_parameters={
                    "rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True
                },
            ),
            vision_config={
                "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                "temporal_patch_size": 2, "num_position_embeddings": 64,
                "deepstack_visual_indexes": [0],
            },
            **special,
        )  # fmt: skip
        model = Qwen3VLForConditionalGeneration(cfg3)
    model.config.use_cache = False
    model.eval()  # type: ignore[no-untyped-call]  # weights are fp32: torch default dtype at init
    return model


def set_attn_implementation(model: PreTrainedModel, impl: str) -> None:
    """Switch a built model (and its text / vision sub-configs) between "sdpa" and "eager"."""
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        if cfg is not None:
            cfg._attn_implementation = impl
    vision = getattr(model.config, "vision_config", None)
    if vision is not None:
        vision._attn_implementation = impl
