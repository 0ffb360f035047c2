"""Packaging guards: every sub-package shipped, layering respected, every export resolves."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import neatpack.graphs
import neatpack.pipes

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    found = {
        "neatpack." + ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("pipes", "graphs")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert found == listed


def test_layering_pipes_never_import_graphs() -> None:
    for path in (ROOT / "pipes").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                assert not name.startswith(("neatpack.graphs", "graphs", "pipes", "support")), (
                    path,
                    name,
                )


def test_every_pipes_export_resolves() -> None:
    for name in dir(neatpack.pipes):
        assert getattr(neatpack.pipes, name) is not None, name


def test_graphs_exports() -> None:
    for name in ("neat_vlm_graph", "neat_llm_graph", "NeatLoader", "NeatVLMConfig"):
        assert callable(getattr(neatpack.graphs, name)), name


def test_embedded_processors_are_package_data() -> None:
    from neatpack.pipes.testing.tiny import tiny_processor_dir

    assert (tiny_processor_dir("qwen2_vl") / "tokenizer.json").is_file()


def test_only_the_demo_processors_ship() -> None:
    """The package ships the Qwen-VL processors the demo and the quickstart load; the other
    families' tiny processors (and every tiny model builder but Qwen's) are test scaffolding
    under tests/support/."""
    from neatpack.pipes.testing.tiny import FAMILIES

    shipped = sorted(p.name for p in (ROOT / "pipes" / "_assets" / "processors").iterdir())
    assert shipped == sorted(FAMILIES)
    assert not list((ROOT / "pipes").rglob("tiny_family_models.py"))
