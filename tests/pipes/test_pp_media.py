"""PP media split: each micro-batch's media belong exactly to the rows pipelining gives it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from neatpack.pipes import pp_media as P
from neatpack.pipes.collating.collate import neat_packed_vlm_collater


def pipelining_rows(batch_size: int, n: int) -> list[list[int]]:
    """The sample rows torch.distributed.pipelining gives each micro-batch."""
    _, kwargs = split_args_kwargs_into_chunks((), {"rows": torch.arange(batch_size)}, n)
    return [k["rows"].tolist() for k in kwargs]


def owner_values(chunk: Any) -> list[int]:
    """Pixel rows are filled with their owning sample id: the distinct ids, in order."""
    rows = chunk if isinstance(chunk, list) else list(chunk)
    seen: list[int] = []
    for r in rows:
        v = int(r.reshape(-1)[0])
        assert bool((r == v).all())
        if not seen or seen[-1] != v:
            seen.append(v)
    return seen


def flat_media(counts: list[int], patches: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat [sum P, 4] pixels (value = owning sample) and grids [N_img, 3] with t*h*w = P."""
    rows, grid = [], []
    it = iter(patches)
    for sample, c in enumerate(counts):
        for _ in range(c):
            p = next(it)
            rows.append(torch.full((p, 4), float(sample)))
            grid.append([1, 2, p // 2])
    return torch.cat(rows), torch.tensor(grid)


@given(st.integers(1, 40), st.integers(1, 40))
def test_bounds_follow_tensor_split(b: int, n: int) -> None:
    if n > b:
        with pytest.raises(ValueError, match="n_microbatches"):
            P.microbatch_bounds(b, n)
        return
    bounds = P.microbatch_bounds(b, n)
    assert [list(range(x, y)) for x, y in bounds] == pipelining_rows(b, n)


def test_docstring_example_b6_n4() -> None:
    counts = [1, 0, 2, 1, 0, 1]
    pv, grid = flat_media(counts, [4] * 5)
    pv_chunks, grid_chunks = P.chunk_vlm_media(pv, grid, 6, 4, torch.tensor(counts))
    assert [c.shape[0] for c in pv_chunks] == [4, 12, 0, 4]
    assert [g.shape[0] for g in grid_chunks] == [1, 3, 0, 1]
    assert [owner_values(c) for c in pv_chunks] == [[0], [2, 3], [], [5]]


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=9),
    st.integers(1, 9),
    st.data(),
)
def test_flat_layout_reassembles(counts: list[int], n: int, data: st.DataObject) -> None:
    b = len(counts)
    if sum(counts) == 0 or n > b:
        return
    patches = data.draw(
        st.lists(st.sampled_from([2, 4, 6]), min_size=sum(counts), max_size=sum(counts))
    )
    pv, grid = flat_media(counts, patches)
    pv_chunks, grid_chunks = P.chunk_vlm_media(pv, grid, b, n, counts)
    assert len(pv_chunks) == n
    assert torch.equal(torch.cat(pv_chunks), pv)
    assert torch.equal(torch.cat(grid_chunks), grid)
    for rows, chunk, g in zip(pipelining_rows(b, n), pv_chunks, grid_chunks, strict=True):
        assert owner_values(chunk) == [r for r in rows if counts[r]]
        assert g.shape[0] == sum(counts[r] for r in rows)


def test_full_image_per_sample_layout() -> None:
    b, n = 5, 3
    pv = torch.arange(b, dtype=torch.float32).view(b, 1, 1, 1).expand(b, 3, 4, 4).contiguous()
    grid = torch.tensor([[1, 2, 2]] * b)
    pv_chunks, grid_chunks = P.chunk_vlm_media(pv, grid, b, n)
    assert len(pv_chunks) == n  # the seed's torch.chunk gives fewer chunks for some B, n
    assert [owner_values(c) for c in pv_chunks] == pipelining_rows(b, n)
    assert [g.shape[0] for g in grid_chunks] == [2, 2, 1]


def test_padded_patches_per_sample_layout() -> None:
    b, n = 6, 4
    pv = torch.arange(b, dtype=torch.float32).view(b, 1, 1).expand(b, 5, 8).contiguous()
    grid = torch.tensor([[1, 2, 2]] * b)
    pv_chunks, _ = P.chunk_vlm_media(pv, grid, b, n)
    assert [owner_values(c) for c in pv_chunks] == pipelining_rows(b, n)


