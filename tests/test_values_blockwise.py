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
from attnlib.blockwise_bounds import (
    gradient_rounding_bound,
    intermediate_bytes,
    output_projection_bound,
    rounding_bound,
    share_sum_bound,
    typical_rounding_bound,
    worst_and_typical_bounds,
)

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


# ---- every term of the bounds visible: float16 (tiny = eps / 16), a batch, n_q, d_k, n_k, d_v all different
F16 = torch.float16


def _batch16() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (2, 3, 2), k (2, 4, 2), v (2, 4, 1), float16 integers (exact), and a mask (3, 4) whose last
    query reads nothing."""
    q = torch.tensor([[[1, -2], [3, 0], [0, 1]], [[2, 2], [-1, 1], [1, 0]]], dtype=F16)
    k = torch.tensor([[[1, 1], [-1, 3], [2, 0], [0, -1]], [[1, 0], [0, 2], [-2, 1], [1, 1]]], dtype=F16)
    v = torch.tensor([[[1], [-2], [3], [0.5]], [[-1], [2], [0], [4]]], dtype=F16)
    mask = torch.tensor([[True, False, True, True], [True, True, True, False], [False] * 4])
    return q, k, v, mask


def _sizes16(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The weights P (0 on a row that reads nothing), the scores (-inf where masked) and S, in float64."""
    s = (q.double() @ k.double().mT) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    big = float((q.double().abs() @ k.double().abs().mT).amax()) * scale
    return p, s, big


