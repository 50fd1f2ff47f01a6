r"""Attention without the n x n matrix: blockwise, online softmax (chapter 10).

:func:`attnlib.attention` writes out the scores and the weights, two ``(n_q, n_k)``
matrices. This module computes the same output one tile of keys at a time, keeping per
query only a running maximum :math:`m`, a running sum :math:`\ell` and an unnormalised
output (the *online softmax* of Milakov & Gimelshein 2018; Rabe & Staats 2021), with
queries tiled as well (FlashAttention, Dao et al. 2022). Its pieces:

- :class:`Partial` and :func:`attend_block`: attention over *some* of the keys, kept as
  the normalised output and the log-sum-exp of its scores;
- :func:`merge`: two partials over disjoint sets of keys -> the partial over their union
  (the log-sum-exp combine; Flash-Decoding's split-K reduction, Dao et al. 2023);
- :func:`blockwise_attention`: the tiled loop (forward, and a backward in either loop
  order), which never holds more than one ``(block_q, block_k)`` tile of scores, skips
  tiles the mask rules out, and keeps float32 accumulators for float16 and bfloat16 inputs;
- :func:`split_k_attention`: the keys split among ``num_splits`` workers, then merged.

:func:`intermediate_bytes`, :func:`rounding_bound` and :func:`gradient_rounding_bound` (the
bytes held, how far two evaluations may differ) come from :mod:`attnlib.blockwise_bounds`.

Masks follow :func:`attnlib.attention`: boolean, ``True`` = may attend, broadcastable to the
scores ``(..., n_q, n_k)``. A query with no allowed key gets a zero output, a log-sum-exp of
``-inf`` and zero gradients, as :func:`attnlib.attention` defines it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnlib.checks import check_mask, check_positive_int, check_tensor, format_shape
from attnlib.attention import check_qkv, check_scale
from attnlib.blockwise_bounds import accumulator_dtype, gradient_rounding_bound, intermediate_bytes, rounding_bound

__all__ = [
    "Partial",
    "BlockwiseResult",
    "attend_block",
    "merge",
    "blockwise_attention",
    "split_k_attention",
    "tile_counts",
    "intermediate_bytes",
    "rounding_bound",
    "gradient_rounding_bound",
    "BACKWARD_ORDERS",
]

BACKWARD_ORDERS = ("kv_outer", "q_outer")  # blockwise_attention(backward_order=...)


class Partial(NamedTuple):
    r"""Attention of each query over a subset :math:`S` of the keys.

    - ``out``: ``(..., n_q, d_v)``, :math:`\sum_{j \in S} e^{s_j - \mathrm{lse}}\, v_j`, the
      output as if :math:`S` were all the keys (0 where no key of :math:`S` is allowed);
    - ``lse``: ``(..., n_q)``, :math:`\log \sum_{j \in S} e^{s_j}` over the allowed keys
      (``-inf`` where there is none).
    """

    out: Tensor
    lse: Tensor


class BlockwiseResult(NamedTuple):
    """What :func:`blockwise_attention` returns: the output ``(..., n_q, d_v)``, the
    log-sum-exp of each query's scores ``(..., n_q)`` (``-inf`` for a query with no allowed
    key), and how many ``(block_q, block_k)`` tiles were computed and skipped."""

    out: Tensor
    lse: Tensor
    computed: int
    skipped: int


# ---- one block, and the merge of two -------------------------------------------------------
def _safe(m: Tensor) -> Tensor:
    """``m`` with ``-inf`` replaced by 0: the shift for a row with no allowed key, whose
    exponentials are then ``exp(-inf) = 0`` instead of ``exp(-inf - -inf) = NaN``."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _scores(q: Tensor, k: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    """One tile of scores ``(..., b_q, b_k)``, scaled and masked in place (no second tile)."""
    s = (q @ k.transpose(-2, -1)).mul_(scale)  # (..., b_q, b_k)
    return s if mask is None else s.masked_fill_(~mask, float("-inf"))


def attend_block(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None
) -> Partial:
    r"""Exact attention of the queries over one block of keys, as a :class:`Partial`.

    .. math::
        m = \max_j s_j, \quad \mathrm{lse} = m + \log \sum_j e^{s_j - m}, \quad
        \mathrm{out} = \sum_j e^{s_j - \mathrm{lse}}\, v_j, \qquad s = q K^\top \cdot \mathrm{scale}.

    Shapes: ``q`` ``(..., n_q, d_k)``, ``k`` ``(..., b, d_k)``, ``v`` ``(..., b, d_v)``, ``mask``
    bool broadcastable to ``(..., n_q, b)``; returns ``out`` ``(..., n_q, d_v)`` and ``lse``
    ``(..., n_q)``. ``scale`` defaults to :math:`1/\sqrt{d_k}`.
    """
    if check_tensor("q", q).dim() < 2:
        raise ValueError(f"q must have shape (..., n_q, d_k), got {format_shape(q)}")
    batch = check_qkv(q, k, v)
    if mask is not None:
        check_mask(mask, batch + (q.shape[-2], k.shape[-2]))
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_scale(scale)
    s = _scores(q, k, sc, mask)  # (..., n_q, b)
    m = _safe(s.amax(-1))  # (..., n_q)
    p = torch.exp(s - m[..., None])  # (..., n_q, b), 0 where masked
    total = p.sum(-1)  # (..., n_q), 0 for a query with no allowed key
    out = (p @ v) / torch.where(total > 0, total, torch.ones_like(total))[..., None]  # (..., n_q, d_v)
    return Partial(out, m + torch.log(total))  # log 0 = -inf: no allowed key


def merge(a: Partial, b: Partial) -> Partial:
    r"""The partial over the union of two disjoint sets of keys (the log-sum-exp combine).

    .. math::
        \mathrm{lse} = \log\!\left(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}\right), \qquad
        \mathrm{out} = e^{\mathrm{lse}_a - \mathrm{lse}}\, \mathrm{out}_a
                     + e^{\mathrm{lse}_b - \mathrm{lse}}\, \mathrm{out}_b .

    The two factors are the shares of the softmax's mass that each set holds; they sum to 1.
    Exact in real arithmetic, commutative and associative, so partials can be merged in any
    order and grouping. A query empty on both sides stays ``out = 0``, ``lse = -inf``.

    Shapes: ``a.out``, ``b.out`` ``(..., n_q, d_v)``; ``a.lse``, ``b.lse`` ``(..., n_q)``.
    """
    for name, p in (("a", a), ("b", b)):
        if not isinstance(p, Partial):
            raise TypeError(f"{name} must be an attnlib.blockwise.Partial, got {type(p).__name__}")
        if p.lse.shape != p.out.shape[:-1]:
            raise ValueError(f"{name}.lse must have shape {format_shape(p.out.shape[:-1])} "
                             f"(that of {name}.out without its last axis), got {format_shape(p.lse)}")
    if a.out.shape != b.out.shape:
        raise ValueError(f"a.out and b.out must have one shape, got {format_shape(a.out)} and {format_shape(b.out)}")
    lse = torch.logaddexp(a.lse, b.lse)  # (..., n_q); -inf only if both are
    shift = _safe(lse)
    w_a = torch.exp(a.lse - shift)[..., None]  # (..., n_q, 1), a's share of the mass
    w_b = torch.exp(b.lse - shift)[..., None]  # (..., n_q, 1)
    return Partial(w_a * a.out + w_b * b.out, lse)


# ---- the tiled loop ---------------------------------------------------------------------------
def tile_counts(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = False) -> tuple[int, int]:
    """``(computed, skipped)``: how many ``(block_q, block_k)`` tiles of an ``n_q x n_k`` score
    matrix :func:`blockwise_attention` computes and skips with only the causal rule (no other
    mask). A tile is skipped when its first key lies after its last query's position."""
    for name, x in (("n_q", n_q), ("n_k", n_k), ("block_q", block_q), ("block_k", block_k)):
        check_positive_int(name, x)
    tq, tk = -(-n_q // block_q), -(-n_k // block_k)
    if not causal:
        return tq * tk, 0
    offset = n_k - n_q  # query i sits at position offset + i
    skipped = sum(1 for i in range(tq) for j in range(tk)
                  if j * block_k > offset + min((i + 1) * block_q, n_q) - 1)
    return tq * tk - skipped, skipped


def _causal_tile(i0: int, i1: int, j0: int, j1: int, offset: int, device: torch.device) -> Tensor:
    """The causal mask of one tile, ``(i1 - i0, j1 - j0)``: key ``j`` <= query position ``offset + i``."""
    rows = torch.arange(i0, i1, device=device)[:, None] + offset  # (b_q, 1)
    return torch.arange(j0, j1, device=device)[None, :] <= rows  # (b_q, b_k)


def _tile_mask(mask: Tensor | None, causal: bool, i0: int, i1: int, j0: int, j1: int,
               offset: int, device: torch.device) -> tuple[Tensor | None, bool]:
    """The mask of tile ``[i0:i1, j0:j1]`` (or None: all allowed) and whether it allows nothing."""
    tile = None if mask is None else mask[..., i0:i1, j0:j1]  # (..., b_q, b_k)
    if causal:
        if j0 > offset + i1 - 1:  # every key after every query of the tile
            return None, True
        if j1 - 1 > offset + i0:  # the diagonal crosses the tile
            c = _causal_tile(i0, i1, j0, j1, offset, device)  # (b_q, b_k)
            tile = c if tile is None else tile & c
    return tile, tile is not None and not bool(tile.any())


def _prepare(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None,
             block_q: int, block_k: int, causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None, float, bool]:
    """Check the arguments; broadcast to one batch shape (views); a single query gets its axis."""
    batch = check_qkv(q, k, v)
    check_positive_int("block_q", block_q)
    check_positive_int("block_k", block_k)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_scale(scale)
    single = q.dim() == 1
    n_k = k.shape[-2]
    if single:
        if mask is not None and mask.dim() >= 1:
            check_mask(mask, batch + (n_k,))  # against the scores (..., n_k)
            mask = mask.unsqueeze(-2)  # (..., 1, n_k)
        q = q.unsqueeze(0)  # (1, d_k)
    n_q = q.shape[-2]
    if causal and n_k < n_q:
        raise ValueError(f"causal attention needs n_k >= n_q (the queries are the last n_q of the n_k "
                         f"positions): q has shape {format_shape(q)}, k has shape {format_shape(k)}")
    if mask is not None:
        check_mask(mask, batch + (n_q, n_k))
        mask = mask.expand(batch + (n_q, n_k))  # (..., n_q, n_k), a view
    q = q.expand(batch + q.shape[-2:])  # (..., n_q, d_k), a view
    k = k.expand(batch + k.shape[-2:])  # (..., n_k, d_k)
    v = v.expand(batch + v.shape[-2:])  # (..., n_k, d_v)
    return q, k, v, mask, sc, single


def _online_step(m: Tensor, ell: Tensor, acc: Tensor, s: Tensor, v: Tensor) -> Tensor:
    r"""One tile of the online softmax, in place: ``ell``, ``acc`` updated, ``s`` made :math:`e^{s - m'}`;
    returns the new running max :math:`m'`. Shapes: ``m``, ``ell`` ``(..., b_q)``; ``acc``
    ``(..., b_q, d_v)``; scores ``s`` ``(..., b_q, b_k)`` (``-inf`` where masked); ``v`` ``(..., b_k, d_v)``."""
    m_new = torch.maximum(m, s.amax(-1))  # (..., b_q)
    shift = _safe(m_new)
    p = s.sub_(shift[..., None]).exp_()  # (..., b_q, b_k), in place of s; 0 where masked
    rescale = torch.exp(m - shift)  # (..., b_q): the old sums were relative to the old max
    ell.mul_(rescale).add_(p.sum(-1))  # (..., b_q)
    acc.mul_(rescale[..., None]).add_(p @ v)  # (..., b_q, d_v)
    return m_new


def _forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
             block_q: int, block_k: int, causal: bool) -> BlockwiseResult:
    """The FlashAttention loop over tiles: per query tile a running max, sum and output, kept
    in float32 for float16 and bfloat16 inputs (``acc``); the output is cast back at the end."""
    n_q, n_k, offset = q.shape[-2], k.shape[-2], k.shape[-2] - q.shape[-2]
    acc_t = accumulator_dtype(q.dtype)
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])  # (..., n_q, d_v)
    lse = q.new_empty(q.shape[:-1], dtype=acc_t)  # (..., n_q)
    computed = skipped = 0
    for i0 in range(0, n_q, block_q):
        i1 = min(i0 + block_q, n_q)
        q_i = q[..., i0:i1, :].to(acc_t)  # (..., b_q, d_k)
        m = q_i.new_full(q_i.shape[:-1], float("-inf"))  # (..., b_q) running max
        ell = torch.zeros_like(m)  # (..., b_q) running sum of exp(s - m)
        acc = q_i.new_zeros(q_i.shape[:-1] + v.shape[-1:])  # (..., b_q, d_v) running sum of exp(s - m) v
        for j0 in range(0, n_k, block_k):
            j1 = min(j0 + block_k, n_k)
            tile, empty = _tile_mask(mask, causal, i0, i1, j0, j1, offset, q.device)
            if empty:
                skipped += 1
                continue
            computed += 1
            s = _scores(q_i, k[..., j0:j1, :].to(acc_t), scale, tile)  # (..., b_q, b_k): the one tile held
            m = _online_step(m, ell, acc, s, v[..., j0:j1, :].to(acc_t))
            del s  # freed before the next tile is computed
        out[..., i0:i1, :] = acc / torch.where(ell > 0, ell, torch.ones_like(ell))[..., None]
        lse[..., i0:i1] = m + torch.log(ell)  # -inf where no key was allowed
    return BlockwiseResult(out, lse, computed, skipped)


