"""attnlib's layout, read from its source with ``ast``: chapter order is import order,
no module grows past ~450 lines, and no private name is imported from another module or
defined (with another meaning) in two."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attnlib"
MAX_LINES = 450

# The chapter whose code each module holds (the longest matching dotted prefix decides). A
# module may import modules of its own chapter or of earlier ones, never a later chapter's.
CHAPTER = {
    "attnlib._core": 0,  # shared records and checks
    "attnlib.plots": 0,  # static figures: they import nothing of attnlib
    "attnlib.attention": 1,
    "attnlib.multihead": 3,
    "attnlib.lowrank": 4,
    "attnlib.separate": 5,  # shown in chapter 3, compared in chapter 5; built on multihead
    "attnlib.interop": 5,
    "attnlib.interop.llama": 8,
    "attnlib.interop.bloom": 8,  # BLOOM's layout, for chapter 8's ALiBi
    "attnlib.pretrained": 6,
    "attnlib.recall": 7,
    "attnlib.decoding": 8,
    "attnlib.audit": 9,
    "attnlib.blockwise": 10,
    "attnlib.blockwise_bounds": 10,
    "attnlib.induction": 11,
    "attnlib.induction.explorer": 99,  # the composition map, built on the explorers machinery
    "attnlib.explorers": 99,  # interactive figures of every chapter
    "attnlib": 99,  # the front door imports everything
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _own_chapter(name: str) -> int:
    keys = [k for k in CHAPTER if _inside(name, k) and (k != "attnlib" or name == "attnlib")]
    if not keys:
        pytest.fail(f"{name} has no chapter: add it to CHAPTER in tests/test_layout.py")
    return CHAPTER[max(keys, key=len)]


def _chapter(name: str) -> int:
    """A module's chapter; a package's is the latest of its modules (importing it runs them all)."""
    if MODULES[name].name != "__init__.py":
        return _own_chapter(name)
    return max(_own_chapter(m) for m in MODULES if _inside(m, name))


def _imports(name: str) -> list[tuple[str, list[str], int, bool]]:
    """(module imported, names taken from it, line, inside a module-level ``__getattr__``)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    lazy = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
            for n in ast.walk(f)}
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno, id(node) in lazy) for a in node.names if _inside(a.name, "attnlib")]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: from . import x
                target = ".".join(base.split(".")[: len(base.split(".")) - node.level + 1] + ([target] if target else []))
            if not _inside(target, "attnlib"):
                continue
            names = [a.name for a in node.names]
            submodules = [n for n in names if f"{target}.{n}" in MODULES]
            for sub in submodules:  # from attnlib import plots: the module attnlib.plots
                found.append((f"{target}.{sub}", [], node.lineno, id(node) in lazy))
            rest = [n for n in names if n not in submodules]
            if rest:
                found.append((target, rest, node.lineno, id(node) in lazy))
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_short(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (> {MAX_LINES}): split it where its seams are"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_follow_chapter_order(name: str) -> None:
    """A later chapter's module is reached only by a module-level ``__getattr__`` that keeps an
    old import path working (``attnlib.multihead.SeparateHeadsAttention``)."""
    mine = _chapter(name)
    for target, _, line, lazy in _imports(name):
        assert target in MODULES, f"{name}:{line} imports {target}, which is not a module of attnlib"
        if lazy or _inside(target, name):
            continue
        theirs = _chapter(target)
        assert theirs <= mine, (
            f"{name} (chapter {mine}) imports {target} (chapter {theirs}) at line {line}: "
            f"a module may import only its own or earlier chapters' modules"
        )


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_name_imported_from_another_module(name: str) -> None:
    for target, names, line, _ in _imports(name):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, (
            f"{name}:{line} imports private {', '.join(private)} from {target}: make it public "
            f"in the lower module, or move it"
        )


def test_every_chapter_module_is_named() -> None:
    """The table above covers every module (a new one needs its chapter)."""
    for name in MODULES:
        _chapter(name)


def _private_top_level(name: str) -> set[str]:
    """The private names a module defines at its top level (functions, classes, assignments)."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Assign):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
    return {n for n in found if n.startswith("_") and not n.startswith("__")}


def test_no_private_name_defined_in_two_modules() -> None:
    """A private name means one thing: two modules defining ``_finish`` (or ``_heads``) read as
    one helper and are two."""
    where: dict[str, list[str]] = {}
    for name in MODULES:
        for private in _private_top_level(name):
            where.setdefault(private, []).append(name)
    twice = {p: mods for p, mods in where.items() if len(mods) > 1}
    assert not twice, f"private names defined in more than one module (rename one, or share a public one): {twice}"
