"""docs/architecture.md lists every module of ``neatpack.pipes`` and ``neatpack.graphs``, one
line each, and no module that does not exist: a new, moved or deleted file fails here until the
map says where it lives."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
#: A module line: ``- `pipes/x.py`: what it holds``.
LINE = re.compile(r"^- `((?:pipes|graphs)/[\w/]+\.py)`: \S", re.M)


def listed(text: str) -> list[str]:
    return LINE.findall(text)


def package_files() -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for pkg in ("pipes", "graphs")
        for p in (ROOT / pkg).rglob("*.py")
        if "_assets" not in p.parts
    }


def test_every_module_has_one_line_and_every_line_a_module() -> None:
    lines = listed(DOC.read_text())
    twice = sorted({m for m in lines if lines.count(m) > 1})
    assert not twice, f"listed more than once in docs/architecture.md: {twice}"
    missing = sorted(package_files() - set(lines))
    assert not missing, f"modules missing from docs/architecture.md (add one line each): {missing}"
    stale = sorted(set(lines) - package_files())
    assert not stale, f"docs/architecture.md lists modules that do not exist: {stale}"


def test_the_check_sees_a_missing_and_a_stale_line() -> None:
    text = DOC.read_text()
    assert "pipes/collating/collate.py" in listed(text)
    dropped = re.sub(r"^- `pipes/collating/collate.py`:.*\n", "", text, flags=re.M)
    assert "pipes/collating/collate.py" not in listed(dropped)
    assert listed("- `pipes/gone.py`: a module that was deleted\n") == ["pipes/gone.py"]


def test_each_kind_of_change_has_a_place() -> None:
    where = DOC.read_text().split("## Where a change goes", 1)[1]
    for kind in ("new model family", "new mask / attention format", "new source / reader",
                 "new node or worker step", "new benchmark"):  # fmt: skip
        assert f"**A {kind}**" in where, kind
