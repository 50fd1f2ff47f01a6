"""Tests for attnlib.lowrank: the factored product, its SVD, gauge and circuits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

from attnlib.decoding import DecoderAttention
from attnlib.lowrank import FactoredMatrix, FlopCount, fix_signs, ov_circuit, qk_circuit
from attnlib.multihead import MultiHeadAttention
from strategies import examples

F64 = torch.float64
FAST = examples(30)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


@st.composite
def factored(draw: st.DrawFn, batched: bool | None = None) -> FactoredMatrix:
    """A random FactoredMatrix in float64: m, r, n in 1..7, optionally a batch of 1..3."""
    m, r, n = (draw(st.integers(1, 7)) for _ in range(3))
    if batched is None:
        batched = draw(st.booleans())
    batch = (draw(st.integers(1, 3)),) if batched else ()
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return FactoredMatrix(_randn(gen, *batch, m, r), _randn(gen, *batch, r, n))


def _well_conditioned(gen: torch.Generator, r: int) -> torch.Tensor:
    """An invertible r x r matrix with condition number <= e^2: Q1 diag(e^u) Q2."""
    q1, _ = torch.linalg.qr(_randn(gen, r, r))
    q2, _ = torch.linalg.qr(_randn(gen, r, r))
    scales = torch.exp(2 * torch.rand(r, generator=gen, dtype=F64) - 1)  # in [1/e, e]
    return q1 @ torch.diag(scales) @ q2


# ---- equivalences (property tests) ----------------------------------------------------
@FAST
@given(factored())
def test_svd_matches_svd_of_full_matrix(fm: FactoredMatrix) -> None:
    full = fm.full()  # (..., m, n)
    u, s, vh = fm.svd()
    k = min(fm.m, fm.n, fm.r)
    assert u.shape == (*fm.batch_shape, fm.m, k) and s.shape == (*fm.batch_shape, k)
    assert vh.shape == (*fm.batch_shape, k, fm.n)
    s_full = torch.linalg.svdvals(full)  # (..., min(m, n))
    assert_close(s, s_full[..., :k])
    # the singular values the factored SVD omits are zero: rank(M) <= r
    assert torch.all(s_full[..., k:] <= 1e-12 * s_full[..., :1].clamp_min(1.0))
    assert_close(fm.singular_values, s)
    assert_close(u.mT @ u, torch.eye(k, dtype=F64).expand_as(u.mT @ u))
    assert_close(vh @ vh.mT, torch.eye(k, dtype=F64).expand_as(vh @ vh.mT))
    assert_close((u * s.unsqueeze(-2)) @ vh, full)


@FAST
@given(factored(), st.integers(1, 7))
def test_rank_is_at_most_r_and_matches_matrix_rank(fm: FactoredMatrix, p: int) -> None:
    rank = fm.rank()
    assert rank.shape == fm.batch_shape
    assert torch.all(rank <= fm.r)
    assert torch.equal(rank, torch.linalg.matrix_rank(fm.full()))
    # a left factor of rank <= p (a product through p columns) caps the rank at p
    gen = torch.Generator().manual_seed(p)
    left = _randn(gen, fm.m, p) @ _randn(gen, p, fm.r)  # (m, r), rank <= p
    low = FactoredMatrix(left, fm.right)
    expected = torch.linalg.matrix_rank(low.full(), rtol=1e-9)
    assert torch.equal(low.rank(tol=1e-9), expected)
    assert torch.all(low.rank(tol=1e-9) <= min(p, fm.r))


@FAST
@given(factored())
def test_stable_rank_is_frobenius_over_spectral_norm(fm: FactoredMatrix) -> None:
    full = fm.full()
    fro = torch.linalg.matrix_norm(full, "fro")  # (...,)
    spec = torch.linalg.matrix_norm(full, 2)  # (...,)
    assert_close(fm.stable_rank, fro**2 / spec**2)
    assert torch.all(fm.stable_rank >= 1 - 1e-12)
    assert torch.all(fm.stable_rank <= fm.rank() + 1e-12)


@FAST
@given(factored(), st.integers(0, 2**31 - 1))
def test_gauge_leaves_the_product_unchanged(fm: FactoredMatrix, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    a = _well_conditioned(gen, fm.r)
    g = fm.gauge(a)
    assert_close(g.full(), fm.full())
    assert_close(g.left, fm.left @ a)
    assert_close(a @ g.right, fm.right)
    assert_close(g.singular_values, fm.singular_values)


@FAST
@given(factored(), st.integers(0, 2**31 - 1))
def test_gauge_with_one_matrix_per_batch_entry(fm: FactoredMatrix, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    count = fm.batch_shape.numel()
    a = torch.stack([_well_conditioned(gen, fm.r) for _ in range(count)]).view(*fm.batch_shape, fm.r, fm.r)
    assert_close(fm.gauge(a).full(), fm.full())


@FAST
@given(factored())
def test_balanced_factors_reproduce_the_product_with_equal_gram_matrices(fm: FactoredMatrix) -> None:
    b = fm.balanced()
    assert b.r == min(fm.m, fm.n, fm.r)
    assert_close(b.full(), fm.full())
    gram = torch.diag_embed(fm.singular_values)  # (..., k, k)
    assert_close(b.left.mT @ b.left, gram)
    assert_close(b.right @ b.right.mT, gram)


@FAST
@given(factored(), st.integers(1, 5), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_scores_through_factors_equal_scores_through_full_matrix(
    fm: FactoredMatrix, n_x: int, n_y: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, n_x, fm.m)
    y = _randn(gen, n_y, fm.n)
    full = fm.full()
    assert_close(fm.bilinear(x, y), x @ full @ y.T)
    assert_close(x @ fm, x @ full)
    assert_close(fm.T.full(), full.mT)


@FAST
@given(st.integers(1, 7), st.integers(1, 7), st.integers(1, 7), st.integers(0, 2**31 - 1))
def test_a_matrix_of_rank_at_most_k_splits_back_into_two_factors(m: int, n: int, k: int, seed: int) -> None:
    k = min(k, m, n)
    gen = torch.Generator().manual_seed(seed)
    matrix = _randn(gen, m, k) @ _randn(gen, k, n)  # rank <= k
    fm = FactoredMatrix.from_matrix(matrix, k)
    assert fm.left.shape == (m, k) and fm.right.shape == (k, n)
    assert_close(fm.full(), matrix)


def test_from_matrix_truncates_to_the_best_approximation() -> None:
    matrix = torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=F64))
    fm = FactoredMatrix.from_matrix(matrix, 2)
    assert_close(fm.full(), torch.diag(torch.tensor([3.0, 2.0, 0.0], dtype=F64)))


# ---- counts ------------------------------------------------------------------------------
def test_parameter_counts_for_the_papers_head() -> None:
    fm = FactoredMatrix(torch.zeros(512, 64), torch.zeros(64, 512))
    assert fm.num_params == 65_536 == fm.left.numel() + fm.right.numel()
    assert fm.full_params == 262_144 == fm.full().numel()
    batched = FactoredMatrix(torch.zeros(8, 512, 64), torch.zeros(8, 64, 512))
    assert batched.num_params == 8 * 65_536 and batched.full_params == 8 * 262_144


def test_flop_counts() -> None:
    fm = FactoredMatrix(torch.zeros(3, 5, 2), torch.zeros(2, 7))  # batch 3, m=5, r=2, n=7
    assert fm.apply_flops(4) == FlopCount(factored=3 * 2 * 4 * 2 * (5 + 7), full=3 * 2 * 4 * 5 * 7)
    f = fm.bilinear_flops(4, 6)
    assert f.factored == 3 * 2 * 2 * (4 * 5 + 6 * 7 + 4 * 6)
    assert f.full == 3 * 2 * min(4 * 5 * 7 + 4 * 7 * 6, 5 * 7 * 6 + 4 * 5 * 6)


def test_zero_matrix_has_rank_and_stable_rank_zero() -> None:
    fm = FactoredMatrix(torch.zeros(4, 2, dtype=F64), torch.ones(2, 3, dtype=F64))
    assert int(fm.rank()) == 0
    assert float(fm.stable_rank) == 0.0


def test_batch_dimensions_broadcast_and_index() -> None:
    left = torch.randn(3, 5, 2, dtype=F64)
    right = torch.randn(2, 4, dtype=F64)
    fm = FactoredMatrix(left, right)
    assert fm.shape == (3, 5, 4) and fm.batch_shape == (3,)
    assert_close(fm[1].full(), left[1] @ right)
    assert "batch=(3,)" in repr(fm) and "batch" not in repr(fm[0])


# ---- the circuits of a real module --------------------------------------------------------
def _mha(seed: int = 0) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(16, 4, bias=False, dtype=F64)


def test_qk_circuit_gives_the_modules_attention_weights() -> None:
    mha = _mha()
    x = torch.randn(2, 6, 16, dtype=F64)
    _, weights = mha(x, x, x)  # (B, h, n, n)
    qk = qk_circuit(mha)  # batch (h,)
    scores = qk.bilinear(x.unsqueeze(1), x.unsqueeze(1)) / math.sqrt(mha.d_k)  # (B, h, n, n)
    assert_close(torch.softmax(scores, -1), weights)
    for i in range(mha.num_heads):
        head = qk_circuit(mha, i)
        assert_close(head.full(), mha.head(i).w_q @ mha.head(i).w_k.T)
        assert int(head.rank()) == mha.d_k


def test_ov_circuit_gives_the_modules_output() -> None:
    mha = _mha(1)
    x = torch.randn(2, 6, 16, dtype=F64)
    out, weights = mha(x, x, x)  # (B, n, d_model), (B, h, n, n)
    ov = ov_circuit(mha).full()  # (h, d_model, d_model)
    # out = sum_i A_i X W_i^{OV}: each head writes through its own rank-d_v matrix
    per_head = weights @ (x.unsqueeze(1) @ ov)  # (B, h, n, d_model)
    assert_close(per_head.sum(1), out)
    assert_close(ov_circuit(mha, 2).full(), mha.head(2).w_v @ mha.head(2).w_o)


def test_circuits_are_detached_views() -> None:
    mha = _mha()
    qk = qk_circuit(mha, 0)
    assert not qk.left.requires_grad
    with torch.no_grad():
        mha.w_q[0, 0] = 123.0
    assert qk.left[0, 0].item() == 123.0


# ---- every error path ----------------------------------------------------------------------
def test_constructor_errors() -> None:
    ok = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="left must be a torch.Tensor"):
        FactoredMatrix([[1.0]], ok.T)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"left must have shape \(\.\.\., m, r\), got \(4,\)"):
        FactoredMatrix(torch.zeros(4), ok.T)
    with pytest.raises(ValueError, match="right must be a floating-point tensor"):
        FactoredMatrix(ok, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"right must have non-empty matrix dimensions.*got \(2, 0\)"):
        FactoredMatrix(ok, torch.zeros(2, 0))
    with pytest.raises(ValueError, match=r"inner dimension r.*\(4, 2\) \(r = 2\).*\(3, 4\) \(r = 3\)"):
        FactoredMatrix(ok, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="same dtype and device"):
        FactoredMatrix(ok, torch.zeros(2, 4, dtype=F64))
    with pytest.raises(ValueError, match=r"batch dimensions of left \(2, 4, 2\) and right \(3, 2, 4\)"):
        FactoredMatrix(torch.zeros(2, 4, 2), torch.zeros(3, 2, 4))


def test_indexing_a_single_matrix_is_an_error() -> None:
    with pytest.raises(IndexError, match="no batch dimension"):
        FactoredMatrix(torch.zeros(4, 2), torch.zeros(2, 3))[0]


def test_product_and_bilinear_shape_errors() -> None:
    fm = FactoredMatrix(torch.zeros(4, 2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"x @ M needs x of shape \(\.\.\., k, m=4\), got \(5, 3\)"):
        torch.zeros(5, 3) @ fm
    assert fm.__rmatmul__([1.0]) is NotImplemented  # so Python raises its TypeError
    with pytest.raises(TypeError, match="unsupported operand"):
        [1.0] @ fm  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"M @ x needs x of shape \(\.\.\., n=3, k\), got \(4, 2\)"):
        fm @ torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"M @ X needs X of shape \(\.\.\., n=3, p\), got \(4, 5\)"):
        fm @ FactoredMatrix(torch.zeros(4, 1), torch.zeros(1, 5))
    assert fm.__matmul__("x") is NotImplemented
    with pytest.raises(TypeError, match="unsupported operand"):
        fm @ "x"  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., n_x, m=4\), got \(5, 3\)"):
        fm.bilinear(torch.zeros(5, 3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"y must have shape \(\.\.\., n_y, n=3\), got \(5, 4\)"):
        fm.bilinear(torch.zeros(5, 4), torch.zeros(5, 4))
    with pytest.raises(TypeError, match=r"y must be a torch.Tensor, got float"):
        fm.bilinear(torch.zeros(5, 4), 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("tol", "error"), [(-0.1, ValueError), (1.0, ValueError), ("1e-3", TypeError), (True, TypeError)])
def test_rank_tolerance_errors(tol: object, error: type[Exception]) -> None:
    fm = FactoredMatrix(torch.zeros(4, 2), torch.zeros(2, 3))
    with pytest.raises(error, match="tol must be a number in"):
        fm.rank(tol)  # type: ignore[arg-type]


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)])
def test_flop_count_argument_errors(bad: object, error: type[Exception]) -> None:
    fm = FactoredMatrix(torch.zeros(4, 2), torch.zeros(2, 3))
    with pytest.raises(error, match="n_rows must be a positive int"):
        fm.apply_flops(bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="n_x must be a positive int"):
        fm.bilinear_flops(bad, 3)  # type: ignore[arg-type]
    with pytest.raises(error, match="n_y must be a positive int"):
        fm.bilinear_flops(3, bad)  # type: ignore[arg-type]


def test_gauge_errors() -> None:
    fm = FactoredMatrix(torch.randn(4, 2, dtype=F64), torch.randn(2, 3, dtype=F64))
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        fm.gauge([[1.0, 0.0], [0.0, 1.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"a must have shape \(\.\.\., r, r\) with r = 2, got \(3, 3\)"):
        fm.gauge(torch.eye(3, dtype=F64))
    with pytest.raises(ValueError, match=r"a must have shape .* got \(2,\)"):
        fm.gauge(torch.ones(2, dtype=F64))
    with pytest.raises(ValueError, match="a must have the factors' dtype and device"):
        fm.gauge(torch.eye(2))
    with pytest.raises(ValueError, match=r"batch dimensions \(3, 2, 2\) do not broadcast"):
        FactoredMatrix(torch.randn(2, 4, 2, dtype=F64), fm.right).gauge(torch.eye(2, dtype=F64).repeat(3, 1, 1))
    with pytest.raises(ValueError, match=r"a must be invertible.*condition number inf"):
        fm.gauge(torch.zeros(2, 2, dtype=F64))
    with pytest.raises(ValueError, match="a must be invertible"):
        fm.gauge(torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=F64))
    with pytest.raises(ValueError, match="a must be invertible"):
        fm.gauge(torch.tensor([[1.0, 0.0], [0.0, 1e-17]], dtype=F64))  # numerically singular


def test_from_matrix_errors() -> None:
    with pytest.raises(ValueError, match=r"matrix must have shape \(\.\.\., m, n\), got \(3,\)"):
        FactoredMatrix.from_matrix(torch.zeros(3), 1)
    with pytest.raises(ValueError, match="rank must be a positive int, got 0"):
        FactoredMatrix.from_matrix(torch.zeros(3, 4), 0)
    with pytest.raises(ValueError, match=r"rank must be at most min\(m, n\) = 3 for matrix \(3, 4\), got 4"):
        FactoredMatrix.from_matrix(torch.zeros(3, 4), 4)


def test_circuit_errors() -> None:
    mha = _mha()
    for circuit in (qk_circuit, ov_circuit):
        with pytest.raises(TypeError, match="mha must be an attnlib.MultiHeadAttention"):
            circuit(torch.nn.MultiheadAttention(16, 4))  # type: ignore[arg-type]
        with pytest.raises(IndexError, match=r"head must be an int in \[0, 4\)"):
            circuit(mha, 4)
        with pytest.raises(IndexError, match="head must be an int"):
            circuit(mha, -1)
        with pytest.raises(TypeError, match="head must be an int"):
            circuit(mha, True)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="head must be an int"):
            circuit(mha, 1.0)  # type: ignore[arg-type]


def test_circuits_refuse_rope_and_read_groups_written_out() -> None:
    """W^QK is not the scores' matrix under RoPE: refused, naming RoPE (ov_circuit too: every
    chapter 2-4 tool reads the plain view). A grouped layer's heads are read with each group's
    key and value blocks repeated for its heads: head i reads group i // (h/g)."""
    rope = DecoderAttention(16, 4, rope_base=10000.0)
    for circuit in (qk_circuit, ov_circuit):
        with pytest.raises(ValueError, match=rf"{circuit.__name__}: DecoderAttention with RoPE \(rope_base=10000\) "
                                             r"has no plain view: RoPE rotates queries and keys"):
            circuit(rope)
    grouped = DecoderAttention(16, 4, num_kv_heads=2)
    for i in range(4):
        torch.testing.assert_close(qk_circuit(grouped, i).left, grouped.head(i).w_q, atol=0, rtol=0)
        torch.testing.assert_close(qk_circuit(grouped, i).right, grouped.head(i).w_k.detach().T, atol=0, rtol=0)
        torch.testing.assert_close(ov_circuit(grouped, i).left, grouped.head(i).w_v, atol=0, rtol=0)
    assert torch.equal(grouped.head(1).w_k, grouped.head(0).w_k)  # heads 0 and 1 share group 0


