r"""A product of a tall and a wide factor, kept factored: :class:`FactoredMatrix` (chapter 4).

Every head's :math:`W_i^{QK} = W_i^Q {W_i^K}^\top` and :math:`W_i^{OV} = W_i^V W_i^O` is such a
product (:mod:`attnlib.lowrank.circuits` builds them); this module knows nothing of attention.

The idea (one object for a low-rank product, its SVD and rank through the factors) is
TransformerLens's ``FactoredMatrix`` (Nanda and Bloom, 2022), which uses the same row-vector
layout; this one is written anew, with its SVD through thin QR decompositions of the factors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from attnlib.checks import broadcast_shape, check_positive_int, check_tensor, format_shape
from attnlib.lowrank.signs import fix_signs

__all__ = ["FactoredMatrix", "FlopCount"]


class FlopCount(NamedTuple):
    """Floating-point operations of one computation done two ways (a multiply-add is 2)."""

    factored: int
    full: int



def _check_factor(name: str, t: object, expected: str) -> Tensor:
    t = check_tensor(name, t)
    if t.dim() < 2:
        raise ValueError(f"{name} must have shape {expected}, got {format_shape(t)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if 0 in t.shape[-2:]:
        raise ValueError(f"{name} must have non-empty matrix dimensions {expected}, got {format_shape(t)}")
    return t


_T = TypeVar("_T")


def _copied(value: _T) -> _T:
    """A tensor, or a tuple of tensors, copied: what a caller does to the result
    (``S.zero_()``) must not reach the cache."""
    if isinstance(value, Tensor):
        return value.clone()  # type: ignore[return-value]
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)  # type: ignore[return-value]
    return value


def _cached(method: Callable[["FactoredMatrix"], _T]) -> Callable[["FactoredMatrix"], _T]:
    """Compute ``method`` once per instance and reuse it while ``left`` and ``right``
    are the same tensors, unchanged in place (their version counters say so). Factors
    that require grad are never cached: each call builds its own graph. Each call
    returns its own copy of the cached tensors."""

    @functools.wraps(method)
    def wrapper(self: "FactoredMatrix") -> _T:
        left, right = self.left, self.right
        if left.requires_grad or right.requires_grad:
            return method(self)
        versions = (left._version, right._version)
        hit = self._cache.get(method.__name__)
        # `is`, not `==`: the factors may have been replaced by other tensors
        if hit is not None and hit[0] is left and hit[1] is right and hit[2] == versions:
            return _copied(hit[3])
        value = method(self)
        self._cache[method.__name__] = (left, right, versions, value)
        return _copied(value)

    return wrapper


class FactoredMatrix:
    r"""The product ``M = left @ right`` of a tall and a wide factor, kept factored.

    .. math::
        M = L R, \qquad L \in \mathbb{R}^{m \times r},\; R \in \mathbb{R}^{r \times n},
        \qquad \operatorname{rank} M \le r .

    Shapes: ``left``: ``(..., m, r)``, ``right``: ``(..., r, n)``; the batch dimensions
    ``...`` broadcast (e.g. one matrix per head: ``(h, m, r)`` and ``(h, r, n)``).
    ``M`` is ``(..., m, n)``. Nothing of size ``m x n`` is formed except by :meth:`full`.

    Every question about ``M`` is answered through the factors:

    - :meth:`svd`: QR of each factor, then the SVD of an ``r x r`` core;
    - :attr:`singular_values`, :meth:`rank`, :attr:`stable_rank`;
    - :attr:`num_params` against :attr:`full_params`, :meth:`apply_flops` and
      :meth:`bilinear_flops` against the full matrix;
    - :meth:`gauge` (``left @ A``, ``A^{-1} @ right``: same product, other factors) and
      :meth:`balanced` (the factorisation read off the SVD);
    - ``x @ fm`` computes ``(x @ left) @ right``; :meth:`bilinear` computes
      ``x @ M @ y^T``, the form of attention scores.
    """

    def __init__(self, left: Tensor, right: Tensor) -> None:
        self._cache: dict[str, tuple[Tensor, Tensor, tuple[int, int], Any]] = {}  # see _cached
        self._set(left, right)

    def _set(self, left: Tensor, right: Tensor) -> None:
        """Check the two factors together and keep them, their batch dimensions broadcast."""
        left = _check_factor("left", left, "(..., m, r)")
        right = _check_factor("right", right, "(..., r, n)")
        if left.shape[-1] != right.shape[-2]:
            raise ValueError(
                f"left (..., m, r) and right (..., r, n) must share the inner dimension r: "
                f"left has shape {format_shape(left)} (r = {left.shape[-1]}), "
                f"right has shape {format_shape(right)} (r = {right.shape[-2]})"
            )
        if left.dtype != right.dtype or left.device != right.device:
            raise ValueError(
                f"left and right must have the same dtype and device: left is {left.dtype} on "
                f"{left.device}, right is {right.dtype} on {right.device}"
            )
        try:
            batch = broadcast_shape(left.shape[:-2], right.shape[:-2])
        except RuntimeError:
            raise ValueError(
                f"the batch dimensions of left {format_shape(left)} and right "
                f"{format_shape(right)} do not broadcast"
            ) from None
        self._left = left.expand(*batch, *left.shape[-2:])  # (..., m, r)
        self._right = right.expand(*batch, *right.shape[-2:])  # (..., r, n)

    # ---- the factors: replacing one is checked against the other, as in the constructor ----
    @property
    def left(self) -> Tensor:
        """``L``: ``(..., m, r)``. Assigning a new one checks it against :attr:`right`."""
        return self._left

    @left.setter
    def left(self, value: Tensor) -> None:
        self._set(value, self._right)

    @property
    def right(self) -> Tensor:
        """``R``: ``(..., r, n)``. Assigning a new one checks it against :attr:`left`."""
        return self._right

    @right.setter
    def right(self, value: Tensor) -> None:
        self._set(self._left, value)

    # ---- sizes ----------------------------------------------------------------
    @property
    def batch_shape(self) -> torch.Size:
        """The batch dimensions ``...`` (``torch.Size([])`` for a single matrix)."""
        return self.left.shape[:-2]

    @property
    def shape(self) -> torch.Size:
        """``(..., m, n)``, the shape of the product."""
        return self.batch_shape + torch.Size([self.m, self.n])

    @property
    def m(self) -> int:
        return self.left.shape[-2]

    @property
    def r(self) -> int:
        """The inner dimension: ``rank(M) <= r``."""
        return self.left.shape[-1]

    @property
    def n(self) -> int:
        return self.right.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.left.dtype

    @property
    def _count(self) -> int:
        return self.batch_shape.numel()

    def __repr__(self) -> str:
        batch = f"batch={tuple(self.batch_shape)}, " if self.batch_shape else ""
        return f"FactoredMatrix({batch}m={self.m}, r={self.r}, n={self.n}, dtype={self.dtype})"

    def __getitem__(self, index: int | slice) -> "FactoredMatrix":
        """Index the batch dimensions: ``fm[i]`` is head ``i``'s matrix."""
        if not self.batch_shape:
            raise IndexError(f"a single matrix {format_shape(self.shape)} has no batch dimension to index")
        return FactoredMatrix(self.left[index], self.right[index])

    @property
    def T(self) -> "FactoredMatrix":
        """:math:`M^\\top = R^\\top L^\\top`, still factored: ``(..., n, m)``."""
        return FactoredMatrix(self.right.mT, self.left.mT)

    # ---- the product ----------------------------------------------------------
    def full(self) -> Tensor:
        """``M = left @ right``: ``(..., m, n)``, formed explicitly."""
        return self.left @ self.right  # (..., m, n)

    def __matmul__(self, x: object) -> "Tensor | FactoredMatrix":
        """``fm @ x`` = ``left @ (right @ x)``: ``x`` ``(..., n, k)`` -> ``(..., m, k)``.

        With ``x`` a :class:`FactoredMatrix` ``(..., n, p)`` the product stays factored:
        ``left @ (right @ x.left @ x.right)``, inner dimension ``r``.
        Any other type: ``NotImplemented`` (Python then raises ``TypeError``).
        """
        if isinstance(x, FactoredMatrix):
            if x.m != self.n:
                raise ValueError(f"M @ X needs X of shape (..., n={self.n}, p), got {format_shape(x.shape)}")
            return FactoredMatrix(self.left, (self.right @ x.left) @ x.right)  # (..., m, r), (..., r, p)
        if not isinstance(x, Tensor):
            return NotImplemented
        if x.dim() < 2 or x.shape[-2] != self.n:
            raise ValueError(f"M @ x needs x of shape (..., n={self.n}, k), got {format_shape(x)}")
        return self.left @ (self.right @ x)  # (..., r, k) -> (..., m, k)

    def __rmatmul__(self, x: object) -> Tensor:
        """``x @ fm`` = ``(x @ left) @ right``: ``x`` ``(..., k, m)`` -> ``(..., k, n)``.

        Any type other than a tensor: ``NotImplemented`` (Python then raises ``TypeError``).
        """
        if not isinstance(x, Tensor):
            return NotImplemented
        if x.dim() < 1 or x.shape[-1] != self.m:
            raise ValueError(f"x @ M needs x of shape (..., k, m={self.m}), got {format_shape(x)}")
        return (x @ self.left) @ self.right  # (..., k, r) -> (..., k, n)

    def bilinear(self, x: Tensor, y: Tensor) -> Tensor:
        r"""The bilinear form ``x @ M @ y^T`` through the factors: :math:`(xL)(yR^\top)^\top`.

        With ``M`` a head's :math:`W_i^{QK}` and ``x = y = X`` this is the head's
        unscaled score matrix, :math:`(XW_i^Q)(XW_i^K)^\top`.

        Shapes: ``x``: ``(..., n_x, m)``, ``y``: ``(..., n_y, n)`` -> ``(..., n_x, n_y)``.
        """
        for name, t, d in (("x", x, self.m), ("y", y, self.n)):
            if check_tensor(name, t).dim() < 2 or t.shape[-1] != d:
                dim = "m" if name == "x" else "n"
                raise ValueError(f"{name} must have shape (..., n_{name}, {dim}={d}), got {format_shape(t)}")
        xl = x @ self.left  # (..., n_x, r): the queries
        yr = y @ self.right.mT  # (..., n_y, r): the keys
        return xl @ yr.mT  # (..., n_x, n_y)

    # ---- spectrum ---------------------------------------------------------------
    def _core(self) -> tuple[Tensor, Tensor, Tensor]:
        """``M = Q_L C Q_R^T`` with orthonormal ``Q_L, Q_R`` and a small core ``C``."""
        q_l, r_l = torch.linalg.qr(self.left)  # (..., m, k_l), (..., k_l, r)
        q_r, r_r = torch.linalg.qr(self.right.mT)  # (..., n, k_r), (..., k_r, r)
        core = r_l @ r_r.mT  # (..., k_l, k_r), at most r x r
        return q_l, core, q_r

    @_cached
    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        r"""The thin SVD ``M = U diag(S) Vh``, from an ``r x r`` problem.

        With thin QR decompositions :math:`L = Q_L R_L` and
        :math:`R^\top = Q_R R_R`,

        .. math::
            M = Q_L\, C\, Q_R^\top, \qquad C = R_L R_R^\top
            \quad (\text{at most } r \times r).

        If :math:`C = U_C\, \mathrm{diag}(S)\, V_C^\top`, then :math:`U = Q_L U_C`
        and :math:`V = Q_R V_C` have orthonormal columns, so this is the SVD of
        ``M``: cost :math:`O((m + n) r^2)` instead of :math:`O(m n \min(m, n))`.

        Returns ``U``: ``(..., m, k)``, ``S``: ``(..., k)`` (decreasing),
        ``Vh``: ``(..., k, n)``, with ``k = min(m, n, r)``. Each pair of singular
        vectors has its sign fixed by :func:`fix_signs` (a LAPACK may return either),
        so the result is the same on every machine wherever the singular values are
        distinct and nonzero; vectors of a zero or repeated singular value are any
        orthonormal basis of their space. Computed once per instance while the
        factors stay unchanged (``@_cached``); each call returns its own copy.
        """
        q_l, core, q_r = self._core()  # (.., m, k_l), (.., k_l, k_r), (.., n, k_r)
        u_c, s, vh_c = torch.linalg.svd(core, full_matrices=False)
        # u_c: (..., k_l, k), s: (..., k), vh_c: (..., k, k_r)
        u, vh = fix_signs(q_l @ u_c, vh_c @ q_r.mT)  # (..., m, k), (..., k, n)
        return u, s, vh

    @property
    def singular_values(self) -> Tensor:
        """``(..., k)``, decreasing, ``k = min(m, n, r)``; the rest of ``M``'s are zero.
        From :meth:`svd`, computed once per instance."""
        return self.svd()[1]  # (..., k)

    def rank(self, tol: float | None = None) -> Tensor:
        r"""Numerical rank: the number of singular values above ``tol * s_max``.

        ``tol`` is relative to the largest singular value; by default
        ``eps(dtype) * max(m, n)``, the rule of :func:`torch.linalg.matrix_rank`.
        Returns an integer tensor of shape ``...`` (a 0-d tensor for one matrix).
        """
        if tol is None:
            tol = torch.finfo(self.dtype).eps * max(self.m, self.n)
        elif isinstance(tol, bool) or not isinstance(tol, (int, float)):
            raise TypeError(f"tol must be a number in [0, 1), got {type(tol).__name__} {tol!r}")
        elif not 0 <= tol < 1:
            raise ValueError(
                f"tol must be a number in [0, 1), relative to the largest "
                f"singular value, got {tol!r}"
            )
        s = self.singular_values  # (..., k)
        return (s > tol * s[..., :1]).sum(-1)  # (...,)

    @property
    def stable_rank(self) -> Tensor:
        r""":math:`\lVert M \rVert_F^2 / \lVert M \rVert_2^2 = \sum_j s_j^2 / s_1^2`
        (Rudelson and Vershynin, 2007): between 1 and ``rank(M)``, and unlike the rank it
        changes little when tiny singular values move. Shape ``...``; 0 for ``M = 0``.
        """
        s = self.singular_values  # (..., k)
        top = s[..., 0]  # (...,)
        safe = torch.where(top > 0, top, torch.ones_like(top))
        return torch.where(top > 0, (s**2).sum(-1) / safe**2, torch.zeros_like(top))

    # ---- costs --------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        """Numbers stored in the factors: ``r (m + n)`` per matrix, summed over the batch."""
        return self._count * self.r * (self.m + self.n)

    @property
    def full_params(self) -> int:
        """Numbers stored by the formed matrix: ``m n`` per matrix, summed over the batch."""
        return self._count * self.m * self.n

    def apply_flops(self, n_rows: int) -> FlopCount:
        r"""FLOPs of ``x @ M`` for ``x`` with ``n_rows`` rows, per matrix summed over the batch.

        Factored, ``(x L) R``: :math:`2\,n_{rows}\, r\,(m + n)`; full, ``x M``:
        :math:`2\,n_{rows}\, m n` (not counting the one-off :math:`2 m r n` to form ``M``).
        """
        k = check_positive_int("n_rows", n_rows)
        m, r, n = self.m, self.r, self.n
        return FlopCount(factored=self._count * 2 * k * r * (m + n), full=self._count * 2 * k * m * n)

    def bilinear_flops(self, n_x: int, n_y: int) -> FlopCount:
        r"""FLOPs of ``x @ M @ y^T`` (``n_x`` by ``n_y`` scores), per matrix summed over the batch.

        Factored, :math:`(xL)(yR^\top)^\top`: :math:`2 r (n_x m + n_y n + n_x n_y)`.
        Full, the cheaper of :math:`(xM)y^\top` and :math:`x(My^\top)`:
        :math:`2 \min(n_x m n + n_x n n_y,\; m n n_y + n_x m n_y)`.
        """
        a = check_positive_int("n_x", n_x)
        b = check_positive_int("n_y", n_y)
        m, r, n = self.m, self.r, self.n
        factored = 2 * r * (a * m + b * n + a * b)
        full = 2 * min(a * m * n + a * n * b, m * n * b + a * m * b)
        return FlopCount(factored=self._count * factored, full=self._count * full)

    # ---- other factorisations of the same product ------------------------------------
    def gauge(self, a: Tensor) -> "FactoredMatrix":
        r"""The same product with other factors: ``(left @ a, a^{-1} @ right)``.

        .. math::
            (L A)(A^{-1} R) = L R
            \quad \text{for every invertible } A \in \mathbb{R}^{r \times r}.

        For a head's :math:`W_i^{QK}` (``left`` :math:`= W_i^Q`, ``right``
        :math:`= {W_i^K}^\top`) the new factors are :math:`W_i^Q A` and
        :math:`(W_i^K A^{-\top})^\top`: other queries and keys, the same scores.

        ``a``: ``(r, r)`` or ``(..., r, r)`` (batch dimensions broadcast), same
        dtype and device as the factors, and invertible: a singular (or
        numerically singular, condition number above ``1/eps``) ``a`` raises
        ``ValueError``.
        """
        if not isinstance(a, Tensor):
            raise TypeError(f"a must be a torch.Tensor, got {type(a).__name__}")
        r = self.r
        if a.dim() < 2 or a.shape[-2:] != (r, r):
            raise ValueError(
                f"a must have shape (..., r, r) with r = {r}, got {format_shape(a)}"
            )
        if a.dtype != self.dtype or a.device != self.left.device:
            raise ValueError(
                f"a must have the factors' dtype and device ({self.dtype} on "
                f"{self.left.device}), got {a.dtype} on {a.device}"
            )
        try:
            broadcast_shape(a.shape[:-2], self.batch_shape)
        except RuntimeError:
            raise ValueError(
                f"a's batch dimensions {format_shape(a)} do not broadcast with the "
                f"factors' {format_shape(self.batch_shape)}"
            ) from None
        cond = torch.linalg.cond(a)  # (...,): s_max / s_min, inf when singular
        limit = 1.0 / torch.finfo(a.dtype).eps
        if not bool(torch.all(torch.isfinite(cond) & (cond < limit))):
            cond = torch.nan_to_num(cond, nan=float("inf"))  # 0/0 for a = 0
            worst = cond.max().item()
            raise ValueError(
                f"a must be invertible, but it is singular or numerically singular "
                f"(condition number {worst:.3g}, limit {limit:.3g} for {a.dtype})"
            )
        left = self.left @ a  # (..., m, r)
        right = torch.linalg.solve(a, self.right)  # (..., r, n): a^{-1} @ right
        return FactoredMatrix(left, right)

    def balanced(self) -> "FactoredMatrix":
        r"""The factorisation read off the SVD: ``(U sqrt(S), sqrt(S) Vh)``.

        .. math::
            M = U \Sigma V^\top = (U \Sigma^{1/2})(\Sigma^{1/2} V^\top).

        Both factors carry the same Gram matrix :math:`\Sigma`
        (``left.mT @ left == right @ right.mT == diag(S)``): neither is larger
        than the other. Inner dimension ``k = min(m, n, r)``.
        """
        u, s, vh = self.svd()  # (..., m, k), (..., k), (..., k, n)
        root = s.sqrt()  # (..., k)
        left = u * root.unsqueeze(-2)  # (..., m, k): U sqrt(S)
        right = root.unsqueeze(-1) * vh  # (..., k, n): sqrt(S) Vh
        return FactoredMatrix(left, right)

    @classmethod
    def from_matrix(cls, matrix: Tensor, rank: int) -> "FactoredMatrix":
        r"""Split ``matrix`` ``(..., m, n)`` into two factors of inner dimension ``rank``.

        The truncated SVD, balanced: :math:`(U_{:k} \Sigma_k^{1/2})(\Sigma_k^{1/2} V_{:k}^\top)`
        with ``k = rank``. The product equals ``matrix`` exactly when
        ``rank(matrix) <= rank``; otherwise it is the best approximation of that rank
        (Eckart-Young).
        """
        matrix = _check_factor("matrix", matrix, "(..., m, n)")
        k = check_positive_int("rank", rank)
        if k > min(matrix.shape[-2:]):
            raise ValueError(
                f"rank must be at most min(m, n) = {min(matrix.shape[-2:])} "
                f"for matrix {format_shape(matrix)}, got {k}"
            )
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)  # (.., m, p), (.., p), (.., p, n)
        u, vh = fix_signs(u, vh)  # the same factors on every machine
        root = s[..., :k].sqrt()  # (..., k)
        return cls(u[..., :k] * root.unsqueeze(-2), root.unsqueeze(-1) * vh[..., :k, :])
