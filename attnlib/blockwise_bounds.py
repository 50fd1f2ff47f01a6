r"""How much memory attention holds, and how close two evaluations must be (chapter 10).

Companions of :mod:`attnlib.blockwise`, for its checks and its benchmark:

- :func:`intermediate_bytes`: the bytes of the intermediates the naive and the blockwise
  algorithm hold at their peak;
- :func:`rounding_bound`, :func:`gradient_rounding_bound`: elementwise bounds on how far two
  evaluations of attention, or of its gradients, may differ by rounding alone (another tile
  size, another order of the sums, another library), derived from the computation.

Each is importable from :mod:`attnlib.blockwise` as well.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlib.checks import check_positive_int, check_tensor, format_shape
from attnlib.attention import attention

__all__ = ["intermediate_bytes", "rounding_bound", "gradient_rounding_bound"]


# ---- memory -------------------------------------------------------------------------------------
def intermediate_bytes(
    n_q: int, n_k: int, d_v: int, *, block_q: int | None = None, block_k: int | None = None,
    batch: int = 1, dtype: torch.dtype = torch.float32,
) -> int:
    r"""Bytes of the intermediates one attention call holds at its peak, inputs and output excluded.

    - naive (``block_q`` and ``block_k`` None), :func:`attnlib.attention`: the scores and the
      weights, two ``(n_q, n_k)`` matrices: :math:`2\, n_q n_k` numbers;
    - blockwise: one tile of scores and one of exponentials, two ``(b_q, b_k)``, plus the
      running state of one query tile, :math:`m, \ell` ``(b_q,)`` and the output accumulator
      ``(b_q, d_v)``, plus the log-sum-exp kept for the backward, ``(n_q,)``:
      :math:`2 b_q b_k + b_q (2 + d_v) + n_q` numbers.

    Times ``batch`` (batch entries times heads) and the dtype's size. The temporaries of one
    elementwise step (a rescale factor, a masked copy) are left out of both counts.
    """
    for name, x in (("n_q", n_q), ("n_k", n_k), ("d_v", d_v), ("batch", batch)):
        check_positive_int(name, x)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    size = torch.finfo(dtype).bits // 8
    if (block_q is None) != (block_k is None):
        raise ValueError("give both block_q and block_k (blockwise) or neither (naive)")
    if block_q is None or block_k is None:
        return batch * 2 * n_q * n_k * size
    b_q = min(check_positive_int("block_q", block_q), n_q)
    b_k = min(check_positive_int("block_k", block_k), n_k)
    return batch * (2 * b_q * b_k + b_q * (2 + d_v) + n_q) * size


# ---- how close two evaluations must be -----------------------------------------------------------
def rounding_bound(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    r"""Elementwise bounds on how far two evaluations of attention may differ by rounding.

    Write :math:`u` for the unit roundoff (``eps / 2``), :math:`S = \max_{ij} \sum_l |q_{il} k_{jl}|
    \cdot \mathrm{scale}` for the largest score's sum of absolute terms. A score computed in any
    order is off by at most :math:`d_k u S` (Higham 2002, section 3.1), which changes each weight
    :math:`p_{ij} = e^{s_{ij} - \mathrm{lse}_i}` by a relative :math:`2 d_k u S` (its own score and
    the shift). Summing the exponentials, one rescale per key block (at most :math:`n_k`), the
    division and the weighted sum of the values add at most :math:`3 n_k u` relative, to first
    order. So each evaluation is within :math:`u (2 d_k S + 3 n_k) (|P|\,|V|)_{ic}` of the exact
    output, and two evaluations (another tile size, order, library) within twice that:

    .. math::
        |\mathrm{out}_a - \mathrm{out}_b|_{ic} \le \varepsilon\,(2 d_k S + 3 n_k)\,(|P|\,|V|)_{ic},
        \qquad
        |\mathrm{lse}_a - \mathrm{lse}_b|_i \le \varepsilon\,(d_k S + 2 n_k + |\mathrm{lse}_i|) .

    The factor :math:`|P|\,|V|` (not the output's own size) matters: an output that is a small
    difference of large values carries the rounding of the large ones.

    Shapes: as :func:`attnlib.attention` (``q`` with its ``n_q`` axis); returns the bound on the
    output ``(..., n_q, d_v)`` and on the log-sum-exp ``(..., n_q)``, in float64. It writes out
    the ``n_q x n_k`` weights: a check for small problems.
    """
    if check_tensor("q", q).dim() < 2:
        raise ValueError(f"q must have shape (..., n_q, d_k), got {format_shape(q)}")
    eps = torch.finfo(q.dtype).eps
    q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))
    _, p = attention(q64, k64, v64, mask=mask, scale=scale)  # (..., n_q, n_k), checks the arguments
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    d_k, n_k = q.shape[-1], k.shape[-2]
    big = float((q64.abs() @ k64.abs().transpose(-2, -1)).amax()) * sc  # S
    out_bound = eps * (2 * d_k * big + 3 * n_k) * (p @ v64.abs())  # (..., n_q, d_v)
    s = (q64 @ k64.transpose(-2, -1)) * sc  # (..., n_q, n_k)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)  # (..., n_q)
    lse_bound = eps * (d_k * big + 2 * n_k + torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse)))
    return out_bound, lse_bound


def gradient_rounding_bound(
    q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, mask: Tensor | None = None,
    scale: float | None = None, d_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Elementwise bounds on how far two evaluations of the gradients may differ by rounding.

    The backward computes :math:`dV = P^\top dO`, :math:`dP = dO\, V^\top`,
    :math:`D = \mathrm{rowsum}(dO \circ O) - d\mathrm{lse}`, :math:`dS = P \circ (dP - D)`
    (times the scale), :math:`dQ = dS\, K`, :math:`dK = dS^\top Q`. Each is bounded as in
    :func:`rounding_bound`, relative to the same formula evaluated on absolute values: the weights
    carry the forward's relative error :math:`\varepsilon (2 d_k S + 3 n_k)`; :math:`dP` and
    :math:`D` add inner products of width :math:`d_v` each, :math:`dQ` one of width :math:`n_k`,
    :math:`dK` and :math:`dV` one of width :math:`n_q`:

    .. math::
        |dQ_a - dQ_b| \le \varepsilon\, w\, (|dS|_{\text{terms}}\, |K|), \quad
        w = 2 d_k S + 3 n_k + 2 d_v + n_k + n_q,

    with :math:`|dS|_{\text{terms}} = P \circ (|dO|\,|V|^\top + \mathrm{rowsum}(|dO| \circ P|V|) + |d\mathrm{lse}|)
    \cdot \mathrm{scale}`, and likewise :math:`|dS|_{\text{terms}}^\top |Q|` for :math:`dK`,
    :math:`P^\top |dO|` for :math:`dV`.

    Shapes: ``q`` ``(..., n_q, d_k)``, ``k`` ``(..., n_k, d_k)``, ``v`` ``(..., n_k, d_v)``,
    ``d_out`` ``(..., n_q, d_v)``, ``d_lse`` ``(..., n_q)`` or None. Returns the bounds for
    ``dq, dk, dv`` (shapes of the broadcast ``q, k, v``), float64; writes out ``P``.
    """
    if check_tensor("q", q).dim() < 2:
        raise ValueError(f"q must have shape (..., n_q, d_k), got {format_shape(q)}")
    eps = torch.finfo(q.dtype).eps
    q64, k64, v64, do = (t.detach().to(torch.float64) for t in (q, k, v, check_tensor("d_out", d_out)))
    _, p = attention(q64, k64, v64, mask=mask, scale=scale)  # (..., n_q, n_k)
    if do.shape != p.shape[:-1] + v64.shape[-1:]:
        raise ValueError(f"d_out must have the output's shape {format_shape(p.shape[:-1] + v64.shape[-1:])}, "
                         f"got {format_shape(d_out)}")
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    n_q, d_k = q.shape[-2], q.shape[-1]
    n_k, d_v = k.shape[-2], v.shape[-1]
    big = float((q64.abs() @ k64.abs().transpose(-2, -1)).amax()) * sc  # S
    w = eps * (2 * d_k * big + 3 * n_k + 2 * d_v + n_k + n_q)
    dp_terms = do.abs() @ v64.abs().transpose(-2, -1)  # (..., n_q, n_k)
    d_terms = (do.abs() * (p @ v64.abs())).sum(-1, keepdim=True)  # (..., n_q, 1)
    if d_lse is not None:
        d_terms = d_terms + d_lse.detach().to(torch.float64).abs()[..., None]
    ds_terms = p * (dp_terms + d_terms) * sc  # (..., n_q, n_k)
    return (w * (ds_terms @ k64.abs()),  # (..., n_q, d_k)
            w * (ds_terms.transpose(-2, -1) @ q64.abs()),  # (..., n_k, d_k)
            w * (p.transpose(-2, -1) @ do.abs()))  # (..., n_k, d_v)
