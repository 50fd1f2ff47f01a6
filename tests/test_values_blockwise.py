"""attnlib.blockwise and attnlib.blockwise_bounds on hand-sized cases with exact expected
numbers: the bounds against their formulas written out by hand, the bytes of the
intermediates, the tiles computed and skipped, and the tiled output at every tile size
against attention(). Written to kill what mutation testing (``make mutants``) and planted
bugs found unchecked: no other test pins ``rounding_bound``'s value."""

from __future__ import annotations

import math

import pytest
import torch

from attnlib.attention import attention, causal_mask
from attnlib.blockwise import attend_block, blockwise_attention, split_k_attention, tile_counts
from attnlib.blockwise_bounds import gradient_rounding_bound, intermediate_bytes, rounding_bound

F64 = torch.float64


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.tensor([[1.0, -2.0], [0.5, 0.0]], dtype=F64)  # (n_q = 2, d_k = 2)
    k = torch.tensor([[1.0, 1.0], [-1.0, 3.0], [2.0, 0.0]], dtype=F64)  # (n_k = 3, d_k = 2)
    v = torch.tensor([[1.0, -1.0], [2.0, 0.0], [-3.0, 4.0]], dtype=F64)  # (n_k = 3, d_v = 2)
    return q, k, v


def test_rounding_bound_is_its_formula() -> None:
    """out: (eps ((e^{2 (d_k + 3) eps S} - 1) / eps + 6 n_k + 2) + 4 (d_k + 1) tiny max(1, scale)) (P |V|)
    + 2 n_k tiny (3 max|V| + 2); lse: eps ((d_k + 3) S + 4 n_k - 1 + 2 ln n_k + |lse|), S the
    largest sum of |q_l k_l| times the scale, here (float32, scale 1/sqrt 2) S = 7/sqrt 2."""
    q, k, v = _qkv()
    eps, tiny = torch.finfo(torch.float32).eps, torch.finfo(torch.float32).tiny
    out_b, lse_b = rounding_bound(q.float(), k.float(), v.float())
    sc = 1 / math.sqrt(2)
    big = 7 * sc  # |q_0| . |k_1| = 1 + 6
    s = (q @ k.T) * sc
    p = torch.softmax(s, -1)
    floor = 2 * 3 * tiny * (3 * 4 + 2)  # max|V| = 4
    weights = math.expm1(2 * 5 * big * eps) / eps  # e^x - 1 for x = 2 (d_k + 3) eps S
    expected = (eps * (weights + 6 * 3 + 2) + 4 * 3 * tiny) * (p @ v.abs()) + floor
    assert torch.allclose(out_b, expected, rtol=1e-12, atol=0)
    lse = torch.logsumexp(s, -1)
    assert torch.allclose(lse_b, eps * (5 * big + 4 * 3 - 1 + 2 * math.log(3) + lse.abs()), rtol=1e-12, atol=0)
    assert out_b.dtype == F64 and out_b.shape == (2, 2) and lse_b.shape == (2,)


def test_rounding_bound_with_a_mask_and_a_scale() -> None:
    q, k, v = _qkv()
    mask = torch.tensor([[True, False, True], [False, False, False]])  # query 1 reads nothing
    eps, tiny = torch.finfo(F64).eps, torch.finfo(F64).tiny
    out_b, lse_b = rounding_bound(q, k, v, mask=mask, scale=0.5)
    big = 7 * 0.5  # S ignores the mask: the largest sum over every pair
    s = (q @ k.T) * 0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)[0]
    floor = 2 * 3 * tiny * (3 * 4 + 2)
    assert torch.allclose(out_b[0], (eps * (2 * 5 * big + 20) + 4 * 3 * tiny) * (p @ v.abs()) + floor,
                          rtol=1e-12, atol=0)
    assert torch.equal(out_b[1], torch.full((2,), floor, dtype=F64))  # no weights: the underflow floor only
    lse0 = torch.logsumexp(s[0, [0, 2]], -1)
    rest = 5 * big + 12 - 1 + 2 * math.log(3)
    assert torch.allclose(lse_b, torch.stack([eps * (rest + lse0.abs()), torch.tensor(eps * rest, dtype=F64)]),
                          rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"q must have shape \(..., n_q, d_k\)"):
        rounding_bound(q[0], k, v)


