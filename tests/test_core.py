"""The pieces every chapter shares: attnlib.checks (the validators), attnlib.records
(AttentionWeights and its packing) and attnlib.rounding.

One rule for every module: a wrong type raises TypeError (a bool is not an int),
a wrong value ValueError, an index out of range IndexError.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlib import FactoredMatrix, MultiHeadAttention, SeparateHeadsAttention, attention
from attnlib.checks import (
    check_dtype,
    check_heads,
    check_index,
    check_mask,
    check_positive_int,
    check_tensor,
    check_width,
    format_shape,
)
from attnlib.records import AttentionWeights, Biases, pack_qkv, split_qkv
from attnlib.lowrank import qk_circuit
from strategies import examples

FAST = examples(20)


def test_format_shape() -> None:
    assert format_shape(torch.zeros(2, 3)) == "(2, 3)"
    assert format_shape(torch.Size([5])) == "(5,)"
    assert format_shape(()) == "()"


@pytest.mark.parametrize("value", [1, 7])
def test_positive_int_accepts(value: int) -> None:
    assert check_positive_int("n", value) == value


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1, ValueError), (True, TypeError), (False, TypeError), (2.0, TypeError), ("3", TypeError), (None, TypeError)],
)
def test_positive_int_rejects(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="n must be a positive int, got"):
        check_positive_int("n", value)


def test_width_takes_the_name_first_and_says_why_it_must_be_even() -> None:
    """check_width took (value, name), the reverse of check_positive_int, and said "RoPE" for any
    even width (sinusoidal encodings too); its message came out garbled from apply_rope."""
    assert check_width("d_k", 4, even=True) == 4 and check_width("d_r", 0, zero_ok=True) == 0
    with pytest.raises(TypeError, match="d_k must be a positive int, got str 'x'"):
        check_width("d_k", "x")
    with pytest.raises(ValueError, match=r"^d_model must be even, got 5$"):
        check_width("d_model", 5, even=True)
    with pytest.raises(ValueError, match=r"^d_model must be even, got 5: sin and cos pair dimensions$"):
        check_width("d_model", 5, even=True, why="sin and cos pair dimensions")
    with pytest.raises(ValueError, match="d_r must be a non-negative int, got -1"):
        check_width("d_r", -1, zero_ok=True)


def test_dtype() -> None:
    assert check_dtype("dtype", torch.float16) is torch.float16
    with pytest.raises(TypeError, match="dtype must be a torch.dtype, got str 'float32'"):
        check_dtype("dtype", "float32")


def test_index() -> None:
    assert check_index("head", 2, 3, "num_heads=3") == 2
    with pytest.raises(IndexError, match=r"head must be an int in \[0, 3\) for num_heads=3, got 3"):
        check_index("head", 3, 3, "num_heads=3")
    with pytest.raises(IndexError, match="got -1"):
        check_index("head", -1, 3, "num_heads=3")
    for bad in (True, 1.5, "1", None):
        with pytest.raises(TypeError, match=r"head must be an int in \[0, 3\), got"):
            check_index("head", bad, 3, "num_heads=3")


def test_heads_and_tensor_and_mask() -> None:
    assert check_heads(12, 4) == 3
    with pytest.raises(ValueError, match="divisible"):
        check_heads(10, 4)
    t = torch.zeros(2)
    assert check_tensor("x", t) is t
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        check_tensor("x", [0.0])
    m = torch.ones(3, dtype=torch.bool)
    assert check_mask(m, torch.Size([2, 3])) is m


def test_one_rule_across_modules() -> None:
    """The same wrong argument raises the same exception class in every module."""
    mha = MultiHeadAttention(8, 2)
    fm = FactoredMatrix(torch.randn(4, 2), torch.randn(2, 3))
    wrong_type = [
        lambda: MultiHeadAttention(True, True),  # type: ignore[arg-type]
        lambda: SeparateHeadsAttention(8, True),  # type: ignore[arg-type]
        lambda: mha.head(True),  # type: ignore[arg-type]
        lambda: qk_circuit(mha, True),  # type: ignore[arg-type]
        lambda: fm.apply_flops(True),  # type: ignore[arg-type]
        lambda: FactoredMatrix.from_matrix(torch.randn(3, 3), True),  # type: ignore[arg-type]
        lambda: attention([1.0], torch.zeros(2, 1), torch.zeros(2, 1)),  # type: ignore[arg-type]
        lambda: mha([1.0], [1.0], [1.0]),  # type: ignore[arg-type]
    ]
    for call in wrong_type:
        with pytest.raises(TypeError):
            call()
    for call in (lambda: mha.head(2), lambda: qk_circuit(mha, -1)):
        with pytest.raises(IndexError):
            call()
    for call in (lambda: MultiHeadAttention(0, 1), lambda: fm.apply_flops(0)):
        with pytest.raises(ValueError):
            call()


# ---- AttentionWeights, Biases and the packing --------------------------------------------------
def _weights(d: int, bias: bool, seed: int = 0, width: int | None = None) -> AttentionWeights:
    """d_model = d; heads of total width ``width`` (h*d_k, d by default)."""
    g = torch.Generator().manual_seed(seed)
    D = d if width is None else width
    w = [torch.randn(d, D, generator=g) for _ in range(3)] + [torch.randn(D, d, generator=g)]
    b = [torch.randn(n, generator=g) for n in (D, D, D, d)] if bias else [None] * 4
    return AttentionWeights(*w, *b)


def test_heads_of_any_width_in_the_record_and_the_checks() -> None:
    w = _weights(4, True, width=6)
    assert (w.d_model, w.heads_width) == (4, 6) and w.b_o.shape == (4,)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"b_q must have shape \(h\*d_k,\) = \(6,\) for w_q of shape \(4, 6\), got \(4,\)"):
        AttentionWeights(w.w_q, w.w_k, w.w_v, w.w_o, w.b_o, w.b_k, w.b_v, w.b_o)
    with pytest.raises(ValueError, match=r"w_o must have shape \(h\*d_v, d_model\) = \(6, 4\)"):
        AttentionWeights(w.w_q, w.w_k, w.w_v, w.w_o.T)
    with pytest.raises(ValueError, match=r"w_qkv must have shape \(d_model, 3\*h\*d_k\), got \(4, 7\)"):
        split_qkv(torch.zeros(4, 7), None, torch.zeros(2, 4), None)
    assert check_heads(6, 4, 5) == 5 and check_heads(8, 4) == 2
    with pytest.raises(ValueError, match="d_k must be a positive int, got 0"):
        check_heads(8, 4, 0)


def test_biases_record() -> None:
    with_bias, without = _weights(4, True), _weights(4, False)
    assert without.biases is None and not without.bias
    b = with_bias.biases
    assert isinstance(b, Biases) and with_bias.bias
    assert b.q is with_bias.b_q and b.k is with_bias.b_k and b.v is with_bias.b_v and b.o is with_bias.b_o


def test_weights_type_errors() -> None:
    w = _weights(4, True)
    with pytest.raises(TypeError, match="w_k must be a torch.Tensor, got list"):
        AttentionWeights(w.w_q, [[0.0]], w.w_v, w.w_o)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="b_v must be a torch.Tensor, got float"):
        AttentionWeights(w.w_q, w.w_k, w.w_v, w.w_o, w.b_q, w.b_k, 0.0, w.b_o)  # type: ignore[arg-type]


@FAST
@given(st.integers(1, 6), st.booleans(), st.integers(0, 2**16), st.sampled_from([None, 1, 7]))
def test_pack_then_split_is_the_identity(d: int, bias: bool, seed: int, width: int | None) -> None:
    """Also for heads of another total width D = h*d_k than d_model (``width``)."""
    w = _weights(d, bias, seed, width)
    D = w.heads_width
    w_qkv, b_qkv = pack_qkv(w)
    assert w_qkv.shape == (d, 3 * D) and (b_qkv is None) == (not bias)
    assert torch.equal(w_qkv[:, D : 2 * D], w.w_k)
    back = split_qkv(w_qkv, b_qkv, w.w_o, w.b_o)
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
        a, b = getattr(back, name), getattr(w, name)
        assert (a is None and b is None) or torch.equal(a, b)
    assert back.w_q.data_ptr() != w_qkv.data_ptr()  # copies, not views


# ---- rounding_tolerance -------------------------------------------------------------
def test_rounding_tolerance_is_eps_times_the_summed_widths() -> None:
    from attnlib import rounding_tolerance

    eps32 = torch.finfo(torch.float32).eps
    assert rounding_tolerance(torch.float32, 384, 32) == eps32 * 416
    assert rounding_tolerance(torch.float64, 1) == torch.finfo(torch.float64).eps


def test_rounding_tolerance_bounds_a_real_reordering() -> None:
    """The bound holds for a sum done in two orders (float32 against float64)."""
    from attnlib import rounding_tolerance

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 512, generator=g), torch.randn(512, 256, generator=g)
    exact = x.double() @ w.double()  # (64, 256)
    size = x.double().abs() @ w.double().abs()  # sum |x_i w_i| per entry
    gap = ((x @ w).double() - exact).abs()
    assert torch.all(gap <= rounding_tolerance(torch.float32, 512) * size)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.int32, 4), TypeError, "dtype must be a floating torch.dtype"),
        (("float32", 4), TypeError, "dtype must be a floating torch.dtype"),
        ((torch.float32,), ValueError, "widths must name at least one"),
        ((torch.float32, 4, 0), ValueError, r"widths\[1\] must be at least 1, got 0"),
        ((torch.float32, 4.0), TypeError, r"widths\[0\] must be a positive int"),
    ],
)
def test_rounding_tolerance_refuses_bad_input(args: tuple, error: type, match: str) -> None:
    from attnlib import rounding_tolerance

    with pytest.raises(error, match=match):
        rounding_tolerance(*args)


def test_assert_rounding_close_passes_rounding_and_fails_a_real_difference() -> None:
    from attnlib import assert_rounding_close, rounding_tolerance

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 384, generator=g), torch.randn(384, 32, generator=g)
    exact = x.double() @ w.double()  # (8, 32)
    bound = assert_rounding_close(x @ w, exact, 384)  # float32 against float64
    assert bound == rounding_tolerance(torch.float32, 384) * exact.abs().max().item()
    with pytest.raises(AssertionError, match="more than rounding allows"):
        assert_rounding_close(x @ w + 0.1, exact, 384)
    with pytest.raises(AssertionError, match="more than rounding allows"):
        assert_rounding_close(torch.full((2,), float("nan")), torch.ones(2), 4)


def test_assert_rounding_close_refuses_bad_input() -> None:
    from attnlib import assert_rounding_close

    with pytest.raises(ValueError, match=r"one shape, got \(2,\) and \(3,\)"):
        assert_rounding_close(torch.ones(2), torch.ones(3), 4)
    with pytest.raises(TypeError, match="actual must be a torch.Tensor"):
        assert_rounding_close([1.0], torch.ones(1), 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="widths must name at least one"):
        assert_rounding_close(torch.ones(2), torch.ones(2))


def test_assert_rounding_close_takes_the_dtype_that_rounded() -> None:
    from attnlib import assert_rounding_close

    exact = torch.linspace(0, 1, 11, dtype=torch.float64)
    via_float32 = exact.float().double()  # float64 numbers that went through float32
    with pytest.raises(AssertionError, match="float64"):
        assert_rounding_close(via_float32, exact, 1)
    assert assert_rounding_close(via_float32, exact, 1, dtype=torch.float32) > 0
