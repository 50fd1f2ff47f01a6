"""Mutation testing of attnlib's core modules with mutmut (``make mutants``).

mutmut (3.x) changes one small thing at a time in a module (a ``<`` for a ``<=``, a
dropped argument, a constant plus one, a string rewritten) and runs the tests that call
the changed function; a *mutant* that no test notices *survived*. This script runs it
module by module, each against the fast unit tests that exercise that module (``MODULES``
below; not the notebooks, not the browser tests), and sorts the survivors:

- **message-only**: the change is inside the message of an exception (a string, or the
  whole message replaced), or in the name an argument check prints; the exception's type
  and every computed value stay the same; or listed in CONTRIBUTING.md ("Message-only
  mutants"), where the change reaches only a message by a path this script does not follow
  (a placeholder that only a message prints). These may survive, counted.
- **equivalent**: listed in CONTRIBUTING.md ("Equivalent mutants"), each with the reason
  why no input can tell it from the original.
- **value-changing**: every other survivor, and every mutant of a function that no
  selected test calls. These need a test.

Each module runs in a folder of its own, ``.mutants/<module>/``, whose ``attnlib``,
``tests`` and ``conftest.py`` are links to this checkout's; mutmut copies them into its
``mutants/`` folder there and runs pytest from that copy. attnlib is *not* installed in
the environment that runs this script (``make mutants`` builds ``.venv-mutants`` from
requirements.txt without its ``-e .`` line), so ``import attnlib`` can only find the
mutated copy: the script checks that before each module, and mutmut checks it again by
making every mutated function raise and requiring the tests to fail.

Usage (from the repository root, in the environment ``make mutants`` builds)::

    python scripts/mutants.py                     # every module, from scratch
    python scripts/mutants.py attention rounding  # some modules
    python scripts/mutants.py --resume attention  # keep earlier verdicts; retest survivors
    python scripts/mutants.py --report            # only summarise the last run

It writes ``.mutants/summary.md`` (the counts) and ``.mutants/survivors.md`` (the
value-changing survivors, with their diffs), and exits 1 if a module kills fewer than
``GOAL`` of its value-changing mutants.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutants"
GOAL = 0.90  # share of the value-changing mutants each module must kill

# module (its path under attnlib/, without .py): the unit test files that exercise it.
# mutmut runs, for each mutant, only those of these tests that call the mutated function,
# the fastest first, and stops at the first failure.
MODULES: dict[str, list[str]] = {
    "checks": ["tests/test_core.py", "tests/test_refusals.py", "tests/test_values_checks.py"],
    "rounding": ["tests/test_core.py", "tests/test_values_rounding.py"],
    "records": ["tests/test_core.py", "tests/test_interop_torch.py"],
    "attention": ["tests/test_attention.py", "tests/test_values_attention.py"],
    "multihead": ["tests/test_multihead.py", "tests/test_interop_torch.py", "tests/test_values_multihead.py"],
    "interop/torch_mha": ["tests/test_interop_torch.py"],
    "lowrank/factored": ["tests/test_lowrank.py", "tests/test_values_factored.py"],
    "interop/layouts": ["tests/test_interop_layouts.py", "tests/test_interop_readers.py",
                        "tests/test_interop_torch.py", "tests/test_values_layouts.py"],
    "decoding/cache": ["tests/test_decoding.py", "tests/test_values_cache.py"],
    "decoding/grouped": ["tests/test_multihead_decoding.py", "tests/test_decoding.py",
                         "tests/test_values_grouped.py"],
    "decoding/rope": ["tests/test_positions.py", "tests/test_decoding.py", "tests/test_values_rope.py"],
    "decoding/positions": ["tests/test_positions.py", "tests/test_values_positions.py"],
    "blockwise": ["tests/test_blockwise.py", "tests/test_blockwise_bounds.py", "tests/test_values_blockwise.py"],
    "blockwise_bounds": ["tests/test_blockwise.py", "tests/test_blockwise_bounds.py", "tests/test_blockwise_io.py",
                         "tests/test_values_blockwise.py"],
    "induction/composition": ["tests/test_induction.py"],
    "audit/catalogue": ["tests/test_audit.py"],
    "audit/search": ["tests/test_audit.py", "tests/test_audit_foreign.py"],
}

# The exit codes mutmut stores (mutmut.stats.status_by_exit_code), by what they mean here.
KILLED = {1, 3}
TIMEOUT = {36, 24, -24, 152, 255}
SURVIVED = {0}
NO_TESTS = {5, 33}

# attnlib.checks' helpers (and plain_view): the positions and keywords of the arguments that
# only name things in an error message (the argument's name, what was expected, what a size counts).
MESSAGE_ARGS: dict[str, tuple[set[int], set[str]]] = {
    "check_tensor": ({0}, {"name"}),
    "check_dtype": ({0}, {"name"}),
    "check_int": ({0, 2}, {"name", "expected"}),
    "check_positive_int": ({0}, {"name"}),
    "check_width": ({0}, {"name", "why"}),
    "check_index": ({0, 3}, {"name", "what"}),
    "check_mask": ({2}, {"name"}),
    "check_head_mask": ({2}, {"name"}),
    # attnlib.multihead.plain_view(module, name, user): name and user only appear in its messages
    "plain_view": ({1, 2}, {"name", "user"}),
}
EQUIVALENTS_FILE = ROOT / "CONTRIBUTING.md"
EQUIVALENT_LINE = re.compile(r"^- `(?P<path>attnlib/[\w/]+\.py)` `(?P<func>[\w.]+)`: "
                             r"`(?P<old>.*?)` → `(?P<new>.*?)`(?:: (?P<why>.*))?$")


def _slug(module: str) -> str:
    return module.replace("/", ".")


def _squash(code: str) -> str:
    return re.sub(r"\s+", "", code)


# ---- preparing a module's folder and running mutmut ---------------------------------------
def _pyproject(module: str, tests: list[str]) -> str:
    """The checkout's pyproject.toml, with pytest's addopts cut to what a mutant run wants
    (no xdist, no notebooks) and a [tool.mutmut] table for this module."""
    text = (ROOT / "pyproject.toml").read_text()
    text, n = re.subn(r'(?m)^addopts = .*$', 'addopts = "-p no:cacheprovider"', text)
    assert n == 1, "pyproject.toml: expected one addopts line under [tool.pytest.ini_options]"
    assert "[tool.mutmut]" not in text
    listed = lambda xs: "[" + ", ".join(json.dumps(x) for x in xs) + "]"  # noqa: E731
    # timeout_constant: mutmut stops a mutant after 15 x (its tests' time + this) seconds of
    # wall time; its default of 1 s gives false timeouts on a machine shared with others.
    # no:unraisableexception, no:threadexception: each of them runs gc.collect() at the end
    # of every pytest session, which takes 0.4 s with torch loaded, four times the cost of
    # a typical mutant; they only turn exceptions in __del__ or threads into warnings.
    return text + f"""
