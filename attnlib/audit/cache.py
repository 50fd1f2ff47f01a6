r"""Is my KV cache right? :func:`diagnose_cache` checks a reader's incremental decoding.

A prefill of the first ``P`` tokens and then steps of one token, or a chunk of several, must
give, position by position, the causal pass over the whole sequence:

.. math::
    \mathrm{step}(x_{0..P-1}) \,\|\, \mathrm{step}(x_P) \,\|\, \dots \,\|\, \mathrm{step}(x_{n-1})
    = \mathrm{MultiHead}(x, x, x;\ \text{causal}) .

A chunk of ``t`` new tokens after ``L`` cached ones is masked causally *aligned to the lower
right*: new token ``i`` sits at position ``L + i`` and sees keys ``0 .. L + i``. A causal mask
aligned to the upper left (``torch.tril(torch.ones(t, L + t))``, or SDPA's ``is_causal=True``
with more keys than queries) lets it see only keys ``0 .. i``.

When they differ, the decoding is rebuilt with each bug of :data:`CACHE_BUGS` planted (and
every pair), from the reference's weights, and the bugs that reproduce the numbers are named.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import Tensor

from attnlib.attention import masked_softmax
from attnlib.audit.catalogue import BUGS_BY_NAME, Bug, tie_reason
from attnlib.audit.checks import check_reference, default_rtol, module_dtype, relative_error, where_raised
from attnlib.audit.engine import ReferenceParams
from attnlib.audit.probes import Probe
from attnlib.audit.report import AuditReport, fmt_error, hint_for, register_bugs
from attnlib.audit.search import float32_note, tolerance
from attnlib.decoding import apply_rope
from attnlib.multihead import MultiHeadAttention

__all__ = ["CACHE_BUGS", "Step", "assert_cache_matches", "diagnose_cache"]

Step = Callable[[Tensor, Any], tuple[Tensor, Any]]
"""A reader's decoding step: ``step(x_new, state) -> (out, state)`` with ``x_new: (B, t, d_model)``
the new tokens, ``out: (B, t, d_model)`` their outputs, and ``state`` whatever the module keeps
between calls (its KV cache), ``None`` at the first call of a sequence."""


@dataclass(frozen=True)
class _CacheRecipe:
    """How a decoding step computes; the defaults are right."""

    # RoPE positions of the new tokens: past .. past + t - 1 (right), or 0 .. t - 1 at every call
    positions: Literal["continue", "restart"] = "continue"
    # each step's new keys and values are appended once (right), or twice (the prefill: once)
    append: Literal["once", "twice"] = "once"
    # attention reads the cache after appending the new keys (right), or before
    read: Literal["after update", "before update"] = "after update"
    # a call of several tokens masks its own future (right), or not
    prefill_causal: bool = True
    # a chunk after the cache: causal mask aligned to the lower right (right), to the upper
    # left, or none
    chunk_causal: Literal["lower right", "upper left", "none"] = "lower right"
    # grouped keys/values: head i reads group i // (h/g) (right), or i % g
    kv_expand: Literal["repeat_interleave", "repeat"] = "repeat_interleave"


_CACHE_CATALOGUE: tuple[Bug, ...] = (
    Bug(
        "rope_positions_restart",
        "RoPE positions restart at 0 at every call: each new token is rotated as position 0",
        "pos = torch.arange(T)   # T new tokens",
        "pos = torch.arange(past_len, past_len + T)   # after the cache",
        {"positions": "restart"},
        needs=frozenset({"rope"}),
    ),
    Bug(
        "keys_appended_twice",
        "each step appends its new keys and values to the cache twice",
        "cache_k = torch.cat([cache_k, k], dim=2)   # and again below",
        "cache_k = torch.cat([cache_k, k], dim=2)   # once per step",
        {"append": "twice"},
        "modelled with the prefill (empty cache) storing its keys once, as code that tests "
        "`if cache is None` does.",
    ),
    Bug(
        "cache_read_before_update",
        "attention reads the cache before the new keys are appended: a new token does not see itself",
        "k_all = cache_k; cache_k = torch.cat([cache_k, k], dim=2)",
        "cache_k = torch.cat([cache_k, k], dim=2); k_all = cache_k",
        {"read": "before update"},
        "modelled with the prefill (empty cache) attending to its own keys, as code that tests "
        "`if cache is None` does.",
    ),
    Bug(
        "prefill_not_causal",
        "no causal mask in a prefill of several tokens (nor, often, in a chunk after the cache): "
        "the prompt attends to its own future",
        "F.scaled_dot_product_attention(q, k, v)   # no mask for T > 1",
        "mask = torch.ones(T, L).tril(L - T).bool()   # L = past_len + T",
        {"prefill_causal": False},
        alternatives=({"prefill_causal": False, "chunk_causal": "none"},),
    ),
    Bug(
        "chunk_causal_upper_left",
        "a chunk of several tokens after the cache masked causally from the upper left: new token i "
        "sees keys 0..i instead of 0..past_len + i",
        "F.scaled_dot_product_attention(q, k, v, is_causal=True)   # T > 1 after the cache",
        "mask = torch.ones(T, L, dtype=torch.bool).tril(L - T)   # L = past_len + T; attn_mask=mask",
        {"chunk_causal": "upper left"},
        "SDPA's is_causal=True aligns its mask to the upper left when there are more keys than "
        "queries. Hugging Face's layers set is_causal only when they get no attention_mask: their "
        "models pass one, so an adapter that calls the layer alone with a cache must pass the "
        "causal mask of the chunk too.",
    ),
    dataclasses.replace(BUGS_BY_NAME["kv_head_order"], change=MappingProxyType({"kv_expand": "repeat"})),
)
_CACHE_BY_NAME = {b.name: b for b in _CACHE_CATALOGUE}
register_bugs(_CACHE_CATALOGUE)

CACHE_BUGS: Mapping[str, str] = MappingProxyType({b.name: b.description for b in _CACHE_CATALOGUE})
"""The cache check's catalogue: bug name -> one-line description (read-only)."""

