"""The loss a user computes is the loss the data means (issue #13).

Every check goes through the path users call: ``model(**model_inputs(batch)).loss`` (transformers'
own causal-LM loss), ``packed_loss`` for the per-document convention, ``NeatTrainer``, and the
example script. The reference is never a hand-written cross-entropy over neatpack's labels: it is
each sample run alone, unpacked, through plain transformers (unshifted labels from the real
processor's tokenization; the model shifts them itself and computes its own positions).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.grouped import GroupedConfig, grouped_vlm_graph
from neatpack.graphs.neat_llm import NeatLLMConfig, neat_llm_graph
from neatpack.graphs.train import model_inputs, packed_loss, step_normalizer
from neatpack.pipes.collating.collate import neat_packed_vlm_collater
from neatpack.pipes.compat.packed_dataset import neat_pack_dataset_vlm
from neatpack.pipes.materializing.loss import label_counts
from neatpack.pipes.materializing.tokenize import tokenize_conversation
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor, tiny_processor_dir
from neatpack.pipes.testing.tiny_models import tiny_model

pytestmark = pytest.mark.parity
TOL = 1e-5
MEDIA = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), num_samples=12, seed=3)


@pytest.fixture(scope="module")
def vl_model(proc: Any) -> Any:
    return tiny_model("qwen2_vl", processor=proc, attn_implementation="eager")


def _alone(source: JsonlSource, proc: Any, sid: int) -> dict[str, Any]:
    """One sample, unpacked, as plain transformers takes it (unshifted labels, batch dim)."""
    s = tokenize_conversation(source[sid], proc)
    out = {"input_ids": s["input_ids"][None], "labels": s["labels"][None]}
    out.update({k: s[k][None] if k == "mm_token_type_ids" else s[k] for k in MEDIA if k in s})
    return out


def _reference(model: Any, samples: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
    """(sum of token CE, label tokens, sum of per-document mean CE, documents), model-shifted."""
    tok_sum = torch.zeros(())
    doc_sum = torch.zeros(())
    n_tok = n_doc = 0
    for s in samples:
        n = int(s["labels"][0, 1:].ne(-100).sum())  # the model drops position 0's label
        if n == 0:
            continue
        total = model(**s, num_items_in_batch=1, use_cache=False).loss  # sum over tokens
        tok_sum = tok_sum + total
        doc_sum = doc_sum + total / n
        n_tok += n
        n_doc += 1
    return tok_sum, torch.tensor(n_tok), doc_sum, torch.tensor(n_doc)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert abs(float(a) - float(b)) <= TOL * max(1.0, abs(float(b))), (float(a), float(b))


@torch.no_grad()
def _check_batch_loss(model: Any, batch: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    tok_sum, n_tok, doc_sum, n_doc = _reference(model, samples)
    assert batch["num_label_tokens"] == int(n_tok)
    assert batch["num_documents"] == int(n_doc)
    out = model(**model_inputs(batch))
    _close(out.loss, tok_sum / n_tok)  # transformers' own loss, batch mean
    _close(packed_loss(out.logits, batch), tok_sum / n_tok)
    _close(packed_loss(out.logits, batch, convention="document"), doc_sum / n_doc)
    # The old path (labels alone) scores every position against the token after next.
    old = model(**{**model_inputs(batch), "shift_labels": None}).loss
    assert abs(float(old) - float(tok_sum / n_tok)) > 1e-4


@pytest.mark.parametrize("fmt", ["sdpa", "eager", "position_ids"])
def test_vlm_graph_loss_is_next_token_ce(fmt: str, corpus: Path, proc: Any, vl_model: Any) -> None:
    cfg = NeatVLMConfig(
        pack_size=1024, batch_size=2, media_root=str(corpus.parent / "media"),
        attn_implementation=fmt, prefetch=0,
    )  # fmt: skip
    batch = next(iter(neat_vlm_graph(corpus, proc, config=cfg)))
    impl = "eager" if fmt == "eager" else "sdpa"  # Qwen2-VL has no flex_attention support
    vl_model.set_attn_implementation(impl)
    try:
        source = JsonlSource(corpus, corpus.parent / "media")
        samples = [_alone(source, proc, i) for row in batch["sample_ids"] for i in row]
        vl_model.set_attn_implementation("eager")
        ref = _reference(vl_model, samples)
        vl_model.set_attn_implementation(impl)
        assert sum(len(r) for r in batch["sample_ids"]) > 2  # really packed
        with torch.no_grad():
            out = vl_model(**model_inputs(batch))
        _close(out.loss, ref[0] / ref[1])
        _close(packed_loss(out.logits, batch, convention="document"), ref[2] / ref[3])
    finally:
        vl_model.set_attn_implementation("eager")


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_grouped_graph_loss(backend: str, corpus: Path, proc: Any, vl_model: Any) -> None:
    """``pil``: ``Qwen2VLImageProcessorPil`` (what transformers gives without torchvision) returns
    a batched call's pixels as a list of numpy rows; the model must still get one tensor."""
    if backend == "pil":
        from transformers import AutoProcessor

        folder = str(tiny_processor_dir("qwen2_vl"))
        # use_fast=False, not backend="pil": the video processor has no PIL backend.
        proc = AutoProcessor.from_pretrained(folder, local_files_only=True, use_fast=False)  # type: ignore[no-untyped-call]
        assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    cfg = GroupedConfig(batch_size=3, media_root=str(corpus.parent / "media"), prefetch=0)
    batch = next(iter(grouped_vlm_graph(corpus, proc, config=cfg)))
    source = JsonlSource(corpus, corpus.parent / "media")
    samples = [_alone(source, proc, i) for row in batch["sample_ids"] for i in row]
    _check_batch_loss(vl_model, batch, samples)


