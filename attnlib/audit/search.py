""":func:`diagnose`: run your forward and the reference on the probes, and search the catalogue
for the bugs that reproduce your numbers."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from types import MappingProxyType

import torch
from torch import Tensor

from attnlib.audit.catalogue import Recipe, active_bugs, active_pairs, tie_reason
from attnlib.audit.checks import (
    check_flags, check_reference, default_rtol, module_dtype, relative_error, where_raised,
)
from attnlib.audit.engine import CONVENTIONS, Forward, ReferenceParams, modes_of, run_recipe
from attnlib.audit.probes import LARGE_SCORES, Probe, make_probes
from attnlib.audit.report import AuditReport, hint_for
from attnlib.multihead import MultiHeadAttention
from attnlib.rounding import rounding_tolerance

__all__ = ["diagnose", "tolerance"]


class _Raised:
    """A call that raised: the kind of error, for matching (a candidate must raise too)."""

    def __init__(self, err: BaseException) -> None:
        self.text = f"{type(err).__name__}: {err}"


Output = Tensor | _Raised


def _describe(p: Probe, cross: bool, padding: bool) -> str:
    x = f"x of shape {tuple(p.x.shape)}"
    if cross:
        x += f", context of shape {tuple(p.keys.shape)}"
    if p.mask is None:
        return x + " and mask=None"
    what = "a bool key-padding mask" if padding else "a bool mask"
    return f"{x} and {what} of shape {tuple(p.mask.shape)}"


def _call(
    forward: Forward, p: Probe, dtype: torch.dtype, device: torch.device, cross: bool, padding: bool, d_model: int,
) -> Output:
    x = p.x.to(dtype=dtype, device=device)
    args: tuple[object, ...] = (x,) if not cross else (x, p.keys.to(dtype=dtype, device=device))
    mask = None if p.mask is None else p.mask.to(device)
    call = "forward(x, context, mask)" if cross else "forward(x, mask)"
    where = f"{call} with {_describe(p, cross, padding)} (reference.d_model = {d_model})"
    try:
        with torch.no_grad():
            out = forward(*args, mask)
    except Exception as err:  # the learner's code failed: say where, with which input
        if cross and p.x.shape[1] != p.keys.shape[1]:
            return _Raised(err)  # part of the diagnosis: keys or values made from x
        form = "(B, n_k) key-padding mask, True = real token" if padding else "(n, n) mask, True = may attend"
        raise ValueError(
            f"{where} raised {type(err).__name__} {where_raised(err, forward)}: {err}. Does reference have your "
            f"module's width, does your forward accept mask=None and a bool {form}, and does it take "
            f"{dtype} inputs (else pass dtype=)?"
        ) from err
    if isinstance(out, tuple):
        raise TypeError(f"{where} returned a tuple; return the output tensor only, e.g. lambda x, m: module(x, m)[0]")
    if not isinstance(out, Tensor):
        raise TypeError(f"{where} must return a torch.Tensor of shape {tuple(x.shape)}, got {type(out).__name__}")
    if out.shape != x.shape:
        raise ValueError(f"{where} must return shape (B, n, d_model) = {tuple(x.shape)}, got {tuple(out.shape)}")
    return out.detach().cpu()


def _reference_mask(p: Probe, causal: bool, padding: bool) -> Tensor | None:
    """The mask the reference attends with, broadcastable to ``(B, h, n_q, n_k)``."""
    n_q, n_k = p.x.shape[1], p.keys.shape[1]
    mask = p.mask
    if padding and mask is not None:
        mask = mask[:, None, None, :]  # (B, 1, 1, n_k)
    if causal:
        tril = torch.ones(n_q, n_k, dtype=torch.bool).tril()  # (n_q, n_k): key j <= query i
        mask = tril if mask is None else mask & tril
    return mask


def _large_scale(w: ReferenceParams, d_model: int) -> float:
    """The input scale at which the reference's scores spread over about :data:`LARGE_SCORES`."""
    x = torch.randn(8, d_model, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q, k = x @ w.w["q"][:, : w.d_k], x @ w.w["k"][:, : w.d_k]  # head 0, no bias: (8, d_k)
    spread = float((q @ k.T).std()) / math.sqrt(w.d_k)
    return math.sqrt(LARGE_SCORES / max(spread, 1e-12))


def _refuse_half(what: str, dtype: torch.dtype) -> None:
    """Half precision is refused: its rounding (about 1e-3 relative, scaled by the scores)
    is as large as the smaller bugs of the catalogue, and the large-scores probe would
    overflow float16."""
    if dtype in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"{what} computes in {str(dtype).removeprefix('torch.')}: diagnose compares float32 or "
            f"float64 layers, since half precision rounds as much as some bugs change; call "
            f"module.float() (and pass float32 inputs) to audit it"
        )


