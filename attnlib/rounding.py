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
    depend on the machine it was written on. It assumes no underflow: a result below
    ``finfo(dtype).smallest_normal`` is rounded to an absolute spacing, not a relative
    one (:func:`assert_rounding_close` adds that spacing per rounding).

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
    actual: Tensor, expected: Tensor, *widths: int, dtype: torch.dtype | None = None,
    size: Tensor | float | None = None,
) -> float:
    r"""Assert that two evaluations of one computation agree to rounding; the bound used.

    The bound is :func:`rounding_tolerance` of ``dtype`` (by default the coarser of the
    two tensors' dtypes; pass ``torch.float32`` where a float64 tensor went through a
    float32 step, as Hugging Face's softmax does) and ``widths``, times the size of the
    numbers: ``|actual - expected| <= eps * sum(widths) * size`` elementwise. Use it
    where two implementations (another library, another order of the same sums) are
    compared: the tolerance follows from the computation, not from the machine it was
    first run on.

    ``size`` is the size of the terms the result is summed from, elementwise (a tensor
    that broadcasts to ``expected``) or one number: for ``x @ W`` it is ``|x| @ |W|``.
    By default it is :math:`\max |\text{expected}|` (at least 1e-30), the size of the
    result, which is right only where the result is as large as its terms: under
    cancellation (a result far below its terms, say heads that nearly cancel through
    :math:`W^O`), or a softmax over large scores, pass the size of the terms (chapter 8
    does). With ``size`` given, each rounding may also lose the spacing of the
    subnormals, ``eps * smallest_normal`` (underflow), which is added once per width.

    Shapes: ``actual`` and ``expected`` of one shape. Returns the largest bound, so that
    a page can print it.
    """
    actual, expected = check_tensor("actual", actual), check_tensor("expected", expected)
    if actual.shape != expected.shape:
        raise ValueError(f"actual and expected must have one shape, got "
                         f"{format_shape(actual)} and {format_shape(expected)}")
    coarser = dtype if dtype is not None else min(
        (actual.dtype, expected.dtype), key=lambda d: torch.finfo(d).bits)
    tol = rounding_tolerance(coarser, *widths)
    if size is None:
        what = "max|expected|"
        scale: Tensor | float = max(expected.detach().abs().max().item(), 1e-30) if expected.numel() else 1.0
        bound: Tensor | float = tol * scale
    else:
        if isinstance(size, bool) or not isinstance(size, (Tensor, int, float)):
            raise TypeError(f"size must be a tensor, a number or None, got {type(size).__name__}")
        what = "size"
        terms = size.detach().to(torch.float64) if isinstance(size, Tensor) else torch.tensor(float(size))
        if terms.numel() and not bool((terms >= 0).all()):
            raise ValueError("size must be >= 0: the size of the terms, e.g. |x| @ |W|")
        try:
            terms = terms.expand(expected.shape)
        except RuntimeError:
            raise ValueError(f"size of shape {format_shape(terms)} does not broadcast to "
                             f"expected's {format_shape(expected)}") from None
        info = torch.finfo(coarser)
        bound = tol * terms + sum(widths) * info.eps * info.smallest_normal  # (expected's shape)
    if not expected.numel():
        return float(bound) if not isinstance(bound, Tensor) else 0.0
    gap = (actual.detach().to(torch.float64) - expected.detach().to(torch.float64)).abs()
    within = gap <= bound  # also False where NaN
    if not bool(within.all()):
        worst = int((gap - bound).nan_to_num(nan=float("inf")).argmax())
        g = gap.flatten()[worst].item()
        b = bound.flatten()[worst].item() if isinstance(bound, Tensor) else bound
        raise AssertionError(
            f"actual and expected differ by {g:.3g}, more than rounding allows: "
            f"eps({coarser}) x {sum(widths)} x {what} = {b:.3g}")
    return float(bound.max()) if isinstance(bound, Tensor) else bound
