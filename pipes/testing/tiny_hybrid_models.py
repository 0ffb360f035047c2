"""Tiny random hybrid models (linear attention / Mamba-2 + attention) built from configs.

For the leak probe's tests and for users who want to see what their packing does to a hybrid
stack before downloading one: every model is a real transformers 5.x class, fp32, eval mode,
a few hundred kilobytes, built offline from a config (no hub).

    qwen3_next  Gated DeltaNet (linear_attention) x2 + full attention x2, MoE MLPs
    qwen3_5     Gated DeltaNet x2 + full attention x2 (Qwen3.5 text stack)
    mamba2      Mamba-2 mixers only
    bamba       Mamba-2 + attention
    nemotron_h  Mamba-2, attention, MLP blocks (Nemotron-H)
    falcon_h1   parallel attention + Mamba-2 in every layer
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TINY_HYBRID_FAMILIES", "tiny_hybrid_model"]

_GDN = {
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
}
_BASE = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}
#: family -> (config class, model class, config kwargs); classes are looked up in transformers.
_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            _BASE,
            **_GDN,
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(_BASE, **_GDN, num_hidden_layers=4),
    ),
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        {
            "vocab_size": 128,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "state_size": 8,
            "num_heads": 4,
            "head_dim": 16,
            "n_groups": 1,
            "expand": 2,
            "chunk_size": 16,
        },
    ),
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            _BASE,
            num_hidden_layers=2,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            attn_layer_indices=[1],
        ),
    ),
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            _BASE,
            num_hidden_layers=3,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=1,
            chunk_size=16,
            layers_block_type=["mamba", "attention", "mlp"],
        ),
    ),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            _BASE,
            num_hidden_layers=2,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            mamba_d_ssm=64,
        ),
    ),
}
TINY_HYBRID_FAMILIES = tuple(_SPECS)


def tiny_hybrid_model(family: str, *, seed: int = 0) -> Any:
    """A tiny random fp32 ``*ForCausalLM`` of ``family`` (one of :data:`TINY_HYBRID_FAMILIES`).

    The same ``seed`` gives the same weights. Raises ``ValueError`` for an unknown family and
    ``ImportError`` when the installed transformers lacks its classes.

    >>> tiny_hybrid_model("bamba").config.layer_types
    ['linear_attention', 'full_attention']
    """
    if family not in _SPECS:
        raise ValueError(f"unknown tiny hybrid model {family=}; valid: {TINY_HYBRID_FAMILIES}")
    import transformers

    config_name, model_name, kwargs = _SPECS[family]
    if not hasattr(transformers, config_name) or not hasattr(transformers, model_name):
        raise ImportError(
            f"transformers {transformers.__version__} has no {config_name} / {model_name}; "
            "upgrade transformers (5.x) for this family"
        )
    config = getattr(transformers, config_name)(**kwargs)
    config.use_cache = False
    torch.manual_seed(seed)  # only for init: tests own the process, the library never calls this
    model = getattr(transformers, model_name)(config)
    model.eval()
    return model
