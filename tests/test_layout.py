"""attnlib's layout, read from its source with ``ast``: chapter order is import order (a
package's own imports included, since importing one of its modules runs them), no module
grows past ~450 lines, and no private name crosses a module: none is imported from
another module, defined (with another meaning) in two, or reached as an attribute of
another module's object (``cache._check``); and no module assigns to another module's
class."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attnlib"
MAX_LINES = 450

# The chapter whose code each module holds (the longest matching dotted prefix decides). A
# module may import modules of its own chapter or of earlier ones, never a later chapter's.
CHAPTER = {
    "attnlib.checks": 0,  # the argument checks every module shares
    "attnlib.records": 0,  # AttentionWeights: a layer's projections
    "attnlib.rounding": 0,  # tolerances derived from the computation (every chapter)
    "attnlib.plots": 0,  # static figures: they import nothing of attnlib
    "attnlib.attention": 1,
    "attnlib.multihead": 3,
    "attnlib.interop.torch_mha": 3,  # nn.MultiheadAttention's layout: from_torch, to_torch
    "attnlib.lowrank": 4,
    "attnlib.separate": 5,  # shown in chapter 3, compared in chapter 5; built on multihead
    "attnlib.interop": 5,
    "attnlib.pretrained": 6,
    "attnlib.recall": 7,
    "attnlib.optim": 7,  # AdamW written out: chapters 7 and 11 train with it
    "attnlib.decoding": 8,
    "attnlib.audit": 9,
    "attnlib.blockwise": 10,
    "attnlib.blockwise_bounds": 10,
    "attnlib.blockwise_io": 10,  # bytes held (measured) and moved between HBM and SRAM (simulated)
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


@cache
def _tree(name: str) -> ast.Module:
    """A module's syntax tree, parsed once for all the checks (read-only)."""
    return ast.parse(MODULES[name].read_text(), str(MODULES[name]))


@cache
def _imports(name: str) -> list[tuple[str, list[str], int, bool]]:
    """(module imported, names taken from it, line, inside a module-level ``__getattr__``)."""
    path = MODULES[name]
    tree = _tree(name)
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


def _packages_run_by(target: str, importer: str) -> list[str]:
    """The packages whose ``__init__`` importing ``target`` runs, besides the front door
    ``attnlib`` (which imports everything) and the importer's own packages (already running)."""
    parts = target.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(2, len(parts)))
            if p in MODULES and MODULES[p].name == "__init__.py" and not _inside(importer, p)]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_follow_chapter_order(name: str) -> None:
    """A later chapter's module is reached only lazily, by a module-level ``__getattr__``
    (``attnlib.interop``'s names). Importing ``attnlib.interop.torch_mha`` runs
    ``attnlib/interop/__init__.py`` first, so what that file imports eagerly counts too."""
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
        for package in _packages_run_by(target, name):
            for runs, _, at, later in _imports(package):
                assert later or _chapter(runs) <= mine, (
                    f"{name} (chapter {mine}) imports {target} at line {line}, which runs {package}'s "
                    f"__init__, whose line {at} imports {runs} (chapter {_chapter(runs)}): load it lazily"
                )


def _private_members(name: str) -> set[str]:
    """The private names a module defines anywhere: at its top level, in a class body, or as
    an attribute of ``self``."""
    found = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
    return {n for n in found if n.startswith("_") and not n.startswith("__")}


PRIVATE = {name: _private_members(name) for name in MODULES}


def _is_own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own members, inherited ones included."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_attribute_of_another_module_is_used(name: str) -> None:
    """``cache._check(...)`` in the decoder layer reaches into the cache's module: a member another
    module needs is public. (A subclass's ``self._attend`` is its own, inherited.)"""
    others = set().union(*(p for m, p in PRIVATE.items() if m != name))
    tree = _tree(name)
    used = sorted({(node.lineno, node.attr) for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr in others - PRIVATE[name]
                   and not _is_own(node.value)})
    assert not used, (
        f"{name} uses private attributes defined in other modules: "
        + ", ".join(f"{attr} (line {line})" for line, attr in used) + ": make them public, or move the code"
    )


def _imported_names(name: str) -> dict[str, str]:
    """Local name -> the attnlib module it comes from, for every ``from attnlib... import X``."""
    out = {}
    for target, names, _, _ in _imports(name):
        out.update({n: target for n in names})
    return out


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_assigns_to_another_modules_class(name: str) -> None:
    """``MultiHeadAttention._decoder_class = DecoderAttention`` in chapter 8 changed chapter 3's
    class from outside: a class is changed only where it is defined."""
    imported = _imported_names(name)
    tree = _tree(name)
    hits = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = [node.args[0]] if node.args else []
            targets = [ast.Attribute(value=t, attr="?") for t in targets]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            root = t
            while isinstance(root, ast.Attribute):
                root = root.value
            if t is not root and isinstance(root, ast.Name) and root.id in imported:
                hits.append(f"line {node.lineno}: {root.id} (from {imported[root.id]})")
    assert not hits, f"{name} assigns to what another module defines: {'; '.join(hits)}"


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
    tree = _tree(name)
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
