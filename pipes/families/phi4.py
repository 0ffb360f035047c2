"""Phi-4-multimodal (``Phi4MultimodalProcessor`` / ``Phi4MultimodalForCausalLM``): text, images
and audio in one conversation (the seed's ``phi4_mm_collate_fn``).

An audio block is ``{"type": "audio", "audio": <.wav path | 1-D float array>}``, read and checked
by ``neatpack.pipes.reading.audio`` (16 kHz, never resampled; missing / empty / non-finite refused
naming the sample). What differs from the default path:

* the processor takes ``audio=[...]``; each ``<|audio|>`` becomes
  ``ceil(frames / 8)`` tokens, ``frames = (samples - 400) // 160 + 1`` (``phi4_audio_tokens``:
  the feature extractor's rule, checked against its ``audio_embed_sizes``); a clip shorter than
  one 25 ms window (400 samples) gives no frame and is refused;
* each ``<|image|>`` becomes ``256 + 1 + R * C + R + 16`` tokens (global 16x16 grid with a
  separator column, one separator, the ``R x C`` HD sub-grid with one separator per row):
  ``phi4_image_tokens`` computes R and C from the image size without pixels (448-pixel crops,
  at most ``dynamic_hd``), checked against the text;
* the Sample keeps the model's own media names: ``image_pixel_values``
  ``[n_img, crops, 3, 448, 448]``, ``image_sizes``, ``image_attention_mask``,
  ``audio_input_features`` ``[n_audio, frames, 80]``, ``audio_embed_sizes`` and
  ``audio_attention_mask`` (built from the frame counts when the extractor omits it for one clip);
* positions are 1-D and the text model takes a 4D mask as it is, so a packed row is the
  block-causal ``mask.to_4d_additive_mask`` with ``phi4_pack_media`` (crops padded to the
  row's maximum as the image processor pads them, audio frames padded with a False mask).

Two model facts a packed row must respect (both measured, ``tests/families/test_family_phi4.py``:
0.34 and 0.077 on the tiny model):

1. the audio projection is chosen per FORWARD: ``"vision"`` when ``image_pixel_values`` is given,
   else ``"speech"``. An image-less audio document packed beside an image document is projected
   differently than alone, so ``phi4_pack_media`` refuses that mix (group such samples apart);
2. the audio encoder adds its boolean padding mask to the scores (+1 / +0) instead of masking, so
   a clip padded to a longer one in the same forward sees the padding (as in an ordinary padded
   batch). Clips of equal frame count, or one clip per row, are exact.

The chat template is rendered from the processor or, when ``Phi4MultimodalProcessor`` lost it on
load (its ``__init__`` does not name ``chat_template``, so 5.23's ``from_pretrained`` drops it),
from its tokenizer.

>>> phi4_audio_tokens(16000)  # 1 s: 98 frames -> ceil(98 / 8)
13
>>> phi4_image_tokens(64, 96)  # one crop, padded to 448x298: 11 of 16 rows hold the image
460
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from torch import Tensor

from neatpack.pipes.materializing.labels import RoleMarkers

from .audio import (
    AUDIO_FAMILY_MODALITIES,
    AudioFamily,
    audio_processor,
    estimate_audio_family,
    tokenize_audio_family,
)
from .registry import Handler, register_handler

__all__ = [
    "PHI4_GRAPH_REFUSED",
    "PHI4_HANDLER",
    "PHI4_MODALITIES",
    "phi4_audio_tokens",
    "phi4_estimate",
    "phi4_image_tokens",
    "phi4_pack_media",
    "phi4_role_markers",
    "tokenize_phi4",
]

PHI4_MODALITIES: Final = AUDIO_FAMILY_MODALITIES
_IMAGE_KEYS: Final = ("image_pixel_values", "image_sizes", "image_attention_mask")
_AUDIO_KEYS: Final = ("audio_input_features", "audio_embed_sizes", "audio_attention_mask")


def phi4_audio_tokens(
    n_samples: int, *, win: int = 400, hop: int = 160, compression: int = 8, downsample: int = 1
) -> int:
    """Audio tokens for ``n_samples`` samples (the feature extractor's rule; 0 when too short)."""
    frames = max((n_samples - win) // hop + 1, 0)
    return math.ceil(math.ceil(frames / compression) / downsample)


def _extractor_rule(processor: Any) -> dict[str, int]:
    fe = audio_processor(processor)
    return {
        "win": int(fe.win_length),
        "hop": int(fe.hop_length),
        "compression": int(fe.audio_compression_rate),
        "downsample": int(fe.audio_downsample_rate),
    }


def phi4_image_tokens(height: int, width: int, *, crop: int = 448, max_crops: int = 4) -> int:
    """``<|image|>`` tokens of one ``height x width`` image (the image processor's
    ``dynamic_preprocess`` arithmetic, no pixels): ``256 + 1 + R * C + R + 16``."""
    patch, grid = 14, crop // 14
    w_n, h_n = math.ceil(width / crop), math.ceil(height / crop)
    if w_n * h_n > max_crops:
        ratios = sorted(
            {(i, j) for n in range(1, max_crops + 1) for i in range(1, n + 1)
             for j in range(1, n + 1) if i * j <= max_crops},
            key=lambda r: r[0] * r[1],
        )  # fmt: skip
        best, best_diff = (1, 1), float("inf")
        for ratio in ratios:  # the processor's find_closest_aspect_ratio, tie rule included
            diff = abs(width / height - ratio[0] / ratio[1])
            if diff < best_diff:
                best, best_diff = ratio, diff
            elif diff == best_diff and width * height > 0.5 * crop * crop * ratio[0] * ratio[1]:
                best = ratio
        w_n, h_n = best
    tw, th = crop * w_n, crop * h_n
    if tw / width < th / height:
        pad_w, pad_h = 0, th - int(height * tw / width)
    else:
        pad_w, pad_h = tw - int(width * th / height), 0
    cols = grid * w_n - (pad_w // patch if pad_w >= patch else 0)
    rows = grid * h_n - (pad_h // patch if pad_h >= patch else 0)
    r, c = math.ceil(rows / 2), math.ceil(cols / 2)  # the 2x2 downsampled mask keeps even cells
    return (grid // 2) ** 2 + 1 + r * c + r + 16


def _image_rule(processor: Any) -> dict[str, int]:
    ip = processor.image_processor
    return {"crop": int(ip.size["height"]), "max_crops": int(ip.dynamic_hd)}


def phi4_role_markers(processor: Any) -> RoleMarkers:
    """``<|assistant|>`` ... ``<|end|>``, given rather than derived: Phi-4's template ends a
    conversation with eos (``<|endoftext|>``), so the rendered user-only probe and the full one
    share the characters ``<|`` past ``<|end|>`` and ``labels.derive_role_markers`` finds its
    boundary inside the ``<|assistant|>`` token."""
    tok = processor.tokenizer
    return RoleMarkers(
        (int(tok.convert_tokens_to_ids("<|assistant|>")),),
        (int(tok.convert_tokens_to_ids("<|end|>")),),
    )


def _phi4_image_total(processor: Any, images: list[Any]) -> int:
    rule = _image_rule(processor)
    return sum(phi4_image_tokens(i.height, i.width, **rule) for i in images)


PHI4: Final = AudioFamily(
    audio_tokens=lambda p, n: phi4_audio_tokens(n, **_extractor_rule(p)),
    clip_tokens=lambda p, out: [int(x) for x in out["audio_embed_sizes"].tolist()],
    image_tokens=_phi4_image_total,
    markers=phi4_role_markers,
    keys=_IMAGE_KEYS + _AUDIO_KEYS,
    image_expansion=lambda p, sizes: [phi4_image_tokens(*hw, **_image_rule(p)) for hw in sizes],
    audio_expansion=lambda p, n: phi4_audio_tokens(n, **_extractor_rule(p)),
)


def tokenize_phi4(record: Mapping[str, Any], processor: Any, **options: Any) -> dict[str, Any]:
    """One Record with text, image and audio blocks -> one Sample (module docstring);
    ``options``: ``label_policy``, ``markers``, ``max_image_pixels``."""
    sample = tokenize_audio_family(record, processor, PHI4, **options)
    if "audio_input_features" in sample and "audio_attention_mask" not in sample:
        n, frames = sample["audio_input_features"].shape[:2]  # the extractor omits it for one clip
        sample["audio_attention_mask"] = torch.ones(n, frames, dtype=torch.bool)
    return sample


def phi4_estimate(record: Mapping[str, Any], processor: Any, *, mode: str = "exact") -> int:
    """``estimate_audio_family`` with Phi-4's rules (``phi4_image_tokens``,
    ``phi4_audio_tokens``). Exact mode equals the real length (a test checks it)."""
    return estimate_audio_family(record, processor, PHI4, mode=mode)


def _pad_dim1(parts: Sequence[Tensor], value: float | bool) -> Tensor:
    width = max(int(p.shape[1]) for p in parts)
    out = []
    for p in parts:
        pad = p.new_full((p.shape[0], width - p.shape[1], *p.shape[2:]), value)
        out.append(torch.cat([p, pad], dim=1))
    return torch.cat(out, dim=0)


def phi4_pack_media(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The model's media inputs for the documents of one pack, in document order: image crops
    padded to the pack's most (zero pixels, mask ones: what the image processor does within a
    batch), audio frames padded (zero features, mask False). Refuses a pack that mixes an
    image-less audio document with an image document (module docstring, fact 1)."""
    has_img = [s.get("image_pixel_values") is not None for s in samples]
    speech = [s.get("sample_id") for s, i in zip(samples, has_img, strict=True)
              if not i and s.get("audio_input_features") is not None]  # fmt: skip
    if speech and any(has_img):
        raise ValueError(
            f"samples {speech} have audio but no image and would be packed beside an image "
            f"document ({[s.get('sample_id') for s, i in zip(samples, has_img, strict=True) if i]})"
            ": Phi-4 projects all audio of a forward with its vision-speech projection when any "
            "image is present, so they would not match their own runs; pack them apart"
        )
    out: dict[str, Any] = {}
    if any(has_img):
        imgs = [s for s in samples if s.get("image_pixel_values") is not None]
        out["image_pixel_values"] = _pad_dim1([s["image_pixel_values"] for s in imgs], 0.0)
        out["image_attention_mask"] = _pad_dim1([s["image_attention_mask"] for s in imgs], 1.0)
        out["image_sizes"] = torch.cat([s["image_sizes"] for s in imgs], dim=0)
    auds = [s for s in samples if s.get("audio_input_features") is not None]
    if auds:
        out["audio_input_features"] = _pad_dim1([s["audio_input_features"] for s in auds], 0.0)
        out["audio_attention_mask"] = _pad_dim1([s["audio_attention_mask"] for s in auds], False)
        out["audio_embed_sizes"] = torch.cat([s["audio_embed_sizes"] for s in auds], dim=0)
    return out


#: Why ``neat_vlm_graph`` refuses Phi-4-multimodal (``Handler.graph_refused``): the graph merges
#: a whole batch's media into ONE forward and plans packs by length only.
PHI4_GRAPH_REFUSED: Final = (
    "Phi-4-multimodal picks its audio projection per forward ('vision' when any image "
    "is in it, else 'speech'), so phi4.phi4_pack_media refuses image-less audio beside "
    "images, a mix the planner does not keep apart (the loader would fail mid-epoch); and its "
    "audio encoder adds its padding mask to the scores, so clips of unequal length in one "
    "forward are not exact (tests/families/test_family_phi4.py measures 0.34 and 0.077). Fix: "
    "pack it with materialize_pack + neat_packed_family_collater over groups that are "
    "image-only, or audio-only with clips of equal length"
)


PHI4_HANDLER = register_handler(
    Handler(
        "phi4",
        tokenize_phi4,
        modalities=PHI4_MODALITIES,
        pack_media=phi4_pack_media,
        description="Phi-4-multimodal: images (448 HD crops) + audio "
        "(Phi4MultimodalFeatureExtractor, 16 kHz checked); packs need "
        "phi4.phi4_pack_media (pipes/families/phi4.py)",
        estimate=phi4_estimate,
        graph_refused=PHI4_GRAPH_REFUSED,
        pp_refused="its media split per pipeline micro-batch is not verified (README family "
        "table: PP 'not done')",
    ),
    ("Phi4MultimodalProcessor",),
)
