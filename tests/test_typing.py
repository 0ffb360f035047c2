"""The public surface is typed and tiered.

``neatpack.pipes`` serves its names lazily (``__getattr__`` over ``_EXPORTS``), so a type
checker would see each one as ``Any``; an ``if TYPE_CHECKING:`` block imports every exported
name from its module instead. Here: the block and ``_EXPORTS`` list exactly the same names
(read with ``ast``, so neither can gain a name alone), mypy sees a real type for every name the
README imports from ``neatpack.pipes`` and ``neatpack.graphs`` (and sees ``Any`` once a line of
the block is gone: the check can fail), importing the package still loads no torch, and the
tiers hold: ``__all__`` has every name the README imports, the family helpers live in
``neatpack.pipes.families``.

mypy cannot follow the editable install (``pipes/`` and ``graphs/`` are mapped to
``neatpack.pipes`` / ``neatpack.graphs`` by setuptools' ``package-dir``): the check builds a
folder ``neatpack/pipes -> pipes``, ``neatpack/graphs -> graphs`` (``neatpack`` a namespace
package, as installed) and points mypy at it, with torch, transformers, torchvision and
datasets skipped (their names are ``Any``; the assertion is about neatpack's names).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import neatpack.graphs
import neatpack.pipes

ROOT = Path(__file__).resolve().parents[1]
INIT = ROOT / "pipes" / "__init__.py"
README = ROOT / "README.md"
#: What the README may import from: the two packages and the documented submodules.
DOCUMENTED = re.compile(r"neatpack\.(pipes|graphs|graphs\.hf_trainer|graphs\.integrations\.\w+)$")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)  # one python block of the README
SKIPPED = ("torch", "transformers", "torchvision", "datasets")  # mypy does not analyze them


def type_checking_imports(source: str) -> dict[str, set[str]]:
    """Module (relative to ``neatpack.pipes``) -> names the ``if TYPE_CHECKING:`` block of
    ``source`` imports from it. A name not imported as itself (``X as X``, the form type
    checkers read as a re-export) is refused."""
    tree = ast.parse(source)
    blocks = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1, "neatpack.pipes needs one top-level `if TYPE_CHECKING:` block"
    out: dict[str, set[str]] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        module = node.module or ""
        assert module.startswith("neatpack.pipes."), ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"write `{alias.name} as {alias.name}`"
            out.setdefault(module.removeprefix("neatpack.pipes."), set()).add(alias.name)
    return out


def readme_imports(text: str) -> dict[str, list[str]]:
    """Module -> names the README's ``python`` blocks import from ``neatpack.*`` (in order)."""
    out: dict[str, list[str]] = {}
    for code in re.findall(BLOCK, text):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("neatpack"):
                names = out.setdefault(node.module or "", [])
                names.extend(a.name for a in node.names if a.name not in names)
    return out


def test_type_checking_block_lists_exactly_the_exports() -> None:
    """Every ``(module, name)`` of ``_EXPORTS`` is imported under ``TYPE_CHECKING`` from that
    module, and nothing else is: a name added to one alone fails here."""
    imported = type_checking_imports(INIT.read_text())
    exported = {module: set(names) for module, names in neatpack.pipes._EXPORTS.items()}
    fix = "add the name to both `_EXPORTS` and the `if TYPE_CHECKING:` block of pipes/__init__.py"
    only_block = {m: sorted(n - exported.get(m, set())) for m, n in imported.items()}
    only_block = {m: n for m, n in only_block.items() if n}
    only_exports = {m: sorted(n - imported.get(m, set())) for m, n in exported.items()}
    only_exports = {m: n for m, n in only_exports.items() if n}
    assert not only_block, f"in the block, not in _EXPORTS: {only_block}; {fix}"
    assert not only_exports, f"in _EXPORTS, not in the block: {only_exports}; {fix}"
    assert sum(map(len, imported.values())) > 150