def test_gradient_rounding_bound_is_its_formula() -> None:
    q, k, v = _qkv()
    d_out = torch.tensor([[1.0, 0.5], [-2.0, 1.0]], dtype=F64)
    d_lse = torch.tensor([0.25, -1.0], dtype=F64)
    eps, tiny = torch.finfo(F64).eps, torch.finfo(F64).tiny
    sc = 1 / math.sqrt(2)
    big = 7 * sc
    n_q, n_k, d_k, d_v = 2, 3, 2, 2
    p = torch.softmax((q @ k.T) * sc, -1)
    star = big + math.log(n_k)
    rho = (2 * d_k + 6) * big + 3 * star + 4 * n_k + 3 + 2 * math.log(n_k)
    alpha = math.expm1(2 * (d_k + 3) * big * eps) / eps + 6 * n_k + 2
    w = eps * (rho + d_v + max(alpha + d_v, rho + d_v + n_k) + 5 + max(n_k, n_q))
    for lse_grad in (None, d_lse):
        dq, dk, dv = gradient_rounding_bound(q, k, v, d_out, d_lse=lse_grad)
        d_terms = (d_out.abs() * (p @ v.abs())).sum(-1, keepdim=True)
        if lse_grad is not None:
            d_terms = d_terms + lse_grad.abs()[:, None]
        x = d_out.abs() @ v.abs().T + d_terms
        ds = p * x * sc
        xs = float(x.max()) * sc + 2
        assert torch.allclose(dq, w * (ds @ k.abs()) + 2 * n_k * tiny * (xs * 3 + 1), rtol=1e-12, atol=0)
        assert torch.allclose(dk, w * (ds.T @ q.abs()) + 2 * n_q * tiny * (xs * 2 + 1), rtol=1e-12, atol=0)
        assert torch.allclose(dv, w * (p.T @ d_out.abs()) + 2 * n_q * tiny * (2 + 1), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"d_out must have the output's shape \(2, 2\), got \(2, 3\)"):
        gradient_rounding_bound(q, k, v, torch.zeros(2, 3, dtype=F64))
    with pytest.raises(ValueError, match="q must have shape"):
        gradient_rounding_bound(q[0], k, v, d_out)


def test_intermediate_bytes() -> None:
    assert intermediate_bytes(4, 6, 3) == 2 * 4 * 6 * 4
    assert intermediate_bytes(4, 6, 3, batch=5, dtype=F64) == 5 * 2 * 4 * 6 * 8
    # blockwise: b_q b_k + 2 b_q d_v + 5 b_q + n_q, with the blocks cut to n_q, n_k
    assert intermediate_bytes(4, 6, 3, block_q=2, block_k=5) == (2 * 5 + 2 * 2 * 3 + 5 * 2 + 4) * 4
    assert intermediate_bytes(4, 6, 3, block_q=9, block_k=9, batch=2) == 2 * (4 * 6 + 2 * 4 * 3 + 5 * 4 + 4) * 4
    # float16: float32 numbers, plus the float32 copies of the query and value tiles (b_q d_k + b_k d_v)
    assert intermediate_bytes(4, 6, 3, block_q=1, block_k=1, dtype=torch.float16) == (1 + 6 + 5 + 4 + 3 + 3) * 4
    assert intermediate_bytes(4, 6, 3, block_q=1, block_k=2, dtype=torch.bfloat16, d_k=5) == \
        (2 + 6 + 5 + 4 + 5 + 2 * 3) * 4
    assert intermediate_bytes(4, 6, 3, block_q=1, block_k=2, d_k=5) == (2 + 6 + 5 + 4) * 4  # d_k: half only
    with pytest.raises(ValueError, match="give both block_q and block_k"):
        intermediate_bytes(4, 6, 3, block_q=2)
    with pytest.raises(ValueError, match="give both block_q and block_k"):
        intermediate_bytes(4, 6, 3, block_k=2)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        intermediate_bytes(4, 6, 3, dtype=torch.int32)
    for bad in ({"n_q": 0}, {"d_v": 0}, {"batch": 0}):
        args = dict(n_q=4, n_k=6, d_v=3) | bad
        with pytest.raises(ValueError):
            intermediate_bytes(**args)
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        intermediate_bytes(4, 6, 3, block_q=0, block_k=1)


