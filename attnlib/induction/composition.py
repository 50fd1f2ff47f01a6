r"""How a head of layer 1 reads what a head of layer 0 wrote: composition scores (chapter 11).

A head of layer 0 adds :math:`\alpha\, x W^{OV}_0` to the residual stream. A head of layer 1
reads the stream three ways, and each reading passes layer 0's output through one of its
matrices (row vectors, :math:`W^{QK} = W^Q {W^K}^\top`, :math:`W^{OV} = W^V W^O`):

- its **queries** (Q-composition): :math:`(y W^{OV}_0)\, W^{QK}_1\, x^\top`, the product
  :math:`W^{OV}_0 W^{QK}_1`;
- its **keys** (K-composition): :math:`x\, W^{QK}_1 (y W^{OV}_0)^\top`, the product
  :math:`W^{OV}_0 {W^{QK}_1}^\top`;
- its **values** (V-composition): :math:`(y W^{OV}_0)\, W^{OV}_1`, the product
  :math:`W^{OV}_0 W^{OV}_1`.

The composition score of Elhage et al. (2021) measures how much of the product survives,

.. math::
    C(A, B) = \frac{\lVert A B \rVert_F}{\lVert A \rVert_F\, \lVert B \rVert_F} \in [0, 1],

0 when what ``A`` writes is orthogonal to what ``B`` reads. It reaches 1 only for aligned
rank-1 matrices: two rank-``r`` projections onto the same space score :math:`1/\sqrt{r}`,
and for given singular values :math:`a_1 \ge a_2 \ge \dots` of ``A`` and
:math:`b_1 \ge b_2 \ge \dots` of ``B`` the best alignment scores (von Neumann's trace
inequality, :func:`composition_ceiling`)

.. math::
    \max_{U \text{ orthogonal}} C(A U, B) = \frac{\sqrt{\sum_i a_i^2 b_i^2}}{\lVert A \rVert_F\, \lVert B \rVert_F} .
 TransformerLens (Nanda and Bloom, 2022) computes it on its ``FactoredMatrix``;
here it is computed on :class:`attnlib.FactoredMatrix` (chapter 4), through the factors: the
product of two factored matrices stays factored, and its Frobenius norm, the root of the
sum of its squared singular values, is that of an ``r x r`` core (:func:`frobenius`).
"""

from __future__ import annotations


import torch
from torch import Tensor

from attnlib.checks import check_positive_int, format_shape
from attnlib.lowrank import FactoredMatrix, ov_circuit, qk_circuit
from attnlib.multihead import MultiHeadAttention, plain_view

__all__ = ["frobenius", "composition_score", "composition_ceiling", "composition_scores",
           "random_composition_scores", "KINDS"]

KINDS = ("Q", "K", "V")


def frobenius(m: FactoredMatrix) -> Tensor:
    r""":math:`\lVert M \rVert_F = \sqrt{\sum_j s_j^2}` of the factored ``M = L R``
    ``(..., m, n)``, from a small core: with the thin QR decompositions :math:`L = Q_L R_L` and
    :math:`R^\top = Q_R R_R` (those of :meth:`attnlib.FactoredMatrix.svd`),
    :math:`M = Q_L (R_L R_R^\top) Q_R^\top` with orthonormal columns in :math:`Q_L, Q_R`, so
    :math:`\lVert M \rVert_F = \lVert R_L R_R^\top \rVert_F` (at most ``r x r``): the singular
    values of ``M`` are those of the core, and no SVD is needed for their sum of squares.
    Shape ``...``."""
    if not isinstance(m, FactoredMatrix):
        raise TypeError(f"m must be an attnlib.FactoredMatrix, got {type(m).__name__}")
    r_l = torch.linalg.qr(m.left, mode="r").R  # (..., k_l, r)
    r_r = torch.linalg.qr(m.right.mT, mode="r").R  # (..., k_r, r)
    return (r_l @ r_r.mT).square().sum((-2, -1)).sqrt()  # (...,)


def _check_composable(a: FactoredMatrix, b: FactoredMatrix) -> None:
    """Both factored, and ``a`` ``(..., m, n)`` composes with ``b`` ``(..., n, p)``."""
    for name, m in (("a", a), ("b", b)):
        if not isinstance(m, FactoredMatrix):
            raise TypeError(f"{name} must be an attnlib.FactoredMatrix, got {type(m).__name__}")
    if a.n != b.m:
        raise ValueError(f"a (..., m, n) and b (..., n, p) must share n: a is {format_shape(a.shape)}, "
                         f"b is {format_shape(b.shape)}")