def tolerance(
    rtol: float | None, ref_dtype: torch.dtype, out_dtype: torch.dtype, reference: MultiHeadAttention,
    w64: ReferenceParams, probes: list[Probe],
) -> float:
    """``rtol``, or sqrt(eps) of the reference's dtype; at least the rounding of the coarser dtype
    along the layer (``d_model, d_k, n_k, d_model``), and of RoPE angles taken in float32 (``n_k``
    per rotation), relative to the largest score of the ordinary probes."""
    if rtol is not None:
        return rtol
    tol = 0.0
    n_k = max(p.keys.shape[1] for p in probes)
    d_model, d_k = reference.d_model, reference.d_k
    coarser = min(ref_dtype, out_dtype, key=lambda d: torch.finfo(d).bits)
    if coarser != ref_dtype or out_dtype != ref_dtype:
        tol += rounding_tolerance(coarser, d_model, d_k, n_k, d_model)
    if w64.rope_base is not None:
        tol += rounding_tolerance(torch.float32, n_k, n_k)
    if tol:
        top = max(
            float((p.x @ w64.w["q"]).norm(dim=-1).max() * (p.keys @ w64.w["k"]).norm(dim=-1).max()) / math.sqrt(d_k)
            for p in probes if p.kind != "large scores"
        )
        tol *= max(1.0, top)
    return max(default_rtol(ref_dtype), tol)