def _row_terms(out: Tensor, lse: Tensor, d_out: Tensor, d_lse: Tensor | None, acc_t: torch.dtype
               ) -> tuple[Tensor, Tensor]:
    """``D = rowsum(dO * O) - dlse`` (``d lse_i / d s_ij = P_ij``) and the shift ``lse`` (0 for a
    query with no allowed key), both ``(..., n_q)``, in the accumulator dtype."""
    D = (d_out.to(acc_t) * out.to(acc_t)).sum(-1)  # (..., n_q) = sum_j P_ij dP_ij
    if d_lse is not None:
        D = D - torch.where(torch.isfinite(lse), d_lse, torch.zeros_like(d_lse)).to(acc_t)
    return D, _safe(lse.to(acc_t))


def _backward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, block_q: int,
              block_k: int, causal: bool, out: Tensor, lse: Tensor, d_out: Tensor,
              d_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    r"""Gradients from the saved log-sum-exp, query tiles outside (this book's first version).

    Per tile: :math:`P = e^{S - \mathrm{lse}}` (recomputed, exact weights),
    :math:`dV \mathrel{+}= P^\top dO`, :math:`dP = dO\, V^\top`,
    :math:`dS = P \circ (dP - D)` with :math:`D = \mathrm{rowsum}(dO \circ O) - d\mathrm{lse}`,
    :math:`dQ \mathrel{+}= dS\, K \cdot \mathrm{scale}`, :math:`dK \mathrel{+}= dS^\top Q \cdot \mathrm{scale}`.
    :math:`dQ_i` stays with its tile; :math:`dK` and :math:`dV` are added into at every tile.
    """
    n_q, n_k, offset = q.shape[-2], k.shape[-2], k.shape[-2] - q.shape[-2]
    acc_t = accumulator_dtype(q.dtype)
    D, shift = _row_terms(out, lse, d_out, d_lse, acc_t)
    dq = q.new_empty(q.shape)
    dk, dv = k.new_zeros(k.shape, dtype=acc_t), v.new_zeros(v.shape, dtype=acc_t)
    for i0 in range(0, n_q, block_q):
        i1 = min(i0 + block_q, n_q)
        q_i, do_i = q[..., i0:i1, :].to(acc_t), d_out[..., i0:i1, :].to(acc_t)  # (..., b_q, d)
        dq_i = torch.zeros_like(q_i)  # (..., b_q, d_k)
        for j0 in range(0, n_k, block_k):
            j1 = min(j0 + block_k, n_k)
            tile, empty = _tile_mask(mask, causal, i0, i1, j0, j1, offset, q.device)
            if empty:
                continue
            k_j, v_j = k[..., j0:j1, :].to(acc_t), v[..., j0:j1, :].to(acc_t)  # (..., b_k, d)
            p = _scores(q_i, k_j, scale, tile).sub_(shift[..., i0:i1, None]).exp_()  # (..., b_q, b_k)
            dv[..., j0:j1, :] += p.transpose(-2, -1) @ do_i  # (..., b_k, d_v)
            ds = (do_i @ v_j.transpose(-2, -1)).sub_(D[..., i0:i1, None]).mul_(p).mul_(scale)
            dq_i += ds @ k_j  # (..., b_q, d_k)
            dk[..., j0:j1, :] += ds.transpose(-2, -1) @ q_i  # (..., b_k, d_k)
        dq[..., i0:i1, :] = dq_i
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _backward_kv_outer(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                       block_q: int, block_k: int, causal: bool, out: Tensor, lse: Tensor,
                       d_out: Tensor, d_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    r"""The same gradients with the key/value tiles outside, FlashAttention's order.

    For each tile of keys and values, :math:`dK_j` and :math:`dV_j` stay with it while the
    query tiles go by; only :math:`dQ` is added into at every tile (on a GPU, each key tile is
    one worker's and these adds are atomic). The per-tile formulas are :func:`_backward`'s.
    """
    n_q, n_k, offset = q.shape[-2], k.shape[-2], k.shape[-2] - q.shape[-2]
    acc_t = accumulator_dtype(q.dtype)
    D, shift = _row_terms(out, lse, d_out, d_lse, acc_t)
    dq = q.new_zeros(q.shape, dtype=acc_t)
    dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)
    for j0 in range(0, n_k, block_k):
        j1 = min(j0 + block_k, n_k)
        k_j, v_j = k[..., j0:j1, :].to(acc_t), v[..., j0:j1, :].to(acc_t)  # (..., b_k, d)
        dk_j, dv_j = torch.zeros_like(k_j), torch.zeros_like(v_j)  # (..., b_k, d_k), (..., b_k, d_v)
        for i0 in range(0, n_q, block_q):
            i1 = min(i0 + block_q, n_q)
            tile, empty = _tile_mask(mask, causal, i0, i1, j0, j1, offset, q.device)
            if empty:
                continue
            q_i, do_i = q[..., i0:i1, :].to(acc_t), d_out[..., i0:i1, :].to(acc_t)  # (..., b_q, d)
            p = _scores(q_i, k_j, scale, tile).sub_(shift[..., i0:i1, None]).exp_()  # (..., b_q, b_k)
            dv_j += p.transpose(-2, -1) @ do_i  # (..., b_k, d_v)
            ds = (do_i @ v_j.transpose(-2, -1)).sub_(D[..., i0:i1, None]).mul_(p).mul_(scale)
            dq[..., i0:i1, :] += ds @ k_j  # (..., b_q, d_k): the atomic add
            dk_j += ds.transpose(-2, -1) @ q_i  # (..., b_k, d_k)
        dk[..., j0:j1, :], dv[..., j0:j1, :] = dk_j, dv_j
    return dq.to(q.dtype), dk, dv


