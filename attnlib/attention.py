"""Scaled dot-product attention for one query or many (chapter 1).

Everything here uses row vectors, as the paper does: a query is a row ``q`` of
width ``d_k``, the keys are the rows of ``K`` and the values the rows of ``V``.

Masks are boolean and ``True`` means *may attend*, the convention of
:func:`torch.nn.functional.scaled_dot_product_attention`.

A query whose keys are **all** masked out has nothing to read. attnlib defines
its weights to be all zero and its output to be the zero vector, with finite
gradients; :func:`_masked_softmax` is the one place that rule is written. A plain
softmax over a row of ``-inf`` would give NaN. PyTorch's
``scaled_dot_product_attention`` returns zeros there too, with zero gradients, from
release 2.5 on, the oldest that attnlib's ``pyproject.toml`` accepts (the tests
check both).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from attnlib.checks import broadcast_shape, check_mask, check_tensor, check_width, format_shape

__all__ = ["masked_softmax", "attention", "causal_mask", "check_qkv", "check_scale"]


def masked_softmax(scores: Tensor, mask: Tensor | None = None, dim: int = -1) -> Tensor:
    r"""Softmax of ``scores`` along ``dim``, over the entries where ``mask`` is True.

    .. math::
        \mathrm{softmax}(s)_j = \frac{m_j\, e^{s_j - c}}{\sum_l m_l\, e^{s_l - c}},
        \qquad c = \max_{l:\, m_l} s_l,

    with :math:`m_j \in \{0, 1\}` the mask. Subtracting the largest allowed score
    :math:`c` changes nothing mathematically and keeps every exponent ``<= 0``, so
    scores of any magnitude give no overflow. A row with no allowed entry is all
    zeros (not NaN).

    Args:
        scores: real tensor of any shape ``(..., n)``.
        mask: boolean, broadcastable to ``scores.shape``; ``True`` = keep.
        dim: the dimension to normalise over.

    Returns:
        weights of the same shape as ``scores``; each row sums to 1, or to 0 when
        its mask is all False.
    """
    scores = check_tensor("scores", scores)
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a floating-point tensor, got {scores.dtype}")
    if mask is None:
        return torch.softmax(scores, dim=dim)
    return _masked_softmax(scores, check_mask(mask, scores.shape), dim)


def _masked_softmax(scores: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """:func:`masked_softmax` without the checks (the caller has made them).

    attnlib's one definition of a query with no allowed key: its weights are all
    0 and its gradients 0, never NaN.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    masked = torch.where(mask, scores, neg_inf)  # (..., n), -inf where not allowed
    row_max = masked.amax(dim=dim, keepdim=True)  # (..., 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(masked - row_max)  # (..., n), exp(-inf) = 0 where masked
    total = exp.sum(dim=dim, keepdim=True)  # (..., 1), 0 for an all-masked row
    return exp / torch.where(total > 0, total, torch.ones_like(total))


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> torch.Size:
    """Raise unless q, k, v fit together; return the broadcast batch shape ``...``.

    ``q``: ``(d_k,)`` or ``(..., n_q, d_k)``; ``k``: ``(..., n_k, d_k)``;
    ``v``: ``(..., n_k, d_v)``; one floating dtype; ``n_k >= 1``, ``d_k >= 1``.
    """
    for name, t, min_dim in (("q", q, 1), ("k", k, 2), ("v", v, 2)):
        if check_tensor(name, t).dim() < min_dim:
            expected = f"(..., n_k, d_{name})"
            if name == "q":
                expected = "(d_k,) or (..., n_q, d_k)"
            raise ValueError(f"{name} must have shape {expected}, got {format_shape(t)}")
    if not (q.is_floating_point() and q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must share one floating-point dtype: "
            f"q has shape {format_shape(q)} and dtype {q.dtype}, "
            f"k has shape {format_shape(k)} and dtype {k.dtype}, "
            f"v has shape {format_shape(v)} and dtype {v.dtype}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same width d_k: q has shape {format_shape(q)} "
            f"(d_k = {q.shape[-1]}), k has shape {format_shape(k)} (d_k = {k.shape[-1]})"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of rows n_k (one value per key): "
            f"k has shape {format_shape(k)}, v has shape {format_shape(v)}"
        )
    if k.shape[-2] == 0:
        raise ValueError(f"attention needs at least one key: k has shape {format_shape(k)}")
    if k.shape[-1] == 0:
        raise ValueError(f"q and k must have width d_k >= 1: k has shape {format_shape(k)}")
    try:
        return broadcast_shape(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"batch dimensions do not broadcast: "
            f"q {format_shape(q)}, k {format_shape(k)}, v {format_shape(v)}"
        ) from None