# ---- fm @ x, and the SVD computed once ------------------------------------------------------
def test_matmul_from_the_left_and_with_another_factored_matrix() -> None:
    g = torch.Generator().manual_seed(3)
    fm = FactoredMatrix(torch.randn(2, 5, 3, generator=g, dtype=F64), torch.randn(2, 3, 4, generator=g, dtype=F64))
    x = torch.randn(2, 4, 6, generator=g, dtype=F64)  # (..., n, k)
    assert_close(fm @ x, fm.full() @ x)
    other = FactoredMatrix(torch.randn(4, 2, generator=g, dtype=F64), torch.randn(2, 7, generator=g, dtype=F64))
    product = fm @ other
    assert isinstance(product, FactoredMatrix) and product.r == fm.r and product.shape == (2, 5, 7)
    assert_close(product.full(), fm.full() @ other.full())


def test_svd_is_computed_once_and_again_after_an_in_place_change(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    svd = torch.linalg.svd

    def counting_svd(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return svd(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.linalg, "svd", counting_svd)
    mha = _mha()
    qk = qk_circuit(mha, 1)  # detached views of mha's weights
    first = qk.singular_values
    qk.rank()
    qk.stable_rank
    qk.svd()
    assert len(calls) == 1
    with torch.no_grad():
        mha.w_q.mul_(2.0)  # the factors are views: the product doubles
    assert_close(qk.singular_values, 2 * first)
    assert len(calls) == 2
    grad = FactoredMatrix(torch.randn(4, 2, requires_grad=True), torch.randn(2, 3))
    grad.singular_values.sum().backward()  # never cached: each call has its own graph
    grad.singular_values.sum().backward()
    assert len(calls) == 4


def test_svd_returns_copies_that_cannot_change_the_cache() -> None:
    g = torch.Generator().manual_seed(3)
    fm = FactoredMatrix(torch.randn(5, 3, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64))
    assert int(fm.rank()) == 3
    fm.svd()[1].zero_()  # a caller's in-place change to S ...
    assert int(fm.rank()) == 3  # ... does not reach the cached SVD


def test_svd_after_a_factor_is_replaced_is_recomputed() -> None:
    g = torch.Generator().manual_seed(4)
    fm = FactoredMatrix(torch.randn(5, 3, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64))
    before = fm.singular_values
    fm.left = 2 * fm.left  # another tensor: the cache must not compare tensors with ==
    assert_close(fm.singular_values, 2 * before)


# ---- the sign convention of singular vectors --------------------------------------
@FAST
@given(factored())
def test_fix_signs_keeps_the_product_and_makes_each_largest_entry_positive(fm: FactoredMatrix) -> None:
    u, s, vh = torch.linalg.svd(fm.full(), full_matrices=False)
    fu, fvh = fix_signs(u, vh)
    assert_close((fu * s.unsqueeze(-2)) @ fvh, (u * s.unsqueeze(-2)) @ vh)
    biggest = fu.abs().argmax(dim=-2, keepdim=True)
    assert torch.all(torch.gather(fu, -2, biggest) >= 0)
    # a LAPACK that returned the opposite signs gives the same answer
    flip = torch.where(torch.arange(u.shape[-1]) % 2 == 0, -1.0, 1.0).to(F64)  # (k,)
    gu, gvh = fix_signs(u * flip, vh * flip.unsqueeze(-1))
    assert torch.equal(gu, fu) and torch.equal(gvh, fvh)


@FAST
@given(factored())
def test_factored_svd_has_the_sign_convention(fm: FactoredMatrix) -> None:
    u, _, vh = fm.svd()
    fu, fvh = fix_signs(u, vh)
    assert torch.equal(fu, u) and torch.equal(fvh, vh)


@pytest.mark.parametrize(
    ("u", "vh", "error", "match"),
    [
        ([[1.0]], torch.ones(1, 1), TypeError, "u must be a torch.Tensor"),
        (torch.ones(3), torch.ones(1, 3), ValueError, r"u must be \(\.\.\., m, k\).*got u \(3,\)"),
        (torch.ones(3, 2), torch.ones(3, 4), ValueError, r"same k, got u \(3, 2\) and vh \(3, 4\)"),
    ],
)
def test_fix_signs_refuses_bad_shapes(u: object, vh: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fix_signs(u, vh)  # type: ignore[arg-type]


def test_a_factor_replaced_is_checked_like_a_new_one() -> None:
    """fm.left = a tensor that does not fit was accepted, and svd() then failed deep inside; it is
    checked against the other factor as the constructor checks it, and a fitting one is taken."""
    g = torch.Generator().manual_seed(0)
    fm = FactoredMatrix(torch.randn(4, 3, generator=g, dtype=F64), torch.randn(3, 5, generator=g, dtype=F64))
    s_before = fm.singular_values
    for name, bad, match in (("left", torch.randn(5, 2, dtype=F64), "must share the inner dimension r"),
                             ("right", torch.randn(2, 5, dtype=F64), "must share the inner dimension r"),
                             ("left", torch.randn(4, 3), "same dtype and device"),
                             ("right", [[1.0]], "right must be a torch.Tensor")):
        with pytest.raises((ValueError, TypeError), match=match):
            setattr(fm, name, bad)
        assert fm.shape == (4, 5) and torch.equal(fm.singular_values, s_before)  # unchanged
    new_left = torch.randn(6, 3, generator=g, dtype=F64)
    fm.left = new_left  # fits: M is now (6, 5), and the cached SVD is not reused
    assert fm.shape == (6, 5) and torch.equal(fm.left, new_left)
    assert_close(fm.singular_values, torch.linalg.svdvals(new_left @ fm.right)[:3])  # rank <= r = 3
