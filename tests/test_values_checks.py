"""attnlib.checks, case by case: what each check returns, and which exception class each
wrong argument raises (the rule: TypeError for a wrong type, ValueError for a wrong value,
IndexError for an index out of range). Written to kill what mutation testing
(``make mutants``) found unchecked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.checks import (
    broadcast_shape,
    check_attention_inputs,
    check_dtype,
    check_head_mask,
    check_heads,
    check_index,
    check_int,
    check_mask,
    check_positive_int,
    check_tensor,
    check_width,
    format_shape,
)


def test_format_shape_of_each_kind() -> None:
    assert format_shape(torch.zeros(2, 3, 4)) == "(2, 3, 4)"
    assert format_shape((7,)) == "(7,)"
    assert format_shape(torch.Size([1, 0])) == "(1, 0)"
    assert format_shape(torch.zeros(())) == "()"


def test_check_dtype() -> None:
    assert check_dtype("dt", torch.float16) is torch.float16
    with pytest.raises(TypeError, match="^dt must be a torch.dtype, got str 'float32'$"):
        check_dtype("dt", "float32")


def test_check_int_and_check_positive_int() -> None:
    assert check_int("n", 0) == 0 and check_int("n", -3) == -3
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="n must be an int, got"):
            check_int("n", bad)
    with pytest.raises(TypeError, match="n must be a count, got bool True"):
        check_int("n", True, "a count")
    assert check_positive_int("n", 1) == 1
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        check_positive_int("n", 0)


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    (("w", 1), {}, 1), (("w", 6), {"even": True}, 6), (("w", 0), {"zero_ok": True}, 0),
    (("w", 3), {"zero_ok": True}, 3), (("w", 2), {"even": True, "zero_ok": True}, 2),
])
def test_check_width_accepts(args: tuple, kwargs: dict, expected: int) -> None:
    assert check_width(*args, **kwargs) == expected


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), [
    (("w", 0), {}, ValueError, "w must be a positive int, got 0"),
    (("w", -1), {"zero_ok": True}, ValueError, "w must be a non-negative int, got -1"),
    (("w", 3), {"even": True}, ValueError, "^w must be even, got 3$"),
    (("w", 3), {"even": True, "why": "RoPE pairs j with j + w/2"}, ValueError,
     r"^w must be even, got 3: RoPE pairs j with j \+ w/2$"),
    (("w", False), {"zero_ok": True}, TypeError, "w must be a positive int, got bool False"),
    (("w", 0.0), {"zero_ok": True}, TypeError, "w must be a positive int, got float"),
    (("w", 2.0), {}, TypeError, "w must be a positive int"),
])
def test_check_width_refuses(args: tuple, kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_width(*args, **kwargs)


def test_check_index_edges() -> None:
    assert check_index("i", 0, 1, "one") == 0
    assert check_index("i", 4, 5, "five") == 4
    with pytest.raises(IndexError, match=r"i must be an int in \[0, 5\) for five, got 5"):
        check_index("i", 5, 5, "five")


def test_check_heads_returns_d_k() -> None:
    assert check_heads(12, 4) == 3
    assert check_heads(5, 5) == 1
    assert check_heads(7, 1) == 7
    assert check_heads(8, 3, 5) == 5  # heads of any width: h d_k need not be d_model
    assert check_heads(10, 4, 1) == 1
    with pytest.raises(ValueError, match="d_k must be a positive int, got 0"):
        check_heads(8, 2, 0)
    with pytest.raises(TypeError, match="d_k must be a positive int"):
        check_heads(8, 2, 2.0)
    with pytest.raises(ValueError, match=r"d_model \(10\) must be divisible by num_heads \(4\)"):
        check_heads(10, 4)
    with pytest.raises(TypeError, match="num_heads must be a positive int"):
        check_heads(8, 2.0)
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        check_heads(0, 1)


def test_check_tensor_returns_its_argument() -> None:
    t = torch.zeros(1)
    assert check_tensor("t", t) is t
    with pytest.raises(TypeError, match="t must be a torch.Tensor, got float"):
        check_tensor("t", 0.0)


def test_check_mask_broadcasts_but_never_enlarges() -> None:
    target = torch.Size([2, 3, 4])
    for shape in ((4,), (3, 4), (1, 1, 4), (2, 3, 4), (2, 1, 1)):
        m = torch.ones(shape, dtype=torch.bool)
        assert check_mask(m, target) is m
    for shape in ((5,), (2, 2, 3, 4), (3, 3, 4)):
        with pytest.raises(ValueError, match=r"mask of shape .* does not broadcast to the scores' shape \(2, 3, 4\)"):
            check_mask(torch.ones(shape, dtype=torch.bool), target)
    with pytest.raises(ValueError, match=r"keep must have dtype torch.bool .* `keep == 0` .* `keep.bool\(\)`"):
        check_mask(torch.ones(4), target, "keep")
    with pytest.raises(TypeError, match="keep must be a torch.Tensor of dtype torch.bool, got list"):
        check_mask([True], target, "keep")


def test_check_head_mask_refuses_3d_and_passes_the_rest() -> None:
    target = torch.Size([2, 3, 4, 5])
    for shape in ((5,), (4, 5), (2, 1, 4, 5), (1, 3, 4, 5)):
        m = torch.ones(shape, dtype=torch.bool)
        assert check_head_mask(m, target) is m
    with pytest.raises(ValueError, match=r"m of shape \(2, 4, 5\) is 3-D.* m\[:, None\] .* m\[None\]"):
        check_head_mask(torch.ones(2, 4, 5, dtype=torch.bool), target, "m")
    with pytest.raises(ValueError, match="m must have dtype torch.bool"):
        check_head_mask(torch.ones(4, 5), target, "m")


def test_check_attention_inputs_accepts_and_refuses() -> None:
    q, k = torch.zeros(2, 3, 8), torch.zeros(2, 5, 8)
    assert check_attention_inputs(q, k, k, None, 8, 4) is None
    check_attention_inputs(q, k, k, torch.ones(2, 4, 3, 5, dtype=torch.bool), 8, 4)
    bad = [
        ((torch.zeros(3, 8), k, k, None), ValueError, r"query must have shape \(B, n_q, d_model=8\), got \(3, 8\)"),
        ((q, torch.zeros(2, 5, 6), k, None), ValueError, r"key must have shape \(B, n_k, d_model=8\)"),
        ((q, k, torch.zeros(2, 5, 6), None), ValueError, r"value must have shape \(B, n_k, d_model=8\)"),
        ((q, k, torch.zeros(2, 4, 8), None), ValueError, "key and value must have the same batch size and length"),
        ((q, k, torch.zeros(1, 5, 8), None), ValueError, "key and value must have the same batch size and length"),
        ((torch.zeros(1, 3, 8), k, k, None), ValueError, "query and key must have the same batch size B"),
        ((q, torch.zeros(2, 0, 8), torch.zeros(2, 0, 8), None), ValueError, "key must hold at least one position"),
        ((q, k, k, torch.ones(2, 4, 3, 6, dtype=torch.bool)), ValueError, r"does not broadcast to the scores' shape \(2, 4, 3, 5\)"),
        ((q, k, k, torch.ones(5, 3, 5, dtype=torch.bool)), ValueError, "is 3-D"),
        (([0.0], k, k, None), TypeError, "query must be a torch.Tensor"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            check_attention_inputs(*args, 8, 4)


@given(st.lists(st.lists(st.integers(0, 3), max_size=4), min_size=1, max_size=3))
@settings(max_examples=40, deadline=None)  # the first call of torch.broadcast_shapes imports sympy
def test_broadcast_shape_is_torchs(shapes: list[list[int]]) -> None:
    """broadcast_shape gives torch.broadcast_shapes' answer, or raises RuntimeError where it does."""
    try:
        expected = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            broadcast_shape(*shapes)
        return
    assert broadcast_shape(*shapes) == expected
