"""Context-parallel packing (issue #20, item 3): planner reservation, head-and-tail shards that
reassemble to the unsplit batch, equal attention work per CP rank, the graphs' cp_size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from neatpack.graphs import NeatLLMConfig, neat_llm_graph
from neatpack.pipes import (
    attention_work_per_rank,
    context_parallel_shards,
    cp_padded_lengths,
    neat_packed_vlm_collater,
    plan_packs,
    shard_for_context_parallel,
)
from neatpack.pipes.collating.mask import to_4d_bool_mask
from neatpack.pipes.materializing.pack import build_pack

SEQ_KEYS = ("input_ids", "labels", "doc_ids", "mm_token_type_ids", "seq_idx", "position_ids")


def _packs(cp: int, rows: list[list[int]], mrope: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    packs = []
    for lengths in rows:
        samples = []
        for n in lengths:
            ids = torch.randint(1, 500, (n,), generator=gen)
            s = {"input_ids": ids, "labels": ids.clone()}
            if mrope:  # mRoPE rows that differ from each other and from the text positions
                s["position_ids"] = torch.stack(
                    [torch.arange(n), torch.arange(n) // 2, torch.arange(n) % 3]
                )
            samples.append(s)
        packs.append(build_pack(samples, alignment=2 * cp, mrope=mrope))
    return packs


def _reassemble(shards: list[dict], key: str, full: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(full, -12345)
    for sh in shards:
        idx = sh["cp_token_index"]
        out.scatter_(-1, idx.expand(*full.shape[:-1], -1), sh[key])
    return out


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["thd", "doc_ids", "sdpa", "flash_attention_2"])
def test_shards_reassemble_to_the_unsplit_batch(cp: int, fmt: str) -> None:
    packs = _packs(cp, [[13, 30, 6], [41], [3, 3, 9, 17]])
    s = 64
    batch = neat_packed_vlm_collater(packs, mask_format=fmt, max_length=s, boundaries=True)
    shards = context_parallel_shards(batch, cp)
    for sh in shards:
        assert sh["input_ids"].shape == (3, s // cp)
    for key in SEQ_KEYS:
        assert torch.equal(_reassemble(shards, key, batch[key]), batch[key]), key
    if fmt == "sdpa":  # the query rows of the 4D mask, local queries x all keys
        full = batch["attention_mask"]
        rebuilt = torch.zeros_like(full)
        for sh in shards:
            idx = sh["cp_token_index"]
            rebuilt.scatter_(2, idx[:, None, :, None].expand(3, 1, -1, s), sh["attention_mask"])
        assert torch.equal(rebuilt, full)
    # every rank holds the same global THD params; local spans are the global ones / cp
    glob = shards[0]["packed_seq_params"]
    assert glob["cu_seqlens_q_padded"][-1] == 3 * s
    for sh in shards:
        assert torch.equal(sh["packed_seq_params"]["cu_seqlens_q"], glob["cu_seqlens_q"])
        assert torch.equal(sh["cp_cu_seqlens_padded"], glob["cu_seqlens_q_padded"] // cp)
    # the local real tokens add up, per document, to the global real lengths
    real_local = sum(sh["cp_cu_seqlens"].diff() for sh in shards)
    assert torch.equal(real_local.int(), glob["cu_seqlens_q"].diff().int())
    # each local real count is the number of label/real tokens of that rank in that document
    assert "cu_seq_lens_q" not in shards[0]  # whole-row flash kwargs do not survive the split


def test_each_rank_gets_chunks_r_and_2cp_minus_1_minus_r() -> None:
    batch = {"input_ids": torch.arange(16)[None], "doc_ids": torch.ones(1, 16, dtype=torch.long)}
    got = [sh["input_ids"].tolist()[0] for sh in context_parallel_shards(batch, 4)]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_cp_rank_has_equal_attention_work(cp: int) -> None:
    packs = _packs(cp, [[100, 7, 250, 31], [512], [2, 2, 3, 200]])
    s = 1024
    batch = neat_packed_vlm_collater(packs, mask_format="doc_ids", max_length=s)
    work = attention_work_per_rank(batch["doc_ids"], cp)
    assert len(set(work)) == 1, work
    # independently: count the (query, key) pairs each rank's local document queries may
    # attend in the block-causal mask built from the emitted metadata
    mask = to_4d_bool_mask(batch["doc_ids"])
    counts = []
    for sh in context_parallel_shards(dict(batch, attention_mask=mask), cp):
        real_q = (sh["doc_ids"] > 0)[:, None, :, None]
        counts.append(int((sh["attention_mask"] & real_q).sum()))
    assert len(set(counts)) == 1, counts
    # the naive contiguous split is far from balanced on the same batch (why head-and-tail)
    q = torch.arange(s)
    naive = [int((mask[..., q[r * s // cp : (r + 1) * s // cp], :]).sum()) for r in range(cp)]
    assert max(naive) / (sum(naive) / cp) > 1.3


def test_mrope_positions_and_media_index_follow_their_tokens() -> None:
    cp = 2
    packs = _packs(cp, [[9, 14], [21]], mrope=True)
    batch = neat_packed_vlm_collater(packs, mask_format="thd", max_length=32)
    assert batch["position_ids"].shape == (4, 2, 32)  # text row + 3 mRoPE rows
    # mark a few tokens as image placeholders to check the media index
    mm = torch.zeros(2, 32, dtype=torch.long)
    mm[0, [2, 3, 17]] = 1
    mm[1, [5, 30]] = 1
    batch["mm_token_type_ids"] = mm
    shards = context_parallel_shards(batch, cp)
    assert torch.equal(
        _reassemble(shards, "position_ids", batch["position_ids"]), batch["position_ids"]
    )
    full_embeds = torch.arange(5)  # one embedding per placeholder, in row-major order
    got = sorted(int(x) for sh in shards for x in full_embeds[sh["cp_media_index"]])
    assert got == [0, 1, 2, 3, 4]
    for sh in shards:  # the local placeholders get exactly their own embeddings, in order
        local_order = (batch["mm_token_type_ids"] != 0).reshape(-1).long().cumsum(0).view(2, 32) - 1
        expected = local_order.gather(1, sh["cp_token_index"])[sh["mm_token_type_ids"] != 0]
        assert torch.equal(sh["cp_media_index"], expected)


def test_unaligned_documents_are_refused_with_the_fix() -> None:
    batch = neat_packed_vlm_collater(_packs(1, [[7, 5]]), mask_format="doc_ids", max_length=16)
    with pytest.raises(ValueError, match="alignment=4"):
        shard_for_context_parallel(batch, 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        shard_for_context_parallel(batch, 2, 2)


def test_planner_reserves_cp_padding() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 900, size=300)
    padded = cp_padded_lengths(lengths, 4)
    assert (padded % 8 == 0).all()
    assert (padded >= lengths).all()
    assert (padded - lengths < 8).all()
    plan = plan_packs(padded, 2048, shuffle=False)
    assert sum(len(p) for p in plan.packs()) == 300
    for pack in plan.packs():
        assert int(padded[list(pack)].sum()) <= 2048


def test_llm_graph_with_cp_size_emits_balanced_shards() -> None:
    rng = np.random.default_rng(1)
    records = [{"input_ids": list(range(1, int(n) + 1))} for n in rng.integers(3, 60, size=40)]
    cfg = NeatLLMConfig(pack_size=128, cp_size=2, attn_implementation="thd", shuffle=False)
    full = next(iter(neat_llm_graph(records, config=cfg)))
    spans = full["packed_seq_params"]["cu_seqlens_q_padded"].diff()
    assert (spans % 4 == 0).all()
    shards = [next(iter(neat_llm_graph(records, config=cfg, cp_rank=r))) for r in range(2)]
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(_reassemble(shards, key, full[key]), full[key]), key
    assert len(set(attention_work_per_rank(full["doc_ids"], 2))) == 1
    with pytest.raises(ValueError, match="2 \\* cp_size must divide"):
        NeatLLMConfig(pack_size=130, cp_size=2)


def test_vlm_graph_cp_shards_and_boundaries(tmp_path: Path) -> None:
    """neat_vlm_graph with cp_size: aligned documents (media included), per-rank shards that
    reassemble with their mRoPE positions, media placement indices, and boundaries turned on
    from a hybrid model's config."""
    from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
    from neatpack.pipes import tiny_hybrid_model
    from neatpack.pipes.testing.synth import write_corpus
    from neatpack.pipes.testing.tiny import load_tiny_processor

    data = write_corpus(str(tmp_path), num_samples=12)
    processor = load_tiny_processor()
    cfg = NeatVLMConfig(
        pack_size=2048,
        cp_size=2,
        attn_implementation="thd",
        media_root=str(tmp_path / "media"),
        shuffle=False,
    )
    hybrid = tiny_hybrid_model("qwen3_5").config
    full = next(iter(neat_vlm_graph(data, processor, config=cfg, model=hybrid)))
    assert full["seq_idx"].dtype == torch.int32  # boundaries on from the config
    spans = full["packed_seq_params"]["cu_seqlens_q_padded"].diff()
    assert (spans % 4 == 0).all()
    assert full["position_ids"].shape[0] == 4  # text row + mRoPE rows
    shards = [
        next(iter(neat_vlm_graph(data, processor, config=cfg, model=hybrid, cp_rank=r)))
        for r in range(2)
    ]
    for key in ("input_ids", "labels", "position_ids", "mm_token_type_ids", "seq_idx"):
        assert torch.equal(_reassemble(shards, key, full[key]), full[key]), key
    n_media = int((full["mm_token_type_ids"] != 0).sum())
    assert n_media > 0
    placed = sorted(int(i) for sh in shards for i in sh["cp_media_index"])
    assert placed == list(range(n_media))
    for sh in shards:  # every rank keeps the whole batch's media for the vision tower
        assert torch.equal(sh["pixel_values"], full["pixel_values"])
