"""The matching behind :func:`~attnlib.audit.diagnose`: does a recipe of the catalogue reproduce
a module's outputs on every probe, under some convention for the queries that read nothing?"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from attnlib.audit.catalogue import BUGS_BY_NAME, Recipe, active_bugs, active_pairs
from attnlib.audit.checks import relative_error
from attnlib.audit.engine import CONVENTIONS, ReferenceParams, run_recipe
from attnlib.audit.probes import Probe
from attnlib.audit.report import PADDED_ROWS

__all__ = [
    "Matcher", "Output", "Raised", "has_blocked_lines", "padded_rows", "recipes_of", "right_output", "rows_of",
    "shared_outputs",
]


class Raised:
    """A call that raised: the kind of error, for matching (a candidate must raise too)."""

    def __init__(self, err: BaseException) -> None:
        self.text = f"{type(err).__name__}: {err}"


Output = Tensor | Raised


def rows_of(t: Tensor, p: Probe) -> Tensor:
    """The compared rows of an output ``(B, n_q, d)``: all, or the real queries' ``(N, d)``."""
    return t if p.rows is None else t[p.rows]


RecipeOutputs = dict[tuple[Recipe, int], dict[str, Tensor] | Raised]
"""A recipe's outputs on each probe, by ``(recipe, probe index)``."""

SHARED_CALLS = 8
"""How many (reference, probes, call form) combinations :func:`shared_outputs` keeps."""

SHARED_BYTES = 64 * 2**20
"""At most this many bytes of outputs kept for the earlier combinations (a layer of width
256 fills about 3 MB)."""

_SHARED: OrderedDict[Hashable, RecipeOutputs] = OrderedDict()


def _content(t: Tensor | None) -> Hashable:
    """A tensor's content: dtype, device, shape and a 256-bit BLAKE2 digest of its bytes (not
    the bytes themselves: a large layer's weights would be copied into the key)."""
    if t is None:
        return None
    t = t.detach()
    digest = hashlib.blake2b(t.cpu().contiguous().numpy().data, digest_size=32).digest()
    return str(t.dtype), str(t.device), tuple(t.shape), digest


def _nbytes(table: RecipeOutputs) -> int:
    return sum(t.numel() * t.element_size() for outs in table.values() if isinstance(outs, dict)
               for t in outs.values())


def _outputs_key(w64: ReferenceParams, probes: Sequence[Probe], causal: bool, padding: bool) -> Hashable:
    """Everything :func:`~attnlib.audit.engine.run_recipe` reads besides the recipe: the weights
    and biases by value, the reference's options, each probe's inputs by value, the call form,
    and the global settings that change its arithmetic (torch's default dtype, autocast)."""
    device = w64.w["q"].device.type
    autocast = torch.is_autocast_enabled(device) and str(torch.get_autocast_dtype(device))
    return (
        tuple((_content(w64.w[r]), _content(w64.b[r])) for r in "qkvo"),
        w64.num_heads, w64.num_kv_heads, w64.rope_base, w64.alibi,
        tuple((_content(p.x), _content(p.context), _content(p.mask)) for p in probes),
        causal, padding, str(torch.get_default_dtype()), autocast,
    )


def shared_outputs(w64: ReferenceParams, probes: Sequence[Probe], causal: bool, padding: bool) -> RecipeOutputs:
    """The recipe outputs already computed for these weights, probes and call form, to share
    between :func:`~attnlib.audit.diagnose` calls that audit several modules against one
    reference. Keyed by the tensors' exact values, not their identity: a reference whose
    weights changed in place gets a fresh (empty) table. The last :data:`SHARED_CALLS`
    combinations are kept, within :data:`SHARED_BYTES`."""
    key = _outputs_key(w64, probes, causal, padding)
    table = _SHARED.pop(key, {})
    _SHARED[key] = table  # the most recent last
    while len(_SHARED) > SHARED_CALLS or (len(_SHARED) > 1 and sum(map(_nbytes, _SHARED.values())) > SHARED_BYTES):
        _SHARED.popitem(last=False)  # the oldest first (over the bytes: never the one asked for)
    return table


