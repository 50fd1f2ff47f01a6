"""attnlib.lowrank.FactoredMatrix on hand-sized cases with exact expected numbers: products
with a matrix, a vector and a batch from either side, its repr, from_matrix behind a batch
axis, and gauge's refusal at the condition-number limit 1/eps. Written to kill what mutation
testing (``make mutants``) found unchecked."""

from __future__ import annotations

import pytest
import torch

from attnlib.lowrank import FactoredMatrix

F64 = torch.float64


def _fm() -> FactoredMatrix:
    """M = L R, L = [[1, 2, 0], [0, 1, 1]], R = [[1, 0], [0, 1], [1, 1]] (m = 2, r = 3, n = 2)."""
    left = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 1.0]], dtype=F64)  # (2, 3)
    right = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=F64)  # (3, 2)
    return FactoredMatrix(left, right)  # M = [[1, 2], [1, 2]]


def test_products_from_either_side() -> None:
    fm = _fm()
    full = torch.tensor([[1.0, 2.0], [1.0, 2.0]], dtype=F64)
    assert torch.equal(fm.full(), full)
    x = torch.tensor([[1.0, -1.0, 3.0], [2.0, 0.0, 1.0]], dtype=F64)  # (n = 2, k = 3)
    right = fm @ x  # a plain matrix on the right
    assert isinstance(right, torch.Tensor) and torch.equal(right, full @ x)
    batch = torch.arange(12, dtype=F64).reshape(2, 2, 3)  # (2, n, 3)
    right = fm @ batch
    assert isinstance(right, torch.Tensor) and torch.equal(right, full @ batch)
    v = torch.tensor([3.0, -1.0], dtype=F64)  # (m,): a vector on the left
    assert torch.equal(v @ fm, torch.tensor([2.0, 4.0], dtype=F64))
    rows = torch.arange(6, dtype=F64).reshape(3, 1, 2)  # (3, k = 1, m = 2): a batch on the left
    assert torch.equal(rows @ fm, rows @ full)
    with pytest.raises(ValueError, match=r"^x @ M needs x of shape \(\.\.\., k, m=2\), got \(3, 2, 1\)$"):
        rows.mT @ fm


def test_repr() -> None:
    assert repr(_fm()) == "FactoredMatrix(m=2, r=3, n=2, dtype=torch.float64)"
    fm = FactoredMatrix(torch.zeros(4, 2, 1), torch.zeros(1, 3))
    assert repr(fm) == "FactoredMatrix(batch=(4,), m=2, r=1, n=3, dtype=torch.float32)"


def test_from_matrix_behind_a_batch_axis() -> None:
    """One batch entry of rank 1 split at rank 1; the batch size (1) is not a matrix dimension."""
    m = torch.tensor([[[2.0, 4.0], [1.0, 2.0]]], dtype=F64)  # (1, 2, 2), rank 1, singular value 5
    fm = FactoredMatrix.from_matrix(m, 2)
    assert fm.shape == (1, 2, 2) and fm.r == 2
    assert torch.allclose(fm.full(), m, rtol=0, atol=1e-14)
    one = FactoredMatrix.from_matrix(m, 1)
    assert torch.allclose(one.full(), m, rtol=0, atol=1e-14)
    assert torch.allclose(one.left.mT @ one.left, torch.tensor([[[5.0]]], dtype=F64), rtol=1e-14, atol=0)


def test_gauge_refuses_a_condition_number_at_the_limit() -> None:
    """cond(diag(1, 0.75 eps)) = 1 / (0.75 eps), above the limit 1/eps; 1 / (1.5 eps) is below it."""
    fm = FactoredMatrix(torch.ones(2, 2, dtype=F64), torch.ones(2, 2, dtype=F64))
    eps = torch.finfo(F64).eps
    with pytest.raises(ValueError, match=r"\(condition number 6e\+15, limit 4\.5e\+15 for torch.float64\)$"):
        fm.gauge(torch.diag(torch.tensor([1.0, 0.75 * eps], dtype=F64)))
    assert fm.gauge(torch.diag(torch.tensor([1.0, 1.5 * eps], dtype=F64))).shape == (2, 2)
