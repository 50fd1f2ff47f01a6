r"""The layer computed the way a :class:`~attnlib.audit.catalogue.Recipe` says, from a
reference's weights and attnlib's own pieces (:func:`~attnlib.masked_softmax`,
:func:`~attnlib.decoding.apply_rope`); and :func:`planted`, that layer as a ``forward``.

A query whose keys are all blocked (a *blocked line* of the softmax) has no defined output;
modules differ there, by convention rather than by bug. :data:`CONVENTIONS` are the ones
met in practice: attnlib's zero weights, the NaN of a softmax over ``-inf``, the uniform
weights of a large finite fill (``-1e9``, ``finfo.min``), and the raw softmax of an additive
mask that every key of the line received alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlib.attention import masked_softmax
from attnlib.audit.catalogue import BUGS, BUGS_BY_NAME, Recipe, can_plant_together
from attnlib.audit.checks import check_flags, check_reference
from attnlib.decoding import DecoderAttention, apply_rope, rope_angles, rotate_half
from attnlib.decoding.positions import AlibiAttention, alibi_slopes
from attnlib.multihead import MultiHeadAttention

__all__ = ["CONVENTIONS", "Forward", "ReferenceParams", "decoder_options", "modes_of", "planted", "run_recipe"]

Forward = Callable[..., Tensor]
"""A learner's layer: ``forward(x, mask) -> out`` (``forward(x, context, mask)`` for
cross-attention); ``x: (B, n, d_model)``, ``out: (B, n, d_model)``."""

CONVENTIONS: dict[str, str] = {
    "zeros": "zeros (no value read; attnlib's convention)",
    "NaN": "NaN (a softmax over -inf only)",
    "mean of values": "the mean of all values (uniform weights, as a -1e9 or finfo.min fill gives)",
    "as if unmasked": "the unmasked softmax (an additive mask that every key of the row got alike)",
}
"""What a module may return for a query whose keys are all blocked: name -> description."""


@dataclass(frozen=True)
class ReferenceParams:
    """The reference's parameters (detached), paper orientation; biases may be None.

    ``w["q"]: (d_model, h*d_k)``, ``w["k"], w["v"]: (d_model, g*d_k)``, ``w["o"]: (h*d_k, d_model)``.
    """

    w: Mapping[str, Tensor]
    b: Mapping[str, Tensor | None]
    num_heads: int
    num_kv_heads: int
    rope_base: float | None
    alibi: bool = False  # ALiBi's bias added to the scaled scores (AlibiAttention)

    @classmethod
    def of(cls, ref: MultiHeadAttention, dtype: torch.dtype) -> ReferenceParams:
        w = {r: getattr(ref, f"w_{r}").detach().to(dtype) for r in "qkvo"}
        b = {r: _opt(getattr(ref, f"b_{r}"), dtype) for r in "qkvo"}
        return cls(w, b, ref.num_heads, *decoder_options(ref), isinstance(ref, AlibiAttention))

    @property
    def d_k(self) -> int:
        return self.w["q"].shape[1] // self.num_heads

    def position_bias(self, q_pos: Tensor, k_pos: Tensor, dtype: torch.dtype) -> Tensor | None:
        """ALiBi's bias ``-m_i (p - j)`` for query positions ``q_pos: (n_q,)`` and key positions
        ``k_pos: (n_k,)``: ``(h, n_q, n_k)``; None without ALiBi."""
        if not self.alibi:
            return None
        m = alibi_slopes(self.num_heads)  # (h,) float64
        gap = (q_pos[:, None] - k_pos[None, :]).to(torch.float64)  # (n_q, n_k)
        return (-m[:, None, None] * gap).to(dtype)  # (h, n_q, n_k)


def decoder_options(reference: MultiHeadAttention) -> tuple[int, float | None]:
    """``(num_kv_heads, rope_base)`` of a reference: chapter 8's
    :class:`~attnlib.decoding.DecoderAttention` has them; the plain layer has one key/value
    head per query head and no RoPE."""
    if isinstance(reference, DecoderAttention):
        return reference.num_kv_heads, reference.rope_base
    return reference.num_heads, None


def _opt(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.detach().to(dtype)


def _project(x: Tensor, w: Tensor, b: Tensor | None, recipe: Recipe) -> Tensor:
    """``x @ W + b`` (or the buggy ``x @ W.T + b``): ``(B, n, d_in) -> (B, n, d_out)``."""
    y = x @ (w if recipe.projection == "x @ W" else w.T)  # (B, n, d_out)
    return y if b is None else y + b


def _split(t: Tensor, heads: int, recipe: Recipe) -> Tensor:
    """``(B, n, heads*d_k) -> (B, heads, n, d_k)``."""
    B, n, d = t.shape
    if recipe.split == "view":
        return t.reshape(B, heads, n, d // heads)  # positions and heads mixed up
    return t.view(B, n, heads, d // heads).transpose(1, 2)  # (B, heads, n, d_k)


def _rope(t: Tensor, positions: Tensor, base: float, recipe: Recipe) -> Tensor:
    """RoPE of ``t: (B, heads, n, d_k)`` at ``positions: (n,)`` in the recipe's layout."""
    if recipe.rope == "rotate-half":
        return apply_rope(t, positions, base)  # (B, heads, n, d_k)
    angles = rope_angles(positions, t.shape[-1], base)  # (n, d_k/2)
    cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)  # (n, d_k/2)
    if recipe.rope == "adjacent":  # pairs (2j, 2j+1) turned by p*w_j (GPT-J, Meta's complex form)
        a, b = t[..., ::2], t[..., 1::2]  # (B, heads, n, d_k/2) each
        return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)  # (.., d_k)
    cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)  # (n, d_k): interleaved
    return t * cos + rotate_half(t) * sin  # (B, heads, n, d_k)