[tool.mutmut]
source_paths = ["attnlib"]
only_mutate = ["attnlib/{module}.py"]
pytest_add_cli_args = ["-p", "no:xdist", "-p", "no:nbval", "-p", "no:unraisableexception",
                       "-p", "no:threadexception", "--hypothesis-profile=mutants"]
pytest_add_cli_args_test_selection = {listed(tests)}
also_copy = ["conftest.py"]
process_isolation = "forkserver"
use_git_change_detection = false
timeout_constant = 10.0
"""


def prepare(module: str, fresh: bool) -> Path:
    tests = MODULES[module]
    work = WORK / _slug(module)
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for name in ("attnlib", "tests", "conftest.py"):
        link = work / name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(ROOT / name, work))
    (work / "pyproject.toml").write_text(_pyproject(module, tests))
    return work


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the checkout must not be importable, only mutmut's copy
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CI="", HYPOTHESIS_PROFILE="mutants")
    return env


def check_isolation(work: Path) -> None:
    """attnlib must not be importable from this environment except as mutmut's copy."""
    found = subprocess.run([sys.executable, "-c", "import importlib.util as u; s = u.find_spec('attnlib');"
                            "print(s.origin if s else '')"], cwd="/", env=_env(),
                           capture_output=True, text=True, check=True).stdout.strip()
    if found:
        sys.exit(f"attnlib is installed in this environment ({found}): the mutants would test it, "
                 f"not mutmut's copy. Run this script with the environment `make mutants` builds.")
    copy = work / "mutants"
    if copy.exists():
        origin = subprocess.run([sys.executable, "-c", "import attnlib; print(attnlib.__file__)"], cwd=copy,
                                env=_env(), capture_output=True, text=True, check=True).stdout.strip()
        if Path(origin).resolve().parent != (copy / "attnlib").resolve():
            sys.exit(f"import attnlib from {copy} found {origin}, not mutmut's copy")