def diagnose(
    forward: Forward,
    reference: MultiHeadAttention,
    *,
    causal: bool = False,
    padding: bool = False,
    cross: bool = False,
    seed: int = 0,
    rtol: float | None = None,
    pairs: bool = True,
    dtype: torch.dtype | None = None,
) -> AuditReport:
    """Compare your ``forward`` with ``reference`` and name the bugs that explain it.

    Args:
        forward: your layer. Default: ``forward(x, mask) -> out`` with ``x: (B, n, d_model)``,
            ``mask``: bool ``(n, n)``, True = may attend, or ``None``; ``out: (B, n, d_model)``.
            ``cross=True``: ``forward(x, context, mask)``, ``x: (B, n_q, d_model)`` the queries,
            ``context: (B, n_k, d_model)`` the keys and values, ``mask`` ``(n_q, n_k)`` or None.
            ``padding=True``: ``mask`` is a bool ``(B, n_k)`` key-padding mask, True = real token
            (every sequence has one; padding on the right). ``causal=True``: your module masks
            the future itself; it gets ``mask=None`` (or the padding mask). Adapt your own mask
            convention inside ``forward``.
        reference: an :class:`~attnlib.MultiHeadAttention` holding the same weights (with
            ``num_kv_heads`` and ``rope_base`` for grouped and rotary layers). It is called as
            ``reference(x, context, context, mask)``, causally when ``causal=True``. To see a
            wrong load (``weights_transposed``), build it from the weights you loaded from.
        causal, padding, cross: the call form (above); ``causal`` and ``cross`` exclude each other.
        seed: seeds the probe inputs and the random masks.
        rtol: tolerance on the relative error; default ``sqrt(eps)`` of the reference's dtype,
            raised to the rounding of the coarser dtype when your outputs have another dtype,
            and of float32 RoPE angles when the reference has RoPE (see :func:`tolerance`).
        pairs: also try every pair of bugs when no single bug explains the outputs.
        dtype: the dtype of the inputs given to ``forward``; default that of your module's
            parameters (when ``forward`` is a module or its method), else the reference's.

    Returns:
        an :class:`AuditReport`; ``str(report)`` says what to look for.

    It runs on one thread (``torch.set_num_threads(1)``, restored on return): on tensors this
    small, more threads only wait for each other.

    Raises:
        TypeError: ``forward`` not callable; ``reference`` not a MultiHeadAttention; ``forward``
            returning something other than one tensor; options of the wrong type.
        ValueError: ``forward`` raising on the probes (the message says whether in your module
            or in your adapter), returning the wrong shape or different outputs for the same
            input (dropout?); ``rtol <= 0``; ``causal`` with ``cross``.
        RuntimeError: the reference raising, or computing something else than attnlib's model
            of it (a subclass with its own forward): an error on the reference's side.
    """
    if not callable(forward):
        raise TypeError(f"forward must be a callable forward(x, mask) -> Tensor, got {type(forward).__name__}")
    check_reference(reference)
    check_flags(causal, padding, cross)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(pairs, bool):
        raise TypeError(f"pairs must be a bool, got {type(pairs).__name__}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol > 0):
        raise ValueError(f"rtol must be a positive number, got {rtol!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add waiting (10x on a busy machine)
    try:
        return _search(forward, reference, causal, padding, cross, seed,
                       None if rtol is None else float(rtol), pairs, dtype)
    finally:
        torch.set_num_threads(threads)


class _Matcher:
    """Does a recipe reproduce target outputs on every probe, for some blocked-line convention?"""

    def __init__(self, w64: ReferenceParams, probes: list[Probe], causal: bool, padding: bool, rtol: float) -> None:
        self.w64, self.probes, self.causal, self.padding, self.rtol = w64, probes, causal, padding, rtol
        self.cache: dict[tuple[Recipe, int], dict[str, Tensor] | _Raised] = {}

    def outputs(self, r: Recipe, i: int) -> dict[str, Tensor] | _Raised:
        key = (r, i)
        if key not in self.cache:
            p = self.probes[i]
            try:
                self.cache[key] = run_recipe(r, self.w64, p.x, p.keys, p.mask,
                                             causal=self.causal, padding=self.padding)
            except (RuntimeError, ValueError, IndexError) as err:  # the buggy code cannot run here
                self.cache[key] = _Raised(err)
        return self.cache[key]

    def convention(self, r: Recipe, targets: Sequence[Output]) -> str | None:
        """The first convention under which ``r`` matches every target, or None."""
        alive = list(CONVENTIONS)
        for i, target in enumerate(targets):  # stop at the first probe that differs
            outs = self.outputs(r, i)
            if isinstance(target, _Raised) or isinstance(outs, _Raised):
                if not (isinstance(target, _Raised) and isinstance(outs, _Raised)):
                    return None
                continue
            if "any" in outs:  # no blocked line: one output for every convention
                alive = alive if relative_error(target, outs["any"]) <= self.rtol else []
            else:
                alive = [c for c in alive if relative_error(target, outs[c]) <= self.rtol]
            if not alive:
                return None
        return alive[0]

    def errors(self, r: Recipe, targets: Sequence[Output], convention: str) -> list[float]:
        out = []
        for i, target in enumerate(targets):
            outs = self.outputs(r, i)
            if isinstance(target, _Raised) or isinstance(outs, _Raised):
                out.append(0.0 if isinstance(target, _Raised) and isinstance(outs, _Raised) else math.inf)
            else:
                out.append(relative_error(target, outs.get(convention, outs.get("any"))))  # type: ignore[arg-type]
        return out


def _zeros(outs: dict[str, Tensor] | _Raised) -> Tensor:
    """The right layer's output (it never raises) with attnlib's zeros for blocked lines."""
    assert not isinstance(outs, _Raised)
    return outs["any"] if "any" in outs else outs["zeros"]


def _blocked_lines(m: _Matcher) -> bool:
    """Has the right layer a query with no allowed key on some probe?"""
    return any(isinstance(o, dict) and "any" not in o for o in (m.outputs(Recipe(), i) for i in range(len(m.probes))))


def _search(
    forward: Forward, reference: MultiHeadAttention, causal: bool, padding: bool, cross: bool, seed: int,
    rtol: float | None, pairs: bool, dtype: torch.dtype | None,
) -> AuditReport:
    """:func:`diagnose` after its argument checks."""
    ref_dtype, device = reference.w_q.dtype, reference.w_q.device
    d_model = reference.d_model
    w64 = ReferenceParams.of(reference, torch.float64)
    probes = make_probes(d_model, seed, causal=causal, padding=padding, cross=cross, large=_large_scale(w64, d_model))
    in_dtype = dtype or module_dtype(forward) or ref_dtype
    _refuse_half("your module", in_dtype)
    _refuse_half("the reference", ref_dtype)

    # 1. your outputs and the reference's
    yours = [_call(forward, p, in_dtype, device, cross, padding, d_model) for p in probes]
    first = next(i for i, y in enumerate(yours) if isinstance(y, Tensor))  # n_q = n_k never raises
    again = _call(forward, probes[first], in_dtype, device, cross, padding, d_model)
    if not (isinstance(again, Tensor) and torch.equal(torch.nan_to_num(again), torch.nan_to_num(yours[first]))):  # type: ignore[arg-type]
        raise ValueError(
            "forward gave different outputs for the same input: is dropout on? Call module.eval() first."
        )
    out_dtype = yours[first].dtype  # type: ignore[union-attr]
    _refuse_half("your module's output", out_dtype)
    expected = []
    for p in probes:
        x, keys = p.x.to(ref_dtype).to(device), p.keys.to(ref_dtype).to(device)
        mask = _reference_mask(p, causal, padding)
        try:
            with torch.no_grad():
                expected.append(reference(x, keys, keys, mask=None if mask is None else mask.to(device))[0].cpu())
        except Exception as err:
            raise RuntimeError(
                f"the reference raised {type(err).__name__} on a {p.kind} probe: {err}. The error is on the "
                "reference's side (the attnlib.MultiHeadAttention you built), not in your module: check its "
                "d_model, num_heads, num_kv_heads and rope_base against your module's"
            ) from err
    rtol = tolerance(rtol, ref_dtype, out_dtype, reference, w64, probes)

    # 2. the right layer in float64, checked against the reference's own forward
    m = _Matcher(w64, probes, causal, padding, rtol)
    right = [_zeros(m.outputs(Recipe(), i)) for i in range(len(probes))]
    for p, a, e in zip(probes, right, expected):
        if relative_error(e, a) > max(rtol, default_rtol(ref_dtype)):
            raise RuntimeError(
                f"attnlib.audit's model of the layer disagrees with reference.forward on a {p.kind} probe; "
                "is reference a subclass with its own forward?"
            )
    convention = m.convention(Recipe(), yours)
    ok = convention is not None
    if convention is None:  # the errors under the convention that fits the most probes
        def misfit(c: str) -> tuple[int, float]:
            errs = m.errors(Recipe(), yours, c)
            return sum(e > rtol for e in errs), max(errs)

        convention = min(CONVENTIONS, key=misfit)
    errors: dict[str, float] = {}
    for p, e in zip(probes, m.errors(Recipe(), yours, convention)):
        errors[p.kind] = max(errors.get(p.kind, 0.0), e)
    max_error = max(errors.values())
    raised = {p.kind: y.text for p, y in zip(probes, yours) if isinstance(y, _Raised)}

    # 3. the candidates, computed in float64 from the reference's weights
    modes = modes_of(reference, causal, padding, cross)
    undetectable = tuple(
        b.name for b in active_bugs(modes) if any(m.convention(rc, right) for rc in b.recipes())
    )
    explanations: tuple[tuple[str, ...], ...] = ()
    if not ok:
        explanations = tuple(
            (b.name,) for b in active_bugs(modes) if any(m.convention(rc, yours) for rc in b.recipes())
        )
        if not explanations and pairs:
            explanations = tuple(
                (a.name, b.name) for a, b in active_pairs(modes)
                if any(m.convention(rb, yours) for ra in a.recipes() for rb in b.recipes(ra))
            )
    names = tuple(dict.fromkeys(itertools.chain.from_iterable(explanations)))
    tie = ""
    if len(explanations) > 1:
        tie = tie_reason(frozenset(names), reference.num_heads, reference.d_k)
    return AuditReport(
        ok=ok,
        bugs=names,
        explanations=explanations,
        max_error=max_error,
        errors=MappingProxyType(errors),
        undetectable=undetectable,
        rtol=rtol,
        num_heads=reference.num_heads,
        blocked_rows=convention if ok and _blocked_lines(m) else None,
        dtype=str(out_dtype).removeprefix("torch."),
        reference_dtype=str(ref_dtype).removeprefix("torch."),
        tie=tie,
        raised=MappingProxyType(raised),
        hint="" if ok or explanations else hint_for(errors, rtol),
    )