def test_packed_dataset_wrapper_loss(corpus: Path, proc: Any, vl_model: Any) -> None:
    """The seed path: neat_pack_dataset_vlm + neat_packed_vlm_collater in a torch DataLoader."""
    source = JsonlSource(corpus, corpus.parent / "media")
    inner = [tokenize_conversation(source[i], proc) for i in range(len(source))]
    ds = neat_pack_dataset_vlm(
        inner, 1024, ds_raw=source, processor=proc,
        get_rope_index=vl_model.model.get_rope_index,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(
        ds, batch_size=2, collate_fn=lambda b: neat_packed_vlm_collater(b, padding_idx=0,
                                                                        attn_implementation="eager"),
    )  # fmt: skip
    batch = next(iter(loader))
    samples = [_alone(source, proc, i) for row in batch["sample_ids"] for i in row]
    _check_batch_loss(vl_model, batch, samples)


@pytest.fixture(scope="module")
def text_records() -> list[dict[str, Any]]:
    return _text_records()


@pytest.mark.parametrize(
    "fmt",
    [
        "sdpa",
        "eager",
        "position_ids",
        # transformers compiles the flex kernel on CPU: about a minute.
        pytest.param(
            "flex_attention", marks=[pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
        ),
    ],
)
def test_llm_graph_loss(fmt: str, text_records: list[dict[str, Any]]) -> None:
    model = tiny_model("qwen2", attn_implementation="eager" if fmt == "eager" else "sdpa")
    if fmt == "flex_attention":
        model.set_attn_implementation("flex_attention")
    cfg = NeatLLMConfig(pack_size=64, batch_size=2, attn_implementation=fmt, prefetch=0)
    batch = next(iter(neat_llm_graph(text_records, config=cfg)))
    samples = [
        {
            "input_ids": torch.tensor([text_records[i]["input_ids"]]),
            "labels": torch.tensor([text_records[i]["labels"]]),
        }
        for row in batch["sample_ids"]
        for i in row
    ]
    _check_batch_loss(model, batch, samples)


def test_neat_pack_dataset_loss(text_records: list[dict[str, Any]]) -> None:
    """The seed's text path: a dataset that shifted its own labels, ``neat_pack_dataset``, the
    collater in a torch DataLoader, then ``model(**model_inputs(batch)).loss``."""
    from neatpack.pipes.compat.text_pack import neat_pack_dataset

    model = tiny_model("qwen2", attn_implementation="eager")
    shifted = [{"input_ids": r["input_ids"][:-1], "labels": r["labels"][1:]} for r in text_records]
    ds = neat_pack_dataset(shifted, "train", 64)
    loader = torch.utils.data.DataLoader(
        ds.with_format("torch"), batch_size=2,
        collate_fn=lambda b: neat_packed_vlm_collater(b, attn_implementation="eager"),
    )  # fmt: skip
    batch = next(iter(loader))
    seq_lens = [ds[i]["seq_lens"] for i in range(2)]
    # neat_pack_dataset keeps no sample ids: find each document by its (shifted) length order
    by_len = {len(r["input_ids"]): k for k, r in enumerate(shifted)}
    samples = [
        {
            "input_ids": torch.tensor([text_records[by_len[n]]["input_ids"]]),
            "labels": torch.tensor([text_records[by_len[n]]["labels"]]),
        }
        for row in seq_lens
        for n in row
    ]
    _check_batch_loss(model, batch, samples)


def test_label_counts_worked_example() -> None:
    labels = torch.tensor([[-100, 5, 6, -100, 7, -100], [-100, 3, 3, 3, -100, -100]])
    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
    out = label_counts(labels, doc_ids)
    assert out["num_label_tokens"] == 6
    assert out["num_documents"] == 3
    w = out["label_weights"]
    assert w[0].tolist() == [0.0, 0.5, 0.5, 0.0, 1.0, 0.0]
    assert torch.allclose(w[1], torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3, 0.0, 0.0]))
    unpacked = label_counts(labels)  # no doc ids: one document per row
    assert unpacked["num_documents"] == 2
    want = torch.tensor([0.0, 1 / 3, 1 / 3, 0.0, 1 / 3, 0.0])
    assert torch.allclose(unpacked["label_weights"][0], want)


