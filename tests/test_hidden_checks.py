"""No check that cannot fail: a static scan of every notebook's code cells, every test file,
attnlib, the benchmarks and the scripts.

A check hides when Python never evaluates it, or evaluates it and throws the answer away:

- ``assert_close(a, b) and assert_close(c, d)``: ``assert_close`` returns ``None``, so the
  second call never runs (chapter 1 had one); any boolean operation over calls, as a
  statement, is refused;
- a bare comparison or predicate as a statement: ``x == y``, ``torch.allclose(a, b)``,
  ``all(...)``, ``t.any()``; nothing looks at the result;
- an ``assert`` that cannot fail: on a non-empty tuple (``assert (x, "message")``), a
  constant, a list, set or dict display or comprehension, a generator, a lambda or f-string,
  or a predicate named but not called (``assert torch.equal``);
- an ``assert_*`` call whose ``None`` is used as a truth value (``if assert_close(...)``,
  ``not assert_close(...)``, ``assert_close(...) or ...``) or that is named but not called;
- an ``except AssertionError`` (or ``Exception``, or a bare ``except``) whose body only
  passes, around code that asserts.

Each rule has a planted snippet below that it must catch, and a legitimate form it must let
through.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Calls that answer a question and change nothing: their result must be used.
PREDICATES = frozenset({"all", "any", "allclose", "isclose", "equal", "array_equal", "array_equiv",
                        "isfinite", "isnan", "isinf", "issubset", "issuperset", "startswith",
                        "endswith", "isinstance", "issubclass", "callable", "hasattr"})
SWALLOWING = frozenset({"AssertionError", "Exception", "BaseException"})


def _name(node: ast.AST) -> str | None:
    """The last name of ``f``, ``mod.f`` or ``obj.f``; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _called(node: ast.AST) -> str | None:
    return _name(node.func) if isinstance(node, ast.Call) else None


def _is_assert_call(node: ast.AST) -> bool:
    name = _called(node)
    return name is not None and name.startswith("assert_")


def _calls_inside(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) for n in ast.walk(node))


def _always_true(test: ast.expr) -> str | None:
    """Why an assert on ``test`` cannot fail, or None."""
    if isinstance(test, ast.Tuple) and test.elts:
        return "an assert on a non-empty tuple is always true (assert (x, 'msg') means assert x, 'msg')"
    if isinstance(test, ast.Constant) and test.value:
        return "an assert on a true constant"
    if isinstance(test, (ast.List, ast.Set, ast.Dict)) and (test.keys if isinstance(test, ast.Dict) else test.elts):
        return "an assert on a non-empty display is always true"
    if isinstance(test, (ast.ListComp, ast.SetComp, ast.DictComp)):
        return "an assert on a comprehension tests whether it is empty, not its elements (use all(...))"
    if isinstance(test, (ast.GeneratorExp, ast.Lambda, ast.JoinedStr)):
        return "an assert on a generator, lambda or f-string is always true"
    if isinstance(test, (ast.Name, ast.Attribute)) and _name(test) in PREDICATES | {"assert_close"}:
        return f"{_name(test)} is named but not called: the function object is always true"
    return None


def _swallows_asserts(handler: ast.ExceptHandler, body: list[ast.stmt]) -> bool:
    caught = handler.type
    names = ([_name(e) for e in caught.elts] if isinstance(caught, ast.Tuple)
             else [None if caught is None else _name(caught)])
    catches = caught is None or any(n in SWALLOWING for n in names)
    passes = all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                 for s in handler.body)
    asserts = any(isinstance(n, ast.Assert) or _is_assert_call(n) for s in body for n in ast.walk(s))
    return catches and passes and asserts


def hidden_checks(source: str) -> list[tuple[int, str]]:
    """``(line, reason)`` for every statement of ``source`` that hides a check."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr):
            value = node.value
            if isinstance(value, ast.BoolOp) and _calls_inside(value):
                found.append((node.lineno, "a boolean operation over calls as a statement: "
                                           "the later operands may never run; write one statement each"))
            elif isinstance(value, ast.Compare):
                found.append((node.lineno, "a bare comparison as a statement checks nothing: assert it"))
            elif isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.Not):
                found.append((node.lineno, "a bare 'not ...' as a statement checks nothing"))
            elif _called(value) in PREDICATES:
                found.append((node.lineno, f"{_called(value)}(...) as a statement: its answer is thrown away"))
            elif isinstance(value, ast.Tuple) and any(
                    isinstance(e, ast.Compare) or _called(e) in PREDICATES for e in value.elts):
                found.append((node.lineno, "a tuple of comparisons as a statement checks nothing"))
            elif isinstance(value, (ast.Name, ast.Attribute)) and (_name(value) or "").startswith("assert_"):
                found.append((node.lineno, f"{_name(value)} named but not called"))
        elif isinstance(node, ast.Assert):
            reason = _always_true(node.test)
            if reason:
                found.append((node.lineno, reason))
        elif isinstance(node, ast.Try):
            for handler in node.handlers:
                if _swallows_asserts(handler, node.body):
                    found.append((handler.lineno, "an except clause that passes swallows the asserts it wraps"))
        # an assert_* call (which returns None or a bound) used as a truth value
        tests: list[ast.expr] = []
        if isinstance(node, ast.BoolOp):
            tests = list(node.values)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            tests = [node.operand]
        elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
            tests = [node.test]
        for t in tests:
            if _is_assert_call(t):
                found.append((t.lineno, f"{_called(t)}(...) used as a truth value: it raises or returns, "
                                        "its result is not the check"))
    return sorted(set(found))


def _notebook_cells(path: Path) -> list[tuple[int, str]]:
    """``(cell index, source)`` of each code cell, IPython's magic and shell lines made ``pass``."""
    cells = json.loads(path.read_text())["cells"]
    return [(i, re.sub(r"^(\s*)[%!].*$", r"\1pass", "".join(c["source"]), flags=re.M))
            for i, c in enumerate(cells) if c["cell_type"] == "code"]


