"""``processor_compat``: the readers that make older transformers 5.x releases work, checked on
the installed release by taking away what an older one lacks (CI runs only the newest; the
old releases themselves: ``scripts/check_transformers_versions.sh``).

Each fallback is compared with what the installed processor itself says, on real tiny
processors: the rule the fallback applies must be the library's.
"""

from __future__ import annotations

import inspect
import pickle
import random
import types
from typing import Any

import pytest
import torch
from PIL import Image
from support.tiny import (
    load_tiny_gemma3_processor,
    load_tiny_gemma4_processor,
    load_tiny_qwen3_omni_processor,
    load_tiny_qwen_omni_processor,
)

from neatpack.pipes.families import tokenize_with_handler
from neatpack.pipes.families.chat_template import media_token_ids
from neatpack.pipes.families.gemma3 import gemma3_num_crops, gemma3_pan_and_scan
from neatpack.pipes.families.gemma4 import gemma4_pack_media, gemma4_video_tokens
from neatpack.pipes.families.processor_compat import (
    CallDefaults,
    image_token_counts,
    media_ids,
    processor_default,
    set_call_defaults,
    video_token_counts,
)
from neatpack.pipes.testing.tiny import load_tiny_processor

SIZES = [(28, 28), (56, 84), (100, 70), (31, 200), (300, 17), (448, 448)]


@pytest.fixture(scope="module", params=["qwen_omni", "qwen3_omni"])
def omni(request: pytest.FixtureRequest) -> Any:
    if request.param == "qwen_omni":
        return load_tiny_qwen_omni_processor()
    return load_tiny_qwen3_omni_processor()


def _needs_the_new_counter(processor: Any) -> None:
    if not hasattr(processor, "_get_num_multimodal_tokens"):  # the fallback is the only path
        pytest.skip(
            "no _get_num_multimodal_tokens to compare with (the family tests compare "
            "the fallback with the real expansion)"
        )


def test_media_ids_fall_back_to_the_tokenizer(omni: Any) -> None:
    """transformers 5.17's Omni processors carry no ``*_token_id``: ``image_token_ids`` is
    ``[None]`` there. The ids then come from the tokenizer, and equal the processor's own."""
    tok = omni.tokenizer
    want = {
        kind: [tok.convert_tokens_to_ids(getattr(omni, f"{kind}_token"))]
        for kind in ("image", "video", "audio")
    }
    assert {kind: media_ids(omni, kind) for kind in want} == want
    old = types.SimpleNamespace(
        tokenizer=tok, image_token_ids=[None], video_token_ids=[None], audio_token_ids=[None]
    )  # what a 5.17 Qwen2.5-Omni processor answers
    assert {kind: media_ids(old, kind) for kind in want} == want
    assert media_token_ids(old) == {1: want["image"], 2: want["video"], 3: want["audio"]}
    with pytest.raises(ValueError, match="'image', 'video', 'audio'"):
        media_ids(omni, "text")


def test_one_int_ids_and_no_modality() -> None:
    tok = types.SimpleNamespace(image_token_id=7)
    assert media_ids(types.SimpleNamespace(tokenizer=tok, image_token_ids=7), "image") == [7]
    assert media_ids(types.SimpleNamespace(tokenizer=tok), "audio") == []


def test_image_counts_without_get_num_multimodal_tokens(omni: Any) -> None:
    """The image processor's patch rule (5.17, no ``_get_num_multimodal_tokens``) == the
    processor's own count (5.24)."""
    sizes = [list(s) for s in SIZES]
    _needs_the_new_counter(omni)
    want = omni._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
    old = types.SimpleNamespace(image_processor=omni.image_processor)
    assert image_token_counts(old, sizes) == list(want) == image_token_counts(omni, sizes)
    assert image_token_counts(old, []) == []
    with pytest.raises(ValueError, match="upgrade transformers"):
        image_token_counts(types.SimpleNamespace(image_processor=object()), sizes)


def test_video_counts_without_get_num_multimodal_tokens(omni: Any) -> None:
    """The video processor's patch rule under the processor's own video defaults (its ``size``
    overrides the video processor's) == the processor's own count."""
    rng = random.Random(3)
    sizes = [[rng.choice((2, 4, 6)), h, w] for h, w in SIZES]
    _needs_the_new_counter(omni)
    want = omni._get_num_multimodal_tokens(video_sizes=sizes).num_video_tokens
    old = types.SimpleNamespace(
        video_processor=omni.video_processor, videos_kwargs=dict(omni.videos_kwargs)
    )
    assert video_token_counts(old, sizes) == list(want) == video_token_counts(omni, sizes)


def test_processor_defaults_from_attributes_or_class_defaults(omni: Any) -> None:
    """5.24: ``processor.position_id_per_seconds``; 5.17: ``valid_processor_kwargs._defaults``."""
    value = getattr(omni, "position_id_per_seconds", None)
    if value is None:  # transformers 5.17: only in the class defaults
        value = omni.valid_processor_kwargs._defaults["videos_kwargs"]["position_id_per_seconds"]
    assert processor_default(omni, "position_id_per_seconds") == value > 0
    kwargs_cls = types.SimpleNamespace(_defaults={"videos_kwargs": {"position_id_per_seconds": 7}})
    old = types.SimpleNamespace(valid_processor_kwargs=kwargs_cls)
    assert processor_default(old, "position_id_per_seconds") == 7
    assert processor_default(old, "n_window", 50) == 50


