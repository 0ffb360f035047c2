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

from neatpack.pipes.families.processor_compat import media_ids, processor_default

__all__ = [
    "WITH_AUDIO",
    "init_tiny_model",
    "tiny_gemma3_model",
    "tiny_gemma4_model",
    "tiny_idefics3_model",
    "tiny_internvl_model",
    "tiny_kimi_k25_model",
    "tiny_llava_onevision_model",
    "tiny_nemotron_omni_model",
    "tiny_qwen3_omni_model",
    "tiny_qwen_omni_model",
    "tiny_smolvlm_model",
    "tiny_step3_model",
    "tiny_tile_model",
]

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


def tiny_gemma3_model(processor: Any, *, seed: int = 0, attn_implementation: str = "eager") -> Any:
    """A tiny random fp32 ``Gemma3ForConditionalGeneration`` matching the tiny processor (28x28
    images, patch 7 -> 4x4 patches pooled to ``image_seq_length`` = 4 soft tokens).

    transformers initialises the image projection (``mm_input_projection_weight``) to zeros,
    which makes every image embedding zero: the pixels would never reach the logits and a
    parity test could not see a wrong image. It gets seeded random weights here (std 0.02,
    ``initializer_range``), so changing the pixels changes the logits."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = processor.tokenizer
    side = int(processor.image_processor.size["height"])
    text = {
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "sliding_window": 2048, "max_position_embeddings": 4096,
        "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16,
        "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }  # fmt: skip
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "image_size": side, "patch_size": side // 4,
    }  # fmt: skip
    cfg = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=int(processor.image_seq_length),
        boi_token_index=int(tok.boi_token_id),
        eoi_token_index=int(tok.eoi_token_id),
        image_token_index=int(tok.image_token_id),
    )
    cfg._attn_implementation = attn_implementation
    for sub in (cfg.text_config, cfg.vision_config):
        sub._attn_implementation = attn_implementation  # type: ignore[union-attr]
    torch.manual_seed(seed)  # init only: tests own the process
    model = Gemma3ForConditionalGeneration(cfg)
    proj = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        proj.normal_(0.0, cfg.text_config.initializer_range)  # type: ignore[union-attr]
    model.config.use_cache = False
    model.eval()  # type: ignore[no-untyped-call]
    return model


def tiny_gemma4_model(
    processor: Any,
    *,
    bidirectional_vision: bool = False,
    audio: bool = False,
    seed: int = 0,
    attn: str = "eager",
) -> Any:
    """A tiny random fp32 ``Gemma4ForConditionalGeneration`` for the tiny processor (patch 4,
    pooling 2); ``bidirectional_vision`` sets ``use_bidirectional_attention="vision"``;
    ``audio`` adds a one-layer audio tower (conv channels ``[128, 4]``: the model sizes its
    projection as ``channels[0] // 4 * channels[1]``, so channels[0] must be the 128 mel bins)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    vp = processor.image_processor
    text = {
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "global_head_dim": 16, "sliding_window": 4096,
        "layer_types": ["sliding_attention", "full_attention"],
        "vocab_size_per_layer_input": len(tok), "hidden_size_per_layer_input": 8,
        "max_position_embeddings": 4096, "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "use_bidirectional_attention": "vision" if bidirectional_vision else None,
    }  # fmt: skip
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
        "patch_size": int(vp.patch_size), "pooling_kernel_size": int(vp.pooling_kernel_size),
        "position_embedding_size": 256,
    }  # fmt: skip
    sound = {
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "subsampling_conv_channels": [128, 4], "output_proj_dims": 32,
    }  # fmt: skip
    cfg = Gemma4Config(
        text_config=text, vision_config=vision, audio_config=sound if audio else None,
        boi_token_id=int(tok.boi_token_id), eoi_token_id=int(tok.eoi_token_id),
        image_token_id=int(processor.image_token_id), video_token_id=int(processor.video_token_id),
        boa_token_id=int(ids("<|audio>")), eoa_token_index=int(ids("<audio|>")),
        audio_token_id=int(ids("<|audio|>")),
    )  # fmt: skip
    return init_tiny_model(
        Gemma4ForConditionalGeneration, cfg, seed=seed, attn=attn, subconfigs=WITH_AUDIO
    )


