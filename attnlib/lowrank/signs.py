"""One sign for singular vectors, the same on every machine (chapter 4)."""

from __future__ import annotations

import torch
from torch import Tensor

from attnlib.checks import check_tensor, format_shape

__all__ = ["fix_signs"]


def fix_signs(u: Tensor, vh: Tensor) -> tuple[Tensor, Tensor]:
    r"""Singular vectors with their sign fixed: ``(U D, D Vh)`` with ``D = diag(±1)``.

    An SVD :math:`M = U \Sigma V^\top` leaves the sign of each pair
    :math:`(u_j, v_j)` free: :math:`(-u_j)\,\sigma_j(-v_j)^\top` is the same term, and
    LAPACKs on different CPUs return different signs. The rule here: the entry of
    largest magnitude in each column of ``U`` is positive (the first one, if two
    tie), and the matching row of ``Vh`` is flipped with it, so
    :math:`U \Sigma V^\top` is unchanged.

    Shapes: ``u``: ``(..., m, k)``, ``vh``: ``(..., k, n)``; returns the same shapes.
    """
    u, vh = check_tensor("u", u), check_tensor("vh", vh)
    if u.dim() < 2 or vh.dim() < 2 or u.shape[-1] != vh.shape[-2]:
        raise ValueError(
            f"u must be (..., m, k) and vh (..., k, n) with the same k, "
            f"got u {format_shape(u)} and vh {format_shape(vh)}")
    biggest = u.abs().argmax(dim=-2, keepdim=True)  # (..., 1, k): first largest
    sign = torch.gather(u, -2, biggest).sign()  # (..., 1, k)
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)  # a zero column: keep it
    return u * sign, vh * sign.mT  # (..., m, k), (..., k, n)