def test_the_check_sees_a_drifted_block() -> None:
    """A line dropped from the block, or a name imported under another name, is seen."""
    text = INIT.read_text()
    line = "    from neatpack.pipes.planning.plan import plan_packs as plan_packs\n"
    assert line in text
    assert "plan_packs" not in type_checking_imports(text.replace(line, ""))["planning.plan"]
    renamed = text.replace(line, line.replace("as plan_packs", "as plan"))
    with pytest.raises(AssertionError, match="write `plan_packs as plan_packs`"):
        type_checking_imports(renamed)


def surface_tree(root: Path, *, drop: str | None = None) -> Path:
    """``root/neatpack/{pipes,graphs}`` linked to the repository's folders, and a mypy config
    that reads them as ``neatpack.*``. ``drop``: a line left out of the copied
    ``pipes/__init__.py`` (the rest of ``pipes/`` linked entry by entry)."""
    pkg = root / "neatpack"
    pkg.mkdir(parents=True)
    (pkg / "graphs").symlink_to(ROOT / "graphs", target_is_directory=True)
    if drop is None:
        (pkg / "pipes").symlink_to(ROOT / "pipes", target_is_directory=True)
    else:
        (pkg / "pipes").mkdir()
        for entry in (ROOT / "pipes").iterdir():
            if entry.name not in ("__init__.py", "__pycache__"):
                (pkg / "pipes" / entry.name).symlink_to(entry)
        text = INIT.read_text()
        assert drop in text
        (pkg / "pipes" / "__init__.py").write_text(text.replace(drop, ""))
    skipped = ",".join(f"{m},{m}.*" for m in SKIPPED)
    (root / "mypy.ini").write_text(
        f"[mypy]\npython_version = 3.11\nmypy_path = {root}\nnamespace_packages = True\n"
        f"explicit_package_bases = True\nignore_missing_imports = True\n"
        f"follow_imports = silent\ncache_dir = {root / '.mypy_cache'}\n\n"
        f"[mypy-{skipped}]\nfollow_imports = skip\n"
    )
    return root


def revealed_types(root: Path, imports: dict[str, list[str]]) -> dict[str, str]:
    """``"module.name"`` -> the type mypy reveals for it, imported as the README imports it."""
    lines, names = [], []
    for module, imported in imports.items():
        lines.append(f"from {module} import {', '.join(imported)}")
    for module, imported in imports.items():
        for name in imported:
            names.append(f"{module}.{name}")
            lines.append(f"reveal_type({name})")
    snippet = root / "surface.py"
    snippet.write_text("\n".join(lines) + "\n")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(root / "mypy.ini"), str(snippet)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert not errors, run.stdout
    assert run.returncode == 0, run.stdout + run.stderr
    first = len(imports) + 1  # the line of the first reveal_type
    out: dict[str, str] = {}
    for line in run.stdout.splitlines():
        m = re.match(r".*surface\.py:(\d+): note: Revealed type is \"(.*)\"$", line)
        if m:
            out[names[int(m.group(1)) - first]] = m.group(2)
    assert sorted(out) == sorted(names), run.stdout
    return out


def public_readme_imports() -> dict[str, list[str]]:
    imports = readme_imports(README.read_text())
    return {m: n for m, n in imports.items() if m in ("neatpack.pipes", "neatpack.graphs")}


