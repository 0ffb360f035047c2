"""NeMo AutoModel (``graphs/integrations/automodel.py``): the YAML of
docs/migrating_from_automodel.md, built by AutoModel's own config loader, gives a resumable
neatpack loader with the peer's option names mapped; the names with no equivalent are refused
by name.

AutoModel 0.7.0 pins torch and transformers versions neatpack does not use, so it is never
installed with its dependencies: when it is not importable, the wheel is installed with
``pip install --no-deps --target`` into a temporary folder (its config loader needs only
pyyaml, which transformers requires); without the registry the AutoModel test skips, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from neatpack.graphs.integrations.automodel import PEER_OPTIONS, build_dataloader
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "support" / "automodel_yaml_run.py"
DOC = (ROOT / "docs" / "migrating_from_automodel.md").read_text()
AUTOMODEL = "nemo-automodel==0.7.0"
NUM_SAMPLES = 24


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_corpus(tmp_path_factory.mktemp("corpus"), num_samples=NUM_SAMPLES, seed=5))


@pytest.fixture(scope="module")
def automodel_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A ``PYTHONPATH`` entry under which ``import nemo_automodel`` works ("": it already does)."""
    if importlib.util.find_spec("nemo_automodel") is not None:
        return ""
    target = tmp_path_factory.mktemp("automodel")
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), AUTOMODEL],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    if pip.returncode != 0:
        pytest.skip(f"{AUTOMODEL} is not installed and pip could not fetch it: {pip.stderr[-300:]}")
    return str(target)


