""":func:`diagnose`: run your forward and the reference on the probes, and search the catalogue
for the bugs that reproduce your numbers."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from attnlib.audit.catalogue import Recipe, active_bugs, mask_bugs, tie_reason
from attnlib.audit.checks import (
    check_flags, check_reference, default_rtol, module_dtype, relative_error, where_raised,
)
from attnlib.audit.engine import CONVENTIONS, Forward, ReferenceParams, modes_of
from attnlib.audit.matcher import (
    Matcher, Output, Raised, has_blocked_lines, padded_rows, right_output, shared_outputs,
)
from attnlib.audit.probes import LARGE_SCORES, Probe, make_probes
from attnlib.audit.report import AuditReport, fmt_error, hint_for
from attnlib.multihead import MultiHeadAttention
from attnlib.rounding import rounding_tolerance

__all__ = ["assert_attention_matches", "diagnose", "float32_note", "tolerance"]





def _describe(p: Probe, cross: bool, padding: bool, takes_mask: bool = True) -> str:
    x = f"x of shape {tuple(p.x.shape)}"
    if cross:
        x += f", context of shape {tuple(p.keys.shape)}"
    if not takes_mask:
        return x
    if p.mask is None:
        return x + " and mask=None"
    what = "a bool key-padding mask" if padding else "a bool mask"
    return f"{x} and {what} of shape {tuple(p.mask.shape)}"


def _call(
    forward: Forward, p: Probe, dtype: torch.dtype, device: torch.device, cross: bool, padding: bool, d_model: int,
    takes_mask: bool = True,
) -> Output:
    x = p.x.to(dtype=dtype, device=device)
    args: tuple[object, ...] = (x,) if not cross else (x, p.keys.to(dtype=dtype, device=device))
    mask = None if p.mask is None else p.mask.to(device)
    call = ("forward(x, context" if cross else "forward(x") + (", mask)" if takes_mask else ")")
    where = f"{call} with {_describe(p, cross, padding, takes_mask)} (reference.d_model = {d_model})"
    try:
        with torch.no_grad():
            out = forward(*args, mask) if takes_mask else forward(*args)
    except Exception as err:  # the learner's code failed: say where, with which input
        if cross and p.x.shape[1] != p.keys.shape[1]:
            return Raised(err)  # part of the diagnosis: keys or values made from x
        form = "(B, n_k) key-padding mask, True = real token" if padding else "(n, n) mask, True = may attend"
        takes = (f"does your forward accept mask=None and a bool {form}" if takes_mask
                 else "does your forward take x alone (takes_mask=False)")
        raise ValueError(
            f"{where} raised {type(err).__name__} {where_raised(err, forward)}: {err}. Does reference have your "
            f"module's width, {takes}, and does it take {dtype} inputs (else pass dtype=)?"
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
    w64: ReferenceParams, probes: list[Probe], compute_dtype: torch.dtype | None = None,
) -> float:
    """``rtol``, or sqrt(eps) of the reference's dtype; at least the rounding of the coarser dtype
    (of the reference, your outputs and ``compute_dtype``, the dtype a step of your module
    computes in) along the layer (``d_model, d_k, n_k, d_model``), and of RoPE angles taken in
    float32 (``n_k`` per rotation), relative to the largest score of the ordinary probes."""
    if rtol is not None:
        return rtol
    tol = 0.0
    n_k = max(p.keys.shape[1] for p in probes)
    d_model, d_k = reference.d_model, reference.d_k
    dtypes = (ref_dtype, out_dtype) if compute_dtype is None else (ref_dtype, out_dtype, compute_dtype)
    coarser = min(dtypes, key=lambda d: torch.finfo(d).bits)
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


def float32_note(rtol64: float, rtol32: float) -> str:
    """The report's line for a float64 module whose outputs differ from the reference by more
    than float64's rounding (``rtol64``) but within float32's along the layer (``rtol32``), with
    no bug to explain them and no ``compute_dtype`` declared: it passed at float32's tolerance,
    and a real error this small would have passed the same way."""
    return (
        f"passed at float32's tolerance ({fmt_error(rtol32)}), not float64's ({fmt_error(rtol64)}): your outputs "
        f"differ from the float64 reference by more than float64's rounding but within float32's along this "
        f"layer, so a step of your module seems to run in float32 (Hugging Face's OPT, CLIP, ViT and Llama layers "
        f"take their softmax in float32). A real error this small (a scale off by 1e-4, say) would pass the same "
        f"way. For a module that computes in float64 throughout, pass compute_dtype=torch.float64 to check at "
        f"float64's rounding (such an error is then WRONG); or pass compute_dtype=torch.float32 to declare the "
        f"float32 step."
    )


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
    takes_mask: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> AuditReport:
    """Compare your ``forward`` with ``reference`` and name the bugs that explain it.

    Args:
        forward: your layer. Default: ``forward(x, mask) -> out`` with ``x: (B, n, d_model)``,
            ``mask``: bool ``(n, n)``, True = may attend, or ``None``; ``out: (B, n, d_model)``.
            ``cross=True``: ``forward(x, context, mask)``, ``x: (B, n_q, d_model)`` the queries,
            ``context: (B, n_k, d_model)`` the keys and values, ``mask`` ``(n_q, n_k)`` or None.
            ``padding=True``: ``mask`` is a bool ``(B, n_k)`` key-padding mask, True = real token
            (every sequence has one; padding on the right, and with ``causal=True`` on the left
            too); only the real queries' outputs are compared, what a padded query gets is a
            convention (``report.padded_rows``). ``causal=True``: your module masks the future
            itself; it gets ``mask=None`` (or the padding mask). ``takes_mask=False``:
            ``forward(x)`` (``forward(x, context)``), for a module that takes no mask (a ViT);
            only unmasked probes run, and ``report.untested`` lists the mask bugs they cannot
            see. Adapt your own mask convention inside ``forward``.
        reference: an :class:`~attnlib.MultiHeadAttention` holding the same weights (with
            ``num_kv_heads`` and ``rope_base`` for grouped and rotary layers; an
            :class:`~attnlib.decoding.AlibiAttention` for ALiBi). It is called as
            ``reference(x, context, context, mask)``, causally when ``causal=True``. To see a
            wrong load (``weights_transposed``), build it from the weights you loaded from.
        causal, padding, cross: the call form (above); ``causal`` and ``cross`` exclude each other,
            and ``padding`` needs ``takes_mask``.
        seed: seeds the probe inputs and the random masks.
        rtol: tolerance on the relative error; default ``sqrt(eps)`` of the reference's dtype,
            raised to the rounding of the coarser dtype when your outputs have another dtype,
            and of float32 RoPE angles when the reference has RoPE (see :func:`tolerance`).
        pairs: also try every pair of bugs when no single bug explains the outputs.
        dtype: the dtype of the inputs given to ``forward``; default that of your module's
            parameters (when ``forward`` is a module or its method), else the reference's.
        takes_mask: False for a module called without a mask (above).
        compute_dtype: a dtype some step of your module computes in (Hugging Face's OPT, CLIP,
            ViT and Llama take their softmax in float32 inside a float64 module): the tolerance
            is then that dtype's rounding along the layer. ``torch.float64`` for a module that
            computes in float64 throughout: the audit keeps float64's tolerance, so an error
            above float64's rounding is WRONG however small. Left None, a float64 audit whose
            error is above float64's rounding but within float32's, with no bug of the
            catalogue to explain it, passes at float32's tolerance (``report.rtol``), and the
            report says so: a step seems to run in float32 (``report.compute_dtype`` and
            ``report.suspected_dtype`` are ``"float32"``), and a real error that small (a
            scale off by 1e-4) would pass the same way, so pass ``torch.float64`` for a module
            that computes in float64 throughout. When a bug explains the outputs only at
            float32's tolerance, it is named, at that tolerance.

    Returns:
        an :class:`AuditReport`; ``str(report)`` says what to look for.

    It runs on one thread (``torch.set_num_threads(1)``, restored on return): on tensors this
    small, more threads only wait for each other.

    Raises:
        TypeError: ``forward`` not callable; ``reference`` not a MultiHeadAttention (or one whose
            attention diagnose cannot model, named); ``forward`` returning something other than
            one tensor; options of the wrong type.
        ValueError: ``forward`` raising on the probes (the message says whether in your module
            or in your adapter), returning the wrong shape or different outputs for the same
            input (dropout?); ``rtol <= 0``; ``causal`` with ``cross``; ``padding`` without
            ``takes_mask``.
        RuntimeError: the reference raising, or computing something else than attnlib's model
            of it: an error on the reference's side.
    """
    if not callable(forward):
        raise TypeError(f"forward must be a callable forward(x, mask) -> Tensor, got {type(forward).__name__}")
    check_reference(reference)
    check_flags(causal, padding, cross)
    if not isinstance(takes_mask, bool):
        raise TypeError(f"takes_mask must be a bool, got {type(takes_mask).__name__}")
    if padding and not takes_mask:
        raise ValueError("padding=True gives your forward a padding mask; a module that takes no mask "
                         "(takes_mask=False) cannot be audited with one")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(pairs, bool):
        raise TypeError(f"pairs must be a bool, got {type(pairs).__name__}")
    for name, value in (("dtype", dtype), ("compute_dtype", compute_dtype)):
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise TypeError(f"{name} must be a floating torch.dtype or None, got {value!r}")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol > 0):
        raise ValueError(f"rtol must be a positive number, got {rtol!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add waiting (10x on a busy machine)
    try:
        form = _Form(causal, padding, cross, takes_mask)
        return _search(forward, reference, form, seed, None if rtol is None else float(rtol), pairs, dtype,
                       compute_dtype)
    finally:
        torch.set_num_threads(threads)


def assert_attention_matches(forward: Forward, reference: MultiHeadAttention, **flags: Any) -> AuditReport:
    """:func:`diagnose` for your own test suite: the report when your ``forward`` matches
    ``reference``; otherwise ``AssertionError`` with the report's text (what is wrong, the bug
    it names and the line to look for). ``flags``: :func:`diagnose`'s keywords (``causal``,
    ``padding``, ``cross``, ``takes_mask``, ``dtype``, ``compute_dtype``, ``rtol``, ``seed``).

    Raises:
        AssertionError: your module disagrees with the reference.
        TypeError, ValueError, RuntimeError: as :func:`diagnose` (a wrong call, not a wrong module).
    """
    report = diagnose(forward, reference, **flags)
    if not report.ok:
        raise AssertionError(str(report))
    return report


@dataclass(frozen=True)
class _Form:
    """A call form: :func:`diagnose`'s flags."""

    causal: bool
    padding: bool
    cross: bool
    takes_mask: bool