@pytest.mark.parametrize(("args", "expected"), [
    ((5, 5, 2, 2, False), (9, 0)),
    ((5, 5, 2, 2, True), (6, 3)),  # tiles (0, 1), (0, 2), (1, 2) lie above the diagonal
    ((4, 4, 1, 1, True), (10, 6)),
    ((2, 5, 1, 2, True), (5, 1)),  # queries at positions 3 and 4: only (0, 2) is skipped
    ((3, 3, 3, 1, True), (3, 0)),
    ((4, 4, 2, 1, True), (6, 2)),  # query tile 0 (positions 0 and 1) skips keys 2 and 3
])
def test_tile_counts(args: tuple, expected: tuple[int, int]) -> None:
    assert tile_counts(*args) == expected
    n_q, n_k, bq, bk, causal = args
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, generator=g, dtype=F64) for n in (n_q, n_k, n_k))
    res = blockwise_attention(q, k, v, block_q=bq, block_k=bk, causal=causal)
    assert (res.computed, res.skipped) == expected
    mask = causal_mask(n_q, n_k) if causal else None
    out, _ = attention(q, k, v, mask=mask)
    assert torch.allclose(res.out, out, rtol=0, atol=1e-13)


@pytest.mark.parametrize("block", [(1, 1), (1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_every_tile_size_gives_attention(block: tuple[int, int], causal: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 2, generator=g, dtype=F64), torch.randn(5, 2, generator=g, dtype=F64), \
        torch.randn(5, 3, generator=g, dtype=F64)
    mask = causal_mask(3, 5) if causal else None
    out, w = attention(q, k, v, mask=mask)
    res = blockwise_attention(q, k, v, block_q=block[0], block_k=block[1], causal=causal)
    assert torch.allclose(res.out, out, rtol=0, atol=1e-13)
    s = (q @ k.T) / math.sqrt(2)
    if causal:
        s = s.masked_fill(~mask, float("-inf"))
    assert torch.allclose(res.lse, torch.logsumexp(s, -1), rtol=0, atol=1e-13)
    for splits in (1, 2, 5):
        merged, parts = split_k_attention(q, k, v, mask=mask, num_splits=splits, block_k=block[1])
        assert len(parts) == splits
        assert torch.allclose(merged, out, rtol=0, atol=1e-13)


def test_attend_block_by_hand() -> None:
    """One block of keys: out = sum_j e^(s_j - lse) v_j, lse = log sum_j e^(s_j), with the scale
    given or 1/sqrt(d_k); batched queries (n_q = 3, d_k = 2, b = 4) keep one shift per row."""
    q, k, v = _qkv()
    part = attend_block(q, k, v, scale=0.5)
    s = (q @ k.T) * 0.5
    assert torch.allclose(part.lse, torch.logsumexp(s, -1), rtol=0, atol=1e-15)
    assert torch.allclose(part.out, torch.softmax(s, -1) @ v, rtol=0, atol=1e-15)
    g = torch.Generator().manual_seed(4)
    qb, kb, vb = (torch.randn(2, n, 2, generator=g, dtype=F64) for n in (3, 4, 4))
    pb = attend_block(qb, kb, vb)
    sb = qb @ kb.mT / math.sqrt(2)
    assert pb.out.shape == (2, 3, 2) and pb.lse.shape == (2, 3)
    assert torch.allclose(pb.lse, torch.logsumexp(sb, -1), rtol=0, atol=1e-14)
    assert torch.allclose(pb.out, torch.softmax(sb, -1) @ vb, rtol=0, atol=1e-14)


def test_attend_block_shifts_each_row_by_its_own_maximum() -> None:
    """Row 0 scores 0 and 0, row 1 scores 1000 and 2000: one shift for both rows (2000) would
    send row 0's exponentials to 0 (out 0, lse -inf); each row's own keeps it exact."""
    q = torch.tensor([[0.0, 0.0], [1000.0, 0.0]], dtype=F64)
    k = torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=F64)
    v = torch.tensor([[1.0, 3.0], [5.0, 7.0]], dtype=F64)
    part = attend_block(q, k, v, scale=1.0)
    assert torch.allclose(part.out, torch.tensor([[3.0, 5.0], [5.0, 7.0]], dtype=F64), rtol=0, atol=1e-15)
    assert torch.allclose(part.lse, torch.tensor([math.log(2), 2000.0], dtype=F64), rtol=1e-15, atol=0)
