r"""Is my attention right? Check your own multi-head attention, and name its bug (chapter 9).

:func:`diagnose` runs your ``forward(x, mask)`` and an :class:`~attnlib.MultiHeadAttention`
holding the same weights on the same probe inputs and compares the outputs,

.. math::
    \mathrm{error} = \max_{\text{probes}} \frac{\max_{b,i,c} |y_{bic} - r_{bic}|}{\max_{b,i,c} |r_{bic}|},

with :math:`y` your output and :math:`r` the reference's. When they disagree it rebuilds
the layer with each bug of :data:`BUGS` planted, and with every pair of them, from the
reference's weights and attnlib's own :func:`~attnlib.attention.attention` and
:func:`~attnlib.attention.masked_softmax`, and reports the bugs whose outputs match yours.

The probes: self-attention on random inputs ``x: (B, n, d_model)`` of several batch sizes
and lengths, with no mask, a causal mask and random masks (bool ``(n, n)``, True = may
attend). Every row and every column of every probe mask holds at least one allowed and one
blocked entry, so that code which fills blocked scores with ``-inf`` and code which fills them
with a large negative number agree, also when the bug under test inverts the mask or
normalises over the wrong axis. The causal probe therefore uses a causal window of ``n - 1``
keys: the last query cannot see key 0.

A bug is one entry of the catalogue: a name, a description, the line to look for, the fix, the
steps of the computation it changes (fields of :class:`_Recipe`) and, for some, a note on where
else the fix may belong (in an adapter around another library's layer, or in the loading code).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch
from torch import Tensor

from attnlib.attention import attention, masked_softmax
from attnlib.multihead import MultiHeadAttention

__all__ = ["BUGS", "PAIRS", "Bug", "AuditReport", "Forward", "diagnose", "planted", "probe_inputs"]

Forward = Callable[[Tensor, Tensor | None], Tensor]
"""A learner's layer as ``forward(x, mask) -> out``: ``x: (B, n, d_model)``, ``mask``: bool
``(n, n)``, True = may attend, or ``None``; ``out: (B, n, d_model)``."""


@dataclass(frozen=True)
class _Recipe:
    """How a forward pass computes each step; the defaults are right."""

    # every projection, W^O included: x @ W (right) or x @ W.T
    projection: Literal["x @ W", "x @ W.T"] = "x @ W"
    # the layer that makes the values
    value_weights: Literal["W_v", "W_k"] = "W_v"
    # (B, n, d) -> (B, h, n, d_k)
    split: Literal["view, transpose", "view"] = "view, transpose"
    # the scores are divided by it
    scale: Literal["sqrt(d_k)", "1", "sqrt(d_model)"] = "sqrt(d_k)"
    # -1: each query's weights over the keys sum to 1; -2: over the queries
    softmax_dim: Literal[-1, -2] = -1
    # what True in the mask means
    mask_true: Literal["may attend", "blocked"] = "may attend"
    # how the mask is used
    mask_use: Literal["-inf", "ignored", "0", "after softmax"] = "-inf"
    # (B, h, n, d_k) -> (B, n, d)
    merge: Literal["transpose, reshape", "reshape"] = "transpose, reshape"
    # multiply the concatenation by W^O (and add b^O)
    output_projection: bool = True

    def effective(self) -> _Recipe:
        """The same computation, with the fields it never reads set to their defaults."""
        if self.mask_use == "ignored":  # an ignored mask has no polarity
            return dataclasses.replace(self, mask_true="may attend")
        return self


@dataclass(frozen=True)
class Bug:
    """One mistake of the catalogue: what it is, where it lives, what it changes."""

    name: str
    description: str
    look_for: str  # the wrong line in its typical hand-written form
    fix: str  # the right line
    change: Mapping[str, object]  # the fields of _Recipe the mistake changes
    note: str = ""  # where else the fix may belong (an adapter, the loading code)

    def recipe(self, base: _Recipe | None = None) -> _Recipe:
        return dataclasses.replace(base or _Recipe(), **self.change)  # type: ignore[arg-type]


_CATALOGUE: tuple[Bug, ...] = (
    Bug(
        "missing_scale",
        "scores not divided by √d_k",
        "scores = q @ k.transpose(-2, -1)",
        "scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)",
        {"scale": "1"},
    ),
    Bug(
        "scale_by_d_model",
        "scores divided by √d_model instead of √d_k",
        "scores = q @ k.transpose(-2, -1) / math.sqrt(d_model)",
        "scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)",
        {"scale": "sqrt(d_model)"},
    ),
    Bug(
        "softmax_wrong_axis",
        "softmax normalised over the queries (dim=-2) instead of the keys",
        "weights = scores.softmax(dim=-2)",
        "weights = scores.softmax(dim=-1)   # over the keys",
        {"softmax_dim": -2},
    ),
    Bug(
        "split_without_transpose",
        "(B, n, d) viewed as (B, h, n, d_k) directly",
        "q = q.view(B, h, n, d_k)",
        "q = q.view(B, n, h, d_k).transpose(1, 2)",
        {"split": "view"},
    ),
    Bug(
        "merge_without_transpose",
        "heads (B, h, n, d_k) reshaped to (B, n, d) without transposing back",
        "out = heads.reshape(B, n, d_model)",
        "out = heads.transpose(1, 2).reshape(B, n, d_model)",
        {"merge": "reshape"},
    ),
    Bug(
        "mask_inverted",
        "True in the mask treated as blocked",
        "scores = scores.masked_fill(mask, float('-inf'))",
        "scores = scores.masked_fill(~mask, float('-inf'))",
        {"mask_true": "blocked"},
        "auditing another library's layer through an adapter, the slip is usually the adapter's: "
        "convert the mask there (torch's attn_mask takes True = blocked: pass ~mask).",
    ),
    Bug(
        "mask_ignored",
        "the mask not applied (e.g. masked_fill's result thrown away)",
        "scores.masked_fill(~mask, float('-inf'))   # result not assigned",
        "scores = scores.masked_fill(~mask, float('-inf'))",
        {"mask_use": "ignored"},
    ),
    Bug(
        "missing_output_projection",
        "the concatenated heads returned without W^O",
        "return heads.transpose(1, 2).reshape(B, n, d_model)",
        "return self.W_o(heads.transpose(1, 2).reshape(B, n, d_model))",
        {"output_projection": False},
        "auditing another library's layer through an adapter, the adapter may have left out the "
        "library's output layer (BERT keeps W^O in BertSelfOutput's dense layer): apply it there.",
    ),
    Bug(
        "weights_transposed",
        "every projection applied as x @ Wᵀ instead of x @ W",
        "layer.weight.copy_(W)   # or: x @ W.T",
        "layer.weight.copy_(W.T)   # nn.Linear computes x @ weight.T",
        {"projection": "x @ W.T"},
        "a wrong load is seen only against a reference built from the weights you loaded from; "
        "a reference read back from the module holds the same transposed weights and passes it.",
    ),
    Bug(
        "mask_fill_zero",
        "blocked scores set to 0 instead of -inf, so blocked keys keep weight",
        "scores = scores.masked_fill(~mask, 0)",
        "scores = scores.masked_fill(~mask, float('-inf'))",
        {"mask_use": "0"},
    ),
    Bug(
        "mask_after_softmax",
        "blocked weights zeroed after the softmax, so the rows no longer sum to 1",
        "weights = scores.softmax(dim=-1).masked_fill(~mask, 0)",
        "weights = scores.masked_fill(~mask, float('-inf')).softmax(dim=-1)",
        {"mask_use": "after softmax"},
    ),
    Bug(
        "value_uses_key_weights",
        "values projected with the key layer (a copy-paste slip)",
        "v = self.W_k(x)",
        "v = self.W_v(x)",
        {"value_weights": "W_k"},
    ),
)

_BY_NAME: Mapping[str, Bug] = MappingProxyType({b.name: b for b in _CATALOGUE})

BUGS: Mapping[str, str] = MappingProxyType({b.name: b.description for b in _CATALOGUE})
"""The catalogue: bug name -> one-line description (read-only)."""


def _compatible(a: Bug, b: Bug) -> bool:
    """Two bugs can be planted together when they change different steps."""
    return not set(a.change) & set(b.change)


_SINGLES = {b.recipe().effective() for b in _CATALOGUE}

_PAIRS: tuple[tuple[Bug, Bug], ...] = tuple(
    (a, b)
    for a, b in itertools.combinations(_CATALOGUE, 2)
    if _compatible(a, b) and b.recipe(a.recipe()).effective() not in _SINGLES
)


PAIRS: tuple[tuple[str, str], ...] = tuple((a.name, b.name) for a, b in _PAIRS)
"""The pairs of bugs :func:`diagnose` tries: every two that change different steps, except a
pair that computes what one bug computes alone (``mask_inverted`` with ``mask_ignored``: an
ignored mask has no polarity)."""


# ---- the (possibly buggy) layer, built from attnlib's pieces ---------------------


@dataclass(frozen=True)
class _Weights:
    """The reference's parameters (detached), paper orientation; biases may be None."""

    w: Mapping[str, Tensor]  # "q", "k", "v", "o": (d_model, d_model)
    b: Mapping[str, Tensor | None]  # (d_model,) or None
    num_heads: int

    @classmethod
    def of(cls, ref: MultiHeadAttention, dtype: torch.dtype) -> _Weights:
        w = {r: getattr(ref, f"w_{r}").detach().to(dtype) for r in "qkvo"}
        b = {r: _opt(getattr(ref, f"b_{r}"), dtype) for r in "qkvo"}
        return cls(w, b, ref.num_heads)