def composition_score(a: FactoredMatrix, b: FactoredMatrix) -> Tensor:
    r""":math:`\lVert A B \rVert_F / (\lVert A \rVert_F \lVert B \rVert_F)` for ``a`` ``(..., m, n)``
    and ``b`` ``(..., n, p)`` (batch dimensions broadcast); shape: the broadcast batch.

    Between 0 and 1 (the Frobenius norm is submultiplicative); unchanged when ``a`` or ``b``
    is scaled, and when an orthogonal ``U`` is put between them (``a U``, ``U^T b``). Where
    ``a`` or ``b`` is zero (a pruned head) the ratio is 0/0, which the maths leaves undefined:
    the score is 0 there, since nothing is written that could be read."""
    _check_composable(a, b)
    product = a @ b  # FactoredMatrix (..., m, p), inner dimension a.r
    assert isinstance(product, FactoredMatrix)
    return _ratio(frobenius(product), frobenius(a) * frobenius(b))


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den``, and 0 where ``den`` is 0 (then ``num`` is 0 too: a zero matrix composes
    with nothing)."""
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


def composition_ceiling(a: FactoredMatrix, b: FactoredMatrix) -> Tensor:
    r"""The largest score ``a`` ``(..., m, n)`` and ``b`` ``(..., n, p)`` can reach with their
    own singular values, over every rotation :math:`U` of the space between them:
    :math:`\max_U C(AU, B) = \sqrt{\sum_i a_i^2 b_i^2} / (\lVert A \rVert_F \lVert B \rVert_F)`,
    both spectra sorted in decreasing order (the shorter padded with zeros); shape: the
    broadcast batch. Reached when ``A``'s right singular vectors meet ``B``'s left ones in order;
    0 where ``a`` or ``b`` is zero, as :func:`composition_score`."""
    _check_composable(a, b)
    sa, sb = a.singular_values, b.singular_values  # (..., r_a), (..., r_b), decreasing
    k = min(sa.shape[-1], sb.shape[-1])
    aligned = (sa[..., :k] * sb[..., :k]).square().sum(-1).sqrt()  # (...,)
    return _ratio(aligned, frobenius(a) * frobenius(b))  # 0 for a zero matrix, as the score


def composition_scores(layer0: MultiHeadAttention, layer1: MultiHeadAttention, kind: str) -> Tensor:
    r"""Every (layer-0 head ``i``, layer-1 head ``j``) score of one kind: ``(h0, h1)``.

    ``kind``: ``"Q"`` scores :math:`W^{OV}_{0,i} W^{QK}_{1,j}`, ``"K"`` scores
    :math:`W^{OV}_{0,i} {W^{QK}_{1,j}}^\top`, ``"V"`` scores :math:`W^{OV}_{0,i} W^{OV}_{1,j}`
    (see the module). The circuits are :func:`attnlib.ov_circuit` and
    :func:`attnlib.qk_circuit`, computed in float64, of each layer's plain view
    (:func:`attnlib.multihead.plain_view`: a layer with RoPE or ALiBi is refused, naming it).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    layer0 = plain_view(layer0, "layer0", "composition_scores")  # refuses RoPE, ALiBi, ... by name
    layer1 = plain_view(layer1, "layer1", "composition_scores")
    if layer0.d_model != layer1.d_model:
        raise ValueError(f"layer0 and layer1 must share d_model, got {layer0.d_model} and {layer1.d_model}")

    def f64(fm: FactoredMatrix) -> FactoredMatrix:
        return FactoredMatrix(fm.left.double(), fm.right.double())

    ov0 = f64(ov_circuit(layer0))  # batch (h0,): (h0, d, d)
    reader = f64(ov_circuit(layer1) if kind == "V" else qk_circuit(layer1))  # batch (h1,)
    if kind == "K":
        reader = reader.T
    a = FactoredMatrix(ov0.left[:, None], ov0.right[:, None])  # batch (h0, 1)
    b = FactoredMatrix(reader.left[None], reader.right[None])  # batch (1, h1)
    return composition_score(a, b)  # (h0, h1)


def random_composition_scores(d_model: int, d_k: int, n: int, generator: torch.Generator) -> Tensor:
    r"""The control: ``n`` scores :math:`C(A, B)` of random matrices with a head's shapes,
    :math:`A = L_A R_A`, :math:`B = L_B R_B` with Gaussian factors ``(d_model, d_k)`` and
    ``(d_k, d_model)``: what two heads score when neither was fitted to the other.
    Returns ``(n,)`` (float64). It concentrates near :math:`1 / \sqrt{d_{model}}`, as for
    two independent Gaussian matrices: :math:`\lVert AB \rVert_F^2` grows like
    :math:`d^3` and :math:`\lVert A \rVert_F^2 \lVert B \rVert_F^2` like :math:`d^4`."""
    check_positive_int("d_model", d_model)
    check_positive_int("d_k", d_k)
    check_positive_int("n", n)
    if d_k > d_model:
        raise ValueError(f"d_k ({d_k}) must be at most d_model ({d_model})")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    f = [torch.randn(n, *s, generator=generator, dtype=torch.float64)
         for s in ((d_model, d_k), (d_k, d_model), (d_model, d_k), (d_k, d_model))]
    return composition_score(FactoredMatrix(f[0], f[1]), FactoredMatrix(f[2], f[3]))  # (n,)


