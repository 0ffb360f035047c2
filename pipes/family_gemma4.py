"""Gemma 4 (``Gemma4Processor``): the thinking-channel prefix after every model turn.

Gemma 4 trains historic model turns with an (empty) thinking channel: after each
``<|turn>model\\n`` header comes ``<|channel>thought\\n<channel|>``, then the answer. The seed's
``gemma4_inject_thinking_prefix`` inserts those tokens after tokenization, but its labels start
right after ``<|turn>model\\n``, so the injected prefix IS labelled (peer note B9), contrary to
its docstring. Here the prefix is injected into the templated text before the processor runs
(no token surgery, media tokens untouched), and the assistant start marker is the header PLUS
the prefix, so the labels are exactly the answer and its ``<turn|>``::

    <|turn>model\\n <|channel>thought\\n<channel|> A cat. <turn|> \\n
    -100 ...        -100 ...                      A cat. <turn|> -100

A model turn whose text already opens a channel (the template emitted one) is left alone.

Packing: positions are 1-D. With ``use_bidirectional_attention="vision"`` the model lets the
tokens of one image / video run see each other on the SLIDING layers only (full layers stay
causal); ``gemma4_packed_masks`` builds that pair for a packed row. With the default (None) both
are block-causal.

>>> inject_thinking_prefix("<|turn>user\\nhi<turn|>\\n<|turn>model\\nyo<turn|>\\n")
'<|turn>user\\nhi<turn|>\\n<|turn>model\\n<|channel>thought\\n<channel|>yo<turn|>\\n'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from .family_default import tokenize_default
from .family_gemma3 import gemma3_packed_mask
from .labels import RoleMarkers, _tail_alternatives

__all__ = [
    "GEMMA4_MODEL_TURN",
    "GEMMA4_THINKING_PREFIX",
    "gemma4_markers",
    "gemma4_pack_media",
    "gemma4_packed_masks",
    "inject_thinking_prefix",
    "load_tiny_gemma4_processor",
    "tiny_gemma4_model",
    "tokenize_gemma4",
]

GEMMA4_MODEL_TURN: Final = "<|turn>model\n"
GEMMA4_THINKING_PREFIX: Final = "<|channel>thought\n<channel|>"
GEMMA4_END_OF_TURN: Final = "<turn|>"
_FOLDER = Path(__file__).resolve().parent / "_assets" / "processors" / "gemma4"


def load_tiny_gemma4_processor() -> Any:
    """The shipped tiny ``Gemma4Processor`` (``scripts/build_tiny_family_processors.py``)."""
    if not (_FOLDER / "processor_config.json").is_file():
        raise FileNotFoundError(
            f"tiny Gemma 4 processor missing in {_FOLDER}; rebuild it with "
            "`python scripts/build_tiny_family_processors.py`"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(_FOLDER), local_files_only=True)  # type: ignore[no-untyped-call]


def inject_thinking_prefix(
    text: str, turn: str = GEMMA4_MODEL_TURN, prefix: str = GEMMA4_THINKING_PREFIX
) -> str:
    """Insert ``prefix`` after every ``turn`` header not already followed by a channel."""
    opener = prefix.split("thought", 1)[0]
    parts = text.split(turn)
    out = [parts[0]]
    for part in parts[1:]:
        out.append(turn)
        out.append(part if part.startswith(opener) else prefix + part)
    return "".join(out)


def gemma4_markers(processor: Any) -> RoleMarkers:
    """Start = tokens of header + prefix (not labelled), end = ``<turn|>`` (labelled).

    Raises ValueError when the tokenizer lacks the Gemma 4 turn / channel specials.
    """
    tok = getattr(processor, "tokenizer", processor)
    unk = getattr(tok, "unk_token_id", None)
    for special in ("<|turn>", "<|channel>", "<channel|>", GEMMA4_END_OF_TURN):
        tid = tok.convert_tokens_to_ids(special)
        if tid is None or tid == unk:
            raise ValueError(
                f"tokenizer {type(tok).__name__} has no {special!r}; not a Gemma 4 tokenizer "
                "(select another handler)"
            )
    start = tuple(int(i) for i in tok(GEMMA4_MODEL_TURN + GEMMA4_THINKING_PREFIX,
                                      add_special_tokens=False)["input_ids"])  # fmt: skip
    end = (int(tok.convert_tokens_to_ids(GEMMA4_END_OF_TURN)),)
    return RoleMarkers(start, end, _tail_alternatives(tok, start[-1]))


def tokenize_gemma4(
    record: Mapping[str, Any], processor: Any, *, thinking_prefix: bool = True, **options: Any
) -> dict[str, Any]:
    """The default path with the thinking prefix injected and kept out of the labels.

    ``thinking_prefix=False``: the plain default path (markers derived from the template)."""
    if not thinking_prefix:
        return tokenize_default(record, processor, modalities=frozenset({"image"}), **options)
    return tokenize_default(
        record,
        processor,
        modalities=frozenset({"image"}),
        markers=options.pop("markers", None) or gemma4_markers(processor),
        text_hook=inject_thinking_prefix,
        **options,
    )


def gemma4_packed_masks(
    doc_ids: Tensor,
    mm_token_type_ids: Tensor,
    *,
    bidirectional_vision: bool = False,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """``{"full_attention", "sliding_attention"}`` additive masks for a packed Gemma 4 row."""
    from .mask import to_4d_additive_mask

    full = to_4d_additive_mask(doc_ids, dtype)
    if not bidirectional_vision:
        return {"full_attention": full, "sliding_attention": full}
    sliding = gemma3_packed_mask(
        doc_ids, mm_token_type_ids, dtype, sliding_window=sliding_window, vision_codes=(1, 2)
    )
    return {"full_attention": full, "sliding_attention": sliding}


def gemma4_pack_media(samples: Any) -> dict[str, Tensor]:
    """``pixel_values`` / ``image_position_ids`` of the pack's images in document order (with
    explicit masks the model needs no ``mm_token_type_ids``)."""
    have = [s for s in samples if s.get("pixel_values") is not None]
    if not have:
        return {}
    return {
        "pixel_values": torch.cat([s["pixel_values"] for s in have], dim=0),
        "image_position_ids": torch.cat([s["image_position_ids"] for s in have], dim=0),
    }


def tiny_gemma4_model(
    processor: Any, *, bidirectional_vision: bool = False, seed: int = 0, attn: str = "eager"
) -> Any:
    """A tiny random fp32 ``Gemma4ForConditionalGeneration`` for the tiny processor (patch 4,
    pooling 2, no audio tower); ``bidirectional_vision`` sets
    ``use_bidirectional_attention="vision"``."""
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
    cfg = Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None,
        boi_token_id=int(tok.boi_token_id), eoi_token_id=int(tok.eoi_token_id),
        image_token_id=int(processor.image_token_id), video_token_id=int(processor.video_token_id),
        boa_token_id=int(ids("<|audio>")), eoa_token_index=int(ids("<audio|>")),
        audio_token_id=int(ids("<|audio|>")),
    )  # fmt: skip
    cfg._attn_implementation = attn
    for sub in (cfg.text_config, cfg.vision_config):
        sub._attn_implementation = attn  # type: ignore[union-attr]
    torch.manual_seed(seed)  # init only: tests own the process
    model = Gemma4ForConditionalGeneration(cfg)
    model.config.use_cache = False
    model.eval()  # type: ignore[no-untyped-call]
    return model