def _causal(n_q: int, n_k: int, recipe: Recipe, device: torch.device) -> Tensor:
    """The module's own causal mask, bool ``(n_q, n_k)``, True = may attend."""
    i = torch.arange(n_q, device=device)[:, None]  # (n_q, 1)
    j = torch.arange(n_k, device=device)[None, :]  # (1, n_k)
    return {"j <= i": j <= i, "j < i": j < i, "j <= i + 1": j <= i + 1, "j >= i": j >= i}[recipe.causal]


def _padding(pad: Tensor, h: int, n_q: int, recipe: Recipe) -> Tensor:
    """A key-padding mask ``(B, n_k)`` (True = real) as the module broadcasts it: 4-D."""
    B = pad.shape[0]
    if recipe.padding == "keys":
        return pad[:, None, None, :]  # (B, 1, 1, n_k)
    if recipe.padding == "queries":
        return pad[:, None, :, None]  # (B, 1, n_k, 1): blocks padded queries, fails if n_q != n_k
    if recipe.padding == "keys and queries":
        return pad[:, None, :, None] & pad[:, None, None, :]  # (B, 1, n, n): a padded query sees nothing
    b, i = torch.arange(B)[:, None], torch.arange(h)[None, :]  # (B, 1), (1, h)
    if recipe.padding == "fold b*h+i by repeat":
        rows = (b * h + i) % B  # (B, h): mask.repeat(h, 1)[b*h + i]
    else:
        rows = (i * B + b) // h  # (B, h): mask.repeat_interleave(h, 0)[i*B + b]
    return pad[rows.to(pad.device)][:, :, None, :]  # (B, h, 1, n_k)


def _mask(
    r: Recipe, p: ReferenceParams, n_q: int, n_k: int, mask: Tensor | None, causal: bool, padding: bool,
    device: torch.device,
) -> Tensor | None:
    """The mask the module attends with, broadcastable to ``(B, h, n_q, n_k)``, or None.

    The polarity and ignored-mask bugs act on the mask the module is given, or, given none,
    on its own causal mask."""
    given = None if mask is None else (_padding(mask, p.num_heads, n_q, r) if padding else mask)
    own = _causal(n_q, n_k, r, device) if causal else None
    if given is not None:
        given = None if r.mask_use == "ignored" else (~given if r.mask_true == "blocked" else given)
    elif own is not None:
        own = None if r.mask_use == "ignored" else (~own if r.mask_true == "blocked" else own)
    if given is None or own is None:
        return given if own is None else own
    return given & own


_FINITE = {"-1e4": -1e4, "+ -1e4": -1e4, "-1e5": -1e5, "+ -1e5": -1e5}
"""The finite mask values of ``mask_fill_finite``: filled (``"-1e4"``) or added (``"+ -1e4"``)."""