def test_worst_typical_and_merged_bounds_are_their_formulas_in_float16() -> None:
    q, k, v, mask = _batch16()
    eps, tiny = torch.finfo(F16).eps, torch.finfo(F16).tiny
    d_k, n_k, merges, lam = 2, 4, 2, 3.0
    sc = 1 / math.sqrt(d_k)  # the default scale: 1/sqrt(d_k), not 1/sqrt(n_q)
    p, s, big = _sizes16(q, k, mask, sc)
    pv = p @ v.double().abs()
    star = big + math.log(n_k)
    beta = (d_k + 3) * big + star + 4 * n_k - 1 + 2 * math.log(n_k)
    count = math.expm1(2 * (d_k + 3) * big * eps) / eps + 6 * n_k + 2 + 2 * beta + merges * (3 * star + 10)
    floor = 2 * (n_k + merges) * tiny * (3 * 4 + 2)  # max|V| = 4
    out = (eps * count + 4 * (d_k + 1) * tiny * 1.0) * pv + floor  # max(1, scale) = 1
    lse = torch.logsumexp(s, -1)
    lse_abs = torch.where(lse.isfinite(), lse.abs(), torch.zeros_like(lse))
    lse_b = eps * ((d_k + 3) * big + 4 * n_k - 1 + 2 * math.log(n_k) + lse_abs + merges * (star + 6))
    typical = eps * lam * (2 * (math.sqrt(d_k) + 3) * big + 2 * math.sqrt(2 * n_k) + 5) * pv + 2 * n_k * tiny * 14
    got = rounding_bound(q, k, v, mask, merges=merges)
    assert torch.allclose(got[0], out, rtol=1e-12, atol=0) and torch.allclose(got[1], lse_b, rtol=1e-12, atol=0)
    assert torch.allclose(typical_rounding_bound(q, k, v, mask, lam=lam), typical, rtol=1e-12, atol=0)
    both = worst_and_typical_bounds(q, k, v, mask, merges=merges, lam=lam)
    assert torch.equal(both[0], got[0]) and torch.equal(both[1], got[1])
    assert torch.allclose(both[2], typical, rtol=1e-12, atol=0)
    default = (typical - 2 * n_k * tiny * 14) * (8 / lam) + 2 * n_k * tiny * 14  # lam's default is 8
    assert torch.allclose(typical_rounding_bound(q, k, v, mask), default, rtol=1e-12, atol=0)
    # a scale above 1 multiplies the tiny term: max(1, scale); no merges by default; lam may be below 1
    got3 = rounding_bound(q, k, v, mask, scale=3.0)
    p3, _, big3 = _sizes16(q, k, mask, 3.0)
    pv3 = p3 @ v.double().abs()
    out3 = (eps * (math.expm1(2 * 5 * big3 * eps) / eps + 26) + 4 * 3 * tiny * 3.0) * pv3 + 2 * 4 * tiny * 14
    typical3 = eps * 0.5 * (2 * (math.sqrt(2) + 3) * big3 + 2 * math.sqrt(8) + 5) * pv3 + 2 * 4 * tiny * 14
    assert torch.allclose(got3[0], out3, rtol=1e-12, atol=0)
    assert torch.allclose(typical_rounding_bound(q, k, v, mask, 3.0, lam=0.5), typical3, rtol=1e-12, atol=0)
    both3 = worst_and_typical_bounds(q, k, v, mask, 3.0, lam=0.5)
    assert torch.equal(both3[0], got3[0]) and torch.equal(both3[1], got3[1])
    assert torch.allclose(both3[2], typical3, rtol=1e-12, atol=0)
    # no mask: the softmax runs along the keys of each batch entry
    p0 = torch.softmax((q.double() @ k.double().mT) * sc, -1)
    big0 = float((q.double().abs() @ k.double().abs().mT).amax()) * sc
    out0 = (eps * (math.expm1(2 * 5 * big0 * eps) / eps + 26) + 12 * tiny) * (p0 @ v.double().abs()) + 8 * tiny * 14
    assert torch.allclose(rounding_bound(q, k, v)[0], out0, rtol=1e-12, atol=0)
    # a mask of the scores' full shape with two batch dimensions (2, 3) is read entry by entry
    q0, k0, v0 = _qkv()
    m0 = torch.tensor([[True, False, True], [False, True, True]])
    one = rounding_bound(q0, k0, v0, m0)
    many = rounding_bound(*(t.expand(2, 3, *t.shape) for t in (q0, k0, v0)), m0.expand(2, 3, 2, 3))
    assert torch.equal(many[0], one[0].expand(2, 3, 2, 2)) and torch.equal(many[1], one[1].expand(2, 3, 2))
    # a mask with more dimensions than the scores is refused, not broadcast
    with pytest.raises(ValueError, match=r"mask of shape \(1, 2, 3, 4\) does not broadcast"):
        rounding_bound(q, k, v, mask.expand(1, 2, 3, 4))


