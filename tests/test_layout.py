"""The package's layout stays untangled: no import cycle among the ``neatpack.pipes`` /
``neatpack.graphs`` modules (imports under ``if TYPE_CHECKING:`` do not run and are not
counted; lazy imports inside functions are), and no module imports another module's private
name (``from x import _name`` or ``alias._name`` on an imported package module).

The checks read the source with ``ast`` (nothing is imported), over every module of both
packages, sub-packages included, so a family module or a new file is checked as soon as it
lands. Each check is also run on a small synthetic package that breaks it, so it can fail.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import neatpack.graphs
import neatpack.pipes

ROOTS = {
    "neatpack.pipes": Path(next(iter(neatpack.pipes.__path__))),
    "neatpack.graphs": Path(next(iter(neatpack.graphs.__path__))),
}


def package_modules(roots: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under each package root."""
    out: dict[str, Path] = {}
    for pkg, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                continue
            stack.append(child)


def _target(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """(runtime import graph among ``modules``, private-name imports across modules)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private: list[str] = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> package module it stands for
        nodes = list(_runtime_nodes(tree))
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                tgt = _target(mod, path.name == "__init__.py", node)
                for a in node.names:
                    sub = f"{tgt}.{a.name}"
                    if sub in modules:  # `from . import mask as M`: a module, not a name
                        aliases[a.asname or a.name] = sub
                        if sub != mod:
                            edges[mod].add(sub)
                        continue
                    if tgt in modules and tgt != mod:
                        edges[mod].add(tgt)
                        if _private(a.name):
                            private.append(f"{mod}:{node.lineno} from {tgt} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules and a.name != mod:
                        edges[mod].add(a.name)
                        if a.asname:
                            aliases[a.asname] = a.name
        private.extend(
            f"{mod}:{node.lineno} {node.value.id}.{node.attr}"
            for node in nodes
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
            and aliases[node.value.id] != mod
        )
    return edges, private


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycle_among_package_modules() -> None:
    edges, _ = scan(package_modules(ROOTS))
    assert len(edges) > 60  # both packages were found, sub-packages included
    found = cycles(edges)
    assert not found, f"import cycles (move the shared name to a module both can import): {found}"


def test_no_private_name_imported_across_modules() -> None:
    _, private = scan(package_modules(ROOTS))
    assert not private, (
        "private names used across modules (make the name public in the module that owns it, "
        f"or move it to the module that uses it): {private}"
    )


def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return package_modules({"fake": root})


def test_the_checks_catch_a_cycle_and_a_private_import(tmp_path: Path) -> None:
    mods = _write(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import helper\n",
            "b.py": "def helper():\n    from . import a\n    from .c import _hidden\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
            "_hidden = 1\n",
            "d.py": "from . import c as C\nprint(C._hidden)\n",
            "sub/__init__.py": "from ..c import _hidden\n",
        },
    )
    edges, private = scan(mods)
    assert cycles(edges) == [["fake.a", "fake.b"]]  # the lazy import counts, TYPE_CHECKING not
    assert sorted(p.split(" ", 1)[1] for p in private) == [
        "C._hidden",
        "from fake.c import _hidden",
        "from fake.c import _hidden",
    ]


def test_seed_names_importable_from_the_package() -> None:
    """Every seed name ``seed_compat.py`` defines is exported by ``neatpack.pipes``, and the short
    ``__all__`` (the core and the README's names) is a subset of what ``dir()`` lists."""
    from neatpack.pipes import _EXPORTS, seed_compat

    tree = ast.parse(Path(seed_compat.__file__).read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
        if isinstance(t, ast.Name)
    }  # fmt: skip
    assert "_estimate_sample_length" in defined
    assert defined == set(_EXPORTS["compat.seed_compat"])
    for name in defined:
        assert getattr(neatpack.pipes, name) is getattr(seed_compat, name)
    assert set(neatpack.pipes.__all__) <= set(dir(neatpack.pipes))
    assert (
        len(neatpack.pipes.__all__) <= 30
    )  # short and deliberate: the core and the README's names


def test_doctests_of_the_split_modules() -> None:
    """The worked examples in the docstrings of the modules the untangling made run as shown."""
    import doctest
    import importlib

    names = ["neatpack.graphs.command.cli_inputs", "neatpack.graphs.checkpoint_dirs"] + [
        f"neatpack.pipes.{m}"
        for m in ("errors", "estimate_types", "mask_format", "collate_media", "seed_compat",
                  "contracts", "sample_collate", "pad_packs")
    ]  # fmt: skip
    results = {n: doctest.testmod(importlib.import_module(n)) for n in names}
    assert all(r.failed == 0 for r in results.values()), results
    assert sum(r.attempted for r in results.values()) >= 10
