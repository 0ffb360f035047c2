"""Resuming ``NeatTrainer`` (``graphs/hf_trainer.py``) the way a user does: ``Trainer.train(
resume_from_checkpoint=...)`` in a fresh process after the first one was SIGKILLed, on tiny real
models and the real tiny processor (the runs are ``tests/support/trainer_run.py``).

Issue 25: a checkpoint saved at an epoch's end resumed into an empty epoch and trained nothing;
Qwen2-VL's weights were not restored (1 of 58 tensors); a torn last checkpoint made
``resume_from_checkpoint=True`` raise.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import support.tiny
import torch
from support import tiny_family_models

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.hf_trainer import load_weights
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import TINY_FAMILIES

pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "support" / "trainer_run.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_corpus(tmp_path_factory.mktemp("corpus"), num_samples=8, seed=3))


def run(spec: dict[str, Any] | list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUN), json.dumps(spec)], capture_output=True, text=True,
        timeout=240, cwd=ROOT,
    )  # fmt: skip


def batches(dumps: Path) -> list[list[int]]:
    return [json.loads(line) for line in (dumps / "batches.jsonl").read_text().splitlines()]


def assert_same_weights(got: Path, want: Path) -> None:
    a, b = torch.load(got), torch.load(want)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors not restored, e.g. {differ[:3]}"


@pytest.mark.timeout(600)
def test_killed_while_saving_resumes_from_the_last_complete_checkpoint(
    corpus: Path, tmp_path: Path
) -> None:
    """SIGKILL while checkpoint-4 is written: ``resume_from_checkpoint=True`` takes checkpoint-2
    (warning about checkpoint-4), restores every weight of the Qwen2-VL model, and trains the
    same batches the killed run trained after step 2; naming the torn folder is refused."""
    out = tmp_path / "out"
    spec = {"family": "qwen2_vl", "corpus": str(corpus), "out": str(out),
            "args": {"max_steps": 4, "save_steps": 2}}  # fmt: skip
    killed = run({**spec, "dumps": str(tmp_path / "a"), "kill_in_save": 4})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (out / "checkpoint-4" / "model.safetensors").exists()  # torn: weights, no state

    shutil.copytree(out, tmp_path / "kept")  # the resumed run below rewrites checkpoint-4
    # seed 1: the fresh model's weights differ from every saved one until the resume loads them
    resumed = run({**spec, "dumps": str(tmp_path / "b"), "resume": True, "seed": 1})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "skipped incomplete checkpoint-4 (no trainer_state.json)" in resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1])["global_step"] == 4
    assert_same_weights(tmp_path / "b" / "begin.pt", tmp_path / "a" / "saved-2.pt")
    assert batches(tmp_path / "b") == batches(tmp_path / "a")[2:4]

    named = {
        **spec,
        "out": str(tmp_path / "kept"),
        "resume": str(tmp_path / "kept" / "checkpoint-4"),
    }
    torn = run({**named, "dumps": str(tmp_path / "t")})
    assert torn.returncode != 0
    assert "cannot resume from" in torn.stderr
    assert "no trainer_state.json" in torn.stderr


@pytest.mark.timeout(600)
def test_resume_from_an_epoch_end_checkpoint_trains_the_next_epoch(
    corpus: Path, tmp_path: Path
) -> None:
    """``save_strategy="epoch"``, killed after the first epoch's checkpoint: the resumed run
    trains the whole second epoch (the loader's epoch 1, batch for batch), not an empty one."""
    proc = load_tiny_processor("qwen2_vl")
    cfg = NeatVLMConfig(pack_size=1024, media_root=str(corpus.parent / "media"), prefetch=0)
    loader = neat_vlm_graph(corpus, proc, config=cfg)
    epochs = [[b["input_ids"].flatten().tolist() for b in loader] for _ in range(2)]
    steps = len(epochs[0])
    assert steps >= 2
    assert epochs[0] != epochs[1]
    spec = {"family": "qwen2_vl", "corpus": str(corpus), "out": str(tmp_path / "out"),
            "args": {"num_train_epochs": 2, "save_strategy": "epoch"}}  # fmt: skip
    killed = run({**spec, "dumps": str(tmp_path / "a"), "kill_after_save": steps})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert batches(tmp_path / "a") == epochs[0]
    resumed = run({**spec, "dumps": str(tmp_path / "b"), "resume": True})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.splitlines()[-1])["global_step"] == 2 * steps
    assert batches(tmp_path / "b") == epochs[1]


@pytest.mark.slow  # 8 runs: ~25 s of CPU (qwen2_vl alone is in the kill test above)
@pytest.mark.timeout(600)
def test_resume_restores_every_weight_of_each_tiny_qwen_model(corpus: Path, tmp_path: Path) -> None:
    """Each tiny model of the parity tests (``TINY_FAMILIES``) saved by one ``NeatTrainer``
    run is, after ``resume_from_checkpoint=True`` in the next (its fresh model seeded
    differently), the saved model, tensor for tensor. ``save_pretrained`` writes Qwen2-VL's and
    Qwen2.5-VL's legacy key names, which the Trainer's own load skipped."""
    phases = []
    for family in TINY_FAMILIES:
        spec = {"family": family, "corpus": str(corpus), "out": str(tmp_path / family)}
        phases.append({**spec, "dumps": str(tmp_path / f"{family}-a"),
                       "args": {"max_steps": 1, "save_steps": 1}})  # fmt: skip
        phases.append({**spec, "dumps": str(tmp_path / f"{family}-b"), "resume": True,
                       "seed": 1, "args": {"max_steps": 2, "save_steps": 1}})  # fmt: skip
    done = run(phases)
    assert done.returncode == 0, done.stderr[-3000:]
    for family in TINY_FAMILIES:
        saved = tmp_path / f"{family}-a" / "saved-1.pt"
        assert_same_weights(tmp_path / f"{family}-b" / "begin.pt", saved)


#: the families whose tiny model (tests/support/tiny_family_models.py) has a packed-vs-separate
#: parity test in tests/families
FAMILY_MODELS = ("gemma3", "gemma4", "idefics3", "internvl", "llava_onevision", "nemotron_omni",
                 "qwen3_omni", "qwen_omni", "smolvlm", "step3")  # fmt: skip


def family_model(family: str) -> Any:
    proc = getattr(support.tiny, f"load_tiny_{family}_processor")()
    return getattr(tiny_family_models, f"tiny_{family}_model")(proc)


@pytest.mark.parametrize("family", FAMILY_MODELS)
def test_resume_weights_of_every_family_model(family: str, tmp_path: Path) -> None:
    """The weights ``NeatTrainer``'s resume loads (``load_weights``) from a folder the Trainer
    writes (``save_pretrained``: legacy names, fused MoE experts) are the saved model's, tensor
    for tensor, for each family model with a parity test; the live model starts elsewhere."""
    saved = family_model(family)
    saved.save_pretrained(tmp_path)
    model = family_model(family)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    load_weights(model, str(tmp_path))
    want, got = saved.state_dict(), model.state_dict()
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_resume_refuses_weights_transformers_cannot_reload(tmp_path: Path) -> None:
    """Kimi K2.5's tiny model: transformers 5.x's loader cannot read back what its
    ``save_pretrained`` wrote (a q/k rope permutation on the wrong shape); the resume refuses,
    naming the model and the folder, instead of training from other weights."""
    saved = family_model("kimi_k25")
    saved.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"cannot restore the weights of Kimi_K25\w+ from '.+'"):
        load_weights(family_model("kimi_k25"), str(tmp_path))