def _weights(scores: Tensor, mask: Tensor | None, r: Recipe) -> dict[str, Tensor]:
    """Attention weights ``(B, h, n_q, n_k)`` per convention for blocked lines (one entry,
    ``"any"``, when no line of the softmax is entirely blocked)."""
    dim = r.softmax_dim
    if mask is None:
        return {"any": scores.softmax(dim=dim)}
    if r.mask_use == "0":
        return {"any": scores.masked_fill(~mask, 0.0).softmax(dim=dim)}
    if r.mask_use == "after softmax":
        return {"any": scores.softmax(dim=dim) * mask}
    if r.mask_use in _FINITE:  # a finite fill (or shift): no line is ever empty
        value = _FINITE[r.mask_use]
        if r.mask_use.startswith("+"):
            return {"any": (scores + torch.where(mask, 0.0, value)).softmax(dim=dim)}
        return {"any": scores.masked_fill(~mask, value).softmax(dim=dim)}
    mask = mask.expand(scores.shape)  # (B, h, n_q, n_k)
    weights = masked_softmax(scores, mask, dim=dim)  # 0 on a blocked line
    blocked = ~mask.any(dim=dim, keepdim=True)  # (..): lines with no allowed key
    if not blocked.any():
        return {"any": weights}
    blocked = blocked.expand(scores.shape)
    return {
        "zeros": weights,
        "NaN": weights.masked_fill(blocked, math.nan),
        "mean of values": torch.where(blocked, 1.0 / scores.shape[dim], weights),
        "as if unmasked": torch.where(blocked, scores.softmax(dim=dim), weights),
    }