def run_mutmut(work: Path, jobs: int, names: list[str]) -> int:
    mutmut = Path(sys.executable).with_name("mutmut")
    cmd = [str(mutmut), "run", "--max-children", str(jobs), *names]
    log = work / "mutmut.log"
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd[:4])} ({len(names)} named)\n")
        out.flush()
        return subprocess.run(cmd, cwd=work, env=_env(), stdout=out, stderr=subprocess.STDOUT).returncode


# ---- reading and sorting the verdicts ---------------------------------------------------
@dataclass
class Mutant:
    name: str
    exit_code: int | None
    function: str = ""  # Class.method or function
    old: str = ""  # the changed source line(s) ...
    new: str = ""  # ... and what the mutant has there
    kind: str = ""  # killed | timeout | message | equivalent | value | not checked | other
    reason: str = ""


@dataclass
class Counts:
    module: str
    mutants: list[Mutant] = field(default_factory=list)

    def n(self, kind: str) -> int:
        return sum(m.kind == kind for m in self.mutants)

    @property
    def rate(self) -> float:
        """Killed (timeouts included) over the mutants that change a value."""
        changing = len(self.mutants) - self.n("message") - self.n("equivalent") - self.n("not checked")
        return (self.n("killed") + self.n("timeout")) / changing if changing else 1.0


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}


def _first_difference(a: ast.AST, b: ast.AST, path: list[ast.AST]) -> tuple[list[ast.AST], object, object]:
    """The innermost pair of nodes where two trees differ, and the nodes above it in ``a``."""
    if type(a) is not type(b) or not isinstance(a, ast.AST):
        return path, a, b
    for name in a._fields:
        if name == "name" and isinstance(a, ast.FunctionDef):
            continue  # the mutant's own name
        x, y = getattr(a, name, None), getattr(b, name, None)
        if isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                return path + [a], x, y  # an element removed (an argument)
            for u, v in zip(x, y):
                if ast.dump(u) != ast.dump(v) if isinstance(u, ast.AST) else u != v:
                    return _first_difference(u, v, path + [a])
        elif isinstance(x, ast.AST) and isinstance(y, ast.AST):
            if ast.dump(x) != ast.dump(y):
                return _first_difference(x, y, path + [a])
        elif x != y and name not in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
            return path, a, b  # a value of this node (a constant) changed
    return path, a, b