def test_step_normalizer_errors() -> None:
    with pytest.raises(ValueError, match="convention"):
        step_normalizer([], convention="sample")
    with pytest.raises(KeyError, match="add_label_counts"):
        step_normalizer([{"labels": torch.zeros(1, 2)}])


# ---- gradient parity: 2 gloo ranks x 2 accumulation micro-steps vs samples one at a time ----

WORLD, ACCUM = 2, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _text_records(copies: int = 1) -> list[dict[str, Any]]:
    """Tokenized text samples of distinct lengths (the first 8 whatever ``copies``): a prompt
    third that is not trained, then trained tokens."""
    g = torch.Generator().manual_seed(5)
    out = []
    for n in (9, 23, 14, 31, 6, 18, 27, 11) * copies:
        ids = torch.randint(10, 4000, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = -100  # a prompt that is not trained
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def _make_model(kind: str) -> Any:
    if kind == "text":
        return tiny_model("qwen2", attn_implementation="eager")
    return tiny_model("qwen2_vl", processor=load_tiny_processor("qwen2_vl"),
                      attn_implementation="eager")  # fmt: skip


def _make_loader(kind: str, corpus: str, rank: int) -> Any:
    if kind == "text":
        cfg = NeatLLMConfig(pack_size=48, batch_size=1, prefetch=0, attn_implementation="eager")
        return neat_llm_graph(_text_records(2), config=cfg, rank=rank, world_size=WORLD)
    media = str(Path(corpus).parent / "media")
    vcfg = NeatVLMConfig(pack_size=1024, batch_size=1, media_root=media, prefetch=0,
                         attn_implementation="eager")  # fmt: skip
    proc = load_tiny_processor("qwen2_vl")
    return neat_vlm_graph(corpus, proc, config=vcfg, rank=rank, world_size=WORLD)


def _rank_grads(rank: int, port: int, kind: str, corpus: str, out_dir: str) -> None:
    """One DDP rank: ACCUM micro-batches, step-level normalizer, gradients saved to a file."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        results: dict[str, Any] = {}
        batches = []
        for b in _make_loader(kind, corpus, rank):
            batches.append(b)
            if len(batches) == ACCUM:
                break
        results["sample_ids"] = [i for b in batches for row in b["sample_ids"] for i in row]
        for convention in ("token", "document"):
            model = _make_model(kind)
            model.train()
            ddp = DistributedDataParallel(model)
            n = step_normalizer(batches, convention=convention)
            for k, b in enumerate(batches):
                ctx = ddp.no_sync() if k < ACCUM - 1 else torch.enable_grad()
                with ctx:
                    if convention == "token":
                        loss = ddp(**model_inputs(b, num_items_in_batch=n)).loss
                    else:
                        logits = ddp(**model_inputs(b, keep_labels=False)).logits
                        loss = packed_loss(logits, b, convention="document", num_items_in_batch=n)
                    (loss * WORLD).backward()  # DDP averages over ranks
            results[convention] = {
                name: p.grad.detach().clone()
                for name, p in model.named_parameters()
                if p.grad is not None
            }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while another still uses it (abort at exit)
    finally:
        dist.destroy_process_group()


def _run_ranks(kind: str, corpus: str, out_dir: str) -> list[dict[str, Any]]:
    # spawn, not fork: this process has run models, and a fork after OpenMP threads can hang.
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_grads, args=(r, port, kind, corpus, out_dir)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(540)
        if p.exitcode is None:
            p.kill()
        assert p.exitcode == 0, f"a rank exited with {p.exitcode} (None: still running at 540 s)"
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


def _check_grad_parity(kind: str, corpus: str, samples_of: Any, out_dir: str) -> None:
    ranks = _run_ranks(kind, corpus, out_dir)
    ids = [i for r in ranks for i in r["sample_ids"]]
    assert len(ids) == len(set(ids))  # no sample twice
    assert len(ids) > WORLD * ACCUM  # packed: more samples than micro-batches
    samples = [samples_of(i) for i in ids]
    worst = {}
    for convention in ("token", "document"):
        model = _make_model(kind)
        model.train()
        tok_sum, n_tok, doc_sum, n_doc = _reference(model, samples)
        ref_loss = tok_sum / n_tok if convention == "token" else doc_sum / n_doc
        ref_loss.backward()
        ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        scale = max(float(g.abs().max()) for g in ref.values())
        for r in ranks:  # DDP: every rank holds the same, all-reduced gradient
            got = r[convention]
            assert got.keys() == ref.keys()
            diff = max(float((got[n] - ref[n]).abs().max()) for n in ref) / scale
            worst[convention] = max(worst.get(convention, 0.0), diff)
    print(f"grad parity {kind}: max relative diff {worst}")
    assert worst["token"] <= TOL, worst
    assert worst["document"] <= TOL, worst


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_grad_parity_qwen2_vl_ddp(corpus: Path, proc: Any, tmp_path: Path) -> None:
    source = JsonlSource(corpus, corpus.parent / "media")
    _check_grad_parity("vl", str(corpus), lambda i: _alone(source, proc, i), str(tmp_path))


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_grad_parity_qwen2_text_ddp(tmp_path: Path) -> None:
    records = _text_records(2)

    def sample(i: int) -> dict[str, Any]:
        r = records[i]
        return {"input_ids": torch.tensor([r["input_ids"]]), "labels": torch.tensor([r["labels"]])}

    _check_grad_parity("text", "", sample, str(tmp_path))


# ---- transformers.Trainer ----


def test_trainer_recipe_counts_and_resume(corpus: Path, proc: Any, tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from neatpack.graphs.hf_trainer import NeatTrainer, loader_state_path

    media = str(corpus.parent / "media")
    cfg = NeatVLMConfig(pack_size=1024, media_root=media, prefetch=0)

    def run(steps: int, out: Path, resume: str | None = None) -> list[dict[str, Any]]:
        loader = neat_vlm_graph(corpus, proc, config=cfg)
        model = tiny_model("qwen2_vl", processor=proc)
        seen: list[dict[str, Any]] = []
        forward = model.forward

        def spy(*args: Any, **kwargs: Any) -> Any:
            seen.append({"ids": kwargs["input_ids"].clone(),
                         "n": kwargs.get("num_items_in_batch"),
                         "labels": int(kwargs["shift_labels"].ne(-100).sum())})  # fmt: skip
            return forward(*args, **kwargs)

        model.forward = spy  # type: ignore[method-assign]
        args = TrainingArguments(
            output_dir=str(out), max_steps=steps, per_device_train_batch_size=1,
            gradient_accumulation_steps=2, save_steps=2, logging_steps=1, report_to=[],
            use_cpu=True, learning_rate=1e-3, save_only_model=False,
        )  # fmt: skip
        NeatTrainer(model=model, args=args, train_loader=loader).train(
            resume_from_checkpoint=resume
        )
        return seen

    full = run(4, tmp_path / "full")
    # num_items_in_batch is the optimizer step's label-token count (both micro-batches).
    for a, b in zip(full[0::2], full[1::2], strict=True):
        assert int(a["n"]) == int(b["n"]) == a["labels"] + b["labels"]
    part = tmp_path / "part"
    run(2, part)
    assert os.path.exists(loader_state_path(part / "checkpoint-2"))
    resumed = run(4, part, resume=str(part / "checkpoint-2"))
    assert len(resumed) == len(full) - 4
    for a, b in zip(full[4:], resumed, strict=True):
        assert torch.equal(a["ids"], b["ids"])  # the loader resumed from its cursor, no replay


@pytest.mark.timeout(600)
def test_train_tiny_example_learns() -> None:
    """examples/train_tiny.py (the README's training loop) lowers the loss on a repeated corpus."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_tiny.py"), "--steps", "10"],
        capture_output=True, text=True, timeout=540, cwd=tempfile.gettempdir(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    losses = result["losses"]
    assert len(losses) == 10
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, losses
    assert result["resumed_identical"] is True