def check_scale(scale: object) -> float:
    """``scale`` as a float if it is a finite real number >= 0 (0 gives uniform weights)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    value = float(scale)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"scale must be a finite number >= 0, or None for 1/sqrt(d_k); got {scale!r}")
    return value


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Scaled dot-product attention, returning the output and the weights.

    .. math::
        A = \mathrm{softmax}\!\left(\frac{Q K^\top}{\sqrt{d_k}}\right), \qquad
        \mathrm{Attention}(Q, K, V) = A V .

    Row ``i`` of ``A`` says where query ``i`` reads (non-negative, sums to 1);
    row ``i`` of the output is the mixture :math:`\sum_j A_{ij} v_j` it reads.

    Shapes (``...`` = any batch dimensions that broadcast):

    - ``q``: ``(..., n_q, d_k)``, or a single query ``(d_k,)``
    - ``k``: ``(..., n_k, d_k)``
    - ``v``: ``(..., n_k, d_v)``
    - ``mask``: bool, ``True`` = may attend; broadcastable to the scores
      ``(..., n_q, n_k)`` (to ``(..., n_k)`` for a single query)
    - returns ``output`` ``(..., n_q, d_v)`` and ``weights`` ``(..., n_q, n_k)``;
      for a single query without the ``n_q`` axis: ``(..., d_v)``, ``(..., n_k)``

    Args:
        scale: multiplies the scores: a finite number >= 0 (0 gives uniform
            weights); default :math:`1/\sqrt{d_k}`.

    A query whose keys are all masked gets zero weights and a zero output.

    Raises:
        TypeError: q, k, v or mask not a tensor; scale not a real number.
        ValueError: a tensor of the wrong rank; q, k, v not of one floating
            dtype; q and k of different widths (or width 0); k and v of
            different lengths; no keys; batch dimensions that do not broadcast;
            a mask that is not bool or would not broadcast to the scores (or
            would enlarge them); a negative, infinite or NaN scale.
    """
    batch = check_qkv(q, k, v)  # the broadcast batch shape "..."
    scale = None if scale is None else check_scale(scale)
    n_k = k.shape[-2]
    single = q.dim() == 1
    if single:
        if isinstance(mask, Tensor) and mask.dim() >= 1:
            check_mask(mask, batch + (n_k,))  # against the scores (..., n_k)
            mask = mask.unsqueeze(-2)  # (..., 1, n_k)
        q = q.unsqueeze(0)  # (1, d_k)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., n_q, n_k)
    if mask is None:
        weights = torch.softmax(scores, dim=-1)  # (..., n_q, n_k)
    else:
        check_mask(mask, batch + scores.shape[-2:])
        weights = _masked_softmax(scores, mask)  # (..., n_q, n_k)
    # batch dims that only v had: each batch entry gets its own copy, not an alias
    weights = weights.expand(batch + scores.shape[-2:]).contiguous()  # (..., n_q, n_k)
    output = weights @ v  # (..., n_q, d_v)
    if single:
        return output.squeeze(-2), weights.squeeze(-2)  # (..., d_v), (..., n_k)
    return output, weights


def causal_mask(n_q: int, n_k: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """The causal mask for ``n_q`` new queries that follow ``n_k - n_q`` cached positions.

    Query ``i`` sits at absolute position ``n_k - n_q + i`` and may attend to keys
    ``j <= n_k - n_q + i``: row ``i`` allows the first ``n_k - n_q + i + 1`` keys. With
    ``n_k = n_q`` (the default) this is the lower triangle, ``tril``.

    Returns:
        bool ``(n_q, n_k)``, ``True`` = may attend.

    Raises:
        ValueError: ``n_q`` not a positive int, or ``n_k`` not an int ``>= n_q``.
    """
    check_width("n_q", n_q)
    if n_k is None:
        n_k = n_q
    check_width("n_k", n_k)
    if n_k < n_q:
        raise ValueError(f"n_k ({n_k}) must be >= n_q ({n_q}): the queries are the last n_q of the n_k positions")
    q_pos = torch.arange(n_k - n_q, n_k, device=device)  # (n_q,) absolute positions
    return torch.arange(n_k, device=device)[None, :] <= q_pos[:, None]  # (n_q, n_k)
