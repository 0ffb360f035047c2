"""Context-parallel attention from the emitted shards equals unsharded packed attention
(issue #20, item 4): real gloo ranks on 127.0.0.1, each with its shard of a packed batch,
compute the first attention layer of a tiny real model over their local queries and the
all-gathered keys / values, masked from the shard's metadata (doc ids, token index) only; the
result equals the same layer on the whole packed batch (fp32, <= 1e-5), for text (Qwen2) and
Qwen2.5-VL mRoPE positions."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

CP = 2
S = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _batch(mrope: bool) -> dict[str, Any]:
    from neatpack.pipes import neat_packed_vlm_collater
    from neatpack.pipes.materializing.pack import build_pack

    gen = torch.Generator().manual_seed(5)
    packs = []
    for lengths in ([13, 22, 6], [30, 9]):
        samples = []
        for n in lengths:
            ids = torch.randint(10, 4000, (n,), generator=gen)
            s: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
            if mrope:  # distinct t / h / w rows, as an image inside the text would give
                a = torch.arange(n)
                s["position_ids"] = torch.stack([a, a // 2 + 1, a % 5 + a // 3])
            samples.append(s)
        packs.append(build_pack(samples, alignment=2 * CP, mrope=mrope))
    return neat_packed_vlm_collater(packs, mask_format="doc_ids", max_length=S)


def _layer(family: str) -> tuple[Any, Any, Any, Any]:
    from neatpack.pipes.testing.tiny_models import tiny_model

    model = tiny_model(family, attn_implementation="eager")
    lm = model.model.language_model if family != "qwen2" else model.model
    layer = lm.layers[0]
    rope = sys.modules[type(layer.self_attn).__module__].apply_rotary_pos_emb
    return lm, layer, layer.self_attn, rope


def _qkv(lm: Any, layer: Any, attn: Any, rope: Any, ids: torch.Tensor, pos: torch.Tensor) -> Any:
    h = layer.input_layernorm(lm.embed_tokens(ids))
    b, s, _ = h.shape
    d = attn.head_dim
    q = attn.q_proj(h).view(b, s, -1, d).transpose(1, 2)
    k = attn.k_proj(h).view(b, s, -1, d).transpose(1, 2)
    v = attn.v_proj(h).view(b, s, -1, d).transpose(1, 2)
    cos, sin = lm.rotary_emb(h, pos)
    q, k = rope(q, k, cos, sin)
    return h, q, k, v


def _attend(attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * attn.scaling
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = scores.softmax(-1) @ v
    b, _, s, _ = out.shape
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    from neatpack.pipes import shard_for_context_parallel
    from neatpack.pipes.collating.mask import to_4d_additive_mask

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=CP)
    try:
        result = {}
        for family, mrope in (("qwen2", False), ("qwen2_5_vl", True)):
            batch = _batch(mrope)
            lm, layer, attn, rope = _layer(family)
            with torch.no_grad():
                # reference: the layer's own attention on the whole packed batch
                h, *_ = _qkv(lm, layer, attn, rope, batch["input_ids"], batch["position_ids"])
                cos_sin = lm.rotary_emb(h, batch["position_ids"])
                mask = to_4d_additive_mask(batch["doc_ids"])
                ref = attn(h, attention_mask=mask, position_embeddings=cos_sin)[0]
                # this rank: its shard only, keys / values all-gathered from every rank
                shard = shard_for_context_parallel(batch, CP, rank)
                _, q, k, v = _qkv(lm, layer, attn, rope, shard["input_ids"], shard["position_ids"])
                gathered = {}
                for name, t in (("k", k), ("v", v), ("idx", shard["cp_token_index"]),
                                ("doc", shard["doc_ids"])):  # fmt: skip
                    parts = [torch.empty_like(t) for _ in range(CP)]
                    dist.all_gather(parts, t.contiguous())
                    gathered[name] = parts
                b = k.shape[0]
                kk = torch.zeros(b, k.shape[1], S, k.shape[-1])
                vv = torch.zeros_like(kk)
                kdoc = torch.zeros(b, S, dtype=torch.long)
                for kp, vp, ip, dp in zip(*gathered.values(), strict=True):
                    at = ip[:, None, :, None].expand(-1, kp.shape[1], -1, kp.shape[-1])
                    kk.scatter_(2, at, kp)
                    vv.scatter_(2, at, vp)
                    kdoc.scatter_(1, ip, dp)
                # the mask from the metadata alone: same document, key position <= query's
                qdoc, qpos = shard["doc_ids"], shard["cp_token_index"]
                kpos = torch.arange(S)
                allowed = (qdoc[:, :, None] == kdoc[:, None, :]) & (qdoc[:, :, None] > 0)
                allowed &= kpos[None, None, :] <= qpos[:, :, None]
                allowed |= kpos[None, None, :] == qpos[:, :, None]  # padding: itself only
                local = _attend(attn, q, kk, vv, allowed)
                expected = ref.gather(1, qpos[:, :, None].expand(-1, -1, ref.shape[-1]))
                real = qdoc > 0
                result[family] = float((local - expected)[real].abs().max())
                # the check is sensitive: dropping the document condition changes the output
                causal = (kpos[None, None, :] <= qpos[:, :, None]).expand_as(allowed)
                leaky = _attend(attn, q, kk, vv, causal)
                result[f"{family}/no_doc_mask"] = float((leaky - expected)[real].abs().max())
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears gloo down while another still uses it (abort at exit)
    finally:
        dist.destroy_process_group()


def test_cp_attention_from_shards_equals_unsharded(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=CP, join=True)
    for rank in range(CP):
        diffs = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for family in ("qwen2", "qwen2_5_vl"):
            assert diffs[family] <= 1e-5, (rank, family, diffs)
            assert diffs[f"{family}/no_doc_mask"] > 1e-3, (rank, family, diffs)
