"""Tokenization handlers keyed by processor class name (the seed's ``COLLATE_FNS`` idea).

One conversation -> one Sample (``docs/data_contracts.md`` section 4) goes through a *handler*.
The lookup, ``get_handler(processor, name=None)``:

1. ``name`` given: that handler, whatever the processor (explicit selection);
2. the processor's class name is registered: its family handler (Qwen-VL classes -> ``qwen_vl``,
   which checks the ``*_grid_thw`` grids and injects fake images);
3. the processor (or its tokenizer) has a chat template: ``chat_template``, the processor-agnostic
   default (labels from role markers derived from the template, media from content lists, media
   token counts from the processor's own ``_get_num_multimodal_tokens``);
4. otherwise ``ValueError`` naming the registry and how to add a handler.

Unlike the seed (which falls back to ``default`` with a warning even without a template and then
fails deep inside ``apply_chat_template``), a template-less processor is refused up front.

>>> from neatpack.pipes.tiny import load_tiny_processor
>>> get_handler(load_tiny_processor("qwen2_vl")).name
'qwen_vl'
>>> sorted(HANDLERS)  # doctest: +NORMALIZE_WHITESPACE
['chat_template', 'gemma3', 'gemma4', 'idefics3', 'kimi_k25', 'llava_onevision',
 'nemotron_omni', 'phi4', 'prompt_answer', 'qwen3_omni', 'qwen_omni', 'qwen_vl', 'smolvlm', 'step3']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .family_default import check_modalities, has_chat_template, tokenize_default
from .family_gemma3 import gemma3_pack_media, gemma3_packed_masks, tokenize_gemma3
from .family_gemma4 import (
    GEMMA4_MODALITIES,
    gemma4_pack_media,
    gemma4_packed_masks,
    tokenize_gemma4,
)
from .family_idefics3 import idefics3_pack_media, tokenize_idefics3
from .family_kimi import kimi_k25_pack_media
from .family_llava_onevision import llava_onevision_pack_media, tokenize_llava_onevision
from .family_nemotron_omni import (
    nemotron_omni_pack_media,
    nemotron_omni_packed_masks,
    tokenize_nemotron_omni,
)
from .family_phi4 import PHI4_MODALITIES, phi4_pack_media, tokenize_phi4
from .family_prompt import tokenize_prompt_answer
from .family_qwen3_omni import tokenize_qwen3_omni
from .family_qwen_omni import OMNI_MODALITIES, qwen_omni_pack_media, tokenize_qwen_omni
from .family_smolvlm import tokenize_smolvlm
from .family_step3 import step3_pack_media, tokenize_step3
from .tokenize import tokenize_conversation

__all__ = [
    "HANDLERS",
    "PROCESSOR_HANDLERS",
    "Handler",
    "get_handler",
    "packed_model_inputs",
    "register_handler",
    "resolve_handler",
    "tokenize_with_handler",
]

TokenizeFn = Callable[..., dict[str, Any]]
PackMediaFn = Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]
PackedMaskFn = Callable[..., Any]


@dataclass(frozen=True)
class Handler:
    """A named way to tokenize one Record with a processor.

    ``tokenize(record, processor, **options) -> Sample``. ``modalities``: the media kinds the
    family accepts (a record with another kind is a ``SampleError`` naming the sample).
    ``needs_chat_template``: refuse a processor without one.
    ``pack_media(samples) -> dict``: the model's media inputs for one pack (None: the pack's own
    ``pixel_values``); ``packed_mask(doc_ids, mm_token_type_ids, **options)``: the attention mask
    (or per-layer-type dict) of a packed row (None: ``mask.to_4d_additive_mask``);
    ``mrope``: positions need the collater's mRoPE path (``packed_model_inputs`` refuses).
    """

    name: str
    tokenize: TokenizeFn
    modalities: frozenset[str] = frozenset({"image", "video"})
    needs_chat_template: bool = True
    description: str = ""
    pack_media: PackMediaFn | None = None
    packed_mask: PackedMaskFn | None = None
    mrope: bool = False

    def __call__(self, record: Mapping[str, Any], processor: Any, **options: Any) -> dict[str, Any]:
        check_modalities(record, processor, self.modalities)
        return self.tokenize(record, processor, **options)


HANDLERS: dict[str, Handler] = {}
"""Handler name -> Handler."""
PROCESSOR_HANDLERS: dict[str, str] = {}
"""Processor class name (``type(processor).__name__``) -> handler name."""


def register_handler(
    handler: Handler, processor_classes: tuple[str, ...] = (), *, replace: bool = False
) -> Handler:
    """Add ``handler`` and map each processor class name to it.

    Re-registering a name or a class with a different handler raises unless ``replace=True``.

    >>> h = Handler("mine", tokenize_default, description="doc example")
    >>> register_handler(h, ("MyProcessor",)) is h
    True
    >>> PROCESSOR_HANDLERS.pop("MyProcessor"), HANDLERS.pop("mine").name
    ('mine', 'mine')
    """
    if not isinstance(handler, Handler):
        raise TypeError(f"handler must be a Handler, got {type(handler).__name__}")
    old = HANDLERS.get(handler.name)
    if old is not None and old is not handler and not replace:
        raise ValueError(
            f"a handler named {handler.name!r} is already registered; pass replace=True"
        )
    for cls in processor_classes:
        prev = PROCESSOR_HANDLERS.get(cls)
        if prev is not None and prev != handler.name and not replace:
            raise ValueError(
                f"processor class {cls!r} already maps to handler {prev!r}; pass replace=True"
            )
    HANDLERS[handler.name] = handler
    for cls in processor_classes:
        PROCESSOR_HANDLERS[cls] = handler.name
    return handler


def get_handler(processor: Any, name: str | None = None) -> Handler:
    """The handler for ``processor``: explicit ``name``, else by class name, else the default."""
    if name is not None:
        if name not in HANDLERS:
            raise ValueError(f"unknown handler {name=}; registered: {sorted(HANDLERS)}")
        handler = HANDLERS[name]
    else:
        cls = type(processor).__name__
        handler = HANDLERS[PROCESSOR_HANDLERS.get(cls, "chat_template")]
    if handler.needs_chat_template and not has_chat_template(processor):
        cls = type(processor).__name__
        raise ValueError(
            f"processor {cls} has no chat template and no handler is registered for it in "
            f"neatpack.pipes.registry (registered classes: {sorted(PROCESSOR_HANDLERS)}). Fix: "
            "give the processor a chat_template, select a template-free handler explicitly "
            "(handler='prompt_answer' for a prompt -> answer model), or add one with "
            f"register_handler(Handler('<name>', <tokenize fn>), processor_classes=({cls!r},))"
        )
    return handler


def resolve_handler(handler: str | Handler) -> Handler:
    """``handler`` itself, or the registered handler of that name (``ValueError`` naming the
    registered ones otherwise)."""
    if isinstance(handler, Handler):
        return handler
    if handler not in HANDLERS:
        raise ValueError(f"unknown handler {handler=}; registered: {sorted(HANDLERS)}")
    return HANDLERS[handler]


def tokenize_with_handler(
    record: Mapping[str, Any], processor: Any, *, handler: str | None = None, **options: Any
) -> dict[str, Any]:
    """``get_handler(processor, handler)(record, processor, **options)``."""
    return get_handler(processor, handler)(record, processor, **options)


def packed_model_inputs(
    samples: Sequence[Mapping[str, Any]],
    processor: Any,
    *,
    handler: str | None = None,
    padding_idx: int = 0,
    mask_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Model kwargs for ONE packed row of UNSHIFTED samples of a 1-D-position family:
    ``input_ids`` / ``position_ids`` ``[1, S]``, the family's ``attention_mask`` and media.

    Qwen-VL (mRoPE) rows go through ``collate.neat_packed_vlm_collater`` instead.
    """
    from .mask import to_4d_additive_mask
    from .pack import build_pack

    h = get_handler(processor, handler)
    if h.mrope:
        raise ValueError(
            f"handler {h.name!r} needs mRoPE positions; use neat_packed_vlm_collater for it"
        )
    pack = build_pack(list(samples), padding_idx=padding_idx)  # type: ignore[arg-type]
    doc, mm = pack["attention_mask"][None], pack["mm_token_type_ids"][None]
    if h.packed_mask is None:
        mask: Any = to_4d_additive_mask(doc)
    else:
        mask = h.packed_mask(doc, mm, **dict(mask_options or {}))
    if h.pack_media is not None:
        media = h.pack_media(samples)
    else:
        media = {} if pack["pixel_values"] is None else {"pixel_values": pack["pixel_values"]}
    out = {
        "input_ids": pack["input_ids"][None],
        "position_ids": pack["text_position_ids"][None],
        "attention_mask": mask,
        **media,
    }
    out["seq_lens"] = pack["seq_lens"]
    return out