def _sources() -> list[tuple[str, str]]:
    files = sorted({*ROOT.glob("tests/*.py"), ROOT / "conftest.py", *ROOT.glob("attnlib/**/*.py"),
                    *ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")})
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in files]
    for nb in sorted(ROOT.glob("chapters/*.ipynb")):
        out.extend((f"{nb.relative_to(ROOT)} cell {i}", src) for i, src in _notebook_cells(nb))
    return out


def test_no_check_hides_in_the_book_tests_or_library() -> None:
    sources = _sources()
    assert len([s for s in sources if "cell" in s[0]]) > 100  # the notebooks were read
    assert any(label.startswith("attnlib/") for label, _ in sources)
    problems = [f"{label}, line {line}: {why}" for label, src in sources for line, why in hidden_checks(src)]
    assert not problems, "checks that cannot fail:\n" + "\n".join(problems)


# ---- each rule catches its planted form, and lets the legitimate one through -----------------

PLANTED = [
    ("assert_close(a, b) and assert_close(c, d)", "boolean operation over calls"),
    ("torch.testing.assert_close(a, b) or print('x')", "boolean operation over calls"),
    ("check(a) and check(b) and check(c)", "boolean operation over calls"),
    ("x == y", "bare comparison"),
    ("out.shape == (2, 3)", "bare comparison"),
    ("not torch.equal(a, b)", "bare 'not"),
    ("all(v > 0 for v in values)", "all(...) as a statement"),
    ("any(flags)", "any(...) as a statement"),
    ("torch.allclose(a, b)", "allclose(...) as a statement"),
    ("(a - b).abs().max().isclose(c)", "isclose(...) as a statement"),
    ("mask.all()", "all(...) as a statement"),
    ("x == y, 'they differ'", "tuple of comparisons"),
    ("assert (x == y, 'they differ')", "non-empty tuple"),
    ("assert True", "true constant"),
    ("assert 'remember to check this'", "true constant"),
    ("assert [v > 0 for v in values]", "comprehension"),
    ("assert [x, y]", "non-empty display"),
    ("assert (v > 0 for v in values)", "generator"),
    ("assert f'{x} == {y}'", "f-string"),
    ("assert torch.equal", "named but not called"),
    ("torch.testing.assert_close", "named but not called"),
    ("if assert_close(a, b):\n    print('same')", "used as a truth value"),
    ("ok = not torch.testing.assert_close(a, b)", "used as a truth value"),
    ("ok = assert_close(a, b) or fallback()", "used as a truth value"),
    ("y = 1 if assert_rounding_close(a, b, 4) else 0", "used as a truth value"),
    ("try:\n    assert x == y\nexcept AssertionError:\n    pass", "swallows"),
    ("try:\n    assert_close(a, b)\nexcept Exception:\n    ...", "swallows"),
    ("try:\n    assert x\nexcept:\n    pass", "swallows"),
]

LEGITIMATE = [
    "assert_close(a, b)\nassert_close(c, d)",
    "assert x == y, 'they differ'",
    "assert all(v > 0 for v in values)",
    "assert torch.equal(a, b) and torch.equal(c, d)",  # an assert evaluates every operand it needs
    "ok = torch.allclose(a, b) and a.shape == b.shape",
    "bound = assert_rounding_close(a, b, 4)",
    "assert False, 'unreachable'",
    "x = [v for v in values if v and check(v)]",
    "with pytest.raises(AssertionError):\n    assert_close(a, b + 1)",
    "try:\n    assert_close(a, b)\nexcept AssertionError:\n    refused = True",
    "try:\n    value = parse(s)\nexcept ValueError:\n    pass",
    "if torch.equal(a, b):\n    print('same')",
    "value = cache.get(k) or compute(k)",
    "print(x == y)",
]


@pytest.mark.parametrize("snippet, reason", PLANTED)
def test_each_planted_hidden_check_is_caught(snippet: str, reason: str) -> None:
    found = hidden_checks(snippet)
    assert found, f"not caught: {snippet!r}"
    assert any(reason in why for _, why in found), found


@pytest.mark.parametrize("snippet", LEGITIMATE)
def test_legitimate_checks_pass(snippet: str) -> None:
    assert hidden_checks(snippet) == []


def test_the_chapter_1_pattern_is_caught_in_a_notebook(tmp_path: Path) -> None:
    """The form that hid a check in chapter 1, planted in a notebook with a magic line: the
    scan reads notebooks as the book's test does."""
    nb = {"cells": [{"cell_type": "code", "source": ["%matplotlib inline\n",
                                                      "assert_close(rotated @ W_K, K) and assert_close(rotated @ W_V, V)\n"]},
                    {"cell_type": "markdown", "source": ["x == y"]}]}
    path = tmp_path / "planted.ipynb"
    path.write_text(json.dumps(nb))
    (index, src), = _notebook_cells(path)
    found = hidden_checks(src)
    assert index == 0 and {line for line, _ in found} == {2}
    assert any("boolean operation over calls" in why for _, why in found)