def test_gemma4_video_tokens_without_video_sizes() -> None:
    """5.17's Gemma 4 ``_get_num_multimodal_tokens`` takes no ``video_sizes``; one blank frame
    through the video processor, times the frames, gives the same count as 5.24's."""
    proc = load_tiny_gemma4_processor()
    if "video_sizes" not in inspect.signature(proc._get_num_multimodal_tokens).parameters:
        pytest.skip("this transformers' Gemma 4 processor cannot count video tokens itself")

    def no_video_sizes(image_sizes: Any = None, audio_lengths: Any = None, **kw: Any) -> Any:
        raise AssertionError("must not be called with video sizes")

    old = types.SimpleNamespace(
        _get_num_multimodal_tokens=no_video_sizes, video_processor=proc.video_processor
    )
    for frames, h, w in ((1, 28, 28), (3, 64, 48), (2, 200, 30), (4, 90, 160)):
        want = int(
            proc._get_num_multimodal_tokens(video_sizes=[(frames, h, w)]).num_video_tokens[0]
        )
        assert (
            gemma4_video_tokens(old, frames, h, w)
            == want
            == gemma4_video_tokens(proc, frames, h, w)
        )


def test_gemma4_pack_media_joins_both_frame_layouts() -> None:
    """5.24 gives ``[frames, patches, dim]`` per sample; 5.17 ``[videos, frames, patches, dim]``
    (frame counts differ between samples: one frame per item, the model flattens dims 0-1)."""
    new = [{"pixel_values_videos": torch.full((f, 5, 3), float(f))} for f in (2, 3)]
    assert gemma4_pack_media(new)["pixel_values_videos"].shape == (5, 5, 3)
    old = [
        {"pixel_values_videos": torch.full((1, f, 5, 3), float(f)),
         "video_position_ids": torch.zeros(1, f, 5, 2)}
        for f in (2, 3)
    ]  # fmt: skip
    out = gemma4_pack_media(old)
    assert out["pixel_values_videos"].shape == (5, 1, 5, 3)  # frames stay on dim 0
    assert out["video_position_ids"].shape == (5, 1, 5, 2)
    assert out["pixel_values_videos"][:, 0, 0, 0].tolist() == [2, 2, 3, 3, 3]  # in order


def test_call_defaults_override_one_instance_and_pickle() -> None:
    """Where the class keeps its defaults in ``valid_processor_kwargs._defaults`` (5.17),
    ``set_call_defaults`` gives THIS processor its own copy (the class's stays as it was) and
    the processor still pickles (loader workers get a copy)."""
    proc = load_tiny_gemma3_processor()
    base = proc.valid_processor_kwargs
    shared = {"images_kwargs": {"do_pan_and_scan": False, "do_convert_rgb": True}}
    proc.valid_processor_kwargs = CallDefaults(base, shared)  # a 5.17-style class default
    set_call_defaults(proc, "images_kwargs", {"do_pan_and_scan": True})
    assert proc.valid_processor_kwargs._defaults["images_kwargs"] == {
        "do_pan_and_scan": True,
        "do_convert_rgb": True,
    }
    assert shared["images_kwargs"]["do_pan_and_scan"] is False  # the shared dict is untouched
    assert proc.valid_processor_kwargs.base is base  # not stacked
    assert proc.images_kwargs["do_pan_and_scan"] is True  # the 5.2x place too
    back = pickle.loads(pickle.dumps(proc))
    assert back.valid_processor_kwargs._defaults == proc.valid_processor_kwargs._defaults
    assert back.valid_processor_kwargs.__annotations__ == base.__annotations__
    with pytest.raises(ValueError, match="images_kwargs"):
        set_call_defaults(proc, "pixels", {})


def test_pan_and_scan_crops_even_when_the_processor_ignores_its_attribute() -> None:
    """5.0 / 5.17 processors do not read ``processor.images_kwargs``: ``tokenize_gemma3``
    passes the pan-and-scan settings with the call, so the crops it counts are the crops made."""
    proc = gemma3_pan_and_scan(load_tiny_gemma3_processor(), min_crop_size=14)
    real_call = type(proc).__call__

    class IgnoresAttribute(type(proc)):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            saved = self.images_kwargs
            self.images_kwargs = {}  # as a release that never reads it
            try:
                return real_call(self, *args, **kwargs)
            finally:
                self.images_kwargs = saved

    proc.__class__ = IgnoresAttribute
    rec = {"sample_id": 1, "conversation": [
        {"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (200, 30))},
                                     {"type": "text", "text": "what is it"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a box"}]}]}  # fmt: skip
    s = tokenize_with_handler(rec, proc, handler="gemma3")
    assert s["pixel_values"].shape[0] == 1 + gemma3_num_crops(proc, 30, 200) > 1


def test_the_qwen_vl_ids_come_from_the_processor() -> None:
    proc = load_tiny_processor("qwen2_vl")
    assert media_ids(proc, "image") == [proc.image_token_id]
    assert media_ids(proc, "video") == [proc.video_token_id]
