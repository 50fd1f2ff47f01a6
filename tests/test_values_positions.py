"""attnlib.decoding.positions on hand-sized cases with exact expected numbers: ALiBi's
slopes for a power of two and for other head counts (BLOOM's rule), and its bias behind a
cache. Written to kill what mutation testing (``make mutants``) and planted bugs found
unchecked."""

from __future__ import annotations

import pytest
import torch

from attnlib.decoding import alibi_bias, alibi_slopes
from attnlib.decoding.positions import score_terms_bound


def test_alibi_slopes_exact() -> None:
    assert alibi_slopes(1).tolist() == [2.0**-8]
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    # h = 6: the 4 slopes of 4 heads, then every other slope of 8 heads: 2^-1, 2^-3
    assert alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    # h = 3: 2 slopes of 2 heads (2^-4, 2^-8), then 2^-2 from 4 heads
    assert alibi_slopes(3).tolist() == [2.0**-4, 2.0**-8, 2.0**-2]
    assert alibi_slopes(5, dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError):
        alibi_slopes(0)


def test_alibi_bias_behind_a_cache() -> None:
    """Two queries at positions 2 and 3 of four, head slopes 1/16 and 1/256."""
    b = alibi_bias(2, 2, 4)
    dist = torch.tensor([[2.0, 1.0, 0.0, -1.0], [3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)  # p - j
    assert torch.equal(b, torch.stack([-dist / 16, -dist / 256]))
    assert torch.equal(alibi_bias(1, 3), -torch.tensor([[[0.0, -1, -2], [1, 0, -1], [2, 1, 0]]], dtype=torch.float64) / 256)
    with pytest.raises(ValueError, match=r"n_k \(2\) must be >= n_q \(3\)"):
        alibi_bias(2, 3, 2)


def test_score_terms_bound_is_its_formula() -> None:
    """gamma_{4 d_model + 2 d_k + 5} (|x_p| + |e_p|)|W^Q| ((|x_j| + |e_j|)|W^K|)^T + eta (3 d_model
    (|A_p|_1 + |A_j|_1) + 6 d_k + 3), eta = eps x smallest normal; d_model = 2, d_k = 1:
    A_p = 1.5 + 2 = 3.5, A_j = 7 and 4, gamma_15."""
    w_q = torch.tensor([[1.0], [-2.0]], dtype=torch.float64)
    w_k = torch.tensor([[3.0], [1.0]], dtype=torch.float64)
    x_q, e_q = torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.tensor([[0.5, 0.0]], dtype=torch.float64)
    x_k = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    e_k = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)
    u = 2.0**-53
    gamma = 15 * u / (1 - 15 * u)
    got = score_terms_bound(x_q, e_q, x_k, e_k, w_q, w_k)
    assert got.shape == (1, 2)
    assert got[0].tolist() == pytest.approx([gamma * 3.5 * 7, gamma * 3.5 * 4], rel=1e-15)
    # queries of zero: only the underflow term, whole multiples of eta (exact subnormals)
    eta = 2.0**-52 * 2.0**-1022
    zero = torch.zeros(1, 2, dtype=torch.float64)
    assert score_terms_bound(zero, zero, x_k, e_k, w_q, w_k)[0].tolist() == [eta * (6 * 7 + 9), eta * (6 * 4 + 9)]
    f32 = [t.float() for t in (zero, zero, x_k, e_k, w_q, w_k)]
    assert score_terms_bound(*f32)[0].tolist() == [2.0**-149 * 51, 2.0**-149 * 33]