def _opt(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.detach().to(dtype)


def _project(x: Tensor, w: Tensor, b: Tensor | None, recipe: _Recipe) -> Tensor:
    """``x @ W + b`` (or the buggy ``x @ W.T + b``): ``(B, n, d) -> (B, n, d)``."""
    y = x @ (w if recipe.projection == "x @ W" else w.T)  # (B, n, d)
    return y if b is None else y + b


def _qkv(x: Tensor, p: _Weights, recipe: _Recipe) -> tuple[Tensor, Tensor, Tensor]:
    """The three projections ``(B, n, d)`` each, before the split into heads."""
    v_role = "v" if recipe.value_weights == "W_v" else "k"
    return (
        _project(x, p.w["q"], p.b["q"], recipe),
        _project(x, p.w["k"], p.b["k"], recipe),
        _project(x, p.w[v_role], p.b[v_role], recipe),
    )


def _split(t: Tensor, h: int, recipe: _Recipe) -> Tensor:
    """``(B, n, d) -> (B, h, n, d_k)``."""
    B, n, d = t.shape
    if recipe.split == "view":
        return t.reshape(B, h, n, d // h)  # positions and heads mixed up
    return t.view(B, n, h, d // h).transpose(1, 2)  # (B, h, n, d_k)


def _heads(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
    d_model: int, r: _Recipe,
) -> Tensor:
    """Every head's output ``(B, h, n, d_k)``; ``q, k, v: (B, h, n, d_k)``."""
    scale = {
        "sqrt(d_k)": 1 / math.sqrt(q.shape[-1]),
        "1": 1.0,
        "sqrt(d_model)": 1 / math.sqrt(d_model),
    }[r.scale]
    if mask is not None and r.mask_true == "blocked":
        mask = ~mask
    if r.mask_use == "ignored":
        mask = None
    if r.softmax_dim == -1 and r.mask_use in ("-inf", "ignored"):
        return attention(q, k, v, mask=mask, scale=scale)[0]  # the right path
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, h, n, n)
    if mask is not None and r.mask_use == "0":
        scores, mask = scores.masked_fill(~mask, 0.0), None
    if mask is not None and r.mask_use == "after softmax":
        weights = masked_softmax(scores, None, dim=r.softmax_dim) * mask
    else:
        weights = masked_softmax(scores, mask, dim=r.softmax_dim)  # (B, h, n, n)
    return weights @ v  # (B, h, n, d_k)


def _finish(heads: Tensor, p: _Weights, recipe: _Recipe) -> Tensor:
    """Merge the heads ``(B, h, n, d_k) -> (B, n, d)`` and apply ``W^O`` (or not)."""
    B, h, n, d_k = heads.shape
    if recipe.merge == "reshape":
        concat = heads.reshape(B, n, h * d_k)  # heads and positions mixed up
    else:
        concat = heads.transpose(1, 2).reshape(B, n, h * d_k)  # (B, n, h*d_k)
    if not recipe.output_projection:
        return concat
    return _project(concat, p.w["o"], p.b["o"], recipe)  # (B, n, d_model)


def _run(recipe: _Recipe, p: _Weights, x: Tensor, mask: Tensor | None) -> Tensor:
    """The layer computed the way ``recipe`` says: ``x: (B, n, d) -> (B, n, d)``."""
    q, k, v = (_split(t, p.num_heads, recipe) for t in _qkv(x, p, recipe))  # (B, h, n, d_k)
    return _finish(_heads(q, k, v, mask, x.shape[-1], recipe), p, recipe)


def planted(reference: MultiHeadAttention, *bugs: str) -> Forward:
    """``forward(x, mask)``: ``reference``'s layer with the named bugs planted.

    ``x: (B, n, d_model)``, ``mask``: bool ``(n, n)`` or None, True = may attend. With no
    bug it computes ``reference(x, x, x, mask)[0]``. Bugs that change the same step
    (``missing_scale`` and ``scale_by_d_model``) cannot be planted together.
    """
    _check_reference(reference)
    recipe = _Recipe()
    for i, name in enumerate(bugs):
        if name not in _BY_NAME:
            raise ValueError(f"unknown bug {name!r}; the catalogue has: {', '.join(BUGS)}")
        for other in bugs[:i]:
            if not _compatible(_BY_NAME[other], _BY_NAME[name]):
                raise ValueError(f"bugs {other!r} and {name!r} change the same step; plant one of them")
        recipe = _BY_NAME[name].recipe(recipe)

    def forward(x: Tensor, mask: Tensor | None = None) -> Tensor:
        return _run(recipe, _Weights.of(reference, x.dtype), x, mask)

    return forward


# ---- probes ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Probe:
    kind: str  # "no mask" | "causal" | "random mask"
    x: Tensor  # (B, n, d_model)
    mask: Tensor | None  # (n, n), bool, True = may attend


# (kind, B, n): the masked probes come first, because they tell most bugs apart.
_PROBE_SIZES = (("random mask", 2, 5), ("causal", 3, 4), ("no mask", 2, 3), ("random mask", 1, 6), ("no mask", 1, 7))


def _probe_mask(kind: str, n: int, g: torch.Generator) -> Tensor | None:
    """Each row and each column holds at least one True and one False (``n >= 3``)."""
    if kind == "no mask":
        return None
    i = torch.arange(n)
    if kind == "causal":  # a causal window of n - 1 keys: key j visible to queries j .. j + n - 2
        return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < n - 1)  # (n, n)
    mask = torch.rand(n, n, generator=g) < 0.5  # (n, n)
    perm = torch.randperm(n, generator=g)
    mask[i, perm] = True  # row i may attend perm[i]: every row and column has a True
    mask[i, perm.roll(-1)] = False  # and is blocked from perm[i + 1]: every row and column has a False
    return mask


def _probes(d_model: int, dtype: torch.dtype, device: torch.device, seed: int) -> list[_Probe]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for kind, B, n in _PROBE_SIZES:
        x = torch.randn(B, n, d_model, generator=g, dtype=torch.float64)  # (B, n, d_model)
        mask = _probe_mask(kind, n, g)
        out.append(
            _Probe(kind, x.to(dtype=dtype, device=device), None if mask is None else mask.to(device))
        )
    return out


def probe_inputs(
    d_model: int, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[tuple[str, Tensor, Tensor | None]]:
    """The probes :func:`diagnose` uses: ``(kind, x, mask)`` with ``x: (B, n, d_model)`` and
    ``mask``: bool ``(n, n)`` (True = may attend) or ``None``; masked probes first."""
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
        raise ValueError(f"d_model must be a positive int, got {d_model!r}")
    return [(p.kind, p.x, p.mask) for p in _probes(d_model, dtype, torch.device("cpu"), seed)]


# ---- the report --------------------------------------------------------------------


@dataclass(frozen=True)
class AuditReport:
    """What :func:`diagnose` found.

    - ``ok``: your outputs match the reference's to within ``rtol`` on every probe.
    - ``bugs``: the explanation found (one bug or a pair) when exactly one fits; empty when
      ``ok``, when nothing in the catalogue explains your outputs, and when several
      explanations fit equally well (then read ``explanations``).
    - ``explanations``: every explanation of the smallest size that fits (more than one when
      the probes cannot tell the bugs apart for this reference; ``str(report)`` then gives the
      line to look for of each).
    - ``max_error``: the worst relative error over all probes (``inf`` for NaN or inf).
    - ``errors``: the worst relative error per kind of probe (``"no mask"``, ``"causal"``,
      ``"random mask"``).
    - ``undetectable``: bugs that compute the same numbers as the right layer for this
      reference (e.g. ``scale_by_d_model`` with one head), so no test with it can see them.
    """

    ok: bool
    bugs: tuple[str, ...]
    explanations: tuple[tuple[str, ...], ...]
    max_error: float
    errors: Mapping[str, float]
    undetectable: tuple[str, ...]
    rtol: float
    num_heads: int

    def __str__(self) -> str:
        if self.ok:
            lines = [f"OK: matches the reference to within {_fmt(self.rtol)} (relative) on every probe"]
        else:
            per_kind = ", ".join(f"{k} {_fmt(v) if v > self.rtol else 'ok'}" for k, v in self.errors.items())
            lines = [f"WRONG: worst relative error {_fmt(self.max_error)} ({per_kind})"]
        if self.undetectable:
            lines.append(
                f"note: with h = {self.num_heads} and these weights, these bugs compute the same "
                f"numbers as the right layer and cannot be seen: {', '.join(self.undetectable)}"
            )
        if self.ok:
            return _wrap(lines)
        if not self.explanations:
            lines.append("no bug of the catalogue, alone or in a pair, explains these numbers;")
            lines.append(_hint(self.errors, self.rtol))
            return _wrap(lines)
        several = len(self.explanations) > 1
        if several:
            alts = "; ".join(" + ".join(e) for e in self.explanations)
            lines.append(f"the probes cannot tell these explanations apart (look for each): {alts}")
        for i, explanation in enumerate(self.explanations, 1):
            for name in explanation:
                bug = _BY_NAME[name]
                lines.append(f"{f'({i}) ' if several else ''}bug {name}: {bug.description}")
                lines.append(f"  look for: {bug.look_for}")
                lines.append(f"  write:    {bug.fix}")
                if bug.note:
                    lines.extend(textwrap.wrap(bug.note, 78, initial_indent="  note: ", subsequent_indent="    "))
        return _wrap(lines)


def _wrap(lines: list[str], width: int = 78) -> str:
    """Lines of prose wrapped to ``width``; the code lines (indented) kept whole."""
    return "\n".join(
        line if line.startswith("  ") else textwrap.fill(line, width, subsequent_indent="  ")
        for line in lines
    )


def _fmt(e: float) -> str:
    return "inf" if math.isinf(e) else f"{e:.2g}"


def _hint(errors: Mapping[str, float], rtol: float) -> str:
    unmasked_ok = errors.get("no mask", math.inf) <= rtol
    if unmasked_ok:
        return "right without a mask, wrong with one: look at how the mask is applied."
    if any(math.isinf(e) for e in errors.values()):
        return "NaN or inf in your output: look for a softmax over a row of -inf, or an overflow."
    return (
        "wrong even without a mask, so not (only) the mask: compare your attention weights with "
        "reference(x, x, x, mask=mask)[1], of shape (B, h, n, n), then the other steps."
    )


# ---- diagnose ------------------------------------------------------------------------


def _rel_error(y: Tensor, r: Tensor) -> float:
    """``max |y - r| / max |r|``; ``inf`` where ``y`` is NaN or inf (``r`` is finite)."""
    diff = (y.to(torch.float64) - r.to(torch.float64)).abs()  # (B, n, d)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    scale = r.to(torch.float64).abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float(diff.max() / scale)


def _check_reference(reference: object) -> None:
    if not isinstance(reference, MultiHeadAttention):
        raise TypeError(
            f"reference must be an attnlib.MultiHeadAttention holding your weights, got {type(reference).__name__}"
        )


def _default_rtol(dtype: torch.dtype) -> float:
    """sqrt(machine epsilon): 3.5e-4 for float32, 1.5e-8 for float64, 0.03 for float16."""
    return math.sqrt(torch.finfo(dtype).eps)


def _call(forward: Forward, probe: _Probe, d_model: int) -> Tensor:
    x = probe.x.clone()
    mask = None if probe.mask is None else probe.mask.clone()
    where = f"forward(x, mask) with x of shape {tuple(x.shape)} (reference.d_model = {d_model}) and " + (
        "mask=None" if mask is None else f"a bool mask of shape {tuple(mask.shape)}"
    )
    try:
        with torch.no_grad():
            out = forward(x, mask)
    except Exception as err:  # the learner's code failed: say with which input
        raise ValueError(
            f"{where} raised {type(err).__name__}: {err}. Does reference have your module's width, "
            "and does your forward accept mask=None and a bool (n, n) mask, True = may attend?"
        ) from err
    if isinstance(out, tuple):
        raise TypeError(f"{where} returned a tuple; return the output tensor only, e.g. lambda x, m: module(x, m)[0]")
    if not isinstance(out, Tensor):
        raise TypeError(f"{where} must return a torch.Tensor of shape {tuple(x.shape)}, got {type(out).__name__}")
    if out.shape != x.shape:
        raise ValueError(f"{where} must return shape (B, n, d_model) = {tuple(x.shape)}, got {tuple(out.shape)}")
    return out.detach()


def diagnose(
    forward: Forward,
    reference: MultiHeadAttention,
    *,
    seed: int = 0,
    rtol: float | None = None,
    pairs: bool = True,
) -> AuditReport:
    """Compare your ``forward(x, mask)`` with ``reference`` and name the bug that explains it.

    Args:
        forward: your layer as ``forward(x, mask) -> out`` with ``x: (B, n, d_model)``,
            ``mask``: bool ``(n, n)``, True = may attend, or ``None``; ``out: (B, n, d_model)``.
            Adapt your own mask convention inside it.
        reference: an :class:`~attnlib.MultiHeadAttention` holding the same weights. To see a
            wrong load (``weights_transposed``), build it from the weights you loaded from, not
            from your module: read back from the module, it holds the same wrong weights.
        seed: seeds the probe inputs and the random masks.
        rtol: tolerance on the relative error; default ``sqrt(eps)`` of the reference's dtype
            (3.5e-4 for float32).
        pairs: also try every pair of bugs when no single bug explains the outputs.

    Returns:
        an :class:`AuditReport`; ``str(report)`` says what to look for.

    It runs on one thread (``torch.set_num_threads(1)``, restored on return): on tensors this
    small, more threads only wait for each other.

    Raises:
        TypeError: ``forward`` not callable; ``reference`` not a MultiHeadAttention; ``forward``
            returning something other than one tensor; options of the wrong type.
        ValueError: ``forward`` raising on the probes (e.g. another width), returning the wrong
            shape or different outputs for the same input (dropout?); ``rtol <= 0``.
    """
    if not callable(forward):
        raise TypeError(f"forward must be a callable forward(x, mask) -> Tensor, got {type(forward).__name__}")
    _check_reference(reference)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(pairs, bool):
        raise TypeError(f"pairs must be a bool, got {type(pairs).__name__}")
    dtype, device = reference.w_q.dtype, reference.w_q.device
    if rtol is None:
        rtol = _default_rtol(dtype)
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol > 0:
        raise ValueError(f"rtol must be a positive number, got {rtol!r}")
    rtol = float(rtol)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add waiting (10x on a busy machine)
    try:
        return _search(forward, reference, seed, rtol, pairs)
    finally:
        torch.set_num_threads(threads)


def _search(
    forward: Forward, reference: MultiHeadAttention, seed: int, rtol: float, pairs: bool
) -> AuditReport:
    """:func:`diagnose` after its argument checks."""
    dtype, device = reference.w_q.dtype, reference.w_q.device
    d_model = reference.w_q.shape[0]
    probes = _probes(d_model, dtype, device, seed)

    # 1. your outputs and the reference's
    yours = [_call(forward, p, d_model) for p in probes]
    again = _call(forward, probes[0], d_model)
    if not torch.equal(torch.nan_to_num(again), torch.nan_to_num(yours[0])):
        raise ValueError(
            "forward(x, mask) gave different outputs for the same input: is dropout on? "
            "Call module.eval() first."
        )
    with torch.no_grad():
        expected = [reference(p.x, p.x, p.x, mask=p.mask)[0] for p in probes]
    errors = {kind: 0.0 for kind in ("no mask", "causal", "random mask")}
    for p, y, r in zip(probes, yours, expected):
        errors[p.kind] = max(errors[p.kind], _rel_error(y, r))
    max_error = max(errors.values())
    ok = max_error <= rtol

    # 2. the candidates, computed in float64 from the reference's weights
    w64 = _Weights.of(reference, torch.float64)
    x64 = [p.x.to(torch.float64) for p in probes]
    right = [_run(_Recipe(), w64, x, p.mask) for x, p in zip(x64, probes)]
    for p, a, r in zip(probes, right, expected):
        if _rel_error(r, a) > max(rtol, _default_rtol(dtype)):
            raise RuntimeError(
                f"attnlib.audit's model of the layer disagrees with reference.forward on a {p.kind} probe; "
                "is reference a subclass with its own forward?"
            )
    cache: dict[tuple[int, str, str], tuple[Tensor, Tensor, Tensor]] = {}

    def outputs_match(recipe: _Recipe, targets: list[Tensor]) -> bool:
        for i, (x, p) in enumerate(zip(x64, probes)):  # stop at the first probe that differs
            key = (i, recipe.projection, recipe.value_weights)
            if key not in cache:
                cache[key] = _qkv(x, w64, recipe)
            q, k, v = (_split(t, w64.num_heads, recipe) for t in cache[key])
            out = _finish(_heads(q, k, v, p.mask, d_model, recipe), w64, recipe)
            if _rel_error(targets[i], out) > rtol:
                return False
        return True

    undetectable = tuple(b.name for b in _CATALOGUE if outputs_match(b.recipe(), right))
    explanations: tuple[tuple[str, ...], ...] = ()
    if not ok:
        explanations = tuple((b.name,) for b in _CATALOGUE if outputs_match(b.recipe(), yours))
        if not explanations and pairs:
            explanations = tuple(
                (a.name, b.name) for a, b in _PAIRS if outputs_match(b.recipe(a.recipe()), yours)
            )
    return AuditReport(
        ok=ok,
        bugs=explanations[0] if len(explanations) == 1 else (),
        explanations=explanations,
        max_error=max_error,
        errors=MappingProxyType(errors),
        undetectable=undetectable,
        rtol=rtol,
        num_heads=reference.num_heads,
    )