def tiny_idefics3_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``Idefics3ForConditionalGeneration`` for the tiny processor (28 px
    tiles, patch 7, pixel shuffle 2 -> ``image_seq_len`` 4; Llama text, 1-D positions)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    return tiny_tile_model(
        processor, Idefics3Config, Idefics3ForConditionalGeneration, seed=seed, attn=attn
    )


def tiny_tile_model(
    processor: Any, config_cls: Any, model_cls: Any, *, seed: int = 0, attn: str = "eager"
) -> Any:
    """The tiny Idefics3-layout model as ``model_cls(config_cls(...))``: Idefics3 and SmolVLM
    take the same config fields (SmolVLM is Idefics3's architecture under another name)."""
    tok = processor.tokenizer
    side = int(processor.image_processor.max_image_size["longest_edge"])
    cfg = config_cls(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": side, "patch_size": 7},
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "max_position_embeddings": 4096,
                     "pad_token_id": tok.pad_token_id},
        image_token_id=int(processor.image_token_id),
        scale_factor=2,
    )  # fmt: skip
    return init_tiny_model(model_cls, cfg, seed=seed, attn=attn)


def tiny_internvl_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``InternVLForConditionalGeneration`` for the tiny processor (28 px
    crops, patch 7, CLS dropped, pixel shuffle 0.5 -> ``image_seq_length`` 4; Qwen2 text)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    tok = processor.tokenizer
    side = int(processor.image_processor.size["height"])
    cfg = InternVLConfig(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": [side, side],
                       "patch_size": [7, 7]},
        text_config={"model_type": "qwen2", "vocab_size": len(tok), "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "max_position_embeddings": 4096,
                     "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id},
        image_token_id=int(processor.image_token_id),
        image_seq_length=int(processor.image_seq_length),
    )  # fmt: skip
    return init_tiny_model(InternVLForConditionalGeneration, cfg, seed=seed, attn=attn)


def tiny_kimi_k25_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``Kimi_K25ForConditionalGeneration`` for the tiny processor: a 2-layer
    32-wide MoonViT (patch 14, merge 2x2) and a 2-layer DeepSeek-V3 text model (MLA attention,
    one dense layer then 4 routed experts, top-2); about 0.4 M parameters, 1-D positions."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    tok = processor.tokenizer
    cfg = Kimi_K25Config(
        text_config={"model_type": "deepseek_v3", "vocab_size": len(tok), "hidden_size": 64,
                     "intermediate_size": 128, "moe_intermediate_size": 32,
                     "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1,
                     "topk_group": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
                     "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 4096,
                     "pad_token_id": tok.pad_token_id, "bos_token_id": None,
                     "eos_token_id": tok.eos_token_id},
        vision_config={"patch_size": int(processor.image_processor.patch_size),
                       "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "pos_emb_height": 8, "pos_emb_width": 8,
                       "pos_emb_time": 4},
        projection_hidden_size=32,
        image_token_id=int(processor.image_token_id),
        video_token_id=int(processor.video_token_id),
        vision_start_token_id=int(tok.convert_tokens_to_ids("<|media_begin|>")),
        vision_end_token_id=int(tok.convert_tokens_to_ids("<|media_end|>")),
    )  # fmt: skip
    return init_tiny_model(Kimi_K25ForConditionalGeneration, cfg, seed=seed, attn=attn)


