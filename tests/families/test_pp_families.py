"""PP micro-batches for the non-Qwen-VL families, on real processor outputs and tiny real models.

A batch of 4 fixed-length rows (documents with 0..2 media each, one row text only) is split in
3 micro-batches as ``torch.distributed.pipelining`` splits rows (``[0, 1] [2] [3]``). Checked per
family: each micro-batch's media == ``pack_media`` of exactly its rows' documents, and the tiny
model run on each micro-batch (its rows + its media) == the whole batch's rows (<= 1e-5 fp32).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from support import tiny, tiny_family_models
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from neatpack.pipes.collating.mask import to_4d_additive_mask
from neatpack.pipes.families import (
    HANDLERS,
    Handler,
    get_handler,
    resolve_handler,
    tokenize_with_handler,
)
from neatpack.pipes.families.gemma3 import gemma3_pan_and_scan
from neatpack.pipes.materializing.pack import build_pack
from neatpack.pipes.parallel.pp_family_media import (
    chunk_family_media,
    family_media_counts,
    prepare_family_media_for_pp,
    wrap_family_collate_for_pp,
)
from neatpack.pipes.parallel.pp_media import VLM_PP_MEDIA_KEY, microbatch_bounds

N_MICRO = 3
WORDS = ["the", "a", "cat", "sat", "on", "mat", "dog", "ran", "quick", "fox", "over", "river"]
# family -> (processor loader in support.tiny, model builder in support.tiny_family_models)
FAMILIES = {
    "gemma3": ("load_tiny_gemma3_processor", "tiny_gemma3_model"),
    "gemma4": ("load_tiny_gemma4_processor", "tiny_gemma4_model"),
    "llava_onevision": ("load_tiny_llava_onevision_processor",
                        "tiny_llava_onevision_model"),
    "idefics3": ("load_tiny_idefics3_processor", "tiny_idefics3_model"),
    "internvl": ("load_tiny_internvl_processor", "tiny_internvl_model"),
    "qwen_omni": ("load_tiny_qwen_omni_processor", "tiny_qwen_omni_model"),
    "qwen3_omni": ("load_tiny_qwen3_omni_processor",
                   "tiny_qwen3_omni_model"),
    "kimi_k25": ("load_tiny_kimi_k25_processor", "tiny_kimi_k25_model"),
    "step3": ("load_tiny_step3_processor", "tiny_step3_model"),
    "smolvlm": ("load_tiny_smolvlm_processor", "tiny_smolvlm_model"),
}  # fmt: skip
#: Families whose audio tower pads each forward's partial 100-frame chunks to the longest one
#: (Qwen3-Omni): a micro-batch's clips would then differ from the whole batch's, so their
#: clips are whole seconds (``test_graph_more_families`` measures the partial-chunk limit).
WHOLE_SECOND_AUDIO = frozenset({"qwen3_omni"})


@cache
def _load(family: str) -> tuple[Any, Callable[..., Any]]:
    loader, builder = FAMILIES[family]
    proc = getattr(tiny, loader)()
    if family == "gemma3":  # crops too: each image's pixel rows = thumbnail + crops
        proc = gemma3_pan_and_scan(proc, min_crop_size=14)
    if family == "gemma4":  # an audio tower for the audio documents
        return proc, partial(getattr(tiny_family_models, builder), audio=True)
    return proc, getattr(tiny_family_models, builder)


def _record(
    sid: int, rng: random.Random, kinds: tuple[str, ...], whole_seconds: bool = False
) -> dict[str, Any]:
    """A user turn with one media block per entry of ``kinds``, then text; a short answer.
    Audio clips: 6000-20000 samples, or 1-2 s with ``whole_seconds``."""
    blocks: list[dict[str, Any]] = []
    for kind in kinds:
        if kind == "audio":
            n = rng.choice([16000, 32000]) if whole_seconds else rng.randint(6000, 20000)
            wav = np.sin(np.arange(n) * rng.uniform(0.01, 0.2))
            blocks.append({"type": "audio", "audio": (0.3 * wav).astype(np.float32)})
        elif kind == "video":
            frames = [Image.new("RGB", (32, 24), (sid * 40, 30 * k, 7)) for k in range(2)]
            blocks.append({"type": "video", "video": frames})
        else:
            w, h = rng.choice([(28, 28), (84, 28), (28, 70), (56, 56), (60, 40)])
            blocks.append({"type": "image", "image": Image.new("RGB", (w, h), (sid * 40, 90, 7))})
    blocks.append({"type": "text", "text": " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))})
    answer = " ".join(rng.choices(WORDS, k=rng.randint(2, 10)))
    return {"sample_id": sid, "conversation": [
        {"role": "user", "content": blocks},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}  # fmt: skip


# media kinds a family's documents cycle through (Gemma 4: images, videos and audio)
KINDS = {
    "qwen_omni": ("audio", "image"),
    "qwen3_omni": ("audio", "image"),
    "gemma4": ("video", "image", "audio"),
}


@cache
def _family_rows(family: str) -> list[list[dict[str, Any]]]:
    return _rows(_load(family)[0], family)


def _rows(proc: Any, family: str) -> list[list[dict[str, Any]]]:
    """4 rows: [2 docs], [1 doc], [text only], [2 docs]; media per doc 2, 0, 1, 0, 2, 1."""
    rng, cycle = random.Random(3), KINDS.get(family, ("image",))
    plan = [[2, 0], [1], [0], [2, 1]]
    sid, kind = iter(range(100)), iter(range(100))
    return [
        [
            tokenize_with_handler(
                _record(
                    next(sid),
                    rng,
                    tuple(cycle[next(kind) % len(cycle)] for _ in range(n)),
                    family in WHOLE_SECOND_AUDIO,
                ),
                proc,
            )
            for n in row
        ]
        for row in plan
    ]


def _media_keys(h: Handler, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The media of ``samples`` as the family collater merges them (``merge_family_media``)."""
    from neatpack.pipes.collating.collate_family import merge_family_media
    from neatpack.pipes.materializing.sample_media import split_media

    return dict(merge_family_media([m for s in samples if (m := split_media(s)[1])], h))