def test_gradient_bound_in_float16_where_the_weights_error_dominates() -> None:
    """Scores large enough in float16 (S = 126) that alpha + d_v, not rho + d_v + n_k, is the larger
    count of D's error; with a mask, a scale, d_lse and a batch."""
    q, k, v, mask = _batch16()
    q = q * 24
    d_out = torch.tensor([[[1], [-0.5], [2]], [[0.25], [1], [-1]]], dtype=F16)
    d_lse = torch.tensor([[1, -2, 0.5], [0, 1, 3]], dtype=F16)
    eps, tiny = torch.finfo(F16).eps, torch.finfo(F16).tiny
    sc, n_q, n_k, d_k, d_v = 0.75, 3, 4, 2, 1
    p, _, big = _sizes16(q, k, mask, sc)
    assert big == 126
    star = big + math.log(n_k)
    rho = (2 * d_k + 6) * big + 3 * star + 4 * n_k + 3 + 2 * math.log(n_k)
    alpha = math.expm1(2 * (d_k + 3) * big * eps) / eps + 6 * n_k + 2
    assert alpha + d_v > rho + d_v + n_k
    w = eps * (rho + d_v + alpha + d_v + 5 + max(n_k, n_q))
    do = d_out.double()
    x = do.abs() @ v.double().abs().mT + (do.abs() * (p @ v.double().abs())).sum(-1, keepdim=True) + d_lse.double().abs()[..., None]
    ds = p * x * sc
    xs = float(x.amax()) * sc + 2
    dq, dk, dv = gradient_rounding_bound(q, k, v, d_out, mask, sc, d_lse)
    assert torch.allclose(dq, w * (ds @ k.double().abs()) + 2 * n_k * tiny * (xs * 3 + 1), rtol=1e-12, atol=0)  # max|K| = 3
    assert torch.allclose(dk, w * (ds.mT @ q.double().abs()) + 2 * n_q * tiny * (xs * 72 + 1), rtol=1e-12, atol=0)  # max|Q| = 72
    assert torch.allclose(dv, w * (p.mT @ do.abs()) + 2 * n_q * tiny * (2 + 1), rtol=1e-12, atol=0)  # max|dO| = 2
    assert dq.shape == (2, 3, 2) and dk.shape == (2, 4, 2) and dv.shape == (2, 4, 1)
    # d_lse is made float64 before its absolute value: an int8 -128 counts 128 (int8's abs(-128) is -128)
    as_int = gradient_rounding_bound(q, k, v, d_out, mask, sc, torch.tensor([[-128, 0, 0], [0, 0, 0]], dtype=torch.int8))
    as_float = gradient_rounding_bound(q, k, v, d_out, mask, sc, torch.tensor([[128.0, 0, 0], [0, 0, 0]], dtype=F16))
    assert all(torch.equal(a, b) for a, b in zip(as_int, as_float))


def test_share_sum_bound_is_its_formula() -> None:
    """e^x - 1 with x = u (|lse| + 2K + 2 + 5 ln K) for one log-sum-exp, u (r (|lse| + ln K + 3) + K + 1
    + ln K) after r merges; 0 where lse is infinite."""
    lse = torch.tensor([-3.0, float("inf"), 2.5], dtype=F16)
    size = torch.tensor([3.0, 0.0, 2.5], dtype=F64)
    finite = torch.tensor([1.0, 0.0, 1.0], dtype=F64)
    for dtype, u in ((None, torch.finfo(F16).eps / 2), (torch.float32, torch.finfo(torch.float32).eps / 2)):
        got = share_sum_bound(lse, 3, dtype)
        want = torch.expm1(u * (size + 2 * 3 + 2 + 5 * math.log(3))) * finite
        assert got.dtype == F64 and torch.allclose(got, want, rtol=1e-12, atol=0)
    u16 = torch.finfo(F16).eps / 2
    assert torch.allclose(share_sum_bound(lse, 1), torch.expm1(u16 * (size + 4)) * finite, rtol=1e-12, atol=0)
    merged = torch.expm1(u16 * (2 * (size + math.log(3) + 3) + 3 + 1 + math.log(3))) * finite
    assert torch.allclose(share_sum_bound(lse, 3, merges=2), merged, rtol=1e-12, atol=0)