def _search(
    forward: Forward, reference: MultiHeadAttention, form: _Form, seed: int,
    rtol: float | None, pairs: bool, dtype: torch.dtype | None, compute_dtype: torch.dtype | None,
) -> AuditReport:
    """:func:`diagnose` after its argument checks."""
    causal, padding, cross, takes_mask = form.causal, form.padding, form.cross, form.takes_mask
    ref_dtype, device = reference.w_q.dtype, reference.w_q.device
    d_model = reference.d_model
    w64 = ReferenceParams.of(reference, torch.float64)
    probes = make_probes(d_model, seed, causal=causal, padding=padding, cross=cross,
                         large=_large_scale(w64, d_model), takes_mask=takes_mask)
    in_dtype = dtype or module_dtype(forward) or ref_dtype
    _refuse_half("your module", in_dtype)
    _refuse_half("the reference", ref_dtype)

    # 1. your outputs and the reference's
    yours = [_call(forward, p, in_dtype, device, cross, padding, d_model, takes_mask) for p in probes]
    first = next(i for i, y in enumerate(yours) if isinstance(y, Tensor))  # n_q = n_k never raises
    again = _call(forward, probes[first], in_dtype, device, cross, padding, d_model, takes_mask)
    if not (isinstance(again, Tensor) and torch.equal(torch.nan_to_num(again), torch.nan_to_num(yours[first]))):  # type: ignore[arg-type]
        raise ValueError(
            "forward gave different outputs for the same input: is dropout on? Call module.eval() first."
        )
    out_dtype = yours[first].dtype  # type: ignore[union-attr]
    _refuse_half("your module's output", out_dtype)
    if compute_dtype is not None:
        _refuse_half("compute_dtype", compute_dtype)
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
    given_rtol = rtol
    rtol = tolerance(rtol, ref_dtype, out_dtype, reference, w64, probes, compute_dtype)

    # 2. the right layer in float64, checked against the reference's own forward
    m = Matcher(w64, probes, causal, padding, rtol, cache=shared_outputs(w64, probes, causal, padding))
    right = [right_output(m.outputs(Recipe(), i)) for i in range(len(probes))]
    for p, a, e in zip(probes, right, expected):
        if relative_error(e, a) > max(rtol, default_rtol(ref_dtype)):
            raise RuntimeError(
                f"attnlib.audit's model of the layer disagrees with reference.forward on a {p.kind} probe; "
                "is reference a subclass with its own forward?"
            )
    modes = modes_of(reference, causal, padding, cross, takes_mask)
    convention = m.convention(Recipe(), yours)
    explanations: tuple[tuple[str, ...], ...] = ()
    if convention is None:
        explanations = m.explanations(yours, modes, pairs)
    # a step in float32 inside a float64 module (or a real error as small): passed at float32's
    # tolerance, and the report says so
    suspected, rtol64 = "", rtol
    if (convention is None and not explanations and given_rtol is None and compute_dtype is None
            and ref_dtype == out_dtype == torch.float64):
        m32 = m.with_rtol(tolerance(None, ref_dtype, out_dtype, reference, w64, probes, torch.float32))
        convention = m32.convention(Recipe(), yours)
        if convention is None:
            explanations = m32.explanations(yours, modes, pairs)
        if convention is not None or explanations:  # within float32's rounding, or a bug named there
            m, rtol, suspected = m32, m32.rtol, "float32"
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
    raised = {p.kind: y.text for p, y in zip(probes, yours) if isinstance(y, Raised)}

    # 3. the candidates, computed in float64 from the reference's weights
    undetectable = tuple(
        b.name for b in active_bugs(modes) if any(m.convention(rc, right) for rc in b.recipes())
    )
    names = tuple(dict.fromkeys(itertools.chain.from_iterable(explanations)))
    tie = ""
    if len(explanations) > 1:
        tie = tie_reason(frozenset(names), reference.num_heads, reference.d_k, reference.d_model)
    notes = []
    if suspected and ok:
        notes.append(float32_note(rtol64, rtol))
    elif suspected:
        notes.append(
            f"a step of your module seems to run in float32: no bug explains its outputs at float64's rounding, "
            f"so the bugs were sought at float32's ({fmt_error(rtol)}). Pass compute_dtype=torch.float32 if a "
            f"step does run in float32, or compute_dtype=torch.float64 if none does."
        )
    elif compute_dtype is not None and compute_dtype != out_dtype:
        name = str(compute_dtype).removeprefix("torch.")
        notes.append(f"compute_dtype={name}: compared at {name}'s rounding, {fmt_error(rtol)}")
    untested = () if "mask" in modes else mask_bugs(modes | {"mask"})
    return AuditReport(
        ok=ok,
        bugs=names,
        explanations=explanations,
        max_error=max_error,
        errors=MappingProxyType(errors),
        undetectable=undetectable,
        rtol=rtol,
        num_heads=reference.num_heads,
        blocked_rows=convention if ok and has_blocked_lines(m) else None,
        dtype=str(out_dtype).removeprefix("torch."),
        reference_dtype=str(ref_dtype).removeprefix("torch."),
        tie=tie,
        raised=MappingProxyType(raised),
        hint="" if ok or explanations else hint_for(errors, rtol, causal=causal),
        untested=untested,
        padded_rows=padded_rows(m, yours) if ok and padding and not cross else None,
        compute_dtype=suspected or ("" if compute_dtype is None else str(compute_dtype).removeprefix("torch.")),
        notes=tuple(notes),
        suspected_dtype=suspected,
    )