class _BlockwiseFunction(torch.autograd.Function):
    """Forward by :func:`_forward`; saves only q, k, v, the output and the log-sum-exp
    (no ``n x n`` tensor), and recomputes each tile's weights in the backward of the order asked."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                block_q: int, block_k: int, causal: bool, order: str, counts: list[int]) -> tuple[Tensor, Tensor]:
        res = _forward(q, k, v, mask, scale, block_q, block_k, causal)
        counts[:] = [res.computed, res.skipped]  # apply() returns tensors only
        ctx.save_for_backward(q, k, v, res.out, res.lse)
        ctx.mask, ctx.args, ctx.order = mask, (scale, block_q, block_k, causal), order
        return res.out, res.lse

    @staticmethod
    def backward(ctx: Any, d_out: Tensor, d_lse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        scale, block_q, block_k, causal = ctx.args
        loop = _backward_kv_outer if ctx.order == "kv_outer" else _backward
        dq, dk, dv = loop(q, k, v, ctx.mask, scale, block_q, block_k, causal, out, lse, d_out, d_lse)
        return dq, dk, dv, None, None, None, None, None, None, None


def blockwise_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None, *,
    block_q: int = 128, block_k: int = 128, causal: bool = False, backward_order: str = "kv_outer",
) -> BlockwiseResult:
    r""":func:`attnlib.attention`'s output, computed tile by tile without the ``n_q x n_k`` matrix.

    For each tile of ``block_q`` queries, the keys are visited in tiles of ``block_k``,
    keeping per query a running maximum :math:`m`, sum :math:`\ell` and output :math:`a`:

    .. math::
        m' = \max(m, \max_j s_j), \quad
        \ell' = e^{m - m'} \ell + \sum_j e^{s_j - m'}, \quad
        a' = e^{m - m'} a + \sum_j e^{s_j - m'} v_j ,

    and at the end :math:`\mathrm{out} = a / \ell`, :math:`\mathrm{lse} = m + \log \ell`.
    A tile whose mask allows nothing is skipped (not computed). With ``causal=True`` query
    ``i`` may attend key ``j <= n_k - n_q + i`` (the queries are the last ``n_q`` positions,
    as :func:`attnlib.decoding.causal_mask`); the causal tiles are made one at a time and
    tiles wholly above the diagonal are skipped. Differentiable: the backward recomputes each
    tile's weights from the saved log-sum-exp (no ``n x n`` tensor is saved either), with the
    key/value tiles outside (``backward_order="kv_outer"``, FlashAttention's order) or the
    query tiles outside (``"q_outer"``). Float16 and bfloat16 inputs are computed and
    accumulated in float32 (:func:`~attnlib.blockwise_bounds.accumulator_dtype`); the output
    and the gradients come back in the input's dtype, the log-sum-exp in float32.

    Shapes (as :func:`attnlib.attention`): ``q`` ``(..., n_q, d_k)`` or ``(d_k,)``; ``k``
    ``(..., n_k, d_k)``; ``v`` ``(..., n_k, d_v)``; ``mask`` bool, ``True`` = may attend,
    broadcastable to ``(..., n_q, n_k)`` (``(..., n_k)`` for a single query). Returns
    ``out`` ``(..., n_q, d_v)``, ``lse`` ``(..., n_q)`` (without the ``n_q`` axis for a single
    query), and the numbers of tiles computed and skipped.

    A query with no allowed key: ``out = 0``, ``lse = -inf``, zero gradients.

    Raises:
        TypeError: a non-tensor input; a non-int block size; ``causal`` not a bool; ``scale``
            not a real number; ``backward_order`` not a str.
        ValueError: what :func:`attnlib.attention` refuses; a block size below 1;
            ``causal=True`` with fewer keys than queries; ``backward_order`` not one of
            :data:`BACKWARD_ORDERS`.
    """
    q, k, v, mask, sc, single = _prepare(q, k, v, mask, scale, block_q, block_k, causal)
    if not isinstance(backward_order, str):
        raise TypeError(f"backward_order must be a str, got {type(backward_order).__name__}")
    if backward_order not in BACKWARD_ORDERS:
        raise ValueError(f"backward_order must be one of {BACKWARD_ORDERS}, got {backward_order!r}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        counts: list[int] = []
        out, lse = _BlockwiseFunction.apply(q, k, v, mask, sc, block_q, block_k, causal, backward_order, counts)
        res = BlockwiseResult(out, lse, *counts)
    else:
        res = _forward(q, k, v, mask, sc, block_q, block_k, causal)
    if single:
        return BlockwiseResult(res.out.squeeze(-2), res.lse.squeeze(-1), res.computed, res.skipped)
    return res


def split_k_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
    *, num_splits: int, block_k: int = 128,
) -> tuple[Tensor, list[Partial]]:
    r"""Split the keys among ``num_splits`` workers, attend in each, merge (Flash-Decoding).

    Worker ``w`` gets the keys ``[w n_k / S, (w+1) n_k / S)`` (as equal as possible) and
    computes its :class:`Partial` with :func:`blockwise_attention`; :func:`merge` combines the
    partials. Meant for few queries against a long key/value cache, where tiling the queries
    leaves too little work to share out.

    Shapes as :func:`blockwise_attention` (``q`` may be ``(d_k,)``). Returns the output
    ``(..., n_q, d_v)`` and the workers' partials, in key order.

    Raises:
        TypeError, ValueError: as :func:`blockwise_attention`; ``num_splits`` not an int from 1
            to ``n_k``.
    """
    q, k, v, mask, sc, single = _prepare(q, k, v, mask, scale, 1, block_k, False)
    n_k = k.shape[-2]
    check_positive_int("num_splits", num_splits)
    if num_splits > n_k:
        raise ValueError(f"num_splits must be at most n_k = {n_k} (one key per worker at least), got {num_splits}")
    bounds = [w * n_k // num_splits for w in range(num_splits + 1)]
    parts = []
    for w in range(num_splits):  # independent: each could run on its own core or GPU block
        a, b = bounds[w], bounds[w + 1]
        m_w = None if mask is None else mask[..., a:b]  # (..., n_q, b - a)
        r = blockwise_attention(q, k[..., a:b, :], v[..., a:b, :], m_w, sc,
                                block_q=max(q.shape[-2], 1), block_k=block_k)
        parts.append(Partial(r.out, r.lse))
    total = parts[0]
    for p in parts[1:]:
        total = merge(total, p)
    out = total.out.squeeze(-2) if single else total.out
    if single:
        parts = [Partial(p.out.squeeze(-2), p.lse.squeeze(-1)) for p in parts]
    return out, parts