def test_mypy_sees_real_types_for_every_name_the_readme_imports(tmp_path: Path) -> None:
    """The names the README imports from ``neatpack.pipes`` and ``neatpack.graphs``, and every
    other name of ``_EXPORTS`` in the same run: mypy reveals none of them as ``Any``."""
    imports = public_readme_imports()
    assert len(imports["neatpack.pipes"]) >= 5
    assert len(imports["neatpack.graphs"]) >= 5
    exported = {name for names in neatpack.pipes._EXPORTS.values() for name in names}
    imports["neatpack.pipes"] += sorted(exported - set(imports["neatpack.pipes"]))
    revealed = revealed_types(surface_tree(tmp_path), imports)
    untyped = sorted(name for name, kind in revealed.items() if kind == "Any")
    assert not untyped, f"mypy sees these as Any (add them to the TYPE_CHECKING block): {untyped}"
    shards = revealed["neatpack.pipes.TarShardSource"]
    assert shards.endswith("-> neatpack.pipes.reading.shards.TarShardSource"), shards
    graph = revealed["neatpack.graphs.neat_vlm_graph"]
    assert graph.endswith("-> neatpack.graphs.runtime.loader.NeatLoader"), graph


def test_mypy_check_sees_a_name_made_any(tmp_path: Path) -> None:
    """The same check with one line of the block gone: mypy falls back to ``__getattr__`` and
    reveals that name, and only it, as ``Any``."""
    line = "    from neatpack.pipes.testing.synth import write_corpus as write_corpus\n"
    imports = public_readme_imports()
    assert "write_corpus" in imports["neatpack.pipes"]
    revealed = revealed_types(surface_tree(tmp_path, drop=line), imports)
    assert [n for n, kind in revealed.items() if kind == "Any"] == ["neatpack.pipes.write_corpus"]


def test_readme_imports_only_the_public_tiers() -> None:
    """The README imports from ``neatpack.pipes``, ``neatpack.graphs`` and the documented
    submodules only, and every name it imports from the two packages is in their ``__all__``."""
    text = README.read_text()
    assert len(BLOCK.findall(text)) == text.count("```python") >= 9  # every block is read
    imports = readme_imports(text)
    assert not [m for m in imports if not DOCUMENTED.match(m)], sorted(imports)
    for package in (neatpack.pipes, neatpack.graphs):
        module = package.__name__
        outside = sorted(set(imports[module]) - set(package.__all__))
        assert not outside, f"the README imports these from {module}, not in its __all__: {outside}"
    assert readme_imports("```python\nfrom neatpack.pipes.testing.tiny import x\n```\n") == {
        "neatpack.pipes.testing.tiny": ["x"]
    }
    assert not DOCUMENTED.match("neatpack.pipes.testing.tiny")


def test_family_helpers_live_in_families() -> None:
    """Every family helper ``neatpack.pipes`` exports is also exported by
    ``neatpack.pipes.families``, the same object."""
    import neatpack.pipes.families as families

    helpers = [
        name
        for module, names in neatpack.pipes._EXPORTS.items()
        if module.startswith("families")
        for name in names
    ]
    assert {"gemma3_estimator", "kimi_k25_pack_media", "Handler"} <= set(helpers)
    missing = sorted(set(helpers) - set(families.__all__))
    assert not missing, f"add to neatpack.pipes.families.__all__: {missing}"
    for name in helpers:
        assert getattr(families, name) is getattr(neatpack.pipes, name), name


def test_importing_the_package_loads_no_torch() -> None:
    """The lazy loading stays: importing ``neatpack.pipes`` and the planner loads no torch or
    transformers (the TYPE_CHECKING block never runs)."""
    code = (
        "import sys; import neatpack.pipes; from neatpack.pipes import plan_packs, LengthIndex; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_project_mypy_run_reads_the_packages_as_neatpack() -> None:
    """``mypy`` from the repository root checks ``neatpack.pipes`` / ``neatpack.graphs``
    through ``.typecheck/neatpack/{pipes,graphs}``, links to the two folders (pyproject.toml)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["packages"] == ["neatpack.pipes", "neatpack.graphs"]
    base = ROOT / config["mypy_path"] / "neatpack"
    assert not (base / "__init__.py").exists()  # a namespace package, as installed
    for name in ("pipes", "graphs"):
        assert (base / name).is_symlink()
        assert (base / name).resolve() == (ROOT / name).resolve()