@pytest.fixture(scope="module")
def meta_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An AutoModel meta dataset: ShareGPT rows with ``<image>`` tags, half with a picture."""
    root = tmp_path_factory.mktemp("meta")
    (root / "media").mkdir()
    rows = []
    for i in range(NUM_SAMPLES):
        row: dict[str, Any] = {"messages": [
            {"role": "user", "content": f"{'<image>' if i % 2 else ''}What is item {i}?"},
            {"role": "assistant", "content": " ".join(f"word{j}" for j in range(30 + 5 * i))},
        ]}  # fmt: skip
        if i % 2:
            Image.new("RGB", (56 + 28 * (i % 5), 56), (9 * i, 90, 200)).save(
                root / f"media/{i}.png"
            )
            row["images"] = [f"{i}.png"]
        rows.append(json.dumps(row) + "\n")
    (root / "train.jsonl").write_text("".join(rows))
    meta = {"train": {"file_name": "train.jsonl", "media_dir": str(root / "media")}}
    (root / "meta.json").write_text(json.dumps(meta))
    return root / "meta.json"


def doc_yaml() -> str:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC, re.S)
    assert len(blocks) == 1, "the migration guide has one recipe YAML, the one this test runs"
    return str(blocks[0])


def test_docs_yaml_builds_a_resumable_loader_through_automodels_config_loader(
    meta_json: Path, automodel_path: str, tmp_path: Path
) -> None:
    (tmp_path / "recipe.yaml").write_text(doc_yaml())
    env = {**os.environ, "NEATPACK_META": str(meta_json)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (automodel_path, env.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, str(RUN), "recipe.yaml", "metrics.jsonl"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])

    assert out["type"] == "NeatLoader"
    # the peer's names, mapped: packed_sequence.*, dataloader.*, seed, local_batch_size
    expected = {"pack_size": 1024, "packing_ratio": 0.9, "overlong": "drop", "tail": "pad",
                "seed": 7, "batch_size": 2, "attn_implementation": "sdpa"}  # fmt: skip
    assert {k: out["config"][k] for k in expected} == expected

    # the epoch: every sample exactly once (padded tail rows repeat packs, flagged)
    real = [row for batch in out["full"] for row in batch if not row["padded"]]
    assert sorted(s for row in real for s in row["sample_ids"]) == list(range(NUM_SAMPLES))
    # labels are next-token targets already (AutoModel's VLM recipe does not shift them again)
    for row in real:
        ids, labels = row["input_ids"], row["labels"]
        trained = [t for t, lab in enumerate(labels) if lab != -100]
        assert trained, row["sample_ids"]
        assert all(labels[t] == ids[t + 1] for t in trained), row["sample_ids"]
    # stopped after 2 batches, saved through torch.save, resumed in a fresh loader
    assert out["head"] + out["tail"] == out["full"]
    assert len(out["head"]) == 2
    assert out["tail"]
    # rank 1 of 2 (dp_rank / dp_world_size, the recipe's runtime names) resumes from its state,
    # and refuses rank 0's by name rather than replaying rank 0's packs
    assert out["rank1_head"] + out["rank1_tail"] == out["rank1_full"]
    assert out["rank1_tail"]
    assert out["rank1_full"] != out["full"][: len(out["rank1_full"])]
    assert out["rank0_state_in_rank1"].startswith("StateMismatchError")
    assert "load each rank's own state" in out["rank0_state_in_rank1"]
    # the data metrics reach AutoModel's JSONL training log, one record per step
    assert out["logged"] == out["full"]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(len(out["full"])))
    for record in logged:
        assert record["data/batches"] == 1.0
        assert record["data/wait_s"] >= 0.0
        assert 0.0 <= record["data/wait_fraction"] <= 1.0
        assert 0.0 < record["data/fill"] <= 1.0
        assert record["num_label_tokens"] > 0
    # AutoModel 0.7.0's VLM recipe config refuses any dataloader but its own (the guide says so)
    assert "expected StatefulDataLoader" in out["recipe_refusal"]


def test_migration_table_lists_every_peer_option() -> None:
    rows = re.findall(r"^\| `(\w+)`", DOC, re.M)
    assert rows == list(PEER_OPTIONS)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"truncate": True}, ValueError, "never cuts a sample.*drop_long_samples"),
        ({"enabled": False}, ValueError, "grouped_vlm_graph"),
        ({"chat_template": "{{ x }}"}, ValueError, "processor.chat_template"),
        ({"post_tokenize_hook_fn": print}, ValueError, "sample_transform"),
        ({"pack_size": 1024, "max_length": 512}, ValueError, "max_length=512 is below"),
        ({"pack_size": 1024, "collate_max_length": 512}, ValueError, "collate_max_length=512"),
        ({"prefetch": 2, "prefetch_factor": 4}, ValueError, "prefetch_factor=4 sets.*prefetch"),
        ({"pack_size": 512, "packed_sequence": {"pack_size": 1024}}, ValueError, "disagree"),
        ({"rank": 0, "dp_rank": 1, "world_size": 2}, ValueError, "rank=0 and dp_rank=1 disagree"),
        ({"packing_format": "bshd"}, ValueError, r"packing_format='bshd' is not one of"),
        ({"packed_mask_type": "causal"}, ValueError, "block_causal"),
        ({"sampler": None}, TypeError, "unknown option 'sampler'.*migrating_from_automodel"),
    ],
)
def test_options_without_an_equivalent_are_refused_by_name(
    corpus: Path, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        build_dataloader(data=str(corpus), processor=load_tiny_processor(), **options)


def test_peer_names_reach_the_batches(corpus: Path) -> None:
    """collate_max_length pads rows to exactly that length; packed_mask_type picks the mask;
    balance_media_tokens is ignored, with a warning that says why."""
    with pytest.warns(UserWarning, match="shuffle then undoes"):
        loader = build_dataloader(
            dataset=str(corpus), media_root=str(corpus.parent / "media"),
            processor=load_tiny_processor(),
            pack_size=1024, collate_max_length=1536, packed_mask_type="flash_varlen",
            balance_media_tokens=True, local_batch_size=2, drop_long_samples=True,
        )  # fmt: skip
    with loader:
        batch = next(iter(loader))
    assert batch["input_ids"].shape == (2, 1536)
    assert loader.config["attn_implementation"] == "flash_attention_2"
    assert batch["cu_seq_lens_q"].dtype.is_floating_point is False


def test_processor_from_the_recipes_model_path(corpus: Path, tmp_path: Path) -> None:
    """No ``processor`` section: the recipe's ``pretrained_model_name_or_path`` (a local
    folder here) loads it; no records at all is refused, saying what to give."""
    load_tiny_processor().save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"data= \(or the AutoModel name dataset=\)"):
        build_dataloader(pretrained_model_name_or_path=str(tmp_path / "model"))
    loader = build_dataloader(
        data=str(corpus), media_root=str(corpus.parent / "media"), pack_size=1024,
        pretrained_model_name_or_path=str(tmp_path / "model"), drop_long_samples=True,
    )  # fmt: skip
    with loader:
        batch = next(iter(loader))
    assert batch["input_ids"].shape[1] <= 1024
