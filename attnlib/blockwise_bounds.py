r"""How much memory attention holds, and how close two evaluations must be (chapter 10).

Companions of :mod:`attnlib.blockwise`, for its checks and its benchmark:

- :func:`intermediate_bytes`: the bytes of the intermediates the naive and the blockwise
  algorithm hold at their peak; :func:`accumulator_dtype`, the dtype the tiles accumulate in;
- :func:`rounding_bound`, :func:`gradient_rounding_bound`: elementwise worst-case bounds on
  how far two evaluations of attention, or of its gradients, may differ by rounding alone
  (another tile size, another order of the sums, another library), derived from the
  computation; :func:`typical_rounding_bound`, the same count for the typical error, a
  tolerance for gates (:func:`worst_and_typical_bounds`: both from one pass over the scores);
  :func:`share_sum_bound` for the shares of a merge (one log-sum-exp or a chain of merges);
  :func:`output_projection_bound` carries a bound on the heads through :math:`W^O`.

Notation of every bound: :math:`u` = unit roundoff (``eps / 2``), :math:`\varepsilon` = ``eps``,
:math:`\tau` = ``finfo(dtype).tiny`` (the smallest normal number),
:math:`S = \max_{ij} \sum_l |q_{il} k_{jl}| \cdot \mathrm{scale}` (the largest score's sum of absolute
terms), :math:`S^* = S + \ln n_k` (at least every :math:`|s_{ij}|` and :math:`|\mathrm{lse}_i|`). An
operation is off by at most :math:`u` relative, ``exp`` and ``log`` by one ulp (:math:`2u`), an
inner product of length :math:`n` by :math:`n u` relative to its terms (Higham 2002, section 3.1);
the bounds are first order (they drop terms in :math:`u^2`) and assume finite scores.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlib.checks import check_mask, check_positive_int, check_tensor, format_shape
from attnlib.attention import check_qkv, check_scale, masked_softmax

__all__ = ["intermediate_bytes", "accumulator_dtype", "rounding_bound", "typical_rounding_bound",
           "worst_and_typical_bounds", "gradient_rounding_bound", "share_sum_bound", "output_projection_bound"]

LAMBDA = 8.0  # typical_rounding_bound's lambda: a sum of n roundings stays within lambda sqrt(n) u


# ---- memory -------------------------------------------------------------------------------------
def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the tiles compute and accumulate in: float32 for float16 and bfloat16 inputs
    (as FlashAttention keeps its running max, sum and output), the input's own otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def intermediate_bytes(
    n_q: int, n_k: int, d_v: int, *, block_q: int | None = None, block_k: int | None = None,
    batch: int = 1, dtype: torch.dtype = torch.float32, d_k: int | None = None,
) -> int:
    r"""Bytes of the intermediates one attention call holds at its peak, inputs and output excluded.

    - naive (``block_q`` and ``block_k`` None), :func:`attnlib.attention` without a mask: the
      scores and the weights, two ``(n_q, n_k)`` matrices: :math:`2\, n_q n_k` numbers;
    - blockwise, :func:`attnlib.blockwise.blockwise_attention`'s forward without a mask, at the
      product :math:`P V` of a tile: the tile of scores, exponentiated in place, ``(b_q, b_k)``;
      the output accumulator and the new :math:`P V`, two ``(b_q, d_v)``; five ``(b_q,)``
      vectors (running max and sum, the new max, its shift, the rescale factor); the
      log-sum-exp kept for the backward, ``(n_q,)``:
      :math:`b_q b_k + 2 b_q d_v + 5 b_q + n_q` numbers of the accumulator dtype.
      For float16 and bfloat16 inputs these are float32 (:func:`accumulator_dtype`), plus the
      float32 copies of the query tile and of the value tile: :math:`b_q d_k + b_k d_v` more
      (``d_k`` defaults to ``d_v``; the key tile's copy is freed once its scores are made).

    Times ``batch`` (batch entries times heads). A mask adds its tile (one byte per entry)
    and a masked copy; they are left out. These are the tensors live at once; the
    temporaries inside one kernel (a BLAS packing buffer) are not tensors and not counted.
    """
    for name, x in (("n_q", n_q), ("n_k", n_k), ("d_v", d_v), ("batch", batch)):
        check_positive_int(name, x)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if (block_q is None) != (block_k is None):
        raise ValueError("give both block_q and block_k (blockwise) or neither (naive)")
    if block_q is None or block_k is None:
        return batch * 2 * n_q * n_k * dtype.itemsize
    b_q = min(check_positive_int("block_q", block_q), n_q)
    b_k = min(check_positive_int("block_k", block_k), n_k)
    numbers = b_q * b_k + 2 * b_q * d_v + 5 * b_q + n_q
    acc = accumulator_dtype(dtype)
    if acc != dtype:  # float32 copies of the half-precision tiles
        width = d_v if d_k is None else check_positive_int("d_k", d_k)
        numbers += b_q * width + b_k * d_v
    return batch * numbers * acc.itemsize


# ---- how close two evaluations must be -----------------------------------------------------------
_Sizes = tuple[Tensor, Tensor, Tensor, Tensor, float, float, float, Tensor]  # what _sizes returns


def _sizes(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None) -> _Sizes:
    """Float64 copies, the weights P (the arguments checked as :func:`attnlib.attention` checks
    them, the weights computed as it computes them, from one product of scores), scale, S, tiny,
    the scores (``-inf`` where masked; their log-sum-exp is the exact lse)."""
    if check_tensor("q", q).dim() < 2:
        raise ValueError(f"q must have shape (..., n_q, d_k), got {format_shape(q)}")
    batch = check_qkv(q, k, v)
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(check_scale(scale))
    q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))
    s = (q64 @ k64.transpose(-2, -1)) * sc  # (..., n_q, n_k)
    if mask is None:
        p = torch.softmax(s, dim=-1)
    else:
        check_mask(mask, batch + s.shape[-2:])
        p = masked_softmax(s, mask)  # 0 for a query with no allowed key
        s = s.masked_fill(~mask, float("-inf"))
    p = p.expand(batch + s.shape[-2:])  # (..., n_q, n_k), v's batch dimensions too
    big = float((q64.abs() @ k64.abs().transpose(-2, -1)).amax()) * sc  # S
    return q64, k64, v64, p, sc, big, torch.finfo(q.dtype).tiny, s


def _check_merges(merges: object) -> int:
    if isinstance(merges, bool) or not isinstance(merges, int) or merges < 0:
        raise ValueError(f"merges must be an int >= 0 (merges along the longest path), got {merges!r}")
    return merges


def rounding_bound(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
    *, merges: int = 0,
) -> tuple[Tensor, Tensor]:
    r"""Elementwise worst-case bounds on how far two evaluations of attention may differ by rounding.

    One evaluation, to first order (notation in the module docstring). A score is an inner
    product of length :math:`d_k` and a scaling: off by :math:`(d_k + 1) u S`. The shifts add
    :math:`2 u S` at most: written out, :math:`s - m` is off by :math:`u |s - m| \le 2 u S`; tile by
    tile, a key of block :math:`b` is shifted by its block's running maximum :math:`m_b` (off by
    :math:`u (m_b - s)`) and then rescaled once per later block whose maximum rose, by
    :math:`e^{m_{t-1} - m_t}`, each exponent off by :math:`u (m_t - m_{t-1})`; these telescope, and
    the shift and all of them are off by :math:`u (m_T - s) \le 2 u S` together. A softmax weight
    moves by twice its exponent's error relative (:math:`2 (d_k + 3) u S`; counted as
    :math:`e^{2 (d_k + 3) u S} - 1`, which that is only while it is small: near-tied float32 scores
    of :math:`10^8` move a weight by far more than :math:`2 (d_k + 3) u S`) and by twice the
    ``exp``'s ulp (:math:`4 u`). The rescale factors' own ``exp`` roundings do not cancel: a factor
    multiplies the earlier blocks' terms, not the new block's, so it moves the weight of the old
    keys against the new. Key :math:`j`'s term carries the roundings :math:`\eta_t` (:math:`|\eta_t|
    \le 2u`) of the factors of the later blocks, and its weight moves by
    :math:`\sum_t \eta_t ([t > b_j] - q_t)`, :math:`q_t` the share of the mass that factor
    :math:`t` multiplies: at most :math:`2 u (T - 1)` for :math:`T` key blocks (each bracket lies
    in :math:`[-1, 1]`). Then the sums: written out, the row sum (:math:`n_k - 1`), the division
    (1) and :math:`P V` (:math:`n_k`); tile by tile, the accumulator's path (its block's product,
    one rescale and one addition per later block: at most :math:`n_k + T`), the running sum's
    (:math:`n_k + T - 1`) and the division. With :math:`T \le n_k` (the bound does not know the
    tiling: blocks of one key, a maximum that rises at every key), one evaluation is within
    :math:`u\,(2 (d_k + 3) S + 6 n_k + 2)\,(|P|\,|V|)_{ic}` of the exact output: :math:`4 n_k + 4`
    for the sums and the weights' ``exp``, :math:`2 (n_k - 1)` for the rescale factors'.

    ``merges``: partials (:func:`~attnlib.blockwise.attend_block`,
    :func:`~attnlib.blockwise.split_k_attention`'s workers) merged along a path of that many
    merges. Each part's log-sum-exp is off by :math:`\beta = u\,((d_k + 3) S + S^* + 4 n_k - 1 +
    2 \ln n_k)` (the score and the shifts; the sum of :math:`\ell`, :math:`n_k + T - 1`; the
    ``exp`` and the rescale factors', :math:`2 + 2 (T - 1)`; the ``log``, :math:`2 \ln n_k`; the
    last addition, :math:`|\mathrm{lse}| \le S^*`), which moves its share by up to :math:`2\beta`,
    and each merge adds the rounding of its log-sum-exp, :math:`u (S^* + 6)`, of the shift and
    the ``exp`` of its shares, :math:`u (2 S^* + 2)`, and of the product and sum, :math:`2u`.

    Two evaluations (another tile size, order, library) differ by at most twice that:

    .. math::
        |o_a - o_b|_{ic} \le \varepsilon\,\big(2 (d_k + 3) S + 6 n_k + 2
            + [\text{merges}]\, (2\beta/u + \text{merges}\,(3 S^* + 10))\big)\, (|P|\,|V|)_{ic}
            + 4 (d_k + 1) \tau \max(1, \mathrm{scale}) (|P|\,|V|)_{ic}
            + 2 (n_k + \text{merges})\, \tau\, (3 \max|V| + 2),

    .. math::
        |\mathrm{lse}_a - \mathrm{lse}_b|_i \le \varepsilon\,\big((d_k + 3) S + 4 n_k - 1 + 2 \ln n_k
            + |\mathrm{lse}_i| + \text{merges}\, (S^* + 6)\big) .

    (An earlier version counted :math:`4 n_k + 4` and :math:`2 n_k + 1`: it held that the rescale
    factor's rounding cancels in :math:`a / \ell`, which it does only for the keys it multiplies.)
    The two :math:`\tau` terms are underflow: a weight, a product or a rescaled accumulator
    below the smallest normal number may round to a subnormal or flush to 0 (absolute error
    :math:`\tau` each), and tiny scores carry an absolute error. Without them the bound holds
    only absent underflow. The factor :math:`|P|\,|V|` (not the output's own size) matters: an
    output that is a small difference of large values carries the rounding of the large ones.

    Shapes: as :func:`attnlib.attention` (``q`` with its ``n_q`` axis); returns the bound on the
    output ``(..., n_q, d_v)`` and on the log-sum-exp ``(..., n_q)``, in float64, for the dtype of
    ``q``. It writes out the ``n_q x n_k`` weights: a check for small problems.
    """
    merges = _check_merges(merges)
    sizes = _sizes(q, k, v, mask, scale)
    return _worst_case(sizes, _pv(sizes), q.dtype, merges)


def _weights_error(d_k: int, big: float, eps: float) -> float:
    r"""A weight's relative error from its scores, in units of ``eps``: :math:`(e^{x} - 1) / u`
    for :math:`x = 2 (d_k + 3) u S` (the first-order :math:`x / u` while :math:`x \ll 1`;
    infinite once :math:`e^x` overflows)."""
    x = 2 * (d_k + 3) * big * eps
    return math.expm1(x) / eps if x < 700 else math.inf


def _output_count(n_k: int) -> int:
    r"""One evaluation's sums and roundings of ``exp``, in units of :math:`u`, past the weights'
    exponent: :math:`4 n_k + 4` (the sums, the weights' ``exp``) :math:`+ 2 (n_k - 1)` (the rescale
    factors' ``exp``, at most one per key block after the first)."""
    return 4 * n_k + 4 + 2 * (n_k - 1)


def _lse_count(d_k: int, big: float, n_k: int) -> float:
    r"""One evaluation's log-sum-exp error in units of :math:`u`, without its last addition
    (:math:`u |\mathrm{lse}|`): :math:`(d_k + 3) S + 4 n_k - 1 + 2 \ln n_k`."""
    return (d_k + 3) * big + 4 * n_k - 1 + 2 * math.log(n_k)


def _pv(sizes: _Sizes) -> Tensor:
    r""":math:`|P|\,|V|` ``(..., n_q, d_v)``, the factor of both bounds."""
    return sizes[3] @ sizes[2].abs()


def _worst_case(sizes: _Sizes, pv: Tensor, dtype: torch.dtype, merges: int) -> tuple[Tensor, Tensor]:
    """:func:`rounding_bound` from :func:`_sizes`' pass over the scores and :func:`_pv`."""
    q64, k64, v64, p, sc, big, tiny, s = sizes
    lse = torch.logsumexp(s, -1)  # (..., n_q)
    eps = torch.finfo(dtype).eps
    d_k, n_k = q64.shape[-1], k64.shape[-2]
    star = big + math.log(n_k)  # S*
    beta = _lse_count(d_k, big, n_k) + star  # a part's lse, in u
    count = _weights_error(d_k, big, eps) + _output_count(n_k)
    if merges:
        count += 2 * beta + merges * (3 * star + 10)
    floor = 2 * (n_k + merges) * tiny * (3 * float(v64.abs().amax()) + 2)
    out_bound = (eps * count + 4 * (d_k + 1) * tiny * max(1.0, sc)) * pv + floor
    lse_abs = torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse))
    lse_bound = eps * (_lse_count(d_k, big, n_k) + lse_abs + merges * (star + 6))
    return out_bound, lse_bound


def typical_rounding_bound(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
    *, lam: float = LAMBDA,
) -> Tensor:
    r"""A tolerance for the *typical* rounding of two single-pass evaluations: a gate, not a proof.

    :func:`rounding_bound` adds every rounding error with its worst sign, so it grows like
    :math:`n_k u`. Rounding errors of opposite signs cancel: modelled as independent with mean
    zero, a sum of :math:`n` of them stays within :math:`\lambda \sqrt{n}\, u` (relative to its
    terms) except with a probability that falls like :math:`e^{-\lambda^2/2}` (Higham and Mary,
    2019). The same count with each length :math:`n` replaced by :math:`\lambda \sqrt n` and each
    single rounding by :math:`\lambda`:

    .. math::
        \varepsilon \lambda \big(2 (\sqrt{d_k} + 3) S + 2 \sqrt{2 n_k} + 5\big)\, (|P|\,|V|)_{ic}
        + 2 n_k \tau (3 \max|V| + 2)

    (underflow kept at its worst case). It keeps the written-out evaluation's count: the
    rescale factors' ``exp`` roundings of a tiled one (:func:`rounding_bound` counts up to
    :math:`2 (T - 1)` for :math:`T` key blocks; typically :math:`2 \sqrt{T - 1}`) are left to the
    margin, which the right kernels are shown to leave (chapter 10). Meant as the gate before a timing: the error of one
    dropped tile of keys exceeds it where the worst case would let it pass (chapter 10 measures
    which planted errors it refuses at which lengths, and which milder ones pass). A kernel
    whose rounding errors are biased could exceed it too; the gate would then fail loudly.
    Shapes and dtype as :func:`rounding_bound`; ``lam`` > 0 (default 8).
    """
    lam = _check_lam(lam)
    sizes = _sizes(q, k, v, mask, scale)
    return _typical(sizes, _pv(sizes), q.dtype, lam)


def _check_lam(lam: object) -> float:
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not lam > 0:
        raise ValueError(f"lam must be a number > 0, got {lam!r}")
    return float(lam)


def _typical(sizes: _Sizes, pv: Tensor, dtype: torch.dtype, lam: float) -> Tensor:
    """:func:`typical_rounding_bound` from :func:`_sizes`' pass over the scores and :func:`_pv`."""
    q64, k64, v64, p, sc, big, tiny, _ = sizes
    eps = torch.finfo(dtype).eps
    d_k, n_k = q64.shape[-1], k64.shape[-2]
    count = 2 * (math.sqrt(d_k) + 3) * big + 2 * math.sqrt(2 * n_k) + 5
    floor = 2 * n_k * tiny * (3 * float(v64.abs().amax()) + 2)
    return eps * lam * count * pv + floor


def worst_and_typical_bounds(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
    *, merges: int = 0, lam: float = LAMBDA,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(*rounding_bound(...), typical_rounding_bound(...))`` from one pass over the scores:
    the worst-case bound on the output ``(..., n_q, d_v)`` and on the log-sum-exp ``(..., n_q)``,
    and the typical tolerance ``(..., n_q, d_v)``, equal to what the two functions return (each
    writes out the ``n_q x n_k`` weights; a gate that needs both computes them once)."""
    merges, lam = _check_merges(merges), _check_lam(lam)
    sizes = _sizes(q, k, v, mask, scale)
    pv = _pv(sizes)
    return (*_worst_case(sizes, pv, q.dtype, merges), _typical(sizes, pv, q.dtype, lam))


def share_sum_bound(lse: Tensor, parts: int, dtype: torch.dtype | None = None, *, merges: int = 0) -> Tensor:
    r"""How far the shares :math:`e^{\mathrm{lse}_w - \widehat{\mathrm{lse}}}` of ``parts`` partials,
    computed in ``dtype``, may sum from 1: :math:`e^{x} - 1`, :math:`K` = ``parts``, with

    .. math::
        x = u\,(|\mathrm{lse}| + 2K + 2 + 5 \ln K) \quad \text{(one log-sum-exp over the } K
        \text{ partial } \mathrm{lse}_w\text{)}, \qquad
        x = u\,\big(r\,(|\mathrm{lse}| + \ln K + 3) + K + 1 + \ln K\big) \quad
        \text{(}r\text{ = ``merges``} \ge 1\text{)}.

    Derivation: the shares of the exact log-sum-exp :math:`L` of the parts' (computed)
    :math:`\mathrm{lse}_w` sum to 1; computed against :math:`\hat L = L - \Delta` they sum to
    :math:`e^{\Delta}` exactly, and their own shifts, ``exp`` and sum multiply that by at most
    :math:`1 + u (\ln K + 2 + K - 1)` (to first order; the shifts' errors :math:`u |\mathrm{lse}_w -
    \hat L|` weighted by the shares sum to at most their entropy, :math:`\ln K`). So the sum is
    within :math:`e^{|\Delta| + u (K + 1 + \ln K)} - 1` of 1, and :math:`|\Delta|` is counted as
    the ``lse`` was made:

    - ``merges=0`` (the default): ``lse`` is one ``logsumexp`` over the :math:`K` partial
      :math:`\mathrm{lse}_w`: off by :math:`u |L|` (its last addition) plus :math:`u (2K + 2 \ln K)
      + 2u (1 + \ln K)` (the shifts, ``exp``, the sum and the ``log``);
    - ``merges=r``: ``lse`` came out of :func:`~attnlib.blockwise.merge` calls, ``r`` of them on the
      longest path from a partial to the result (:math:`K - 1` for a chain, :math:`\lceil \log_2 K
      \rceil` for a pairwise tree). Each merge rounds its :math:`\log(e^a + e^b) = \max +
      \mathrm{log1p}(e^{-|a - b|})` by :math:`u |\mathrm{lse}'|` in its last addition (and can
      absorb a small partial whole: half an ulp of :math:`\mathrm{lse}'` is :math:`u |\mathrm{lse}'|`),
      plus :math:`3u` in the ``log1p``, ``exp`` and subtraction; an intermediate
      :math:`|\mathrm{lse}'|` is at most :math:`|\mathrm{lse}| + \ln K`, and the errors of the
      merged inputs pass on weighted by their shares, so along a path they add:
      :math:`r\,u\,(|\mathrm{lse}| + \ln K + 3)`.

    The first count is the linear one of an earlier version, which held only while
    :math:`x \ll 1`: a shares' sum moves by :math:`e^{\Delta} - 1`, not :math:`\Delta`, and
    :math:`u |L|` is not small for huge scores (eight float32 partials at :math:`2^{24}`, whose
    log-sum-exp rounds down by 0.997, sum to 2.71, 1.71 past the linear bound of 1.0000017).
    :math:`u |L|` grows with the scores: a share sum is a rounding-level 1 only relative to the
    log-sum-exp's size. The counts are first order in the sums (:math:`K u \ll 1`).

    Shapes: ``lse`` the merged log-sum-exp ``(...)``; returns ``(...)`` float64 (0 where ``lse``
    is infinite: no share then; ``inf`` where :math:`e^{x}` overflows).
    """
    lse = check_tensor("lse", lse)
    check_positive_int("parts", parts)
    merges = _check_merges(merges)
    dt = lse.dtype if dtype is None else dtype
    u = torch.finfo(dt).eps / 2
    size = torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse)).to(torch.float64)
    log_k = math.log(parts)
    if merges:
        x = u * (merges * (size + log_k + 3) + parts + 1 + log_k)
    else:
        x = u * (size + 2 * parts + 2 + 5 * log_k)
    bound = torch.where(x < 700, torch.expm1(x.clamp(max=700)), torch.full_like(x, math.inf))
    return torch.where(torch.isfinite(lse).to(bound.device), bound, torch.zeros_like(bound))


def output_projection_bound(head_bound: Tensor, heads: Tensor, w_o: Tensor, b_o: Tensor | None = None
                            ) -> Tensor:
    r"""Carry a bound on two evaluations of the heads through :math:`y = \mathrm{Concat}(\text{heads})
    W^O + b^O`.

    .. math::
        |y_a - y_b| \le |\Delta|\, |W^O| + \varepsilon\, (h d_v + 1)\, (|C|\, |W^O| + |b^O|)
            + 2 (h d_v + 1) \tau,

    with :math:`|\Delta|` the heads' bound concatenated and :math:`C` the concatenation: the
    heads' difference goes through the product, and each evaluation's product (an inner
    product of length :math:`h d_v`, then the bias) adds its own rounding, relative to its
    terms, not to the result: under cancellation (heads that :math:`W^O` subtracts) the
    result's size would be wrong. Shapes: ``heads``, ``head_bound`` ``(..., h, n, d_v)``;
    ``w_o`` ``(h d_v, d_model)``; ``b_o`` ``(d_model,)``; returns ``(..., n, d_model)`` float64.
    """
    heads, head_bound, w_o = (check_tensor(n, t) for n, t in (("heads", heads), ("head_bound", head_bound),
                                                              ("w_o", w_o)))
    if heads.dim() < 3 or head_bound.shape != heads.shape:
        raise ValueError(f"heads must have shape (..., h, n, d_v) and head_bound the same, got "
                         f"{format_shape(heads)} and {format_shape(head_bound)}")
    h, n, d_v = heads.shape[-3:]
    if w_o.dim() != 2 or w_o.shape[0] != h * d_v:
        raise ValueError(f"w_o must have shape ({h * d_v}, d_model) for {h} heads of width {d_v}, "
                         f"got {format_shape(w_o)}")

    def concat(t: Tensor) -> Tensor:  # (..., h, n, d_v) -> (..., n, h*d_v)
        return t.detach().to(torch.float64).transpose(-3, -2).reshape(*t.shape[:-3], n, h * d_v)

    w = w_o.detach().to(torch.float64).abs()
    terms = concat(heads).abs() @ w  # (..., n, d_model)
    if b_o is not None:
        terms = terms + check_tensor("b_o", b_o).detach().to(torch.float64).abs()
    finfo = torch.finfo(heads.dtype)
    return concat(head_bound) @ w + finfo.eps * (h * d_v + 1) * terms + 2 * (h * d_v + 1) * finfo.tiny


def gradient_rounding_bound(
    q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, mask: Tensor | None = None,
    scale: float | None = None, d_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Elementwise worst-case bounds on how far two evaluations of the gradients may differ.

    The backward computes :math:`dV = P^\top dO`, :math:`dP = dO\, V^\top`,
    :math:`D = \mathrm{rowsum}(dO \circ O) - d\mathrm{lse}`, :math:`dS = P \circ (dP - D)`
    (times the scale), :math:`dQ = dS\, K`, :math:`dK = dS^\top Q`. One evaluation, to first
    order, in units of :math:`u` (notation in the module docstring): the weights are off by
    :math:`\rho = (2 d_k + 6) S + 3 S^* + 4 n_k + 3 + 2 \ln n_k` relative (recomputed from the
    saved log-sum-exp: the score, the log-sum-exp's error as :func:`rounding_bound` counts it,
    rescale factors included, the shift and ``exp``; or the softmax's own); :math:`D` by
    :math:`\max(\alpha + d_v, \rho + d_v + n_k)` relative to
    :math:`\mathrm{rowsum}(|dO| \circ P|V|)` (from the output, :math:`\alpha = 2 (d_k + 3) S + 6 n_k + 2`
    as in :func:`rounding_bound`, its weights' term counted as :math:`e^x - 1`, or from
    :math:`\sum_j P_{ij} dP_{ij}`); :math:`dP` by :math:`d_v`;
    the two subtractions, the product and the scale add 4; then the final product, of
    length :math:`n_k` (:math:`dQ`) or :math:`n_q` (:math:`dK`, :math:`dV`), and one more scaling. So

    .. math::
        |dQ_a - dQ_b| \le \varepsilon\, w\, (|dS|_{\text{terms}}\, |K|) + \text{underflow}, \quad
        w = \rho + d_v + \max(\alpha + d_v, \rho + d_v + n_k) + 5 + \max(n_k, n_q),

    with :math:`|dS|_{\text{terms}} = P \circ (|dO|\,|V|^\top + \mathrm{rowsum}(|dO| \circ P|V|) +
    |d\mathrm{lse}|) \cdot \mathrm{scale}`, and likewise :math:`|dS|_{\text{terms}}^\top |Q|` for
    :math:`dK`, :math:`P^\top |dO|` for :math:`dV`. Underflow (a weight, a product below
    :math:`\tau`): :math:`2 n_q \tau (\max|dO| + 1)` for :math:`dV`, and
    :math:`2 n \tau ((X \mathrm{scale} + 2) \max|K| + 1)` for :math:`dQ` (:math:`n = n_k`; for
    :math:`dK`, :math:`n = n_q` and :math:`\max|Q|`), :math:`X` the largest
    :math:`|dS|_{\text{terms}} / P` before the scale.

    Shapes: ``q`` ``(..., n_q, d_k)``, ``k`` ``(..., n_k, d_k)``, ``v`` ``(..., n_k, d_v)``,
    ``d_out`` ``(..., n_q, d_v)``, ``d_lse`` ``(..., n_q)`` or None. Returns the bounds for
    ``dq, dk, dv`` (shapes of the broadcast ``q, k, v``), float64; writes out ``P``.
    """
    q64, k64, v64, p, sc, big, tiny, _ = _sizes(q, k, v, mask, scale)
    do = check_tensor("d_out", d_out).detach().to(torch.float64)
    if do.shape != p.shape[:-1] + v64.shape[-1:]:
        raise ValueError(f"d_out must have the output's shape {format_shape(p.shape[:-1] + v64.shape[-1:])}, "
                         f"got {format_shape(d_out)}")
    eps = torch.finfo(q.dtype).eps
    n_q, d_k = q.shape[-2], q.shape[-1]
    n_k, d_v = k.shape[-2], v.shape[-1]
    star = big + math.log(n_k)
    rho = _lse_count(d_k, big, n_k) + (d_k + 3) * big + 3 * star + 4  # (2 d_k + 6) S + 3 S* + 4 n_k + 3 + 2 ln n_k
    alpha = _weights_error(d_k, big, eps) + _output_count(n_k)
    w = eps * (rho + d_v + max(alpha + d_v, rho + d_v + n_k) + 5 + max(n_k, n_q))
    dp_terms = do.abs() @ v64.abs().transpose(-2, -1)  # (..., n_q, n_k)
    d_terms = (do.abs() * (p @ v64.abs())).sum(-1, keepdim=True)  # (..., n_q, 1)
    if d_lse is not None:
        d_terms = d_terms + d_lse.detach().to(torch.float64).abs()[..., None]
    x = dp_terms + d_terms  # (..., n_q, n_k): |dP - D| at most
    ds_terms = p * x * sc  # (..., n_q, n_k)
    xs = float(x.amax()) * sc + 2
    under_q = 2 * n_k * tiny * (xs * float(k64.abs().amax()) + 1)
    under_k = 2 * n_q * tiny * (xs * float(q64.abs().amax()) + 1)
    under_v = 2 * n_q * tiny * (float(do.abs().amax()) + 1)
    return (w * (ds_terms @ k64.abs()) + under_q,  # (..., n_q, d_k)
            w * (ds_terms.transpose(-2, -1) @ q64.abs()) + under_k,  # (..., n_k, d_k)
            w * (p.transpose(-2, -1) @ do.abs()) + under_v)  # (..., n_k, d_v)