def test_per_image_rows_with_uneven_owners_use_the_counts() -> None:
    # N_img == B == 4, but sample 0 owns two images and sample 3 none (peer bug B16: the seed
    # splits this by row and hands image 1 to sample 1's micro-batch).
    counts = [2, 1, 1, 0]
    owners = [0, 0, 1, 2]
    pv = torch.tensor(owners, dtype=torch.float32).view(4, 1, 1).expand(4, 3, 8).contiguous()
    grid = torch.tensor([[1, 2, 2]] * 4)
    pv_chunks, grid_chunks = P.chunk_vlm_media(pv, grid, 4, 2, torch.tensor(counts))
    assert [owner_values(c) for c in pv_chunks] == [[0, 1], [2]]
    assert [g.shape[0] for g in grid_chunks] == [3, 1]


def test_list_of_per_image_tensors() -> None:
    counts = [1, 2, 0]
    pv = [torch.full((4, 2), 0.0), torch.full((6, 2), 1.0), torch.full((2, 2), 1.0)]
    grid = torch.tensor([[1, 2, 2], [1, 2, 3], [1, 1, 2]])
    pv_chunks, _ = P.chunk_vlm_media(pv, grid, 3, 2, counts)
    assert [len(c) for c in pv_chunks] == [3, 0]


def test_legacy_flat_one_image_per_sample() -> None:
    pv, grid = flat_media([1, 1, 1], [2, 4, 6])
    pv_chunks, grid_chunks = P.chunk_vlm_media(pv, grid, 3, 2)
    assert [owner_values(c) for c in pv_chunks] == [[0, 1], [2]]
    assert [g.tolist() for g in grid_chunks] == [[[1, 2, 1], [1, 2, 2]], [[1, 2, 3]]]


def test_chunk_step3_media() -> None:
    num_patches = torch.tensor([2, 0, 1])
    pv = torch.arange(3, dtype=torch.float32).view(3, 1).expand(3, 4)
    patch = torch.tensor([0.0, 0.0, 2.0]).view(3, 1)
    newline = torch.tensor([True, False, True])
    out = P.chunk_step3_media(pv, 3, 2, num_patches, patch, newline)
    assert [c[:, 0].tolist() for c in out["pixel_values"]] == [[0.0, 1.0], [2.0]]
    assert [c.tolist() for c in out["num_patches"]] == [[2, 0], [1]]
    assert [c.view(-1).tolist() for c in out["patch_pixel_values"]] == [[0.0, 0.0], [2.0]]
    assert [c.tolist() for c in out["patch_newline_mask"]] == [[True, False], [True]]
    flat = P.chunk_step3_media(patch, batch_size=3, n_microbatches=2, num_patches=num_patches)
    assert [c.view(-1).tolist() for c in flat["pixel_values"]] == [[0.0, 0.0], [2.0]]
    assert set(flat) == {"pixel_values", "num_patches"}


def _pack(sid: int, lens: list[int], images: list[int], videos: int = 0) -> dict[str, Any]:
    """A contract pack whose first documents carry one 4-patch image each (1 token at merge 2)."""
    t = sum(lens)
    mm = torch.zeros(t, dtype=torch.long)
    start = 0
    for k, _ in enumerate(images):
        mm[start] = 1
        start += lens[k]
    if videos:
        mm[t - 1] = 2
    pack: dict[str, Any] = {
        "sample_ids": [sid * 10 + k for k in range(len(lens))],
        "input_ids": torch.arange(t),
        "labels": torch.arange(t),
        "attention_mask": torch.cat([torch.full((n,), k + 1) for k, n in enumerate(lens)]),
        "mm_token_type_ids": mm,
        "n_images": len(images),
        "n_videos": videos,
    }
    if images:
        pack["pixel_values"] = torch.full((4 * len(images), 3), float(sid))
        pack["image_grid_thw"] = torch.tensor([[1, 2, 2]] * len(images))
    if videos:
        pack["pixel_values_videos"] = torch.full((4, 3), float(sid))
        pack["video_grid_thw"] = torch.tensor([[1, 2, 2]])
        pack["second_per_grid_ts"] = torch.tensor([float(sid)])
    return pack


