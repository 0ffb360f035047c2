"""What a processor says, read the same way on every transformers 5.x release.

``transformers>=5,<6`` covers releases whose processors store the same facts in different
places. Every reader here detects the feature, never the version string:

* media token ids: 5.24 processors carry ``image_token_id`` / ``image_token_ids``; 5.17's
  Qwen-Omni processors have neither (``image_token_ids`` is ``[None]``) and only their tokenizer
  knows the id (``tokenizer.image_token_id``); some tokenizers give one int, not a list.
* processor defaults (``position_id_per_seconds``, ``n_window``...): 5.24 keeps them as
  processor attributes; 5.17 keeps them in the class's ``valid_processor_kwargs._defaults``
  per modality. (Settings neatpack changes, such as Gemma 3's pan-and-scan, are passed to each
  call instead: call-time kwargs win on every release.)
* image token counts: 5.24's Omni processors have ``_get_num_multimodal_tokens``; 5.17's do
  not, and the image processor's ``get_number_of_image_patches`` (in every 5.x) gives the same
  count.

>>> from neatpack.pipes.testing.tiny import load_tiny_processor
>>> proc = load_tiny_processor("qwen2_vl")
>>> media_ids(proc, "image") == [proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")]
True
>>> image_token_counts(proc, [[56, 56]])  # 4x4 patches of 14 px, merged 2x2
[4]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "MODALITY_KWARGS",
    "call_defaults",
    "image_token_counts",
    "media_ids",
    "processor_default",
    "set_call_defaults",
    "video_token_counts",
]

MODALITY_KWARGS = ("text_kwargs", "images_kwargs", "videos_kwargs", "audio_kwargs")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):  # some tokenizers give one id, not a list
        return [value]
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [int(i) for i in value if i is not None]
    return []


def _safe(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name, None)
    except (AttributeError, KeyError, TypeError, ValueError):  # properties that raise
        return None


def media_ids(processor: Any, kind: str) -> list[int]:
    """Token ids of ``kind`` (``"image"``, ``"video"``, ``"audio"``) placeholders in the row.

    The processor's ``{kind}_token_ids``, else its ``{kind}_token_id``, else its tokenizer's
    ``{kind}_token_id`` (transformers 5.17 Qwen-Omni processors know no id themselves). Empty
    when the processor has no such modality."""
    if kind not in ("image", "video", "audio"):
        raise ValueError(f"{kind=} is not one of ('image', 'video', 'audio')")
    for obj, attr in (
        (processor, f"{kind}_token_ids"),
        (processor, f"{kind}_token_id"),
        (_safe(processor, "tokenizer"), f"{kind}_token_id"),
    ):
        ids = _ids(_safe(obj, attr)) if obj is not None else []
        if ids:
            return ids
    return []


def processor_default(processor: Any, name: str, default: Any = None) -> Any:
    """A processor-level default such as ``position_id_per_seconds`` or ``n_window``.

    The processor's attribute (transformers >= 5.2x), else the value in its class's
    ``valid_processor_kwargs._defaults`` (any modality group; transformers 5.17), else
    ``default``."""
    value = _safe(processor, name)
    if value is not None:
        return value
    defaults = _class_defaults(processor)
    for group in MODALITY_KWARGS:
        if name in defaults.get(group, {}):
            return defaults[group][name]
    return default


def call_defaults(processor: Any, modality: str) -> dict[str, Any]:
    """The processor-level ``{modality}`` defaults: the instance/class attribute
    (``processor.videos_kwargs``, 5.2x), else ``valid_processor_kwargs._defaults`` (5.17)."""
    value = _safe(processor, modality)
    if isinstance(value, Mapping):
        return dict(value)
    return dict(_class_defaults(processor).get(modality, {}))


def _class_defaults(processor: Any) -> Mapping[str, Mapping[str, Any]]:
    kwargs_cls = _safe(processor, "valid_processor_kwargs")
    defaults = _safe(kwargs_cls, "_defaults") if kwargs_cls is not None else None
    return defaults if isinstance(defaults, Mapping) else {}


class CallDefaults:
    """A processor's ``valid_processor_kwargs`` with some ``_defaults`` replaced, for ONE
    processor instance (the class's dict is shared by every processor of the class).

    An instance, not a class, so a processor holding it still pickles (workers get a copy)."""

    def __init__(self, base: Any, defaults: Mapping[str, Mapping[str, Any]]) -> None:
        self.base = base
        self._defaults = {k: dict(v) for k, v in defaults.items()}
        self.__annotations__ = dict(base.__annotations__)

    def __getattr__(self, name: str) -> Any:
        if name == "base":  # unpickling: no base yet
            raise AttributeError(name)
        return getattr(self.base, name)


def set_call_defaults(processor: Any, modality: str, values: Mapping[str, Any]) -> Any:
    """Make ``values`` the ``{modality}`` defaults of THIS processor's calls (returned).

    Writes both places transformers 5.x reads them from: the instance attribute
    (``processor.images_kwargs``, read by 5.2x, where the class declares none) and, where the
    class keeps ``valid_processor_kwargs._defaults[modality]`` (5.17, which ignores the
    attribute), a per-instance ``CallDefaults`` carrying the values. Releases whose processors
    read neither (5.0's Gemma 3) still honour call-time kwargs: pass them there too."""
    if modality not in MODALITY_KWARGS:
        raise ValueError(f"{modality=} is not one of {MODALITY_KWARGS}")
    current = _safe(processor, modality)
    setattr(processor, modality, {**(current if isinstance(current, Mapping) else {}), **values})
    defaults = _class_defaults(processor)
    if modality in defaults:
        base = processor.valid_processor_kwargs
        base = base.base if isinstance(base, CallDefaults) else base
        merged = {**defaults, modality: {**defaults[modality], **values}}
        processor.valid_processor_kwargs = CallDefaults(base, merged)
    return processor


def image_token_counts(processor: Any, sizes: Sequence[Sequence[int]]) -> list[int]:
    """Tokens per image of ``sizes`` (``[height, width]`` each), as the processor expands them.

    ``processor._get_num_multimodal_tokens(image_sizes=...)`` where the processor has it; else
    (transformers 5.17's Qwen-Omni processors) the image processor's
    ``get_number_of_image_patches`` divided by ``merge_size**2``, the rule those processors
    apply to ``image_grid_thw``."""
    if not sizes:
        return []
    fn = _safe(processor, "_get_num_multimodal_tokens")
    if fn is not None:
        return [int(n) for n in fn(image_sizes=[list(s) for s in sizes]).num_image_tokens]
    ip = processor.image_processor
    patches = getattr(ip, "get_number_of_image_patches", None)
    if patches is None:
        raise ValueError(
            f"{type(processor).__name__} has no _get_num_multimodal_tokens and "
            f"{type(ip).__name__} no get_number_of_image_patches: this transformers release "
            "cannot say how many tokens an image takes; upgrade transformers (5.24 is tested)"
        )
    merge = int(getattr(ip, "merge_size", 1) or 1)
    return [int(patches(int(h), int(w), {})) // merge**2 for h, w in sizes]


def video_token_counts(processor: Any, sizes: Sequence[Sequence[int]]) -> list[int]:
    """Tokens per video of ``sizes`` (``[frames, height, width]`` each), as the processor
    expands them: ``_get_num_multimodal_tokens(video_sizes=...)`` where the processor has it,
    else the video processor's ``get_num_of_video_patches`` under the processor's own video
    defaults (its ``size`` as ``min_pixels`` / ``max_pixels``) divided by ``merge_size**2``."""
    if not sizes:
        return []
    fn = _safe(processor, "_get_num_multimodal_tokens")
    if fn is not None:
        return [int(n) for n in fn(video_sizes=[list(s) for s in sizes]).num_video_tokens]
    vp = processor.video_processor
    patches = getattr(vp, "get_num_of_video_patches", None)
    if patches is None:
        raise ValueError(
            f"{type(processor).__name__} has no _get_num_multimodal_tokens and "
            f"{type(vp).__name__} no get_num_of_video_patches: this transformers release "
            "cannot say how many tokens a video takes; upgrade transformers (5.24 is tested)"
        )
    kw = call_defaults(processor, "videos_kwargs")
    size = kw.get("size")
    if isinstance(size, Mapping):  # the processor call resizes by it; the patch rule reads pixels
        kw.setdefault("min_pixels", size.get("shortest_edge"))
        kw.setdefault("max_pixels", size.get("longest_edge"))
    merge = int(getattr(vp, "merge_size", 1) or 1)
    return [int(patches(int(t), int(h), int(w), kw)) // merge**2 for t, h, w in sizes]