def tiny_llava_onevision_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``LlavaOnevisionForConditionalGeneration`` for the tiny processor
    (SigLIP tower 28 px / patch 7 -> 16 features per tile, Qwen2 text, 1-D positions)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    tok = processor.tokenizer
    side = int(processor.image_processor.size["height"])
    cfg = LlavaOnevisionConfig(
        text_config={
            "model_type": "qwen2", "vocab_size": len(tok), "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 4096,
            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
        },
        vision_config={
            "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": side,
            "patch_size": 7,
        },
        image_token_index=int(processor.image_token_id),
        video_token_index=int(processor.video_token_id),
        image_grid_pinpoints=[list(p) for p in processor.image_processor.image_grid_pinpoints],
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        vision_feature_layer=-1,
        vision_aspect_ratio=processor.vision_aspect_ratio,
    )  # fmt: skip
    return init_tiny_model(LlavaOnevisionForConditionalGeneration, cfg, seed=seed, attn=attn)


def tiny_nemotron_omni_model(
    processor: Any, layers: tuple[str, ...] = ("attention", "mlp", "attention", "mlp")
) -> Any:
    """Tiny random fp32 model: Nemotron-H text stack (hidden 64, ``layers`` of "attention",
    "mlp", "mamba"), RADIO vision (hidden 32, 2 layers, patch 16), Parakeet encoder (hidden 32,
    2 layers, 128 mel bins)."""
    from transformers.models.nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3,
        NemotronH_Omni_Reasoning_V3_Config,
    )

    tok = processor.tokenizer
    cfg = NemotronH_Omni_Reasoning_V3_Config(
        text_config={
            "model_type": "nemotron_h", "vocab_size": len(tok), "hidden_size": 64,
            "layers_block_type": list(layers), "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "ssm_state_size": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1,
            "chunk_size": 16, "pad_token_id": tok.pad_token_id, "bos_token_id": None,
            "eos_token_id": tok.eos_token_id,
        },
        vision_config={
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "patch_size": 16, "image_size": 64, "max_img_size": 256, "num_cls_tokens": 1,
            "num_registers": 1, "video_temporal_patch_size": 2,
        },
        audio_config={
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "num_mel_bins": 128, "subsampling_conv_channels": 8,
            "conv_kernel_size": 3, "projection_hidden_size": 64, "projection_bias": False,
        },
        vision_hidden_size=32, projector_hidden_size=64,
        image_token_id=int(processor.image_token_id),
        audio_token_id=int(processor.audio_token_id),
        video_token_id=int(processor.video_token_id),
    )  # fmt: skip
    for c in (cfg, cfg.text_config, cfg.vision_config, cfg.audio_config):
        c._attn_implementation = "eager"  # type: ignore[union-attr]
    torch.manual_seed(0)  # init only: tests own the process
    model = NemotronH_Omni_Reasoning_V3(cfg)
    model.config.use_cache = False
    model.eval()  # type: ignore[no-untyped-call]
    return model


