r"""Is my KV cache right? :func:`diagnose_cache` checks a reader's incremental decoding.

A prefill of the first ``P`` tokens and then one-token steps must give, position by position,
the causal pass over the whole sequence:

.. math::
    \mathrm{step}(x_{0..P-1}) \,\|\, \mathrm{step}(x_P) \,\|\, \dots \,\|\, \mathrm{step}(x_{n-1})
    = \mathrm{MultiHead}(x, x, x;\ \text{causal}) .

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
from attnlib.audit.report import AuditReport, hint_for, register_bugs
from attnlib.audit.search import tolerance
from attnlib.decoding import apply_rope
from attnlib.multihead import MultiHeadAttention

__all__ = ["CACHE_BUGS", "Step", "diagnose_cache"]

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
    # a prefill of several tokens masks its own future (right), or not
    prefill_causal: bool = True
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
        "no causal mask in a prefill of several tokens: the prompt attends to its own future",
        "F.scaled_dot_product_attention(q, k, v)   # no mask for T > 1",
        "mask = torch.ones(T, L).tril(L - T).bool()   # L = past_len + T",
        {"prefill_causal": False},
    ),
    dataclasses.replace(BUGS_BY_NAME["kv_head_order"], change=MappingProxyType({"kv_expand": "repeat"})),
)
_CACHE_BY_NAME = {b.name: b for b in _CACHE_CATALOGUE}
register_bugs(_CACHE_CATALOGUE)

CACHE_BUGS: Mapping[str, str] = MappingProxyType({b.name: b.description for b in _CACHE_CATALOGUE})
"""The cache check's catalogue: bug name -> one-line description (read-only)."""

# (B, n, P): a prefill of P tokens, then n - P one-token steps
_CACHE_PROBES = ((2, 6, 3), (1, 5, 2))


def _plant(bugs: tuple[str, ...]) -> _CacheRecipe:
    change = {k: v for b in bugs for k, v in _CACHE_BY_NAME[b].change.items()}
    return dataclasses.replace(_CacheRecipe(), **change)  # type: ignore[arg-type]


