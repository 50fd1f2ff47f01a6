r"""Tolerances derived, not tuned: how far two evaluations of one computation may drift
apart by rounding (every chapter).

:func:`rounding_tolerance` gives the bound :math:`\varepsilon \sum_j n_j` for a chain of
inner products of lengths :math:`n_j`; :func:`assert_rounding_close` checks two results
against it, relative to their size, and returns the bound so that a page can print it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlib.checks import check_int, check_tensor, format_shape

__all__ = ["rounding_tolerance", "assert_rounding_close"]


def rounding_tolerance(dtype: torch.dtype, *widths: int) -> float:
    r"""How far two evaluations of the same computation may drift apart by rounding.

    An inner product of length :math:`n` computed in floating point, in any order, is
    off by at most :math:`\gamma_n = n u / (1 - n u) \approx n u` relative to
    :math:`\sum_i |x_i y_i|` (:math:`u` = unit roundoff = ``eps / 2``; Higham,
    *Accuracy and Stability of Numerical Algorithms*, 2002, section 3.1). A chain of
    such products, one after another (a projection of width ``d_model``, then scores
    of width ``d_k``, ...), adds their lengths to first order. Two implementations
    that sum in different orders (another CPU, BLAS or thread count) are each that
    close to the exact result, so they differ by at most

    .. math::  2u \sum_j n_j = \varepsilon \sum_j n_j \quad (\varepsilon = \texttt{eps}),

    relative to the size of the terms. This is a worst case, not a typical error:
    measured gaps are usually far smaller, and a tolerance derived this way does not
    depend on the machine it was written on.

    Args:
        dtype: a floating dtype, e.g. ``torch.float32``.
        widths: the lengths of the inner products along the computation's path, one
            per step (at least one, each at least 1).

    Returns ``eps(dtype) * sum(widths)``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not widths:
        raise ValueError("widths must name at least one inner-product length, got none")
    for i, w in enumerate(widths):
        check_int(f"widths[{i}]", w, "a positive int")
        if w < 1:
            raise ValueError(f"widths[{i}] must be at least 1, got {w}")
    return torch.finfo(dtype).eps * sum(widths)


def assert_rounding_close(
    actual: Tensor, expected: Tensor, *widths: int, dtype: torch.dtype | None = None
) -> float:
    r"""Assert that two evaluations of one computation agree to rounding; the bound used.

    The bound is :func:`rounding_tolerance` of ``dtype`` (by default the coarser of the
    two tensors' dtypes; pass ``torch.float32`` where a float64 tensor went through a
    float32 step, as Hugging Face's softmax does) and ``widths``, times
    the size of the numbers, :math:`\max |\text{expected}|` (at least 1e-30):
    ``|actual - expected| <= eps * sum(widths) * max|expected|`` elementwise. Use it
    where two implementations (another library, another order of the same sums) are
    compared in float32: the tolerance follows from the computation, not from the
    machine it was first run on. It is a first-order tolerance relative to the size of
    the result: where the terms are much larger than the result (cancellation, or a
    softmax over large scores), a worst-case bound must use the size of the terms
    instead, as chapter 6 does.

    Shapes: ``actual`` and ``expected`` of one shape. Returns the bound, so that a
    page can print it.
    """
    actual, expected = check_tensor("actual", actual), check_tensor("expected", expected)
    if actual.shape != expected.shape:
        raise ValueError(f"actual and expected must have one shape, got "
                         f"{format_shape(actual)} and {format_shape(expected)}")
    coarser = dtype if dtype is not None else min(
        (actual.dtype, expected.dtype), key=lambda d: torch.finfo(d).bits)
    size = max(expected.detach().abs().max().item(), 1e-30) if expected.numel() else 1.0
    bound = rounding_tolerance(coarser, *widths) * size
    gap = (actual.detach().to(expected.dtype) - expected.detach()).abs().max().item() \
        if expected.numel() else 0.0
    if not gap <= bound:  # also catches NaN
        raise AssertionError(
            f"actual and expected differ by {gap:.3g}, more than rounding allows: "
            f"eps({coarser}) x {sum(widths)} x max|expected| = {bound:.3g}")
    return bound
