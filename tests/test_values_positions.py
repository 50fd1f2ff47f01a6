"""attnlib.decoding.positions on hand-sized cases with exact expected numbers: ALiBi's
slopes for a power of two and for other head counts (BLOOM's rule), and its bias behind a
cache. Written to kill what mutation testing (``make mutants``) and planted bugs found
unchecked."""

from __future__ import annotations

import pytest
import torch

from attnlib.decoding import alibi_bias, alibi_slopes


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