def _decode(r: _CacheRecipe, p: ReferenceParams, x: Tensor, prefill: int) -> Tensor:
    """Prefill ``x[:, :prefill]`` then one-token steps, the way ``r`` says: ``(B, n, d) -> (B, n, d)``."""
    B, n, d = x.shape
    h, g, d_k = p.num_heads, p.num_kv_heads, p.d_k
    keys = values = x.new_zeros(B, g, 0, d_k)  # (B, g, cached, d_k)
    key_pos = torch.zeros(0, dtype=torch.long)  # (cached,): each cached key's position
    outs = []
    for s, e in [(0, prefill)] + [(t, t + 1) for t in range(prefill, n)]:
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
        mask = KP[None, :] <= torch.arange(s, e)[:, None]  # (t, cached): causal
        if s == 0 and not r.prefill_causal:
            mask = torch.ones_like(mask)
        if g < h:
            K, V = ((t.repeat_interleave(h // g, dim=1) if r.kv_expand == "repeat_interleave"
                     else t.repeat(1, h // g, 1, 1)) for t in (K, V))  # (B, h, cached, d_k)
        weights = masked_softmax(q @ K.transpose(-2, -1) / math.sqrt(d_k), mask)  # (B, h, t, cached)
        concat = (weights @ V).transpose(1, 2).reshape(B, e - s, h * d_k)  # (B, t, d)
        outs.append(_linear(concat, p, "o"))  # (B, t, d)
    return torch.cat(outs, dim=1)  # (B, n, d)


def _linear(x: Tensor, p: ReferenceParams, role: str) -> Tensor:
    """``x @ W + b`` for one role of the reference's weights."""
    b = p.b[role]
    return x @ p.w[role] if b is None else x @ p.w[role] + b


def _run_step(step: Step, x: Tensor, prefill: int) -> Tensor:
    """The reader's decoding of ``x: (B, n, d)``: prefill, then one token at a time."""
    state: Any = None
    outs = []
    for s, e in [(0, prefill)] + [(t, t + 1) for t in range(prefill, x.shape[1])]:
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
    pairs: bool = True, dtype: torch.dtype | None = None,
) -> AuditReport:
    """Check incremental decoding against the full causal pass, and name the cache bug.

    Args:
        step: your decoding step ``step(x_new, state) -> (out, state)`` (see :data:`Step`):
            ``x_new: (B, t, d_model)``, ``out: (B, t, d_model)``; ``state`` is ``None`` at the
            first call of each sequence and what you returned afterwards.
        reference: an :class:`~attnlib.MultiHeadAttention` holding your weights (with
            ``num_kv_heads`` and ``rope_base`` as your module has them); the expected outputs are
            ``reference(x, x, x, mask=causal)``.
        seed, rtol, pairs, dtype: as in :func:`~attnlib.audit.diagnose`.

    Returns:
        an :class:`~attnlib.audit.AuditReport` whose ``errors`` are per ``"prefill"`` and
        ``"steps"``, and whose bugs come from :data:`CACHE_BUGS`.

    Raises:
        TypeError: ``step`` not callable or not returning ``(out, state)``; ``reference`` not a
            MultiHeadAttention.
        ValueError: ``step`` raising (the message says where), returning the wrong shape, or
            different outputs for the same input; ``rtol <= 0``.
    """
    if not callable(step):
        raise TypeError(f"step must be a callable step(x_new, state) -> (out, state), got {type(step).__name__}")
    check_reference(reference)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol > 0):
        raise ValueError(f"rtol must be a positive number, got {rtol!r}")
    ref_dtype = reference.w_q.dtype
    in_dtype = dtype or module_dtype(step) or ref_dtype
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, n, reference.d_model, generator=g, dtype=torch.float64) for B, n, _ in _CACHE_PROBES]
    prefills = [P for _, _, P in _CACHE_PROBES]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        device = reference.w_q.device
        yours = [_run_step(step, x.to(in_dtype).to(device), P) for x, P in zip(xs, prefills)]
        if not torch.equal(torch.nan_to_num(_run_step(step, xs[0].to(in_dtype).to(device), prefills[0])),
                           torch.nan_to_num(yours[0])):
            raise ValueError("step gave different outputs for the same input: is dropout on? Call module.eval().")
        w64 = ReferenceParams.of(reference, torch.float64)
        probes = [Probe("steps", x, None, None) for x in xs]
        rtol = tolerance(None if rtol is None else float(rtol), ref_dtype, yours[0].dtype, reference, w64, probes)
        with torch.no_grad():
            for x, right in zip(xs, (_decode(_CacheRecipe(), w64, x, P) for x, P in zip(xs, prefills))):
                n = x.shape[1]
                mask = torch.ones(n, n, dtype=torch.bool).tril()
                expected = reference(*(x.to(ref_dtype).to(device),) * 3, mask=mask.to(device))[0].cpu()
                if relative_error(expected, right) > max(rtol, default_rtol(ref_dtype)):
                    raise RuntimeError("attnlib.audit's model of decoding disagrees with reference.forward; "
                                       "is reference a subclass with its own forward?")

        def errors_of(r: _CacheRecipe) -> dict[str, float]:
            errs = {"prefill": 0.0, "steps": 0.0}
            for x, P, y in zip(xs, prefills, yours):
                out = _decode(r, w64, x, P)
                errs["prefill"] = max(errs["prefill"], relative_error(y[:, :P], out[:, :P]))
                errs["steps"] = max(errs["steps"], relative_error(y[:, P:], out[:, P:]))
            return errs

        errors = errors_of(_CacheRecipe())
        ok = max(errors.values()) <= rtol
        grouped, rope = w64.num_kv_heads < w64.num_heads, w64.rope_base is not None
        active = [b for b in _CACHE_CATALOGUE
                  if b.needs <= {n for n, on in (("grouped", grouped), ("rope", rope)) if on}]

        def fits(names: tuple[str, ...], targets: list[Tensor]) -> bool:
            r = _plant(names)
            return all(relative_error(y, _decode(r, w64, x, P)) <= rtol for x, P, y in zip(xs, prefills, targets))

        rights = [_decode(_CacheRecipe(), w64, x, P) for x, P in zip(xs, prefills)]
        undetectable = tuple(b.name for b in active if fits((b.name,), rights))
        explanations: tuple[tuple[str, ...], ...] = ()
        if not ok:
            explanations = tuple((b.name,) for b in active if fits((b.name,), yours))
            if not explanations and pairs:
                explanations = tuple((a.name, b.name) for a, b in itertools.combinations(active, 2)
                                     if fits((a.name, b.name), yours))
    finally:
        torch.set_num_threads(threads)
    names = tuple(dict.fromkeys(itertools.chain.from_iterable(explanations)))
    return AuditReport(
        ok=ok, bugs=names, explanations=explanations, max_error=max(errors.values()),
        errors=MappingProxyType(errors), undetectable=undetectable, rtol=rtol, num_heads=reference.num_heads,
        dtype=str(yours[0].dtype).removeprefix("torch."), reference_dtype=str(ref_dtype).removeprefix("torch."),
        tie=tie_reason(frozenset(names), reference.num_heads, reference.d_k) if len(explanations) > 1 else "",
        hint="" if ok or explanations else hint_for(errors, rtol)
        + " If the full pass is wrong too, check it first with diagnose(..., causal=True).",
    )