def _is_message_only(path: list[ast.AST], old: object, new: object) -> bool:
    """The change touches only the text of an error message (module docstring)."""

    def string_or_gone(o: object, n: object) -> bool:  # a string changed, or replaced by None
        return isinstance(o, ast.Constant) and isinstance(o.value, str) and (
            isinstance(n, ast.Constant) and (isinstance(n.value, str) or n.value is None))

    raises = [i for i, node in enumerate(path) if isinstance(node, ast.Raise)]
    if raises:
        i = raises[-1]
        exc = path[i + 1] if i + 1 < len(path) else None
        if not isinstance(exc, ast.Call):
            return False
        if exc is path[-1] and isinstance(old, list):
            return True  # an argument of the exception removed: Error() has no message
        inner = path[i + 2:]
        if not inner:  # the argument itself changed, directly under the exception's call
            return string_or_gone(old, new) or (isinstance(new, ast.Constant) and new.value is None)
        if string_or_gone(old, new):
            return True
        if any(isinstance(node, ast.JoinedStr) for node in inner):
            # inside an f-string: an operator or a number changed, or type()/repr()/str() of None
            if isinstance(old, ast.operator | ast.cmpop | ast.unaryop | ast.boolop):
                return True
            if isinstance(old, ast.Constant) and isinstance(old.value, int | float):
                return True
            call = path[-1]
            return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id in ("type", "repr", "str") and isinstance(new, ast.Constant))
        return False
    # a name or a description handed to one of attnlib.checks' helpers
    call = next((node for node in reversed(path) if isinstance(node, ast.Call)), None)
    if call is None or not isinstance(call.func, ast.Name) or call.func.id not in MESSAGE_ARGS:
        return False
    positions, keywords = MESSAGE_ARGS[call.func.id]
    if not string_or_gone(old, new):
        return False
    assert isinstance(old, ast.AST)
    return (any(old is arg for i, arg in enumerate(call.args) if i in positions)
            or any(old is kw.value for kw in call.keywords if kw.arg in keywords))


def _lines(source: list[str], f: ast.FunctionDef) -> list[str]:
    """The function's source lines without its docstring."""
    assert f.end_lineno is not None
    lines = list(range(f.lineno - 1, f.end_lineno))
    first = f.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        assert first.end_lineno is not None
        lines = [i for i in lines if not first.lineno - 1 <= i < first.end_lineno]
    return [source[i] for i in lines]


def _signature_line(line: str) -> str:
    return re.sub(r"def \S+?__mutmut_\w+\(", "def (", line)


def load_equivalents() -> dict[tuple[str, str, str, str], tuple[str, str]]:
    """The mutants CONTRIBUTING.md lists, by (path, function, old, new): ``("equivalent", why)``
    under its heading "Equivalent mutants", ``("message", why)`` under "Message-only mutants"
    (a change that reaches only an exception's message, by a path the sorter cannot follow)."""
    out = {}
    kind = ""
    for line in EQUIVALENTS_FILE.read_text().splitlines():
        if line.startswith("#"):
            kind = ("equivalent" if "Equivalent mutants" in line else
                    "message" if "Message-only mutants" in line else "")
            continue
        m = EQUIVALENT_LINE.match(line)
        if m and kind:
            out[(m["path"], m["func"], _squash(m["old"]), _squash(m["new"]))] = (kind, m["why"] or "")
    return out


