"""Packed batch through the collater == each sample run alone, on tiny real transformers models.

Packs are built with the real ``build_pack`` (shift + concat + tail padding), collated in every
format, run through a tiny random ``Qwen2ForCausalLM`` (and Qwen2-VL with images), and each
document's logits are compared with a separate forward of that shifted sample (fp32, 1e-5).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from neatpack.pipes.collating.collate import neat_packed_vlm_collater
from neatpack.pipes.collating.text_positions import to_text_position_ids
from neatpack.pipes.materializing.pack import build_pack

pytestmark = pytest.mark.parity
VOCAB = 512
TOL = 1e-5


def tiny_qwen2(attn: str) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)  # same weights for every attention implementation
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
        use_cache=False,
    )
    cfg._attn_implementation = attn
    return Qwen2ForCausalLM(cfg).eval()


def text_samples() -> list[list[dict[str, Any]]]:
    """Three rows of 2-4 unshifted random samples; rows end with different padding."""
    gen = torch.Generator().manual_seed(1)
    lens = [[9, 14], [7, 5, 11, 6], [12, 4, 8]]
    rows, sid = [], 0
    for row in lens:
        samples = []
        for n in row:
            ids = torch.randint(2, VOCAB, (n,), generator=gen)
            samples.append({"sample_id": sid, "input_ids": ids, "labels": ids.clone()})
            sid += 1
        rows.append(samples)
    return rows


def separate_logits(model: Any, sample: dict[str, Any]) -> torch.Tensor:
    ids = sample["input_ids"][:-1].unsqueeze(0)  # the shift build_pack applies
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits[0]


def packed_logits(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    keys = ("input_ids", "attention_mask", "position_ids")
    with torch.no_grad():
        return model(**{k: batch[k] for k in keys}, use_cache=False).logits


def max_diff(model: Any, rows: list[list[dict[str, Any]]], batch: dict[str, Any]) -> float:
    logits = packed_logits(model, batch)
    worst = 0.0
    for r, samples in enumerate(rows):
        start = 0
        for s in samples:
            ref = separate_logits(model, s)
            n = ref.shape[0]
            got = logits[r, start : start + n]
            worst = max(worst, float((got - ref).abs().max()))
            start += n
    return worst


@pytest.fixture(scope="module")
def packs() -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    rows = text_samples()
    return rows, [build_pack(r) for r in rows]


@pytest.mark.parametrize(
    ("attn", "fmt"),
    [("sdpa", "sdpa"), ("eager", "eager"), ("sdpa", "eager"), ("sdpa", "position_ids"),
     ("eager", "position_ids"), ("sdpa", "doc_ids-as-4d")],
)  # fmt: skip
def test_text_parity(attn: str, fmt: str, packs: Any) -> None:
    rows, built = packs
    model = tiny_qwen2(attn)
    if fmt == "doc_ids-as-4d":  # materialize_4d_mask=False, then the user builds the mask
        batch = neat_packed_vlm_collater(built, materialize_4d_mask=False)
        from neatpack.pipes.collating.mask import to_4d_bool_mask

        assert batch["attention_mask"].dim() == 2
        batch["attention_mask"] = to_4d_bool_mask(batch["attention_mask"])
    else:
        batch = neat_packed_vlm_collater(built, attn_implementation=fmt, pad_to_multiple_of=8)
    assert batch["input_ids"].shape[0] == 3
    assert max_diff(model, rows, batch) <= TOL


def test_controls_fail_without_boundaries(packs: Any) -> None:
    """The comparison can fail: a bool mask under eager, or no mask at all, is wrong."""
    rows, built = packs
    eager = tiny_qwen2("eager")
    batch = neat_packed_vlm_collater(built, attn_implementation="sdpa")  # bool mask
    assert max_diff(eager, rows, batch) > 1e-2
    sdpa = tiny_qwen2("sdpa")
    batch = neat_packed_vlm_collater(built, attn_implementation="position_ids")
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand(3, -1)
    assert max_diff(sdpa, rows, batch) > 1e-2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_text_parity_flex(packs: Any) -> None:
    """flex_attention through transformers compiles its kernel (about a minute on CPU)."""
    rows, built = packs
    model = tiny_qwen2("flex_attention")
    batch = neat_packed_vlm_collater(built, attn_implementation="flex_attention")
    assert max_diff(model, rows, batch) <= TOL


@pytest.mark.parametrize("fmt", ["flash_attention_2", "thd"])
def test_cu_seqlens_equal_document_boundaries(fmt: str, packs: Any) -> None:
    rows, built = packs
    batch = neat_packed_vlm_collater(built, attn_implementation=fmt)
    s = batch["input_ids"].shape[1]
    real = [len(x["input_ids"]) - 1 for r in rows for x in r]  # shifted lengths
    if fmt == "thd":
        p = batch["packed_seq_params"]
        assert p["cu_seqlens_q"].diff().tolist() == real
        padded = []
        for r in rows:
            lens = [len(x["input_ids"]) - 1 for x in r]
            padded += [*lens[:-1], lens[-1] + s - sum(lens)]
        assert p["cu_seqlens_q_padded"].diff().tolist() == padded
        return
    expected = []
    for r in rows:
        lens = [len(x["input_ids"]) - 1 for x in r]
        expected += lens + ([s - sum(lens)] if s > sum(lens) else [])
    assert batch["cu_seq_lens_q"].diff().tolist() == expected
    assert batch["max_length_q"] == max(expected)


def test_cu_seqlens_match_transformers_own_derivation(packs: Any) -> None:
    """transformers derives cu_seqlens from position_ids; on unpadded rows it must agree."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    rows, _ = packs
    full = [build_pack(r) for r in rows]
    width = max(int(p["input_ids"].numel()) for p in full)
    rows_padded = []
    for r, p in zip(rows, full, strict=True):
        extra = width - int(p["input_ids"].numel())
        tail = {"sample_id": 99, "input_ids": torch.arange(2, extra + 3), "labels": None}
        tail["labels"] = tail["input_ids"].clone()
        rows_padded.append([*r, tail] if extra else r)
    batch = neat_packed_vlm_collater(
        [build_pack(r) for r in rows_padded], attn_implementation="flash_attention_2"
    )
    assert int((batch["doc_ids"] == 0).sum()) == 0
    (cu, _), (mx, _) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert torch.equal(batch["cu_seq_lens_q"], cu)
    assert batch["max_length_q"] == int(mx)