def test_prepare_on_a_collated_batch_and_wrapper() -> None:
    packs = [_pack(0, [3, 2], [0, 1]), _pack(1, [4], []), _pack(2, [2, 2], [0], videos=1)]
    packs.append(_pack(3, [3], [], videos=1))
    batch = neat_packed_vlm_collater(packs)
    out = P.prepare_vlm_media_for_pp(batch, batch_size=4, n_microbatches=3)
    for key in ("pixel_values", "image_grid_thw", "n_images_per_sample", "pixel_values_videos"):
        assert key not in out
    assert out["input_ids"].shape[0] == 4  # text tensors stay for pipelining to split
    pp = out[P.VLM_PP_MEDIA_KEY]
    rows = pipelining_rows(4, 3)  # [[0, 1], [2], [3]]
    assert [owner_values(c) for c in pp["pixel_values"]] == [[0], [2], []]
    assert [g.shape[0] for g in pp["image_grid_hws"]] == [2, 1, 0]
    assert [owner_values(c) for c in pp["pixel_values_videos"]] == [[], [2], [3]]
    assert [c.tolist() for c in pp["second_per_grid_ts"]] == [[], [2.0], [3.0]]
    assert [c.tolist() for c in pp["n_images_per_sample"]] == [[2, 0], [1], [0]]
    assert len(rows) == 3
    # end to end: pipelining's own split of the text rows meets exactly its media chunks
    _, text_chunks = split_args_kwargs_into_chunks(
        (), {"mm_token_type_ids": out["mm_token_type_ids"]}, 3
    )
    for m, text in enumerate(text_chunks):
        image_tokens = int((text["mm_token_type_ids"] == 1).sum())
        video_tokens = int((text["mm_token_type_ids"] == 2).sum())
        assert image_tokens * 4 == int(pp["image_grid_hws"][m].prod(-1).sum())
        assert image_tokens * 4 == pp["pixel_values"][m].shape[0]
        assert video_tokens * 4 == pp["pixel_values_videos"][m].shape[0]

    wrapped = P.wrap_vlm_collate_for_pp(neat_packed_vlm_collater, 2)
    w = wrapped(packs)
    assert [owner_values(c) for c in w[P.VLM_PP_MEDIA_KEY]["pixel_values"]] == [[0], [2]]
    text_only = wrapped([_pack(1, [4], [])])
    assert P.VLM_PP_MEDIA_KEY not in text_only


def test_stage_media_sets_and_clears_attributes() -> None:
    model = torch.nn.Linear(2, 2)
    stage = SimpleNamespace(_user_meta=None)
    schedule = SimpleNamespace(_stage=stage, _stage_forward_initialized=False)
    pp = SimpleNamespace(info=SimpleNamespace(has_first_stage=True, schedule=schedule))
    chunks = {"pixel_values": [torch.ones(1)], "image_grid_hws": [torch.ones(1, 3)]}
    batch = {"input_ids": torch.ones(1, 2), P.VLM_PP_MEDIA_KEY: chunks}
    with P.stage_vlm_media_for_pp(pp, [model], batch):
        assert P.VLM_PP_MEDIA_KEY not in batch
        assert model._vlm_pixel_values_chunks is chunks["pixel_values"]
        assert model._vlm_pixel_values_videos_chunks is None
        model._vlm_chunk_idx = 1  # the shape-inference forward consumed a chunk
        model(torch.ones(1, 2))
        assert model._vlm_chunk_idx == 0  # the one-shot hook reset it
        model._vlm_chunk_idx = 1
        model(torch.ones(1, 2))
        assert model._vlm_chunk_idx == 1  # hook is gone
    assert model._vlm_pixel_values_chunks is None
    assert model._vlm_chunk_idx is None
    later = SimpleNamespace(info=SimpleNamespace(has_first_stage=False))
    batch2: dict[str, Any] = {P.VLM_PP_MEDIA_KEY: chunks}
    with P.stage_vlm_media_for_pp(later, [model], batch2):
        assert model._vlm_pixel_values_chunks is None


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.badinput
def test_more_microbatches_than_samples() -> None:
    pv, grid = flat_media([1, 1], [2, 2])
    with pytest.raises(ValueError, match="n_microbatches=3 > batch_size=2"):
        P.chunk_vlm_media(pv, grid, 2, 3, [1, 1])
    with pytest.raises(ValueError, match="n_microbatches must be >= 1"):
        P.prepare_vlm_media_for_pp({"pixel_values": pv}, batch_size=2, n_microbatches=0)


@pytest.mark.badinput
def test_uneven_split_documented_semantics() -> None:
    # 5 samples in 2 micro-batches: tensor_split gives 3 + 2 (the seed: 3 + 2 here, but 2,2,2,0
    # for B=6, n=4 where pipelining gives 2,2,1,1).
    assert P.microbatch_bounds(5, 2) == [(0, 3), (3, 5)]
    assert P.microbatch_bounds(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]


@pytest.mark.badinput
def test_mismatched_media() -> None:
    pv, grid = flat_media([1, 2], [2, 2, 2])
    with pytest.raises(ValueError, match="summing to the 3 grid rows"):
        P.chunk_vlm_media(pv, grid, 2, 2, [1, 1])
    with pytest.raises(ValueError, match="5 patch rows"):
        P.chunk_vlm_media(pv[:5], grid, 2, 2, [1, 2])
    with pytest.raises(ValueError, match="cannot align"):
        P.chunk_vlm_media(pv, grid, 2, 2)
    with pytest.raises(ValueError, match="without video_grid_thw"):
        P.prepare_vlm_media_for_pp({"pixel_values_videos": pv}, batch_size=2, n_microbatches=1)
    with pytest.raises(ValueError, match="num_patches"):
        P.chunk_step3_media(pv, 2, 1, torch.tensor([1, 1, 1]))