def classify(module: str, work: Path) -> Counts:
    rel = f"attnlib/{module}.py"
    meta = work / "mutants" / (rel + ".meta")
    counts = Counts(module)
    if not meta.exists():
        return counts
    codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
    text = (work / "mutants" / rel).read_text()
    tree, source = ast.parse(text), text.splitlines()
    functions = _functions(tree)
    equivalents = load_equivalents()
    for name, code in sorted(codes.items()):
        m = Mutant(name, code)
        counts.mutants.append(m)
        mangled = name.rpartition(".")[2]
        base = mangled.partition("__mutmut_")[0]
        m.function = base[2:] if base.startswith("x_") else ".".join(base.split("ǁ")[1:])
        if code in KILLED:
            m.kind = "killed"
            continue
        if code in TIMEOUT:
            m.kind = "timeout"
            continue
        if code is None:
            m.kind = "not checked"
            continue
        orig, mutant = functions[base + "__mutmut_orig"], functions[mangled]
        a = [_signature_line(s) for s in _lines(source, orig)]
        b = [_signature_line(s) for s in _lines(source, mutant)]
        diff = list(difflib.ndiff(a, b))
        m.old = " ⏎ ".join(s[2:].strip() for s in diff if s.startswith("- "))
        m.new = " ⏎ ".join(s[2:].strip() for s in diff if s.startswith("+ "))
        key = (rel, m.function, _squash(m.old), _squash(m.new))
        if key in equivalents:
            m.kind, m.reason = equivalents[key]
        elif code in SURVIVED | NO_TESTS:
            path, old, new = _first_difference(orig, mutant, [])
            m.kind = "message" if _is_message_only(path, old, new) else "value"
            m.reason = "no selected test calls this function" if code in NO_TESTS else ""
        else:
            m.kind, m.reason = "other", f"mutmut exit code {code}"
    return counts


# ---- the report -------------------------------------------------------------------------
def report(all_counts: list[Counts], seconds: dict[str, float]) -> str:
    head = ("| module | mutants | killed | timeout | survived: value-changing | message-only | equivalent "
            "| other | not run | killed of value-changing | time |")
    rows = [head, "|" + " --- |" * 11]
    for c in all_counts:
        t = f"{seconds[c.module]:.0f} s" if c.module in seconds else ""
        rows.append(f"| {c.module} | {len(c.mutants)} | {c.n('killed')} | {c.n('timeout')} | {c.n('value')} "
                    f"| {c.n('message')} | {c.n('equivalent')} | {c.n('other')} | {c.n('not checked')} "
                    f"| {100 * c.rate:.1f} % | {t} |")
    return "\n".join(rows) + "\n"


def survivors(all_counts: list[Counts]) -> str:
    out = []
    for c in all_counts:
        for m in c.mutants:
            if m.kind in ("value", "other"):
                out.append(f"- `attnlib/{c.module}.py` `{m.function}`: `{m.old}` → `{m.new}`"
                           f" ({m.name}{', ' + m.reason if m.reason else ''})")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"some of: {', '.join(MODULES)} (default: all)")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MUTANTS_JOBS", "2")),
                        help="mutants run at once (mutmut's --max-children; default 2)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the verdicts of an earlier run; retest its survivors and timeouts")
    parser.add_argument("--report", action="store_true", help="only summarise the last run")
    args = parser.parse_args()
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {unknown}; choose from {list(MODULES)}")
    modules = args.modules or list(MODULES)
    seconds: dict[str, float] = {}
    for module in modules:
        if args.report:
            continue
        start = time.monotonic()
        work = prepare(module, fresh=not args.resume)
        check_isolation(work)
        rc = run_mutmut(work, args.jobs, [])  # new and changed mutants (all of them, when fresh)
        if rc == 0 and args.resume:
            retry = [m.name for m in classify(module, work).mutants if m.kind in ("value", "timeout", "other")]
            if retry:
                rc = run_mutmut(work, args.jobs, retry)
        check_isolation(work)
        seconds[module] = time.monotonic() - start
        print(f"{module}: mutmut exited {rc} after {seconds[module]:.0f} s (log: {work / 'mutmut.log'})",
              flush=True)
        if rc != 0:
            print((work / "mutmut.log").read_text()[-3000:])
            return rc
    all_counts = [classify(m, WORK / _slug(m)) for m in modules]
    table, left = report(all_counts, seconds), survivors(all_counts)
    (WORK / "summary.md").write_text(table)
    (WORK / "survivors.md").write_text(left)
    print(table)
    print(f"value-changing survivors: {WORK / 'survivors.md'}")
    below = [c.module for c in all_counts if c.rate < GOAL]
    if below:
        print(f"below the goal of {GOAL:.0%} killed: {', '.join(below)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