def test_output_projection_bound_is_its_formula() -> None:
    """heads (2, h = 2, n = 3, d_v = 2), W^O (4, d_model = 3), b^O, all float16: the concatenation
    puts head 1's columns after head 0's, per batch entry."""
    heads = torch.arange(24, dtype=F16).reshape(2, 2, 3, 2) - 11
    bound = torch.arange(24, dtype=F16).reshape(2, 2, 3, 2) / 8
    w_o = torch.tensor([[1, -2, 0], [3, 1, -1], [0, 2, 2], [-1, 0, 1]], dtype=F16)
    b_o = torch.tensor([1, -3, 0.5], dtype=F16)
    eps, tiny = torch.finfo(F16).eps, torch.finfo(F16).tiny

    def concat(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[..., 0, :, :], t[..., 1, :, :]], -1).double()  # (..., n, h*d_v)

    w = w_o.double().abs()
    want = concat(bound) @ w + eps * 5 * (concat(heads).abs() @ w + b_o.double().abs()) + 2 * 5 * tiny
    got = output_projection_bound(bound, heads, w_o, b_o)
    assert got.dtype == F64 and got.shape == (2, 3, 3) and torch.allclose(got, want, rtol=1e-12, atol=0)
    # b^O is made float64 before its absolute value: an int8 -128 counts 128
    as_int = output_projection_bound(bound, heads, w_o, torch.tensor([-128, 0, 1], dtype=torch.int8))
    assert torch.equal(as_int, output_projection_bound(bound, heads, w_o, torch.tensor([128.0, 0, 1], dtype=F16)))
    one = output_projection_bound(bound[0], heads[0], w_o)  # one (h, n, d_v), no bias
    assert torch.allclose(one, (concat(bound) @ w + eps * 5 * (concat(heads).abs() @ w) + 2 * 5 * tiny)[0], rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"^heads must have shape \(\.\.\., h, n, d_v\) and head_bound the same, got \(3, 2\) and \(3, 2\)$"):
        output_projection_bound(bound[0, 0], heads[0, 0], w_o)
    with pytest.raises(ValueError, match=r"got \(2, 3, 2\) and \(2, 3, 1\)$"):
        output_projection_bound(bound[0, :, :, :1], heads[0], w_o)
    with pytest.raises(ValueError, match=r"^w_o must have shape \(4, d_model\) for 2 heads of width 2, got \(3, 3\)$"):
        output_projection_bound(bound, heads, w_o[:3])
    for i, name in enumerate(("head_bound", "heads", "w_o")):
        args: list[object] = [bound, heads, w_o]
        args[i] = 1.0
        with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor"):
            output_projection_bound(*args)  # type: ignore[arg-type]


def test_bound_argument_refusals() -> None:
    q, k, v = _qkv()
    for merges in (-1, True, 1.5):
        with pytest.raises(ValueError, match="merges must be an int >= 0"):
            rounding_bound(q, k, v, merges=merges)  # type: ignore[arg-type]
    for lam in (0, -1.0, True, "8"):
        with pytest.raises(ValueError, match="lam must be a number > 0"):
            typical_rounding_bound(q, k, v, lam=lam)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="lam must be a number > 0"):
            worst_and_typical_bounds(q, k, v, lam=lam)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="merges must be an int >= 0"):
        worst_and_typical_bounds(q, k, v, merges=-1)
    for name in ("n_k", "d_v", "batch"):
        args = dict(n_q=4, n_k=6, d_v=3, batch=1) | {name: 0}
        with pytest.raises(ValueError, match=f"^{name} must be a positive int"):
            intermediate_bytes(**args)


def test_weights_error_is_infinite_from_x_700() -> None:
    """(e^x - 1) / eps for x = 2 (d_k + 3) S eps, infinite from x = 700 on: at x = 700 exactly
    (d_k = 2, S = 8960, eps = 2^-7, bfloat16's) the finite value would be 1.3e306."""
    from attnlib.blockwise_bounds import _weights_error

    assert _weights_error(2, 8960.0, 2.0 ** -7) == math.inf and _weights_error(2, 1e9, 2.0 ** -7) == math.inf
    assert _weights_error(2, 8959.0, 2.0 ** -7) == math.expm1(10 * 8959.0 * 2.0 ** -7) / 2.0 ** -7


# ---- blockwise's survivors of the fifth round (make mutants) ------------------------------------
def test_default_tiles_are_128_by_128() -> None:
    """129 queries and keys with the default block sizes: 2 x 2 tiles (128 + 1 each way)."""
    x = torch.zeros(129, 1, dtype=F64)
    assert blockwise_attention(x, x, x)[2:] == (4, 0)