class Matcher:
    """Does a recipe reproduce target outputs on every probe, for some blocked-line convention?

    ``cache``: the recipe outputs to start from and add to (:func:`shared_outputs`); a new
    table by default."""

    def __init__(
        self, w64: ReferenceParams, probes: list[Probe], causal: bool, padding: bool, rtol: float,
        every_row: bool = False, cache: RecipeOutputs | None = None,
    ) -> None:
        self.w64, self.probes, self.causal, self.padding, self.rtol = w64, probes, causal, padding, rtol
        self.every_row = every_row  # compare the padded queries' rows too
        self.cache: RecipeOutputs = {} if cache is None else cache

    def with_rtol(self, rtol: float, every_row: bool = False) -> Matcher:
        """The same matcher (sharing the computed outputs) at another tolerance."""
        return Matcher(self.w64, self.probes, self.causal, self.padding, rtol, every_row, self.cache)

    def outputs(self, r: Recipe, i: int) -> dict[str, Tensor] | Raised:
        key = (r, i)
        if key not in self.cache:
            p = self.probes[i]
            try:
                outs = run_recipe(r, self.w64, p.x, p.keys, p.mask, causal=self.causal, padding=self.padding)
                shape = next(iter(outs.values())).shape
                if shape != p.x.shape:  # e.g. no W^O with h*d_k != d_model: diagnose refuses that shape
                    raise ValueError(f"returns shape {tuple(shape)}, not {tuple(p.x.shape)}")
                self.cache[key] = outs
            except (RuntimeError, ValueError, IndexError) as err:  # the buggy code cannot run here
                self.cache[key] = Raised(err)
        return self.cache[key]

    def _error(self, target: Tensor, out: Tensor, i: int) -> float:
        p = self.probes[i]
        if self.every_row:
            return relative_error(target, out)
        return relative_error(rows_of(target, p), rows_of(out, p))

    def convention(self, r: Recipe, targets: Sequence[Output]) -> str | None:
        """The first convention under which ``r`` matches every target, or None."""
        alive = list(CONVENTIONS)
        for i, target in enumerate(targets):  # stop at the first probe that differs
            outs = self.outputs(r, i)
            if isinstance(target, Raised) or isinstance(outs, Raised):
                if not (isinstance(target, Raised) and isinstance(outs, Raised)):
                    return None
                continue
            if "any" in outs:  # no blocked line: one output for every convention
                alive = alive if self._error(target, outs["any"], i) <= self.rtol else []
            else:
                alive = [c for c in alive if self._error(target, outs[c], i) <= self.rtol]
            if not alive:
                return None
        return alive[0]

    def errors(self, r: Recipe, targets: Sequence[Output], convention: str) -> list[float]:
        out = []
        for i, target in enumerate(targets):
            outs = self.outputs(r, i)
            if isinstance(target, Raised) or isinstance(outs, Raised):
                out.append(0.0 if isinstance(target, Raised) and isinstance(outs, Raised) else math.inf)
            else:
                out.append(self._error(target, outs.get(convention, outs.get("any")), i))  # type: ignore[arg-type]
        return out

    def explanations(self, targets: Sequence[Output], modes: frozenset[str], pairs: bool) -> tuple[tuple[str, ...], ...]:
        """The single bugs that reproduce ``targets``; the pairs when no single one does."""
        found: tuple[tuple[str, ...], ...] = tuple(
            (b.name,) for b in active_bugs(modes) if any(self.convention(rc, targets) for rc in b.recipes()))
        if not found and pairs:
            found = tuple(
                (a.name, b.name) for a, b in active_pairs(modes)
                if any(self.convention(rb, targets) for ra in a.recipes() for rb in b.recipes(ra))
            )
        if len(found) > 1 and any(p.rows is not None for p in self.probes):
            # the padded queries' rows are a convention for a right module; between explanations
            # that the real rows cannot tell apart, those that fit the padded rows too come first
            every = self.with_rtol(self.rtol, every_row=True)
            closer = tuple(e for e in found if any(every.convention(r, targets) for r in recipes_of(e)))
            found = closer or found
        return found


def recipes_of(names: tuple[str, ...]) -> list[Recipe]:
    """Every recipe of an explanation: one bug's ways of being made, or a pair's combinations."""
    first = BUGS_BY_NAME[names[0]].recipes()
    if len(names) == 1:
        return list(first)
    return [rb for ra in first for rb in BUGS_BY_NAME[names[1]].recipes(ra)]


def right_output(outs: dict[str, Tensor] | Raised) -> Tensor:
    """The right layer's output (it never raises) with attnlib's zeros for blocked lines."""
    assert not isinstance(outs, Raised)
    return outs["any"] if "any" in outs else outs["zeros"]


def has_blocked_lines(m: Matcher) -> bool:
    """Has the right layer a query with no allowed key on some probe (padded queries aside)?"""
    for i, p in enumerate(m.probes):
        outs = m.outputs(Recipe(), i)
        if isinstance(outs, dict) and "any" not in outs:
            lines = rows_of(outs["NaN"].isnan().any(dim=-1), p)  # the queries that read nothing
            if bool(lines.any()):
                return True
    return False


def padded_rows(m: Matcher, yours: Sequence[Output]) -> str | None:
    """What your module returns for padded queries: a key of :data:`PADDED_ROWS`,
    ``"something else"``, or None when no probe has a padded query."""
    both = dataclasses.replace(Recipe(), padding="keys and queries")
    alive = list(PADDED_ROWS)
    seen = False
    for i, (p, y) in enumerate(zip(m.probes, yours)):
        if p.rows is None or not isinstance(y, Tensor):
            continue
        seen = True
        pad = ~p.rows  # (B, n_q): the padded queries
        right, outs = m.outputs(Recipe(), i), m.outputs(both, i)
        assert isinstance(right, dict) and isinstance(outs, dict)
        candidates = {"the real keys": right_output(right), "zero vectors": torch.zeros_like(y, dtype=torch.float64)}
        candidates.update({c: outs.get(c, outs.get("any")) for c in CONVENTIONS})  # type: ignore[misc]
        alive = [c for c in alive if relative_error(y[pad], candidates[c][pad]) <= m.rtol]
    if not seen:
        return None
    return alive[0] if alive else "something else"
