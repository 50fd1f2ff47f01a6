"""``assert_rounding_close(..., size=)``: the size of the terms, where the result is smaller.

Sized by the result (the default), a rounding bound breaks under cancellation: two heads
that nearly cancel through ``W^O`` give an output far below its terms, and two correct
float32 evaluations differ by more than eps x width x max|output|. Sized by the terms,
``|concat| @ |W^O|``, the bound holds; and it still refuses a real difference.
"""

from __future__ import annotations

import re

import pytest
import torch

from attnlib import assert_rounding_close, rounding_tolerance

F64, F32 = torch.float64, torch.float32


def _cancelling_heads(c: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """concat = [head 0 | head 0] (two identical heads) and W^O whose head-1 rows are
    -(1 - c) times head 0's: the output is c times its terms."""
    g = torch.Generator().manual_seed(0)
    head = torch.randn(5, 8, generator=g, dtype=F64)
    w_o0 = torch.randn(8, 16, generator=g, dtype=F64)
    concat = torch.cat([head, head], -1)  # (n, 2 d_k)
    w_o = torch.cat([w_o0, -(1 - c) * w_o0])  # (2 d_k, d_model)
    return concat, w_o, concat.abs() @ w_o.abs()


@pytest.mark.parametrize("c", [1e-3, 0.0])
def test_size_of_the_terms_holds_under_cancellation_where_the_result_size_breaks(c: float) -> None:
    concat, w_o, size = _cancelling_heads(c)
    exact = concat @ w_o  # float64: the reference
    in_float32 = (concat.float() @ w_o.float()).double()  # a correct float32 evaluation
    with pytest.raises(AssertionError, match=re.escape("max|expected|")):
        assert_rounding_close(in_float32, exact, 16, dtype=F32)
    bound = assert_rounding_close(in_float32, exact, 16, dtype=F32, size=size)
    assert bound == pytest.approx(rounding_tolerance(F32, 16) * size.max().item(), rel=1e-12)
    wrong = in_float32 + 1e-3 * size.max()  # a real difference, far above rounding
    with pytest.raises(AssertionError, match="x size ="):
        assert_rounding_close(wrong, exact, 16, dtype=F32, size=size)


def test_size_covers_underflow_and_checks_its_argument() -> None:
    tiny = torch.tensor([2.0**-140], dtype=F32)  # subnormal in float32
    exact = tiny.double() * 3.0**-1 * 3.0  # the same number, as float64
    got = (tiny / 3 * 3).double()  # float32 rounding in the subnormals: an absolute spacing
    with pytest.raises(AssertionError):  # float64 spacing: far below what float32 lost
        assert_rounding_close(got, exact, 2, size=tiny.double())
    assert_rounding_close(got, exact, 2, dtype=F32, size=tiny.double())
    assert assert_rounding_close(torch.ones(2), torch.ones(2), 4, size=2.0) == rounding_tolerance(F32, 4) * 2.0 + \
        4 * torch.finfo(F32).eps * torch.finfo(F32).smallest_normal
    with pytest.raises(ValueError, match=">= 0"):
        assert_rounding_close(torch.ones(2), torch.ones(2), 4, size=-torch.ones(2))
    with pytest.raises(ValueError, match="does not broadcast"):
        assert_rounding_close(torch.ones(2), torch.ones(2), 4, size=torch.ones(3))
    with pytest.raises(TypeError, match="size"):
        assert_rounding_close(torch.ones(2), torch.ones(2), 4, size="big")  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        assert_rounding_close(torch.tensor([float("nan")]), torch.ones(1), 4, size=1.0)