_CACHE_PROBES = ((2, 6, 3, 1), (1, 5, 2, 1), (2, 8, 3, 3))
"""``(B, n, P, t)``: a prefill of ``P`` tokens, then steps of ``t`` tokens (the last one may be
shorter); ``t > 1`` is the ``"chunks"`` probe."""


def _schedule(n: int, prefill: int, chunk: int) -> list[tuple[int, int]]:
    """The calls ``(start, end)`` of a decoding: the prefill, then steps of ``chunk`` tokens."""
    return [(0, prefill)] + [(t, min(t + chunk, n)) for t in range(prefill, n, chunk)]


def _plant(bugs: tuple[str, ...]) -> list[_CacheRecipe]:
    """The recipes of ``bugs`` planted together: one per combination of their ways of being made."""
    out = []
    for changes in itertools.product(*((b.change, *b.alternatives) for b in (_CACHE_BY_NAME[n] for n in bugs))):
        change = {k: v for c in changes for k, v in c.items()}
        out.append(dataclasses.replace(_CacheRecipe(), **change))  # type: ignore[arg-type]
    return out


def _decode(r: _CacheRecipe, p: ReferenceParams, x: Tensor, prefill: int, chunk: int = 1) -> Tensor:
    """Prefill ``x[:, :prefill]`` then steps of ``chunk`` tokens, the way ``r`` says:
    ``(B, n, d) -> (B, n, d)``."""
    B, n, d = x.shape
    h, g, d_k = p.num_heads, p.num_kv_heads, p.d_k
    keys = values = x.new_zeros(B, g, 0, d_k)  # (B, g, cached, d_k)
    key_pos = torch.zeros(0, dtype=torch.long)  # (cached,): each cached key's position
    outs = []
    for s, e in _schedule(n, prefill, chunk):
        xs = x[:, s:e]  # (B, t, d)
        q, k, v = (_linear(xs, p, role).view(B, e - s, -1, d_k).transpose(1, 2) for role in "qkv")  # (B, h|g, t, d_k)
        start = keys.shape[2] if r.positions == "continue" else 0  # positions follow the cached length
        pos = torch.arange(start, start + e - s)  # (t,)
        if p.rope_base is not None:
            q, k = apply_rope(q, pos, p.rope_base), apply_rope(k, pos, p.rope_base)
        times = 2 if r.append == "twice" and s > 0 else 1
        old = (keys, values, key_pos)
        keys = torch.cat([keys] + [k] * times, dim=2)  # (B, g, cached', d_k)
        values = torch.cat([values] + [v] * times, dim=2)
        key_pos = torch.cat([key_pos] + [torch.arange(s, e)] * times)  # the tokens' places in x
        K, V, KP = old if r.read == "before update" and old[0].shape[2] else (keys, values, key_pos)
        L, t = len(KP), e - s  # the keys read, the new tokens
        # causal, aligned to the lower right: new token i sees the first L - t + i + 1 keys read
        # (for a right cache, key positions <= s + i; buggy caches count their keys the same way)
        mask = torch.arange(L)[None, :] <= torch.arange(L - t, L)[:, None]  # (t, L)
        if s > 0 and t > 1 and r.chunk_causal == "upper left":
            mask = torch.arange(L)[None, :] <= torch.arange(t)[:, None]  # (t, L): key j <= i
        if t > 1 and ((s == 0 and not r.prefill_causal) or (s > 0 and r.chunk_causal == "none")):
            mask = torch.ones_like(mask)
        if g < h:
            K, V = ((t.repeat_interleave(h // g, dim=1) if r.kv_expand == "repeat_interleave"
                     else t.repeat(1, h // g, 1, 1)) for t in (K, V))  # (B, h, cached, d_k)
        scores = q @ K.transpose(-2, -1) / math.sqrt(d_k)  # (B, h, t, cached)
        bias = p.position_bias(torch.arange(s, e), KP, scores.dtype)  # ALiBi: (h, t, cached) or None
        weights = masked_softmax(scores if bias is None else scores + bias, mask)  # (B, h, t, cached)
        concat = (weights @ V).transpose(1, 2).reshape(B, e - s, h * d_k)  # (B, t, d)
        outs.append(_linear(concat, p, "o"))  # (B, t, d)
    return torch.cat(outs, dim=1)  # (B, n, d)


def _linear(x: Tensor, p: ReferenceParams, role: str) -> Tensor:
    """``x @ W + b`` for one role of the reference's weights."""
    b = p.b[role]
    return x @ p.w[role] if b is None else x @ p.w[role] + b


def _run_step(step: Step, x: Tensor, prefill: int, chunk: int = 1) -> Tensor:
    """The reader's decoding of ``x: (B, n, d)``: prefill, then ``chunk`` tokens at a time."""
    state: Any = None
    outs = []
    for s, e in _schedule(x.shape[1], prefill, chunk):
        what = f"step(x_new, state) with x_new of shape {(x.shape[0], e - s, x.shape[2])} " + (
            "and state=None (the prefill)" if s == 0 else f"after {s} tokens")
        try:
            with torch.no_grad():
                result = step(x[:, s:e].clone(), state)
        except Exception as err:
            raise ValueError(f"{what} raised {type(err).__name__} {where_raised(err, step)}: {err}") from err
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Tensor)):
            raise TypeError(f"{what} must return (out, state) with out a tensor, got {type(result).__name__}")
        out, state = result
        if out.shape != (x.shape[0], e - s, x.shape[2]):
            raise ValueError(f"{what} must return out of shape {(x.shape[0], e - s, x.shape[2])}, got {tuple(out.shape)}")
        outs.append(out.detach().cpu())
    return torch.cat(outs, dim=1)  # (B, n, d)


def diagnose_cache(
    step: Step, reference: MultiHeadAttention, *, seed: int = 0, rtol: float | None = None,
    pairs: bool = True, dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None,
) -> AuditReport:
    """Check incremental decoding against the full causal pass, and name the cache bug.

    Three decodings are checked: a prefill of 3 tokens then one-token steps, a prefill of 2 then
    one-token steps, and a prefill of 3 then a chunk of 3 tokens and a chunk of 2.

    Args:
        step: your decoding step ``step(x_new, state) -> (out, state)`` (see :data:`Step`):
            ``x_new: (B, t, d_model)``, ``out: (B, t, d_model)``; ``state`` is ``None`` at the
            first call of each sequence and what you returned afterwards.
        reference: an :class:`~attnlib.MultiHeadAttention` holding your weights (with
            ``num_kv_heads`` and ``rope_base`` as your module has them; an
            :class:`~attnlib.decoding.AlibiAttention` for ALiBi); the expected outputs are
            ``reference(x, x, x, mask=causal)``.
        seed, rtol, pairs, dtype, compute_dtype: as in :func:`~attnlib.audit.diagnose`.

    Returns:
        an :class:`~attnlib.audit.AuditReport` whose ``errors`` are per ``"prefill"``,
        ``"steps"`` (one token after the cache) and ``"chunks"`` (several tokens after the
        cache), and whose bugs come from :data:`CACHE_BUGS`. A step that raises on a chunk is
        reported in ``raised`` (the chunk is then not checked), not as an error.

    Raises:
        TypeError: ``step`` not callable or not returning ``(out, state)``; ``reference`` not a
            MultiHeadAttention.
        ValueError: ``step`` raising on the prefill or a one-token step (the message says
            where), returning the wrong shape, or different outputs for the same input;
            ``rtol <= 0``.
    """
    if not callable(step):
        raise TypeError(f"step must be a callable step(x_new, state) -> (out, state), got {type(step).__name__}")
    check_reference(reference)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol > 0):
        raise ValueError(f"rtol must be a positive number, got {rtol!r}")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise TypeError(f"compute_dtype must be a floating torch.dtype or None, got {compute_dtype!r}")
    ref_dtype = reference.w_q.dtype
    in_dtype = dtype or module_dtype(step) or ref_dtype
    g = torch.Generator().manual_seed(seed)
    plan = [(torch.randn(B, n, reference.d_model, generator=g, dtype=torch.float64), P, t)
            for B, n, P, t in _CACHE_PROBES]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        device = reference.w_q.device
        yours: list[Tensor] = []
        runs: list[tuple[Tensor, int, int]] = []
        raised: dict[str, str] = {}
        for x, P, t in plan:
            try:
                yours.append(_run_step(step, x.to(in_dtype).to(device), P, t))
            except ValueError as err:
                if t == 1 or not isinstance(err.__cause__, Exception):
                    raise
                raised["chunks"] = f"{err} (chunks of several tokens after the cache were not checked)"
                continue
            runs.append((x, P, t))
        if not torch.equal(torch.nan_to_num(_run_step(step, plan[0][0].to(in_dtype).to(device), plan[0][1])),
                           torch.nan_to_num(yours[0])):
            raise ValueError("step gave different outputs for the same input: is dropout on? Call module.eval().")
        w64 = ReferenceParams.of(reference, torch.float64)
        probes = [Probe("steps", x, None, None) for x, _, _ in runs]
        given = None if rtol is None else float(rtol)
        rtol = tolerance(given, ref_dtype, yours[0].dtype, reference, w64, probes, compute_dtype)
        rights = [_decode(_CacheRecipe(), w64, x, P, t) for x, P, t in runs]
        with torch.no_grad():
            for (x, _, _), right in zip(runs, rights):
                n = x.shape[1]
                mask = torch.ones(n, n, dtype=torch.bool).tril()
                expected = reference(*(x.to(ref_dtype).to(device),) * 3, mask=mask.to(device))[0].cpu()
                if relative_error(expected, right) > max(rtol, default_rtol(ref_dtype)):
                    raise RuntimeError(f"attnlib.audit's model of decoding disagrees with reference.forward; "
                                       f"is reference ({type(reference).__name__}) a subclass with its own forward?")

        def errors_of(r: _CacheRecipe) -> dict[str, float]:
            errs = {"prefill": 0.0, "steps": 0.0}
            for (x, P, t), y in zip(runs, yours):
                out = _decode(r, w64, x, P, t)
                kind = "steps" if t == 1 else "chunks"
                errs["prefill"] = max(errs["prefill"], relative_error(y[:, :P], out[:, :P]))
                errs[kind] = max(errs.get(kind, 0.0), relative_error(y[:, P:], out[:, P:]))
            return errs

        grouped, rope = w64.num_kv_heads < w64.num_heads, w64.rope_base is not None
        active = [b for b in _CACHE_CATALOGUE
                  if b.needs <= {n for n, on in (("grouped", grouped), ("rope", rope)) if on}]

        def fits(names: tuple[str, ...], targets: list[Tensor], tol: float) -> bool:
            return any(all(relative_error(y, _decode(r, w64, x, P, t)) <= tol for (x, P, t), y in zip(runs, targets))
                       for r in _plant(names))

        def search(tol: float) -> tuple[bool, tuple[tuple[str, ...], ...]]:
            if max(errors.values()) <= tol:
                return True, ()
            found: tuple[tuple[str, ...], ...] = tuple((b.name,) for b in active if fits((b.name,), yours, tol))
            if not found and pairs:
                found = tuple((a.name, b.name) for a, b in itertools.combinations(active, 2)
                              if fits((a.name, b.name), yours, tol))
            return False, found

        errors = errors_of(_CacheRecipe())
        ok, explanations = search(rtol)
        suspected, rtol64 = "", rtol  # a float32 step (or a real error as small): passed at float32's, and said
        if (not ok and not explanations and given is None and compute_dtype is None
                and ref_dtype == yours[0].dtype == torch.float64):
            rtol32 = tolerance(None, ref_dtype, yours[0].dtype, reference, w64, probes, torch.float32)
            ok32, found32 = search(rtol32)
            if ok32 or found32:
                ok, explanations, rtol, suspected = ok32, found32, rtol32, "float32"
        undetectable = tuple(b.name for b in active if fits((b.name,), rights, rtol))
    finally:
        torch.set_num_threads(threads)
    names = tuple(dict.fromkeys(itertools.chain.from_iterable(explanations)))
    notes: tuple[str, ...] = ()
    if suspected and ok:
        notes = (float32_note(rtol64, rtol),)
    elif suspected:
        notes = (f"a step of your module seems to run in float32: no bug explains its outputs at float64's "
                 f"rounding, so the bugs were sought at float32's ({fmt_error(rtol)}). Pass "
                 f"compute_dtype=torch.float32 if a step does run in float32, or torch.float64 if none does.",)
    return AuditReport(
        ok=ok, bugs=names, explanations=explanations, max_error=max(errors.values()),
        errors=MappingProxyType(errors), undetectable=undetectable, rtol=rtol, num_heads=reference.num_heads,
        dtype=str(yours[0].dtype).removeprefix("torch."), reference_dtype=str(ref_dtype).removeprefix("torch."),
        tie=tie_reason(frozenset(names), reference.num_heads, reference.d_k, reference.d_model) if len(explanations) > 1 else "",
        raised=MappingProxyType(raised),
        hint="" if ok or explanations else hint_for(errors, rtol)
        + " If the full pass is wrong too, check it first with diagnose(..., causal=True).",
        compute_dtype=suspected or ("" if compute_dtype is None else str(compute_dtype).removeprefix("torch.")),
        notes=notes, suspected_dtype=suspected,
    )


def assert_cache_matches(step: Step, reference: MultiHeadAttention, **flags: Any) -> AuditReport:
    """:func:`diagnose_cache` for your own test suite: the report when your decoding matches
    the full causal pass of ``reference``; otherwise ``AssertionError`` with the report's text.
    ``flags``: :func:`diagnose_cache`'s keywords.

    Raises:
        AssertionError: your decoding disagrees with the reference.
        TypeError, ValueError, RuntimeError: as :func:`diagnose_cache`.
    """
    report = diagnose_cache(step, reference, **flags)
    if not report.ok:
        raise AssertionError(str(report))
    return report