def test_each_query_tile_row_keeps_its_own_running_maximum() -> None:
    """attend_block's two rows (scores 0 and 0, 1000 and 2000) in one query tile, one key per key
    tile: one shift for the whole tile (its largest score) would send row 0's weights to 0."""
    q = torch.tensor([[0.0, 0.0], [1000.0, 0.0]], dtype=F64)
    k = torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=F64)
    v = torch.tensor([[1.0, 3.0], [5.0, 7.0]], dtype=F64)
    r = blockwise_attention(q, k, v, scale=1.0, block_k=1)
    assert torch.equal(r.out, torch.tensor([[3.0, 5.0], [5.0, 7.0]], dtype=F64))
    assert torch.equal(r.lse, torch.tensor([math.log(2), 2000.0], dtype=F64))


def _one_key_each() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (3, 2) integers and v (3, 2); with causal=True the mask leaves each query one key
    (0, 1, 0), so the output is that key's value row and the log-sum-exp its score, exactly."""
    q = torch.tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 1.0]], dtype=F64)
    k = torch.tensor([[2.0, 0.0], [1.0, 1.0], [-1.0, 2.0]], dtype=F64)
    v = torch.tensor([[1.0, -2.0], [3.0, 0.5], [7.0, 5.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [False, True, True], [True, False, False]])
    return q, k, v, mask


def test_causal_and_a_mask_combine_in_a_tile_the_diagonal_crosses() -> None:
    """One 3 x 3 tile, crossed by the diagonal: the causal rule AND the mask (not either alone, not OR)."""
    q, k, v, mask = _one_key_each()
    r = blockwise_attention(q, k, v, mask, scale=1.0, causal=True, block_q=3, block_k=3)
    assert torch.equal(r.out, v[[0, 1, 0]])
    assert torch.equal(r.lse, torch.tensor([2.0, -1.0, 6.0], dtype=F64))  # q_0.k_0, q_1.k_1, q_2.k_0
    assert r[2:] == (1, 0)


def test_causal_tiles_are_made_on_the_inputs_device_not_the_default_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a default device of "meta" (standing in for a CPU default with inputs on a GPU), the
    forward's causal tiles are made on the inputs' device: the results are the ones computed
    without it, bit for bit. The backward runs outside that context (autograd does not carry it),
    so there the device each causal tile is asked for is recorded: the inputs', in both loops."""
    import attnlib.blockwise as bw

    devices: list[object] = []
    make = bw._causal_tile
    monkeypatch.setattr(bw, "_causal_tile", lambda *a: devices.append(a[-1]) or make(*a))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, generator=g, dtype=F64) for _ in range(3))
    results = []
    for device in ("cpu", "meta"):
        got = []
        for order in ("kv_outer", "q_outer"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with torch.device(device):
                r = blockwise_attention(*leaves, causal=True, block_q=2, block_k=2, backward_order=order)
            got += [r.out, r.lse, *torch.autograd.grad(r.out.sum() + r.lse.sum(), leaves)]
        results.append(got)
    assert all(a.device.type == "cpu" and torch.equal(a, b) for a, b in zip(*results))
    assert len(devices) == 8 and set(devices) == {torch.device("cpu")}  # 1 tile crossed: 4 forwards, 4 backwards


def test_q_outer_backward_reads_d_lse_and_goes_on_past_an_empty_tile() -> None:
    """The query-outer loop, with the log-sum-exp in the loss and a mask whose first key tile is
    empty for every query: the same gradients as the key-outer loop, bit for bit."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, n, 2, generator=g, dtype=F64) for n in (3, 4, 4))
    mask = torch.tensor([[False, False, True, False], [False, False, True, True], [False, False, False, True]])
    grads = []
    for order in ("q_outer", "kv_outer"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        r = blockwise_attention(*leaves, mask, block_q=2, block_k=2, backward_order=order)
        assert r[2:] == (2, 2)  # key tile 0 is empty for both query tiles
        grads.append(torch.autograd.grad((r.out * v[:, :3]).sum() + (r.lse * q[..., 0]).sum(), leaves))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_backward_order_picks_its_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """"kv_outer" (the default) runs the key-outer loop, "q_outer" the query-outer one."""
    import attnlib.blockwise as bw

    calls: list[str] = []
    for name in ("_backward", "_backward_kv_outer"):
        monkeypatch.setattr(bw, name, lambda *a, _f=getattr(bw, name), _n=name: calls.append(_n) or _f(*a))
    q, k, v, _ = _one_key_each()
    for kwargs in ({}, {"backward_order": "kv_outer"}, {"backward_order": "q_outer"}):
        leaf = q.clone().requires_grad_()
        blockwise_attention(leaf, k, v, **kwargs).out.sum().backward()
    assert calls == ["_backward_kv_outer", "_backward_kv_outer", "_backward"]


def test_split_k_workers_get_all_queries_in_one_tile_and_the_key_tile_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import attnlib.blockwise as bw

    seen: list[tuple[object, object]] = []
    inner = bw.blockwise_attention
    monkeypatch.setattr(bw, "blockwise_attention",
                        lambda *a, **kw: seen.append((kw.get("block_q"), kw.get("block_k"))) or inner(*a, **kw))
    q, k, v, _ = _one_key_each()
    split_k_attention(q, k, v, num_splits=2, block_k=2)
    split_k_attention(q[:2], k, v, num_splits=1)
    assert seen == [(3, 2), (3, 2), (2, 128)]


def test_split_k_with_a_scale_more_queries_than_keys_and_one_query() -> None:
    """Three queries, two keys, one per worker: each partial is its key's value row, with the scaled
    score as log-sum-exp (exact: integers times 0.5); for a single query (d_k,) the partials lose
    the query axis too."""
    q, k, v, _ = _one_key_each()
    k, v = k[:2], v[:2]
    s = (q @ k.T) * 0.5  # (3, 2)
    out, parts = split_k_attention(q, k, v, scale=0.5, num_splits=2)
    for w, p in enumerate(parts):
        assert torch.equal(p.out, v[w].expand(3, 2)) and torch.equal(p.lse, s[:, w])
    assert torch.allclose(out, attention(q, k, v, scale=0.5)[0], rtol=0, atol=1e-15)
    one, parts1 = split_k_attention(q[2], k, v, scale=0.5, num_splits=2)
    assert torch.equal(one, out[2])
    for w, p in enumerate(parts1):
        assert torch.equal(p.out, v[w]) and torch.equal(p.lse, s[2, w])


def test_tile_counts_and_a_single_querys_mask_name_what_they_refuse() -> None:
    for i, name in enumerate(("n_q", "n_k", "block_q", "block_k")):
        args = [4, 4, 2, 2]
        args[i] = 0
        with pytest.raises(ValueError, match=f"^{name} must be a positive int"):
            tile_counts(*args)
    q, k, _, _ = _one_key_each()
    with pytest.raises(ValueError, match=r"^mask of shape \(2,\) does not broadcast to the scores' shape \(3,\)$"):
        blockwise_attention(q[0], k, k, torch.ones(2, dtype=torch.bool))


# ---- blockwise_bounds' survivors of the fifth round ----------------------------------------------
def test_share_sum_bound_is_infinite_from_x_700() -> None:
    """One part, float16's u = 2^-11: x = u (|lse| + 4) is exactly 700 at |lse| = 700 * 2^11 - 4,
    where the bound is inf (e^700 - 1 would still be finite); 2 less gives x = 700 - 2^-10, finite."""
    lse = torch.tensor([700 * 2048 - 4.0, 4 - 700 * 2048.0, 700 * 2048 - 6.0], dtype=F64)
    got = share_sum_bound(lse, 1, F16)
    assert got[0] == math.inf and got[1] == math.inf
    assert float(got[2]) == pytest.approx(math.expm1(700 - 2.0 ** -10), rel=1e-14, abs=0)
