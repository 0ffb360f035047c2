"""A neatpack loader in an ``accelerate`` loop (``graphs/integrations/accelerate.py``), run the
way a user runs it: ``accelerate launch`` on 2 CPU processes (gloo), a tiny real Qwen2-VL, the
loader checkpointed by neatpack's ``save_state`` (``accelerator.save_state``, then a marker) and
resumed by ``accelerator.load_state(last_complete_state(out))`` in a fresh launch after a
SIGKILL inside ``save_state`` (the runs are ``tests/support/accelerate_run.py``).

Without ``prepare_loader``, ``register_for_checkpointing(loader)`` saves rank 0's loader state
only and rank 1's ``load_state`` is refused; ``prepare(loader)`` does nothing to it.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

accelerate = pytest.importorskip("accelerate")
from neatpack.graphs.integrations.accelerate import (  # noqa: E402
    COMPLETE,
    STATE_KEY,
    AcceleratorBatches,
    last_complete_state,
    loss_scale,
    prepare_loader,
    save_state,
)

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "support" / "accelerate_run.py"
WORLD = 2
# --multi_gpu on a machine without CUDA is how `accelerate launch` starts several CPU
# processes (torchrun, gloo); `--cpu --num_processes 2` starts one process (its multi-CPU
# launch needs MPI). The script's Accelerator(cpu=True) keeps them on the CPU even with GPUs.
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
          f"--num_processes={WORLD}", "--num_machines=1", "--mixed_precision=no",
          "--dynamo_backend=no"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_corpus(tmp_path_factory.mktemp("corpus"), num_samples=16, seed=3))


def config(corpus: Path) -> NeatVLMConfig:  # the script's
    return NeatVLMConfig(pack_size=1024, media_root=str(corpus.parent / "media"), prefetch=0,
                         attn_implementation="eager")  # fmt: skip


def launch(spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:  # not the default 29500, which another run may hold
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run(
        [*LAUNCH, f"--main_process_port={port}", str(RUN), json.dumps(spec)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip


def steps(dumps: Path, rank: int) -> list[dict[str, Any]]:
    lines = (dumps / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def assert_same_weights(got: Path, want: Path) -> None:
    a, b = torch.load(got), torch.load(want)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors not restored, e.g. {differ[:3]}"


def uninterrupted(corpus: Path, rank: int, epochs: int) -> list[list[list[Any]]]:
    """This rank's batches (``packs``: sample ids, padded) over ``epochs`` epochs, no training:
    what any run must see, whatever the model does."""
    loader = neat_vlm_graph(corpus, load_tiny_processor("qwen2_vl"), config=config(corpus),
                            rank=rank, world_size=WORLD)  # fmt: skip
    return [
        [[m["sample_ids"], bool(m["padded"])] for m in batch["packs"]]
        for _ in range(epochs)
        for batch in loader
    ]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_launch_trains_next_token_ce_and_resumes_exactly_after_sigkill_in_save_state(
    corpus: Path, tmp_path: Path
) -> None:
    """Two ranks, 4 steps an epoch, ``save_state(accelerator, out/step-N)`` every 2 steps. Rank
    0 is SIGKILLed inside step 4's save, after the weights, optimizer and loader state are on
    disk: ``step-4`` is torn (no marker; Accelerate's ``load_state`` would fail on the missing
    custom state). A fresh launch resumes from ``last_complete_state(out)``: ``step-2``, with a
    warning naming ``step-4``, every weight as saved, and trains steps 3-5, rewriting ``step-4``;
    a third resumes from that one, saved at epoch 0's end, into epoch 1. Every rank's batches
    equal the uninterrupted run's, epoch 0 trains each sample once over both ranks, and each
    step's loss is next-token cross-entropy of its batch (the model's logits against the next
    input token, over the step's trained tokens on both ranks), its gradient after
    ``accelerator.backward(loss * loss_scale(...))`` that of the two ranks' summed reference.
    The data figures reach the run's tracker once a step."""
    out = tmp_path / "out"
    spec = {"corpus": str(corpus), "out": str(out), "steps": 5, "save_every": 2}
    killed = launch({**spec, "dumps": str(tmp_path / "a"), "kill_in_save": 4})
    assert killed.returncode != 0
    assert "SIGKILL" in killed.stderr, killed.stderr[-3000:]  # torchrun names rank 0's signal
    torn = {p.name for p in (out / "step-4").iterdir()}
    assert {"model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl"} <= torn, torn
    assert "custom_checkpoint_1.pkl" not in torn  # the tripwire's, saved last: Accelerate fails
    assert COMPLETE not in torn
    assert COMPLETE in {p.name for p in (out / "step-2").iterdir()}
    resumed = launch({**spec, "dumps": str(tmp_path / "b"), "resume": "last"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipped incomplete step-4 (no {COMPLETE})" in resumed.stderr
    assert_same_weights(tmp_path / "b" / "begin.pt", tmp_path / "a" / "saved-2.pt")
    again = launch({**spec, "steps": 6, "dumps": str(tmp_path / "c"), "resume": "last"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "skipped incomplete" not in again.stderr
    assert_same_weights(tmp_path / "c" / "begin.pt", tmp_path / "b" / "saved-4.pt")

    epoch0 = []
    for rank in range(WORLD):
        want = uninterrupted(corpus, rank, epochs=2)
        assert len(want) == 8  # 4 steps an epoch: the resume at step 2 is mid-epoch
        killed_steps = steps(tmp_path / "a", rank)
        assert [s["packs"] for s in killed_steps] == want[:4]
        before = killed_steps[:2]
        after, later = steps(tmp_path / "b", rank), steps(tmp_path / "c", rank)
        assert [s["step"] for s in before + after] == [1, 2, 3, 4, 5]
        assert [s["packs"] for s in before + after] == want[:5]
        assert [(s["step"], s["epoch"]) for s in later] == [(5, 1), (6, 1)]
        assert [s["packs"] for s in later] == want[4:6]
        # step 5 again from step-4's weights and optimizer, as load_state restored them
        assert later[0]["loss"] == pytest.approx(after[-1]["loss"], rel=1e-6)
        for s in before + after + later:
            assert s["loss"] == pytest.approx(s["reference"], rel=1e-5), s
            assert s["grad_error"] <= 1e-5, s  # 0.5 without loss_scale: DDP halves it
        epoch0 += [i for s in before + after if s["epoch"] == 0 for ids, padded in s["packs"]
                   if not padded for i in ids]  # fmt: skip
    assert sorted(epoch0) == list(range(16))

    # the data figures, once a step, through accelerator.log into the run's tracker
    logged = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [3, 4, 5]
    for m in logged:
        assert m["data/batches"] == 1
        assert 0 < m["data/fill"] <= 1
        assert 0 <= m["data/wait_s"] <= m["data/wait_s_max"]
        assert 0 <= m["data/wait_fraction"] <= m["data/wait_fraction_max"] <= 1


def test_prepare_leaves_the_loader_alone_and_prepare_loader_checks_ranks(corpus: Path) -> None:
    """``accelerator.prepare(loader)`` returns the loader itself (it wraps DataLoaders only: no
    second sharding, but no checkpointing either); a loader built for another rank layout than
    the accelerator's processes is refused, naming both and the fix."""
    accelerator = accelerate.Accelerator(cpu=True)
    proc = load_tiny_processor("qwen2_vl")
    loader = neat_vlm_graph(corpus, proc, config=config(corpus))
    assert accelerator.prepare(loader) is loader
    assert loss_scale(accelerator) == 1
    batches = prepare_loader(accelerator, loader)
    assert accelerator._custom_objects[-1] is batches
    other = neat_vlm_graph(corpus, proc, config=config(corpus), rank=1, world_size=WORLD)
    with pytest.raises(ValueError, match=r"rank 1 of 2 but this process is rank 0 of 1.*after "):
        prepare_loader(accelerator, other)


def test_a_state_saved_without_prepare_loader_is_refused(corpus: Path) -> None:
    """A checkpoint whose custom state is the bare loader's (``register_for_checkpointing(
    loader)``: rank 0's state only) is refused with the cause and the fix; the gathered state
    resumes the loader where it was."""
    loader = neat_vlm_graph(corpus, load_tiny_processor("qwen2_vl"), config=config(corpus))
    batches = AcceleratorBatches(loader, accelerate.Accelerator(cpu=True))
    it = iter(batches)
    next(it)
    state = batches.state_dict()
    assert list(state) == [STATE_KEY]
    want = [b["sample_ids"] for b in it]
    with pytest.raises(ValueError, match=r"register_for_checkpointing\(loader\) instead of prep"):
        batches.load_state_dict(loader.state_dict())
    batches.load_state_dict(state)
    assert [b["sample_ids"] for b in batches] == want


def test_a_two_process_state_resumes_on_one_process(corpus: Path) -> None:
    """A checkpoint of 2 processes, each one batch in, loaded by 1 process: the rest of the
    epoch is re-strided from the global cursor, every sample the two ranks had not trained
    exactly once."""
    proc = load_tiny_processor("qwen2_vl")
    states, seen = [], []
    for rank in range(WORLD):
        loader = neat_vlm_graph(corpus, proc, config=config(corpus), rank=rank, world_size=WORLD)
        seen += [i for row in next(iter(loader))["sample_ids"] for i in row]
        states.append(loader.state_dict())
    batches = AcceleratorBatches(
        neat_vlm_graph(corpus, proc, config=config(corpus)), accelerate.Accelerator(cpu=True)
    )
    batches.load_state_dict({STATE_KEY: states})
    rest = [i for b in batches for row in b["sample_ids"] for i in row]
    assert sorted(seen + rest) == list(range(16))


def test_loss_scale_undoes_the_accumulation_division(corpus: Path) -> None:
    """``Accelerator(gradient_accumulation_steps=2)``: ``accelerator.backward`` divides each
    micro-batch's loss by 2; with ``loss_scale`` the step's gradient is that of next-token
    cross-entropy summed over both micro-batches over the step's trained tokens (plain
    autograd on a copy of the model), not half of it."""
    from support.accelerate_run import next_token_ce

    from neatpack.graphs.train import model_inputs, step_normalizer
    from neatpack.pipes.testing.tiny_models import tiny_model

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    assert loss_scale(accelerator) == 2
    proc = load_tiny_processor("qwen2_vl")
    model = tiny_model("qwen2_vl", processor=proc, attn_implementation="eager")
    copy = tiny_model("qwen2_vl", processor=proc, attn_implementation="eager")
    copy.load_state_dict(model.state_dict())
    model = accelerator.prepare(model)
    batches = iter(prepare_loader(accelerator, neat_vlm_graph(corpus, proc, config=config(corpus))))
    micro = [next(batches), next(batches)]
    n = step_normalizer(micro)
    for batch in micro:
        with accelerator.accumulate(model):
            loss = model(**model_inputs(batch, num_items_in_batch=n)).loss
            accelerator.backward(loss * loss_scale(accelerator))
    want = sum(next_token_ce(copy(**model_inputs(b)).logits, b)[0] for b in micro) / n
    want.backward()
    got, ref = model.lm_head.weight.grad, copy.lm_head.weight.grad
    assert got is not None
    assert ref is not None
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5


class Tear:
    """A checkpointed object whose save fails when ``armed``: ``save_state`` stops after the
    model, optimizer, random states and loader state, as a kill there would leave the folder."""

    armed = False

    def state_dict(self) -> dict[str, Any]:
        if self.armed:
            raise OSError("killed while saving")
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_automatic_naming_resumes_from_the_newest_complete_checkpoint(
    corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``ProjectConfiguration(automatic_checkpoint_naming=True)``: ``checkpoint_1`` is torn.
    Accelerate's ``load_state()`` picks it and fails, and its ``save_state`` refuses to save
    that iteration again; ``last_complete_state`` takes ``checkpoint_0`` (warning about
    ``checkpoint_1``), the loader continues there, and neatpack's ``save_state`` replaces the
    torn folder with a complete one."""
    project = accelerate.utils.ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True
    )
    accelerator = accelerate.Accelerator(cpu=True, project_config=project)
    model = torch.nn.Linear(4, 4)  # weights and optimizer state in every checkpoint
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = neat_vlm_graph(corpus, load_tiny_processor("qwen2_vl"), config=config(corpus))
    batches = prepare_loader(accelerator, loader)
    tear = Tear()
    accelerator.register_for_checkpointing(tear)
    it = iter(batches)
    next(it)
    save_state(accelerator)
    want = [b["sample_ids"] for b in it]
    tear.armed = True
    with pytest.raises(OSError, match="killed while saving"):
        save_state(accelerator)
    tear.armed = False
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(RuntimeError, match="Number of custom checkpoints"):
        accelerator.load_state()  # Accelerate's own pick: the newest folder, torn
    with caplog.at_level(logging.WARNING):
        newest = last_complete_state(checkpoints)
    assert newest == str(checkpoints / "checkpoint_0")
    assert f"skipped incomplete checkpoint_1 (no {COMPLETE})" in caplog.text
    accelerator.load_state(newest)
    assert [b["sample_ids"] for b in batches] == want
    with pytest.raises(ValueError, match="already exists"):
        accelerator.save_state()  # Accelerate refuses the torn folder of this iteration
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        save_state(accelerator)
    assert f"removing {checkpoints / 'checkpoint_1'}, torn" in caplog.text
    assert last_complete_state(checkpoints) == str(checkpoints / "checkpoint_1")