def tiny_qwen3_omni_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``Qwen3OmniMoeThinkerForConditionalGeneration`` for the tiny processor.

    Text: a real mixture of experts (4 experts, top 2, every layer sparse), hidden 64, 2 layers,
    interleaved mRoPE sections [2, 3, 3]; vision: depth 2, width 32, patch 16, deepstack from
    layer 0 into text layer 0; audio: 2 layers, d_model 32, 128 mel bins, ``n_window`` 50 (as
    the processor), initialised with std 0.2 so that its output depends on the audio.
    ``position_id_per_seconds`` 13, as the processor (videos' temporal scale).
    """
    from transformers import (
        Qwen3OmniMoeThinkerConfig,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    tok = processor.tokenizer
    cfg = Qwen3OmniMoeThinkerConfig(
        text_config={
            "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 4096, "bos_token_id": None,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": [2, 3, 3], "interleaved": True},
            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
        },
        audio_config={
            "num_mel_bins": int(processor.feature_extractor.feature_size), "encoder_layers": 2,
            "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "d_model": 32,
            "output_dim": 64, "n_window": int(processor_default(processor, "n_window", 50)),
            "downsample_hidden_size": 16,
            # at 0.02 this tiny tower's output has std 0.006 and barely depends on its input
            # (zeroed features move the logits by 1e-4); at 0.2 the audio really counts
            "initializer_range": 0.2,
        },
        audio_token_id=media_ids(processor, "audio")[0],
        image_token_id=media_ids(processor, "image")[0],
        video_token_id=media_ids(processor, "video")[0],
        audio_start_token_id=int(tok.convert_tokens_to_ids(processor.audio_bos_token)),
        position_id_per_seconds=int(processor_default(processor, "position_id_per_seconds")),
        # not a declared field, but get_rope_index reads config.vision_start_token_id
        vision_start_token_id=int(tok.convert_tokens_to_ids(processor.vision_bos_token)),  # type: ignore[call-arg]
    )  # fmt: skip
    return init_tiny_model(
        Qwen3OmniMoeThinkerForConditionalGeneration,
        cfg,
        seed=seed,
        attn=attn,
        subconfigs=WITH_AUDIO,
    )


def tiny_qwen_omni_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``Qwen2_5OmniThinkerForConditionalGeneration`` for the tiny processor
    (text: hidden 64, 2 layers, mrope_section [2, 3, 3]; vision: depth 2, width 32; audio:
    2 layers, d_model 32, 128 mel bins); about 0.7 M parameters."""
    from transformers import (
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
    )

    tok = processor.tokenizer
    cfg = Qwen2_5OmniThinkerConfig(
        text_config={
            "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "bos_token_id": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": [2, 3, 3]},
            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "out_hidden_size": 64, "fullatt_block_indexes": [1], "window_size": 56,
        },
        audio_config={
            "num_mel_bins": int(processor.feature_extractor.feature_size), "encoder_layers": 2,
            "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "d_model": 32,
            "output_dim": 64,
        },
        audio_token_index=media_ids(processor, "audio")[0],
        image_token_index=media_ids(processor, "image")[0],
        video_token_index=media_ids(processor, "video")[0],
        audio_start_token_id=int(tok.convert_tokens_to_ids(processor.audio_bos_token)),
        audio_end_token_id=int(tok.convert_tokens_to_ids(processor.audio_eos_token)),
        # not a declared field, but get_rope_index reads config.vision_start_token_id
        vision_start_token_id=int(tok.convert_tokens_to_ids(processor.vision_bos_token)),  # type: ignore[call-arg]
    )  # fmt: skip
    return init_tiny_model(
        Qwen2_5OmniThinkerForConditionalGeneration, cfg, seed=seed, attn=attn, subconfigs=WITH_AUDIO
    )


def tiny_smolvlm_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``SmolVLMForConditionalGeneration`` for the tiny processor (28 px
    tiles, patch 7, pixel shuffle 2 -> ``image_seq_len`` 4; Llama text, 1-D positions): the
    Idefics3 tiny model's config (``idefics3.tiny_tile_model``)."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    return tiny_tile_model(
        processor, SmolVLMConfig, SmolVLMForConditionalGeneration, seed=seed, attn=attn
    )


def tiny_step3_model(processor: Any, *, seed: int = 0, attn: str = "eager") -> Any:
    """A tiny random fp32 ``Step3p7ForConditionalGeneration`` for the tiny processor: a 2-layer
    32-wide ViT (patch 14, two stride-2 downsamplers: 112 px -> 4 features, 56 px -> 1) and a
    2-layer dense text model with full attention, 1-D positions; about 0.76 M parameters."""
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    tok = processor.tokenizer
    side = int(processor.image_processor.size["height"])
    cfg = Step3p7Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": side, "patch_size": 14,
                       "max_position_embeddings": (side // 14) ** 2},
        text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 16, "max_position_embeddings": 4096,
                     "mlp_layer_types": ["dense", "dense"],
                     "layer_types": ["full_attention", "full_attention"], "sliding_window": 4096,
                     "pad_token_id": tok.pad_token_id},
        image_token_id=int(processor.image_token_id),
    )  # fmt: skip
    return init_tiny_model(Step3p7ForConditionalGeneration, cfg, seed=seed, attn=attn)
