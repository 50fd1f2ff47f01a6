r"""Positions seen through :math:`W^{QK}`: additive encodings and ALiBi (chapter 8).

Three ways a decoder tells positions apart, and where each puts the position:

- **additive** (Vaswani et al. 2017, sinusoidal or learned): :math:`x_p + e_p` enters the
  projections, so the score :math:`(x_p + e_p) W^Q {W^K}^\top (x_j + e_j)^\top` splits
  into four terms (:func:`score_terms`): content-content, content-position,
  position-content and position-position;
- **RoPE** (:mod:`attnlib.decoding.rope`): a rotation between the two factors;
- **ALiBi** (Press et al. 2022): no change to the queries, keys or :math:`W^{QK}`; a
  per-head bias :math:`-m_i (p - j)` is added to the scores (:func:`alibi_slopes`,
  :func:`alibi_bias`, :class:`AlibiAttention`).

Notation as in the book: query position ``p``, key position ``j``, head ``i``.
Orientation as everywhere in attnlib: row vectors, ``x @ W``; masks boolean, ``True`` =
may attend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, Self

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlib.checks import check_positive_int, check_tensor, check_width, format_shape
from attnlib.attention import masked_softmax
from attnlib.decoding.grouped import DecoderAttention
from attnlib.multihead import Device, DType
from attnlib.records import AttentionWeights, record_tensors

__all__ = ["sinusoidal_positions", "ScoreTerms", "score_terms", "score_terms_bound", "alibi_slopes", "alibi_bias",
           "AlibiWeights", "AlibiAttention"]


def sinusoidal_positions(
    n: int,
    d_model: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> Tensor:
    r"""The sinusoidal position encodings of Vaswani et al. (2017), section 3.5.

    .. math::
        P_{p,\,2\ell} = \sin\!\big(p / \text{base}^{2\ell/d}\big), \qquad
        P_{p,\,2\ell+1} = \cos\!\big(p / \text{base}^{2\ell/d}\big),

    for positions ``p = 0..n-1`` and ``l = 0..d/2-1``, ``d = d_model``; added to the token
    embeddings, :math:`x_p + P_p`. Computed in float64, rounded once to ``dtype``.

    Returns:
        ``(n, d_model)``.

    Raises:
        TypeError: ``n`` or ``d_model`` not an int, ``base`` not a number (``True`` is neither).
        ValueError: ``n`` below 1; ``d_model`` not a positive even int; ``base`` not > 1.
    """
    check_positive_int("n", n)
    check_width("d_model", d_model, even=True, why="sin and cos fill each pair of dimensions 2l, 2l + 1")
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise TypeError(f"base must be a number > 1, got {type(base).__name__} {base!r}")
    if not base > 1:
        raise ValueError(f"base must be a number > 1, got {base!r}")
    p = torch.arange(n, dtype=torch.float64, device=device)[:, None]  # (n, 1)
    two_l = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)  # (d/2,)
    angles = p / float(base) ** (two_l / d_model)  # (n, d/2)
    pe = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (n, d/2, 2): sin at 2l, cos at 2l+1
    return pe.flatten(-2).to(dtype)  # (n, d_model)


class ScoreTerms(NamedTuple):
    """The four terms of an additive-position score, each ``(..., n_q, n_k)``."""

    content_content: Tensor  # x_p W^Q W^K^T x_j^T
    content_position: Tensor  # x_p W^Q W^K^T e_j^T
    position_content: Tensor  # e_p W^Q W^K^T x_j^T
    position_position: Tensor  # e_p W^Q W^K^T e_j^T

    def total(self) -> Tensor:
        """The sum of the four terms: the score of :math:`x + e`."""
        return self.content_content + self.content_position + self.position_content + self.position_position


def _check_terms_inputs(x_q: Tensor, e_q: Tensor, x_k: Tensor, e_k: Tensor, w_q: Tensor, w_k: Tensor) -> None:
    """The argument checks of :func:`score_terms` and :func:`score_terms_bound`."""
    for name, t in (("x_q", x_q), ("e_q", e_q), ("x_k", x_k), ("e_k", e_k), ("w_q", w_q), ("w_k", w_k)):
        check_tensor(name, t)
    if w_q.dim() != 2 or w_q.shape != w_k.shape:
        raise ValueError(f"w_q and w_k must both have shape (d_model, d_k), got {format_shape(w_q)} and {format_shape(w_k)}")
    d_model = w_q.shape[0]
    for (a, ta), (b, tb) in ((("x_q", x_q), ("e_q", e_q)), (("x_k", x_k), ("e_k", e_k))):
        if ta.shape != tb.shape:
            raise ValueError(f"{a} and {b} must have one shape, got {format_shape(ta)} and {format_shape(tb)}")
        if ta.dim() < 2 or ta.shape[-1] != d_model:
            raise ValueError(f"{a} must have shape (..., n, d_model={d_model}), got {format_shape(ta)}")


def score_terms(x_q: Tensor, e_q: Tensor, x_k: Tensor, e_k: Tensor, w_q: Tensor, w_k: Tensor) -> ScoreTerms:
    r"""Split the (unscaled) score of additive positions into its four terms.

    .. math::
        (x_p + e_p) W^Q {W^K}^\top (x_j + e_j)^\top
        = x_p W x_j^\top + x_p W e_j^\top + e_p W x_j^\top + e_p W e_j^\top,
        \qquad W = W^Q {W^K}^\top,

    each term computed through the two factors, ``(a @ w_q) @ (b @ w_k).mT``.

    Args:
        x_q, e_q: ``(..., n_q, d_model)``, the queries' tokens and position vectors.
        x_k, e_k: ``(..., n_k, d_model)``, the keys' tokens and position vectors.
        w_q, w_k: ``(d_model, d_k)``, one head's :math:`W^Q, W^K`.

    Returns:
        a :class:`ScoreTerms` of four ``(..., n_q, n_k)`` tensors.

    Raises:
        TypeError: an argument not a tensor.
        ValueError: ``x_q`` and ``e_q`` (or ``x_k`` and ``e_k``) of different shapes; a
            rank below 2; widths that do not match ``w_q``/``w_k`` ``(d_model, d_k)``.
    """
    _check_terms_inputs(x_q, e_q, x_k, e_k, w_q, w_k)
    cq, eq = x_q @ w_q, e_q @ w_q  # (..., n_q, d_k): content and position parts of the queries
    ck, ek = x_k @ w_k, e_k @ w_k  # (..., n_k, d_k)
    return ScoreTerms(cq @ ck.mT, cq @ ek.mT, eq @ ck.mT, eq @ ek.mT)  # (..., n_q, n_k) each


def score_terms_bound(x_q: Tensor, e_q: Tensor, x_k: Tensor, e_k: Tensor, w_q: Tensor, w_k: Tensor) -> Tensor:
    r"""Elementwise bound on ``|score_terms(...).total() - ((x_q + e_q) @ w_q) @ ((x_k + e_k) @ w_k).mT|``.

    Both sides are computed in the inputs' dtype (unit roundoff :math:`u`). The score
    multiplies two projected vectors, and each projection is its own sum of length
    :math:`d_{model}`: a term :math:`(a W^Q)(b W^K)^\top` is off by
    :math:`\gamma_{2 d_{model} + d_k}\,|a|\,|W^Q|\,(|b|\,|W^K|)^\top`, and adding the four
    terms costs :math:`\gamma_3` of their sum of sizes; the direct side rounds
    :math:`x + e` (twice, one per factor), then the same three sums. Both are within their
    error of the exact score, so they differ by at most

    .. math::
        \gamma_{4 d_{model} + 2 d_k + 5}\; S, \qquad
        S = (|x_p| + |e_p|)\,|W^Q|\;\big((|x_j| + |e_j|)\,|W^K|\big)^\top ,

    about :math:`\varepsilon\,(2 d_{model} + d_k + 2.5)\,S`, plus, for results in the
    subnormal range (gradual underflow, IEEE's default; ``torch.set_flush_denormal(True)``
    turns it off), at most :math:`\eta`, the subnormals' spacing, per rounding, the bound's
    own included: :math:`\eta\,(3 d_{model} (\|A_p\|_1 + \|A_j\|_1) + 6 d_k + 3)` with
    :math:`A_p = (|x_p| + |e_p|)|W^Q|`. Counting :math:`d_{model}` once, as if the score
    were one sum, is not enough: the two projections' errors add up (chapter 8 shows an
    input that reaches :math:`2 d_{model}\,\varepsilon`). Finite results only: an overflow
    has no bound.

    Shapes as for :func:`score_terms`; returns ``(..., n_q, n_k)``.
    """
    _check_terms_inputs(x_q, e_q, x_k, e_k, w_q, w_k)
    d_model, d_k = w_q.shape
    info = torch.finfo(w_q.dtype)
    u = info.eps / 2
    eta = info.eps * info.smallest_normal  # the spacing of the subnormals
    a_q = (x_q.abs() + e_q.abs()) @ w_q.abs()  # (..., n_q, d_k)
    a_k = (x_k.abs() + e_k.abs()) @ w_k.abs()  # (..., n_k, d_k)
    k = 4 * d_model + 2 * d_k + 5
    relative = k * u / (1 - k * u) * (a_q @ a_k.mT)  # (..., n_q, n_k)
    l1 = a_q.sum(-1)[..., :, None] + a_k.sum(-1)[..., None, :]  # (..., n_q, n_k)
    return relative + eta * (3 * d_model * l1 + 6 * d_k + 3)


def alibi_slopes(
    num_heads: int, *, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> Tensor:
    r"""ALiBi's head slopes :math:`m_0, \dots, m_{h-1}` (Press et al. 2022, section 3).

    For ``h`` a power of two, the geometric sequence that starts at and is multiplied
    by :math:`2^{-8/h}`: :math:`m_i = 2^{-8(i+1)/h}` (``h = 8``: 1/2, 1/4, ..., 1/256).
    For other ``h``, with :math:`n = 2^{\lfloor \log_2 h \rfloor}`: the ``n`` slopes of
    ``n`` heads, then the first ``h - n`` of every other slope of ``2n`` heads,
    :math:`2^{-8(2k+1)/(2n)}`, ``k = 0, 1, ...`` (the authors' code, and BLOOM's).

    Returns:
        ``(h,)``, computed in float64 and rounded once to ``dtype``.

    Raises:
        ValueError: ``num_heads`` not a positive int.
    """
    h = check_positive_int("num_heads", num_heads)
    n = 2 ** int(math.floor(math.log2(h)))
    f64: dict[str, Any] = {"dtype": torch.float64, "device": device}
    k = torch.arange(1, n + 1, **f64)  # (n,): 1, 2, .., n
    slopes = 2.0 ** (-8.0 * k / n)  # (n,)
    if h > n:
        odd = torch.arange(1, 2 * (h - n), 2, **f64)  # (h - n,): 1, 3, 5, ..
        slopes = torch.cat([slopes, 2.0 ** (-8.0 * odd / (2 * n))])  # (h,)
    return slopes.to(dtype)


def alibi_bias(
    num_heads: int,
    n_q: int,
    n_k: int | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> Tensor:
    r"""ALiBi's bias :math:`-m_i (p - j)`: head ``i``, query position ``p``, key position ``j``.

    The queries are the last ``n_q`` of ``n_k`` positions, as in
    :func:`attnlib.attention.causal_mask`: query ``a`` sits at ``p = n_k - n_q + a``
    (``n_k = n_q`` by default: ``p = a``). A key in the past is penalised in proportion
    to its distance; the entries ``j > p`` are positive, and a causal mask hides them.

    Returns:
        ``(h, n_q, n_k)``, to be added to the scaled scores ``q k^T / sqrt(d_k)``.

    Raises:
        ValueError: ``num_heads`` or ``n_q`` not a positive int; ``n_k`` not an int
            ``>= n_q``.
    """
    check_width("n_q", n_q)
    n_k = n_q if n_k is None else check_width("n_k", n_k)
    if n_k < n_q:
        raise ValueError(f"n_k ({n_k}) must be >= n_q ({n_q}): "
                         f"the queries are the last n_q of the n_k positions")
    f64: dict[str, Any] = {"dtype": torch.float64, "device": device}
    m = alibi_slopes(num_heads, device=device)  # (h,) float64
    p = torch.arange(n_k - n_q, n_k, **f64)  # (n_q,): query positions
    j = torch.arange(n_k, **f64)  # (n_k,): key positions
    return (-m[:, None, None] * (p[:, None] - j[None, :])).to(dtype)  # (h, n_q, n_k)


# What the plain layer lacks, for the refusals below.
ALIBI_REASON = (
    "ALiBi adds the position bias -m_i (p - j) to head i's scores, which the plain layer of "
    "chapters 2-4 does not have"
)


@dataclass(frozen=True)
class AlibiWeights(AttentionWeights):
    """The projections of an :class:`AlibiAttention` (what its ``projections()`` returns):
    an :class:`~attnlib.AttentionWeights` that says its layer adds ALiBi, so that a tool for
    the plain layer refuses it (:meth:`as_plain`) instead of dropping the positions.
    :meth:`AlibiAttention.from_projections` and :func:`attnlib.interop.write_bloom` (BLOOM has
    ALiBi) take it; :meth:`without_alibi` is the same weights as a plain record, for a
    reader who means to drop ALiBi."""

    def as_plain(self) -> NoReturn:
        raise TypeError(
            f"these weights are an AlibiAttention's (AlibiWeights): {ALIBI_REASON}; build "
            f"AlibiAttention.from_projections(w, h), or take w.without_alibi() to drop ALiBi on purpose"
        )

    def without_alibi(self) -> AttentionWeights:
        """The same tensors as a plain :class:`~attnlib.AttentionWeights` (ALiBi dropped)."""
        return AttentionWeights(**record_tensors(self))


class AlibiAttention(DecoderAttention):
    r"""Multi-head attention with ALiBi (Press et al. 2022): chapter 8's
    :class:`~attnlib.decoding.DecoderAttention` whose per-head attention adds
    :func:`alibi_bias` to the scaled scores,

    .. math::
        A_i = \mathrm{softmax}\!\Big(\frac{Q_i K_i^\top}{\sqrt{d_k}} - m_i\,(p - j)\Big),

    for head ``i``, query position ``p`` and key position ``j``, and changes nothing else:
    the projections, :math:`W^{QK}_i`, the merge and the cache are the parent's, and the
    cache holds plain keys :math:`x_j W^K_i` (no position).
    The queries are the last ``n_q`` of the ``n_k`` key positions (a self-attention pass,
    or new tokens after a :class:`~attnlib.decoding.KVCache`).

    ``AlibiAttention(d_model, num_heads, bias=True, *, d_k=None, device=None, dtype=None)``;
    the call and its shapes are :class:`DecoderAttention`'s. No RoPE and no grouped keys.
    It has no plain view (:meth:`as_plain` raises), and its records say ALiBi
    (:class:`AlibiWeights`), so that no tool for the plain layer drops the bias.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        bias: bool = True,
        *,
        num_kv_heads: int | None = None,
        rope_base: float | None = None,
        d_k: int | None = None,
        device: Device = None,
        dtype: DType = None,
    ) -> None:
        super().__init__(d_model, num_heads, bias, num_kv_heads=num_kv_heads, rope_base=rope_base, d_k=d_k,
                         device=device, dtype=dtype)
        if self.num_kv_heads != self.num_heads or self.rope_base is not None:
            raise ValueError(
                f"AlibiAttention takes no num_kv_heads or rope_base (got {num_kv_heads!r}, {rope_base!r}): "
                f"ALiBi's positions are its bias"
            )

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The parent's attention with the ALiBi bias added to the scaled scores:
        ``q`` ``(B, h, n_q, d_k)``, ``k``, ``v`` ``(B, h, n_k, .)`` -> ``(B, h, n_q, d_v)``
        and ``(B, h, n_q, n_k)`` (``None`` with ``need_weights=False``: SDPA)."""
        n_q, n_k = q.shape[-2], k.shape[-2]
        bias = alibi_bias(self.num_heads, n_q, n_k, dtype=q.dtype, device=q.device)
        if not need_weights:  # (h, n_q, n_k) above; with the mask, one additive mask
            if mask is not None:
                bias = bias.masked_fill(~mask, float("-inf"))  # (.., h, n_q, n_k)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            return out, None  # (B, h, n_q, d_v)
        scores = (q * self.d_k**-0.5) @ k.transpose(-2, -1) + bias  # (B, h, n_q, n_k)
        weights = masked_softmax(scores, mask)  # (B, h, n_q, n_k)
        return weights @ v, weights  # (B, h, n_q, d_v), (B, h, n_q, n_k)

    # ---- the plain view and records: ALiBi is never dropped -------------------------
    def as_plain(self) -> NoReturn:
        """Raises ``TypeError``: ALiBi's bias is not something the plain layer computes."""
        raise TypeError(f"AlibiAttention has no plain view: {ALIBI_REASON}")

    def projections(self) -> AlibiWeights:
        """The four projections and biases (detached copies), as :class:`AlibiWeights`."""
        return AlibiWeights(**record_tensors(super().projections()))

    def grouped_projections(self) -> NoReturn:
        """Raises ``TypeError``: a :class:`~attnlib.decoding.GroupedAttentionWeights` holds
        groups and RoPE, not ALiBi (use :meth:`projections`)."""
        raise TypeError(
            f"an AlibiAttention has no grouped_projections(): GroupedAttentionWeights holds groups and RoPE, "
            f"not ALiBi, and would drop it; use projections(), whose AlibiWeights keeps it"
        )

    @classmethod
    def from_projections(cls, weights: AttentionWeights, num_heads: int) -> Self:
        """A layer holding copies of ``weights``: an :class:`AlibiWeights` (what
        :meth:`projections` returns), or a plain record (``read_bloom``'s), to which this
        class adds ALiBi."""
        if isinstance(weights, AlibiWeights):
            weights = weights.without_alibi()
        return super().from_projections(weights, num_heads)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", alibi=True"