@pytest.mark.gpu
def test_flash_attention_2_varlen_parity(packs: Any) -> None:
    pytest.importorskip("flash_attn")
    rows, built = packs
    model = tiny_qwen2("flash_attention_2").to("cuda", torch.bfloat16)
    batch = neat_packed_vlm_collater(built, attn_implementation="flash_attention_2")
    kw = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    with torch.no_grad():
        flat_ids = batch["input_ids"].reshape(1, -1).cuda()
        flat_pos = batch["position_ids"].reshape(1, -1).cuda()
        logits = model(input_ids=flat_ids, position_ids=flat_pos, **kw).logits.float()
    s = batch["input_ids"].shape[1]
    logits = logits.view(len(rows), s, -1)
    for r, samples in enumerate(rows):
        start = 0
        for smp in samples:
            ids = smp["input_ids"][:-1].unsqueeze(0).cuda()
            with torch.no_grad():
                ref = model(input_ids=ids).logits[0].float()
            got = logits[r, start : start + ref.shape[0]]
            assert float((got - ref).abs().max()) < 5e-2
            start += ref.shape[0]


def test_text_positions_of_packs_match_mask_helper(packs: Any) -> None:
    _, built = packs
    batch = neat_packed_vlm_collater(built, attn_implementation="doc_ids")
    assert torch.equal(batch["position_ids"], to_text_position_ids(batch["doc_ids"]))


# -- Qwen2-VL with images: the whole chain, real processor, real get_rope_index ---------------


def _vl_records() -> list[dict[str, Any]]:
    from PIL import Image

    def img(w: int, h: int, c: int) -> Any:
        return Image.new("RGB", (w, h), (c, 255 - c, (3 * c) % 256))

    def rec(sid: int, text: str, answer: str, *images: Any) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "image", "image": i} for i in images]
        content.append({"type": "text", "text": text})
        return {
            "sample_id": sid,
            "conversation": [
                {"role": "user", "content": content},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ],
        }

    return [
        rec(0, "what is this", "a red square", img(112, 56, 40)),
        rec(1, "no picture here, just words", "fine"),
        rec(2, "two images", "both tall", img(56, 112, 90), img(56, 56, 200)),
        rec(3, "describe", "blue", img(84, 56, 160)),
    ]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def vl_setup(request: Any) -> tuple[Any, list[list[dict[str, Any]]], list[dict[str, Any]]]:
    from neatpack.pipes.materializing.tokenize import tokenize_conversation
    from neatpack.pipes.testing.tiny import load_tiny_processor
    from neatpack.pipes.testing.tiny_models import tiny_model

    proc = load_tiny_processor(request.param)
    model = tiny_model(request.param, processor=proc)
    samples = [tokenize_conversation(r, proc) for r in _vl_records()]
    rows = [[samples[0], samples[1]], [samples[2], samples[3]]]
    rope = model.model.get_rope_index
    return model, rows, [build_pack(r, mrope=rope) for r in rows]


def _vl_max_diff(model: Any, rows: list[list[dict[str, Any]]], batch: dict[str, Any]) -> float:
    keys = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw")
    with torch.no_grad():
        logits = model(
            **{k: batch[k] for k in keys},
            mm_token_type_ids=batch["mm_token_type_ids"],
            use_cache=False,
        ).logits
    worst = 0.0
    for r, samples in enumerate(rows):
        start = 0
        for s in samples:
            kw: dict[str, Any] = {
                "input_ids": s["input_ids"][:-1][None],
                "mm_token_type_ids": s["mm_token_type_ids"][:-1][None],
            }
            if s.get("pixel_values") is not None:
                kw.update(pixel_values=s["pixel_values"], image_grid_thw=s["image_grid_thw"])
            with torch.no_grad():
                ref = model(**kw, use_cache=False).logits[0]
            got = logits[r, start : start + ref.shape[0]]
            worst = max(worst, float((got - ref).abs().max()))
            start += ref.shape[0]
    return worst


@pytest.mark.parametrize(
    ("attn", "fmt"), [("sdpa", "sdpa"), ("eager", "eager"), ("sdpa", "position_ids")]
)
def test_qwen_vl_parity(attn: str, fmt: str, vl_setup: Any) -> None:
    from neatpack.pipes.testing.tiny_models import set_attn_implementation

    model, rows, built = vl_setup
    set_attn_implementation(model, attn)
    try:
        batch = neat_packed_vlm_collater(built, attn_implementation=fmt)
        assert batch["n_images_per_sample"].tolist() == [1, 3]
        expected_dims = 4 if fmt == "position_ids" else 3
        assert batch["position_ids"].shape[0] == expected_dims
        assert _vl_max_diff(model, rows, batch) <= TOL
        # control: [3,B,S] mRoPE rows with no mask leak across documents
        if fmt == "position_ids":
            batch["position_ids"] = batch["position_ids"][1:]
            assert _vl_max_diff(model, rows, batch) > 1e-3
    finally:
        set_attn_implementation(model, "sdpa")
