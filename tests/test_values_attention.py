"""attnlib.attention's values on hand-sized cases with exact expected numbers: the causal
mask behind a cache, the masked softmax along another axis, the batch shape and the scale
the checks return. Written to kill what mutation testing (``make mutants``) found unchecked."""

from __future__ import annotations

import math

import pytest
import torch

from attnlib.attention import attention, causal_mask, check_qkv, check_scale, masked_softmax


def test_causal_mask_is_the_lower_triangle() -> None:
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(3), expected)
    assert torch.equal(causal_mask(3, 3), expected)
    assert causal_mask(3).dtype == torch.bool


def test_causal_mask_behind_a_cache() -> None:
    """Two new queries after three cached positions sit at positions 3 and 4."""
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 5), expected)
    assert torch.equal(causal_mask(1, 4), torch.ones(1, 4, dtype=torch.bool))


@pytest.mark.parametrize(("args", "error"), [((0,), ValueError), ((True,), TypeError), ((3, 2), ValueError),
                                              ((2, 1.5), TypeError), ((2, 0), ValueError)])
def test_causal_mask_refuses(args: tuple, error: type[Exception]) -> None:
    with pytest.raises(error):
        causal_mask(*args)


def test_masked_softmax_along_the_first_axis_with_a_mask() -> None:
    scores = torch.tensor([[0.0, 1.0], [math.log(3.0), 2.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False], [True, False]])
    w = masked_softmax(scores, mask, dim=0)  # column 0: softmax(0, log 3) = (1/4, 3/4); column 1: nothing allowed
    assert torch.allclose(w, torch.tensor([[0.25, 0.0], [0.75, 0.0]], dtype=torch.float64), rtol=0, atol=1e-15)
    plain = masked_softmax(scores, dim=0)
    assert torch.allclose(plain[:, 0], torch.tensor([0.25, 0.75], dtype=torch.float64), rtol=0, atol=1e-15)


def test_masked_softmax_of_an_all_masked_row_is_zero_not_nan() -> None:
    scores = torch.tensor([[5.0, -2.0, 1.0], [1.0, 2.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[False, False, False], [True, False, True]])
    w = masked_softmax(scores, mask)
    e = math.exp(2.0)
    assert torch.equal(w[0], torch.zeros(3, dtype=torch.float64))
    assert torch.allclose(w[1], torch.tensor([1 / (1 + e), 0.0, e / (1 + e)], dtype=torch.float64), rtol=0, atol=1e-15)


def test_attention_on_a_hand_sized_case() -> None:
    """q = (1, 0), keys (1, 0) and (0, 1) with d_k = 2: scores 1/sqrt 2 and 0."""
    q = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[10.0], [20.0]], dtype=torch.float64)
    a = 1 / (1 + math.exp(-1 / math.sqrt(2)))  # the weight of key 0
    out, w = attention(q, k, v)
    assert torch.allclose(w, torch.tensor([[a, 1 - a]], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(out, torch.tensor([[10 * a + 20 * (1 - a)]], dtype=torch.float64), rtol=0, atol=1e-13)
    out2, w2 = attention(q, k, v, scale=2.0)  # scores 2 and 0
    b = 1 / (1 + math.exp(-2.0))
    assert torch.allclose(w2, torch.tensor([[b, 1 - b]], dtype=torch.float64), rtol=0, atol=1e-15)
    _, w0 = attention(q, k, v, scale=0)  # scale 0: uniform
    assert torch.equal(w0, torch.tensor([[0.5, 0.5]], dtype=torch.float64))


def test_single_query_with_a_mask_over_batched_keys() -> None:
    q = torch.tensor([1.0, 0.0], dtype=torch.float64)
    k = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]]], dtype=torch.float64)  # (2, 2, 2)
    v = torch.tensor([[10.0], [20.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False], [False, True]])  # (2, n_k): batch entry b reads key b
    out, w = attention(q, k, v, mask=mask)
    assert out.shape == (2, 1) and w.shape == (2, 2)
    assert torch.equal(w, torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64))
    assert torch.equal(out, torch.tensor([[10.0], [20.0]], dtype=torch.float64))


def test_check_qkv_returns_the_broadcast_batch() -> None:
    q, k, v = torch.zeros(3, 1, 2, 4), torch.zeros(1, 5, 6, 4), torch.zeros(5, 6, 7)
    assert check_qkv(q, k, v) == torch.Size([3, 5])
    assert check_qkv(torch.zeros(4), torch.zeros(6, 4), torch.zeros(6, 2)) == torch.Size([])


@pytest.mark.parametrize(("shapes", "dtypes"), [
    (((2, 4), (3, 4), (3, 2)), (torch.float32, torch.float64, torch.float32)),
    (((2, 4), (3, 4), (3, 2)), (torch.float32, torch.float32, torch.float64)),
    (((2, 4), (3, 4), (3, 2)), (torch.int64, torch.int64, torch.int64)),
    (((2, 4), (3, 5), (3, 2)), (torch.float32,) * 3),
    (((2, 4), (3, 4), (2, 2)), (torch.float32,) * 3),
    (((2, 4), (0, 4), (0, 2)), (torch.float32,) * 3),
    (((2, 0), (3, 0), (3, 2)), (torch.float32,) * 3),
    (((1, 2, 0), (1, 3, 0), (1, 3, 2)), (torch.float32,) * 3),  # width 0 behind a batch axis
    (((2, 2, 4), (3, 3, 4), (3, 2)), (torch.float32,) * 3),
    (((), (3, 4), (3, 2)), (torch.float32,) * 3),
    (((4,), (4,), (3, 2)), (torch.float32,) * 3),
    (((4,), (3, 4), (3,)), (torch.float32,) * 3),
])
def test_check_qkv_refuses_with_value_error(shapes: tuple, dtypes: tuple) -> None:
    q, k, v = (torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes))
    with pytest.raises(ValueError):
        check_qkv(q, k, v)


def test_check_scale_values_and_errors() -> None:
    assert check_scale(2) == 2.0 and isinstance(check_scale(2), float)
    assert check_scale(0) == 0.0
    for bad, error in ((True, TypeError), ("1", TypeError), (None, TypeError), (-1.0, ValueError),
                       (float("inf"), ValueError), (float("nan"), ValueError)):
        with pytest.raises(error):
            check_scale(bad)


def test_a_mask_that_would_add_a_batch_axis_is_refused() -> None:
    """Scores (3, 2, 5): a mask (3, 1, 2, 5) would make them (3, 3, 2, 5)."""
    q, k, v = torch.zeros(3, 2, 4), torch.zeros(3, 5, 4), torch.zeros(3, 5, 1)
    with pytest.raises(ValueError, match=r"does not broadcast to the scores' shape \(3, 2, 5\)"):
        attention(q, k, v, mask=torch.ones(3, 1, 2, 5, dtype=torch.bool))
    out, w = attention(q, k, v, mask=torch.ones(3, 2, 5, dtype=torch.bool))
    assert w.shape == (3, 2, 5) and torch.equal(w, torch.full((3, 2, 5), 0.2))
