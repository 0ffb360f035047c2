"""``pp_microbatches`` through ``neat_vlm_graph`` for every family whose handler splits its media
(``Handler.pp_split``, or the split by samples when it has none), through the one
``PPMediaSplitter`` step: Qwen2-VL and four other families (Gemma 3, Idefics3,
LLaVA-OneVision, InternVL through ``chat_template``).

Three graphs over the same corpus: ``batch_size=4`` (the whole batches), the same with
``pp_microbatches=2``, and ``batch_size=2`` (each micro-batch's rows ALONE: the plan does not
depend on the batch size, so batch ``2 i + m`` of it holds the rows of micro-batch ``m`` of
batch ``i``). Checked: the split batch keeps the whole batch's row tensors; micro-batch ``m``'s
rows of ``input_ids`` / ``labels`` / positions / mask are batch ``2 i + m`` of the third graph,
and its media chunk is exactly that batch's media (every key, in order; LLaVA-OneVision tiles
are zero-padded to the widest image of the batch they were collated in). Before #26 the graph
refused ``pp_microbatches`` for every family but Qwen-VL. A handler that declares no split is
refused by that declaration, naming it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from support import tiny

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.families import get_handler
from neatpack.pipes.parallel.pp_media import VLM_PP_MEDIA_KEY
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

PACK_SIZE = 640
#: family -> its tiny processor
PROCESSORS = {
    "qwen2_vl": lambda: load_tiny_processor("qwen2_vl"),
    "gemma3": tiny.load_tiny_gemma3_processor,
    "idefics3": tiny.load_tiny_idefics3_processor,
    "llava_onevision": tiny.load_tiny_llava_onevision_processor,
    "internvl": tiny.load_tiny_internvl_processor,
}
#: the PP chunks store Qwen-VL's image grids under the seed's key (``prepare_vlm_media_for_pp``)
CHUNK_KEY = {"image_grid_thw": "image_grid_hws"}
ROW_KEYS = ("input_ids", "labels", "position_ids", "doc_ids", "mm_token_type_ids")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = write_corpus(
        tmp_path_factory.mktemp("pp_graph"), num_samples=24, seed=7, max_images=2
    )
    return path


@cache
def _processor(family: str) -> Any:
    return PROCESSORS[family]()


def _batches(corpus: Path, family: str, **kw: Any) -> list[dict[str, Any]]:
    config = NeatVLMConfig(
        pack_size=PACK_SIZE, estimate_mode="exact", media_root=str(corpus.parent / "media"),
        attn_implementation="eager", tail="drop", overlong="drop", **kw,
    )  # fmt: skip
    return list(neat_vlm_graph(str(corpus), _processor(family), config=config))


def _rows(value: Any, r0: int, r1: int) -> Any:
    """Rows ``[r0, r1)`` of a batch tensor (mRoPE positions ``[3, B, S]``: dim 1), or of each
    tensor of a per-layer-type mask dict."""
    if isinstance(value, dict):
        return {k: _rows(v, r0, r1) for k, v in value.items()}
    return value[:, r0:r1] if value.dim() == 3 and value.shape[0] == 3 else value[r0:r1]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            _same(a[k], b[k]) for k in a
        )  # fmt: skip
    return bool(torch.equal(a, b))


def _equal_up_to_padding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal on ``want``'s extent, zero beyond it (tiles padded to a wider batch's image)."""
    if got.dim() != want.dim() or any(g < w for g, w in zip(got.shape, want.shape, strict=True)):
        return False
    region = tuple(slice(0, n) for n in want.shape)
    rest = got.clone()
    rest[region] = 0
    return torch.equal(got[region], want) and not bool(rest.any())


@pytest.mark.parametrize("family", sorted(PROCESSORS))
def test_each_microbatch_alone_equals_its_rows_of_the_whole_batch(
    corpus: Path, family: str
) -> None:
    h = get_handler(_processor(family))
    assert h.pp_refused is None
    whole = _batches(corpus, family, batch_size=4)
    split = _batches(corpus, family, batch_size=4, pp_microbatches=2)
    alone = _batches(corpus, family, batch_size=2)
    assert len(whole) >= 2
    assert len(split) == len(whole)
    assert len(alone) >= 2 * len(whole)
    media_seen = 0
    for i, (w, s) in enumerate(zip(whole, split, strict=True)):
        chunks = s.pop(VLM_PP_MEDIA_KEY)
        assert s["sample_ids"] == w["sample_ids"]
        for key in (*ROW_KEYS, "attention_mask"):  # pipelining splits these by rows itself
            assert _same(s[key], w[key]), (family, i, key)
        media = set(w) - set(s)  # the keys the split moved into the chunks
        assert media, (family, i)
        assert {CHUNK_KEY.get(k, k) for k in media} == set(chunks), (family, i)
        for m, (r0, r1) in enumerate([(0, 2), (2, 4)]):
            part = alone[2 * i + m]
            assert part["sample_ids"] == w["sample_ids"][r0:r1], (family, i, m)
            for key in (*ROW_KEYS, "attention_mask"):
                assert _same(_rows(s[key], r0, r1), part[key]), (family, i, m, key)
            # the chunk holds exactly the media of these rows alone, every key, in order
            want = {CHUNK_KEY.get(k, k): part[k] for k in media if k in part}
            got = {k: v[m] for k, v in chunks.items() if v[m] is not None}
            assert set(got) == set(want), (family, i, m, sorted(got), sorted(want))
            for key, value in want.items():
                assert _equal_up_to_padding(got[key], value), (family, i, m, key)
                media_seen += int(value.numel() > 0)
        for key, parts in chunks.items():  # nothing lost, nothing repeated
            if all(p is not None for p in parts):
                axis = h.media_axis if h.media_per_sample else 0
                w_key = next(k for k in media if CHUNK_KEY.get(k, k) == key)
                if torch.cat(parts, dim=axis).shape == w[w_key].shape:
                    assert torch.equal(torch.cat(parts, dim=axis), w[w_key]), (family, key)
    assert media_seen >= 4, family  # media in both micro-batches of the batches


@pytest.mark.badinput
def test_a_handler_without_a_split_is_refused_by_its_declaration(corpus: Path) -> None:
    """Nemotron-H Omni declares ``pp_refused``: the graph refuses, naming the handler, its reason
    and the fix, before any record is read."""
    proc = tiny.load_tiny_nemotron_omni_processor()
    assert get_handler(proc).pp_refused is not None
    config = NeatVLMConfig(pack_size=PACK_SIZE, batch_size=2, pp_microbatches=2)
    with pytest.raises(
        ValueError,
        match=r"pp_microbatches=2 but handler 'nemotron_omni' declares no pipeline-parallel "
        r"media split \(Handler.pp_refused: its media split per pipeline micro-batch is not "
        r"verified.*\)\. Fix: set pp_microbatches=None, or register",
    ):
        neat_vlm_graph(str(corpus), proc, config=config)