register_handler(
    Handler(
        "qwen_vl",
        tokenize_conversation,
        mrope=True,
        description="Qwen2-VL / Qwen2.5-VL / Qwen3-VL: grid_thw checks, fake images, video "
        "metadata (pipes/tokenize.py)",
    ),
    (
        "Qwen2VLProcessor",
        "Qwen2_5_VLProcessor",
        "Qwen3VLProcessor",
        "Qwen3VLMoeProcessor",
    ),
)
register_handler(
    Handler(
        "chat_template",
        tokenize_default,
        description="any processor with a chat template (pipes/family_default.py)",
    )
)


register_handler(
    Handler(
        "gemma3",
        tokenize_gemma3,
        modalities=frozenset({"image"}),
        pack_media=gemma3_pack_media,
        packed_mask=gemma3_packed_masks,
        description="Gemma 3: the default path, images only, pan-and-scan crops counted; packed "
        "rows need family_gemma3.gemma3_packed_mask (bidirectional image tokens)",
    ),
    ("Gemma3Processor",),
)
register_handler(
    Handler(
        "gemma4",
        tokenize_gemma4,
        modalities=GEMMA4_MODALITIES,
        pack_media=gemma4_pack_media,
        packed_mask=gemma4_packed_masks,
        description="Gemma 4: thinking-channel prefix injected after each model turn and kept "
        "out of the labels (pipes/family_gemma4.py); images, videos (frame lists), audio",
    ),
    ("Gemma4Processor",),
)
register_handler(
    Handler(
        "llava_onevision",
        tokenize_llava_onevision,
        modalities=frozenset({"image"}),
        pack_media=llava_onevision_pack_media,
        description="LLaVA-OneVision: AnyRes image-token rule; packs need "
        "family_llava_onevision.llava_onevision_pack_media (image_sizes, batch_num_images)",
    ),
    ("LlavaOnevisionProcessor",),
)
register_handler(
    Handler(
        "idefics3",
        tokenize_idefics3,
        modalities=frozenset({"image"}),
        pack_media=idefics3_pack_media,
        description="Idefics3 / SmolVLM-style tiles: image_seq_len per tile; packs need "
        "family_idefics3.idefics3_pack_media (tiles on axis 1)",
    ),
    ("Idefics3Processor",),
)
register_handler(
    Handler(
        "prompt_answer",
        tokenize_prompt_answer,
        modalities=frozenset({"image"}),
        needs_chat_template=False,
        description="no chat template: prompt masked, answer + eos labelled "
        "(Nemotron-Parse style, pipes/family_prompt.py)",
    )
)
register_handler(
    Handler(
        "qwen_omni",
        tokenize_qwen_omni,
        modalities=OMNI_MODALITIES,
        pack_media=qwen_omni_pack_media,
        mrope=True,
        description="Qwen2.5-Omni: images + audio (WhisperFeatureExtractor features, 16 kHz "
        "checked), mRoPE from the model's get_rope_index (pipes/family_qwen_omni.py)",
    ),
    ("Qwen2_5OmniProcessor",),
)
register_handler(
    Handler(
        "qwen3_omni",
        tokenize_qwen3_omni,
        modalities=OMNI_MODALITIES,
        pack_media=qwen_omni_pack_media,
        mrope=True,
        description="Qwen3-Omni: the Qwen2.5-Omni path with 13 audio tokens per 100-frame chunk "
        "and no 30 s window; features padded per pack (pipes/family_qwen3_omni.py)",
    ),
    ("Qwen3OmniMoeProcessor",),
)
register_handler(
    Handler(
        "phi4",
        tokenize_phi4,
        modalities=PHI4_MODALITIES,
        pack_media=phi4_pack_media,
        description="Phi-4-multimodal: images (448 HD crops) + audio "
        "(Phi4MultimodalFeatureExtractor, 16 kHz checked); packs need "
        "family_phi4.phi4_pack_media (pipes/family_phi4.py)",
    ),
    ("Phi4MultimodalProcessor",),
)
register_handler(
    Handler(
        "nemotron_omni",
        tokenize_nemotron_omni,
        modalities=frozenset({"image", "audio"}),
        pack_media=nemotron_omni_pack_media,
        packed_mask=nemotron_omni_packed_masks,
        description="Nemotron-H Omni: images (<img> runs from image_grid_hw) + audio (Parakeet "
        "features, 16 kHz checked); packs need family_nemotron_omni.nemotron_omni_pack_media; "
        "Mamba layers are not isolated per document (pipes/family_nemotron_omni.py)",
    ),
    ("NemotronH_Omni_Reasoning_V3Processor",),
)
register_handler(
    Handler(
        "kimi_k25",
        tokenize_default,
        modalities=frozenset({"image"}),
        pack_media=kimi_k25_pack_media,
        description="Kimi K2.5: the default path, images pre-expanded by the processor to "
        "(h // 2) * (w // 2) tokens from image_grid_thw; packs need "
        "family_kimi.kimi_k25_pack_media (pixels + grids)",
    ),
    ("Kimi_K25Processor",),
)
register_handler(
    Handler(
        "step3",
        tokenize_step3,
        modalities=frozenset({"image"}),
        pack_media=step3_pack_media,
        description="Step3 (Step-3.7) crops: global view + sliding-window crops per image, "
        "<im_patch> count checked (pipes/family_step3.py); packs need "
        "family_step3.step3_pack_media (pixel_values, pixel_values_local, num_local_patches)",
    ),
    ("Step3p7Processor",),
)
register_handler(
    Handler(
        "smolvlm",
        tokenize_smolvlm,
        modalities=frozenset({"image"}),
        pack_media=idefics3_pack_media,
        description="SmolVLM: Idefics3's tiles and markers, token count from the image "
        "processor's layout (no _get_num_multimodal_tokens; pipes/family_smolvlm.py)",
    ),
    ("SmolVLMProcessor",),
)