def _seq(rows: list[list[dict[str, Any]]]) -> int:
    """The fixed row length: the longest row rounded up to a multiple of 32."""
    longest = max(sum(len(s["input_ids"]) for s in row) for row in rows)
    return -(-longest // 32) * 32


def _batch(rows: list[list[dict[str, Any]]], h: Handler, proc: Any) -> dict[str, Any]:
    """The fixed-length collated batch: rows padded to ``_seq``, per-document positions (Omni: its
    mRoPE, ``qwen_omni_mrope`` == the model's ``get_rope_index``), the family's mask, the media
    of all the batch's samples in row then document order."""
    ids, pos, doc, mm, seq = [], [], [], [], _seq(rows)
    for row in rows:
        if h.mrope:
            rule = h.positions
            assert rule is not None
            row = [dict(s, position_ids=rule(s, proc)) for s in row]
        pack = build_pack(row, mrope=h.mrope)
        pad = seq - int(pack["input_ids"].shape[0])
        ids.append(torch.nn.functional.pad(pack["input_ids"], (0, pad)))
        doc.append(torch.nn.functional.pad(pack["attention_mask"], (0, pad)))
        mm.append(torch.nn.functional.pad(pack["mm_token_type_ids"], (0, pad)))
        p = pack["position_ids"] if h.mrope else pack["text_position_ids"]
        pos.append(torch.nn.functional.pad(p, (0, pad)))
    d, m = torch.stack(doc), torch.stack(mm)
    mask = to_4d_additive_mask(d) if h.packed_mask is None else h.packed_mask(d, m)
    return {
        "input_ids": torch.stack(ids),
        "position_ids": torch.stack(pos, dim=1) if h.mrope else torch.stack(pos),
        "attention_mask": mask,
        **_media_keys(h, [s for row in rows for s in row]),
    }


def _media_rows(rows: list[list[dict[str, Any]]]) -> list[list[dict[str, Any] | None]]:
    """Each row's ``media_samples`` as ``materialize_pack`` stores them (``split_media``)."""
    from neatpack.pipes.materializing.sample_media import split_media

    return [[split_media(s)[1] or None for s in row] for row in rows]


def _equal_up_to_padding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal on ``want``'s extent; anything beyond it (tiles padded to the batch's widest) is 0."""
    if got.dim() != want.dim():
        return False
    region = tuple(slice(0, n) for n in want.shape)
    rest = got.clone()
    rest[region] = 0
    return torch.equal(got[region], want) and not bool(rest.any())


def _family_ids() -> list[str]:
    return sorted(FAMILIES)


@pytest.mark.parametrize("family", _family_ids())
def test_microbatch_media_are_their_rows_media(family: str) -> None:
    proc, _ = _load(family)
    h = get_handler(proc)
    rows = _family_rows(family)
    batch = _batch(rows, h, proc)
    all_keys = set(_media_keys(h, [s for r in rows for s in r]))
    out = prepare_family_media_for_pp(batch, _media_rows(rows), h, N_MICRO, seq_len=_seq(rows))
    pp = out[VLM_PP_MEDIA_KEY]
    assert set(pp) == all_keys
    if family == "gemma4":  # frames (and their counts, 5.2x) and audio features split too
        assert {"pixel_values_videos", "input_features"} <= all_keys
    assert not all_keys & set(out)  # media popped: pipelining splits only the row tensors
    for m, (r0, r1) in enumerate(microbatch_bounds(len(rows), N_MICRO)):
        want = _media_keys(h, [s for row in rows[r0:r1] for s in row])
        got = {k: v[m] for k, v in pp.items() if v[m] is not None}
        assert set(got) == set(want), (family, m)
        for key, value in want.items():
            assert _equal_up_to_padding(got[key], value), (family, m, key)


@pytest.mark.parity
@pytest.mark.parametrize("family", _family_ids())
def test_running_each_microbatch_equals_the_whole_batch(family: str) -> None:
    """Pipelining's own split of the row tensors (``split_args_kwargs_into_chunks``) with each
    micro-batch's media chunk gives the whole batch's logits, max abs diff <= 1e-5 fp32."""
    proc, builder = _load(family)
    model = builder(proc)
    h = get_handler(proc)
    rows = _family_rows(family)
    batch = _batch(rows, h, proc)
    with torch.no_grad():
        whole = model(**batch).logits
    out = prepare_family_media_for_pp(
        dict(batch), _media_rows(rows), h, N_MICRO, seq_len=_seq(rows)
    )
    pp = out.pop(VLM_PP_MEDIA_KEY)
    text = {k: v for k, v in out.items() if k != "position_ids"}
    _, chunks = split_args_kwargs_into_chunks((), text, N_MICRO)
    bounds = microbatch_bounds(len(rows), N_MICRO)
    worst = 0.0
    for m, (chunk, (r0, r1)) in enumerate(zip(chunks, bounds, strict=True)):
        pos = batch["position_ids"][:, r0:r1] if h.mrope else batch["position_ids"][r0:r1]
        media = {k: v[m] for k, v in pp.items() if v[m] is not None}
        with torch.no_grad():
            part = model(**chunk, position_ids=pos, **media).logits
        worst = max(worst, float((part - whole[r0:r1]).abs().max()))
    assert worst <= 1e-5, (family, worst)


def test_counts_come_from_pack_media_on_the_item_axis() -> None:
    rows = _family_rows("idefics3")
    counts = family_media_counts(_media_rows(rows), "idefics3")
    tiles = [sum(int(s["pixel_values"].shape[1]) for s in row if "pixel_values" in s)
             for row in rows]  # fmt: skip
    assert counts["pixel_values"] == tiles == counts["pixel_attention_mask"]
    assert resolve_handler("idefics3").media_axis == 1
    assert tiles[2] == 0  # the text-only row


def test_wrapped_collater_checks_the_fixed_length() -> None:
    proc, _ = _load("gemma3")
    h = get_handler(proc)
    rows = _family_rows("gemma3")
    packs = [{"media_samples": r} for r in _media_rows(rows)]

    def collate(ps: Any) -> dict[str, Any]:
        return _batch(rows, h, proc)

    out = wrap_family_collate_for_pp(collate, "gemma3", N_MICRO, _seq(rows))(packs)
    assert [c is None for c in out[VLM_PP_MEDIA_KEY]["pixel_values"]] == [False, True, False]
    with pytest.raises(ValueError, match="not the fixed seq_len=100"):
        wrap_family_collate_for_pp(collate, "gemma3", N_MICRO, 100)(packs)


@pytest.mark.badinput
def test_media_that_do_not_belong_to_the_rows_are_refused() -> None:
    pv = torch.zeros(5, 3)
    with pytest.raises(ValueError, match="counts \\[3, 1, 0\\] sum to 4"):
        chunk_family_media({"pixel_values": pv}, {"pixel_values": [3, 1, 0]}, 2)
    with pytest.raises(ValueError, match="differ"):
        chunk_family_media({"pixel_values": pv}, {}, 2)
    with pytest.raises(ValueError, match="n_microbatches=4 > batch_size=3"):
        chunk_family_media({"pixel_values": pv}, {"pixel_values": [3, 1, 1]}, 4)
    with pytest.raises(ValueError, match="unknown handler"):
        family_media_counts([[None]], "nope")
    assert "gemma3" in HANDLERS


SLOW_WRAPPED = ("idefics3", "smolvlm")


@pytest.mark.parity
@pytest.mark.parametrize(
    "family",
    ["gemma3", "step3", *(pytest.param(f, marks=pytest.mark.slow) for f in SLOW_WRAPPED)],
)
def test_the_family_collater_wrapped_for_pp(family: str) -> None:
    """Packs built as ``materialize_pack`` builds them (tokens + ``media_samples``), collated by
    the real ``neat_packed_family_collater`` at a fixed ``max_length`` and wrapped for PP: every
    micro-batch (pipelining's split of the row tensors + its media chunk) gives the whole
    batch's logits (<= 1e-5 fp32)."""
    from neatpack.pipes.collating.collate_family import neat_packed_family_collater
    from neatpack.pipes.materializing.sample_media import split_media

    proc, builder = _load(family)
    model = builder(proc)
    rows = _family_rows(family)
    seq = _seq(rows)
    packs = []
    for row in rows:
        pack = build_pack([split_media(s)[0] for s in row])
        pack["media_samples"] = [split_media(s)[1] for s in row]
        packs.append(pack)
    collate = partial(neat_packed_family_collater, handler=family, max_length=seq)
    whole_batch = collate(packs)
    pp_batch = wrap_family_collate_for_pp(collate, family, N_MICRO, seq)(packs)
    keys = ("input_ids", "position_ids", "attention_mask")
    media_keys = set(_media_keys(get_handler(proc), [s for r in rows for s in r]))
    with torch.no_grad():
        whole = model(**{k: whole_batch[k] for k in (*keys, *media_keys)}).logits
    pp = pp_batch[VLM_PP_MEDIA_KEY]
    _, chunks = split_args_kwargs_into_chunks((), {k: pp_batch[k] for k in keys}, N_MICRO)
    worst = 0.0
    for m, (chunk, (r0, r1)) in enumerate(zip(chunks, microbatch_bounds(4, N_MICRO), strict=True)):
        media = {k: v[m] for k, v in pp.items() if v[m] is not None}
        with torch.no_grad():
            part = model(**chunk, **media).logits
        worst = max(worst, float((part - whole[r0:r1]).abs().max()))
    assert worst <= 1e-5, (family, worst)
