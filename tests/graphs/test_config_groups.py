"""The graphs' configuration groups (graphs/config.py): every field is declared once, with its
description and whether it enters the checkpoint key; the key is read by one function for every
graph; a field declared without it cannot build a key; states saved before the groups still load.

``data/states_before_config_groups.json`` holds loader states saved by neatpack at commit 6a0a567
(the last layout before the groups: each graph wrote its own key), made with
``tests/graphs/data/old_states.py`` run against that commit.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from neatpack.graphs import (
    GroupedConfig,
    NeatLLMConfig,
    NeatVLMConfig,
    checkpoint_key,
    grouped_vlm_graph,
    neat_llm_graph,
    neat_vlm_graph,
)
from neatpack.graphs.config import KEY_WHEN_SET, Options, field_docs, options_markdown
from neatpack.pipes import load_tiny_processor, write_corpus
from neatpack.pipes.planning.source import StateMismatchError

CONFIGS = (NeatVLMConfig, NeatLLMConfig, GroupedConfig)
OLD = json.loads((Path(__file__).parent / "data" / "states_before_config_groups.json").read_text())
# a subclass may give a shared field another default; nothing else is declared twice
OVERRIDES = {("NeatLLMConfig", "pack_size"), ("GroupedConfig", "batch_size")}


@pytest.mark.parametrize("config", CONFIGS)
def test_every_field_is_documented_and_declares_its_key(config: type[Any]) -> None:
    docs = field_docs(config)
    assert set(docs) == {f.name for f in dataclasses.fields(config)}
    for f in dataclasses.fields(config):
        assert f.metadata["key"] in (True, False, KEY_WHEN_SET), f.name
        assert len(f.metadata["doc"]) > 10, f.name


def test_a_field_added_without_a_key_declaration_cannot_build_a_key() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Mine(NeatLLMConfig):
        rope_scaling: float = 1.0  # a plain field: no option(doc=..., key=...)

    with pytest.raises(TypeError, match=r"Mine\.rope_scaling is declared without option"):
        checkpoint_key(Mine())
    records = [{"input_ids": [1, 2, 3]}]
    with pytest.raises(TypeError, match="rope_scaling"):  # the graph builds its key the same way
        neat_llm_graph(records, config=Mine(pack_size=16))


def test_a_shared_option_is_declared_once() -> None:
    """A field two configs have comes from one group's declaration (same Field object), not a
    copy in each config."""
    owners: dict[str, set[str]] = {}
    for config in CONFIGS:
        for f in dataclasses.fields(config):
            owner = next(c for c in config.__mro__ if f.name in inspect.get_annotations(c))
            if (config.__name__, f.name) in OVERRIDES:
                assert owner is config
                continue
            owners.setdefault(f.name, set()).add(owner.__name__)
    twice = {name: sorted(o) for name, o in owners.items() if len(o) > 1}
    assert not twice, f"declared in more than one class: {twice}"
    shared = {n for n, o in owners.items() if next(iter(o)) not in {c.__name__ for c in CONFIGS}}
    assert {"seed", "tail", "num_workers", "keep_ledger", "attn_implementation"} <= shared
    assert all(issubclass(c, Options) for c in CONFIGS)


def test_the_key_is_the_declared_fields_for_every_graph() -> None:
    """The keys the graphs wrote themselves before the groups (an allowlist in the VLM graph, a
    denylist in the LLM graph) are what the declarations give now, with the balance they were
    saved under (tokens, the default then); the default (cost) adds ``balance`` to the key."""
    old: dict[str, Any] = {"balance": "tokens"}
    for name, config in (("neat_llm", NeatLLMConfig(pack_size=16, **old)),
                         ("neat_llm_cp", NeatLLMConfig(pack_size=16, cp_size=2, **old)),
                         ("grouped", GroupedConfig(batch_size=2)),
                         ("neat_vlm", NeatVLMConfig(pack_size=1024, **old))):  # fmt: skip
        saved = {k: v for k, v in OLD[name]["config"].items() if k not in ("graph", "lengths")}
        assert checkpoint_key(config) == saved, name
        if not isinstance(config, GroupedConfig):
            default = dataclasses.replace(config, balance="cost")
            assert checkpoint_key(default) == {**saved, "balance": "cost"}, name
    assert "cp_size" not in checkpoint_key(NeatLLMConfig())  # when_set: absent at the default
    assert "handler" not in checkpoint_key(NeatVLMConfig())


@pytest.mark.parametrize("config", CONFIGS)
def test_a_policy_outside_its_literal_is_refused_with_the_valid_values(config: type[Any]) -> None:
    with pytest.raises(ValueError, match=r"tail='sideways'\): not one of \['drop', 'pad'\]"):
        config(tail="sideways")
    with pytest.raises(ValueError, match="worker_method='fiber'"):
        config(worker_method="fiber")


def _batches(loader: Any, n: int) -> list[Any]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["packs"] == b["packs"]
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k


def test_text_states_saved_before_the_groups_resume_exactly() -> None:
    records = [{"input_ids": list(range(1, n + 1))} for n in (5, 9, 3, 7, 4, 6, 8, 2, 11, 5)]
    # saved when tokens was the default balance: resumed with it set, refused without
    old: dict[str, Any] = {"balance": "tokens"}
    cases = [("neat_llm", NeatLLMConfig(pack_size=16, **old), 2),
             ("neat_llm_cp", NeatLLMConfig(pack_size=16, cp_size=2, **old), 1)]  # fmt: skip
    for name, cfg, done in cases:
        whole = _batches(neat_llm_graph(records, config=cfg), done + 1)
        resumed = neat_llm_graph(records, config=cfg)
        resumed.load_state_dict(OLD[name])
        _same(next(iter(resumed)), whole[done])
        default = neat_llm_graph(records, config=dataclasses.replace(cfg, balance="cost"))
        with pytest.raises(StateMismatchError, match="pass balance='tokens' to resume it"):
            default.load_state_dict(OLD[name])


@pytest.mark.parametrize(("name", "graph"), [("neat_vlm", neat_vlm_graph),
                                             ("grouped", grouped_vlm_graph)])  # fmt: skip
def test_vlm_states_saved_before_the_groups_resume_exactly(
    tmp_path: Path, name: str, graph: Any
) -> None:
    data = write_corpus(tmp_path, num_samples=12, seed=3)  # the corpus the states were saved on
    media = f"{tmp_path}/media"
    # saved when tokens was the default balance: resumed with it set, refused without
    cfg: Any = GroupedConfig(batch_size=2, media_root=media)
    if name == "neat_vlm":
        cfg = NeatVLMConfig(pack_size=1024, media_root=media, balance="tokens")
    processor = load_tiny_processor()
    whole = _batches(graph(data, processor, config=cfg), 3)
    resumed = graph(data, processor, config=cfg)
    resumed.load_state_dict(OLD[name])
    _same(next(iter(resumed)), whole[2])
    if name == "neat_vlm":
        default = graph(data, processor, config=NeatVLMConfig(pack_size=1024, media_root=media))
        with pytest.raises(StateMismatchError, match="pass balance='tokens' to resume it"):
            default.load_state_dict(OLD[name])


def test_grouped_graph_takes_the_shared_worker_method(tmp_path: Path) -> None:
    """The grouped graph shares the worker group, so threads work there as in the packed ones."""
    data = write_corpus(tmp_path, num_samples=8, seed=1)
    processor = load_tiny_processor()
    base = GroupedConfig(batch_size=2, media_root=f"{tmp_path}/media", shuffle=False)
    inline = list(grouped_vlm_graph(data, processor, config=base))
    threads = dataclasses.replace(base, num_workers=2, worker_method="thread")
    for a, b in zip(inline, grouped_vlm_graph(data, processor, config=threads), strict=True):
        _same(a, b)


def test_the_configuration_page_is_the_declarations() -> None:
    """docs/configuration.md is generated from the declarations: a field added, renamed or
    re-described without regenerating it fails here. Regenerate it with ``python -c "from
    neatpack.graphs.config import options_markdown as m; print(m(), end='')" >
    docs/configuration.md``."""
    page = Path(__file__).parents[2] / "docs" / "configuration.md"
    assert page.read_text() == options_markdown()
    for config in CONFIGS:
        for f in dataclasses.fields(config):
            assert f"`{f.name}`" in page.read_text(), f.name