def run_recipe(
    r: Recipe, p: ReferenceParams, x: Tensor, context: Tensor, mask: Tensor | None,
    *, causal: bool = False, padding: bool = False,
) -> dict[str, Tensor]:
    """The layer computed the way ``r`` says, per blocked-line convention (see :func:`_weights`).

    ``x: (B, n_q, d_model)`` gives the queries, ``context: (B, n_k, d_model)`` the keys and
    values (``x`` itself for self-attention); ``mask``: bool ``(n_q, n_k)``, or ``(B, n_k)``
    key padding when ``padding``, or None; ``causal``: the module adds its own causal mask.
    Returns ``(B, n_q, d_model)`` tensors."""
    h, g = p.num_heads, p.num_kv_heads
    v_role = "v" if r.value_weights == "W_v" else "k"
    q = _split(_project(x, p.w["q"], p.b["q"], r), h, r)  # (B, h, n_q, d_k)
    k = _split(_project(context if r.key_input == "context" else x, p.w["k"], p.b["k"], r), g, r)  # (B, g, n_k, d_k)
    v_in = context if r.value_input == "context" else x
    v = _split(_project(v_in, p.w[v_role], p.b[v_role], r), g, r)  # (B, g, n_k, d_k)
    if p.rope_base is not None:
        q = _rope(q, torch.arange(q.shape[-2]), p.rope_base, r)  # (B, h, n_q, d_k)
        k = _rope(k, torch.arange(k.shape[-2]), p.rope_base, r)  # (B, g, n_k, d_k)
        if r.rope_values:
            v = _rope(v, torch.arange(v.shape[-2]), p.rope_base, r)  # (B, g, n_k, d_k)
    if g < h:  # each group serves h/g query heads
        k, v = ((t.repeat_interleave(h // g, dim=1) if r.kv_expand == "repeat_interleave"
                 else t.repeat(1, h // g, 1, 1)) for t in (k, v))  # (B, h, n_k, d_k)
    d_k, d_model = q.shape[-1], x.shape[-1]
    scale = {"sqrt(d_k)": d_k**-0.5, "1": 1.0, "sqrt(d_model)": d_model**-0.5, "d_k": 1.0 / d_k}[r.scale]
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, h, n_q, n_k)
    n_q, n_k = q.shape[-2], k.shape[-2]  # ALiBi: the queries are the last n_q of the n_k positions
    bias = p.position_bias(torch.arange(n_k - n_q, n_k), torch.arange(n_k), scores.dtype)
    if bias is not None:
        scores = scores + bias  # (B, h, n_q, n_k)
    m = _mask(r, p, q.shape[-2], k.shape[-2], mask, causal, padding, x.device)
    return {c: _finish(w @ v, p, r) for c, w in _weights(scores, m, r).items()}  # (B, n_q, d_model)


def _finish(heads: Tensor, p: ReferenceParams, recipe: Recipe) -> Tensor:
    """Merge the heads ``(B, h, n, d_k) -> (B, n, d)`` and apply ``W^O`` (or not)."""
    B, h, n, d_k = heads.shape
    if recipe.merge == "reshape":
        concat = heads.reshape(B, n, h * d_k)  # heads and positions mixed up
    else:
        concat = heads.transpose(1, 2).reshape(B, n, h * d_k)  # (B, n, h*d_k)
    if not recipe.output_projection:
        return concat
    return _project(concat, p.w["o"], p.b["o"], recipe)  # (B, n, d_model)


def modes_of(
    reference: MultiHeadAttention, causal: bool, padding: bool, cross: bool, takes_mask: bool = True,
) -> frozenset[str]:
    """The features of a call form and a reference that some bugs need (``"mask"``: the module
    masks something, a mask it is given or its own causal one)."""
    g, rope_base = decoder_options(reference)
    flags = {"causal": causal, "padding": padding, "cross": cross,
             "grouped": g < reference.num_heads, "rope": rope_base is not None,
             "mask": takes_mask or causal}
    return frozenset(name for name, on in flags.items() if on)


def _recipe_of(bugs: tuple[str, ...], modes: frozenset[str]) -> Recipe:
    """The recipe with ``bugs`` planted; unknown, clashing or out-of-place bugs refused."""
    recipe = Recipe()
    for i, name in enumerate(bugs):
        if name not in BUGS_BY_NAME:
            raise ValueError(f"unknown bug {name!r}; the catalogue has: {', '.join(BUGS)}")
        bug = BUGS_BY_NAME[name]
        if not bug.all_needs <= modes:
            raise ValueError(
                f"bug {name!r} needs {', '.join(sorted(bug.all_needs - modes))} "
                f"(pass causal=/padding=/cross=True, or a reference with num_kv_heads/rope_base)"
            )
        for other in bugs[:i]:
            if not can_plant_together(BUGS_BY_NAME[other], bug):
                raise ValueError(f"bugs {other!r} and {name!r} change the same step; plant one of them")
        recipe = bug.recipe(recipe)
    return recipe


def planted(
    reference: MultiHeadAttention, *bugs: str, causal: bool = False, padding: bool = False,
    cross: bool = False, blocked: str = "zeros",
) -> Forward:
    """``reference``'s layer with the named bugs planted, as a forward in :func:`diagnose`'s
    call form: ``forward(x, mask)``, or ``forward(x, context, mask)`` with ``cross=True``.

    ``x: (B, n_q, d_model)``; ``context: (B, n_k, d_model)``; ``mask``: bool ``(n_q, n_k)``,
    or ``(B, n_k)`` key padding (True = real token) with ``padding=True``, or None; with
    ``causal=True`` the layer masks the future itself. ``blocked``: what a query with no
    allowed key returns (a key of :data:`CONVENTIONS`). With no bug it computes
    ``reference(x, context, context, mask)[0]``. Bugs that change the same step
    (``missing_scale`` and ``scale_by_d_model``) cannot be planted together; a bug that
    needs a call form (``causal_*``: ``causal=True``) or a reference feature
    (``kv_head_order``: ``num_kv_heads``) refuses to be planted without it.
    """
    check_reference(reference)
    check_flags(causal, padding, cross)
    if blocked not in CONVENTIONS:
        raise ValueError(f"blocked must be one of {', '.join(CONVENTIONS)}, got {blocked!r}")
    recipe = _recipe_of(bugs, modes_of(reference, causal, padding, cross))

    def run(x: Tensor, context: Tensor, mask: Tensor | None) -> Tensor:
        params = ReferenceParams.of(reference, x.dtype)
        outs = run_recipe(recipe, params, x, context, mask, causal=causal, padding=padding)
        return outs["any"] if "any" in outs else outs[blocked]

    if cross:
        return run
    return lambda x, mask=None: run(x, x, mask)
