"""attnlib.blockwise_bounds: every bound pinned to its formula on a hand-sized case, and hunted
for a break with inputs built where bounds fail: cancellation (values that cancel, heads that
W^O subtracts), underflow (weights below the smallest normal number), huge and tiny entries,
scores that rise key after key (every rescale rounds), lengths that are not powers of two,
blocks of one key, long chains of merges. Each evaluation (attnlib's tiles in both backward
orders, attention(), SDPA's math and flash kernels, split-K) is compared with float64.

Example counts: few under the ``ci`` profile (``make test`` has a time budget), at least
2,000 per hunt under ``thorough`` through ``strategies.hunt`` where the suite has it (else
``strategies.examples``, which scales with the profile).
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from strategies import examples
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnlib import MultiHeadAttention, attention
from attnlib.blockwise import (
    BACKWARD_ORDERS,
    Partial,
    attend_block,
    blockwise_attention,
    gradient_rounding_bound,
    merge,
    rounding_bound,
    split_k_attention,
)
from attnlib.blockwise_bounds import (
    output_projection_bound,
    share_sum_bound,
    typical_rounding_bound,
    worst_and_typical_bounds,
)
from attnlib.decoding import causal_mask

from strategies import half_tile_bounds

try:
    from strategies import hunt  # type: ignore[attr-defined]
except ImportError:  # a suite without the thorough profile's helper
    hunt = examples

F64 = torch.float64


# ---- pinned on a hand-sized case ----------------------------------------------------------------------
def test_rounding_bound_equals_its_formula_on_a_hand_sized_case() -> None:
    """q = (1, 2), keys (1, 0), (0, 1), (-1, 1), values 1, -2, 3, float32, scale 1/sqrt 2:
    S = 3/sqrt 2, |P||V| = p1 + 2 p2 + 3 p3, and every constant of the docstring: 6 n_k + 2 for
    the sums and the roundings of exp (the rescale factors' 2 (n_k - 1) among them), 4 n_k - 1
    in the log-sum-exp."""
    q = torch.tensor([[1.0, 2.0]])
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 1.0]])
    v = torch.tensor([[1.0], [-2.0], [3.0]])
    out_b, lse_b = rounding_bound(q, k, v)
    eps, tiny = 2.0**-23, 2.0**-126
    s = [1 / math.sqrt(2), 2 / math.sqrt(2), 1 / math.sqrt(2)]
    lse = math.log(sum(math.exp(x) for x in s))
    p = [math.exp(x - lse) for x in s]
    big, d_k, n_k = 3 / math.sqrt(2), 2, 3
    pv = p[0] + 2 * p[1] + 3 * p[2]
    weights = math.expm1(2 * (d_k + 3) * big * eps) / eps  # e^x - 1, not x: the weights' error, in eps
    expected = (eps * (weights + 6 * n_k + 2) + 4 * (d_k + 1) * tiny) * pv + 2 * n_k * tiny * (3 * 3 + 2)
    assert out_b.item() == pytest.approx(expected, rel=1e-12, abs=0)
    assert lse_b.item() == pytest.approx(eps * ((d_k + 3) * big + 4 * n_k - 1 + 2 * math.log(n_k) + lse), rel=1e-12, abs=0)
    # with two merges: 2 beta + 2 (3 S* + 10) more
    star = big + math.log(n_k)
    beta = (d_k + 3) * big + star + 4 * n_k - 1 + 2 * math.log(n_k)
    out_m, lse_m = rounding_bound(q, k, v, merges=2)
    more = eps * (2 * beta + 2 * (3 * star + 10)) * pv + 4 * tiny * (3 * 3 + 2)
    assert out_m.item() == pytest.approx(expected + more, rel=1e-12, abs=0)
    assert lse_m.item() == pytest.approx(lse_b.item() + eps * 2 * (star + 6), rel=1e-12, abs=0)
    assert typical_rounding_bound(q, k, v).item() == pytest.approx(
        eps * 8 * (2 * (math.sqrt(2) + 3) * big + 2 * math.sqrt(6) + 5) * pv + 2 * 3 * tiny * 11, rel=1e-12, abs=0)
    assert share_sum_bound(torch.tensor([lse], dtype=F64), 3, torch.float32).item() == pytest.approx(
        math.expm1(eps / 2 * (lse + 6 + 2 + 5 * math.log(3))), rel=1e-12, abs=0)
    assert share_sum_bound(torch.tensor([-lse], dtype=F64), 3, torch.float32, merges=2).item() == pytest.approx(
        math.expm1(eps / 2 * (2 * (lse + math.log(3) + 3) + 3 + 1 + math.log(3))), rel=1e-12, abs=0)
    assert share_sum_bound(torch.tensor([2.0**40, -math.inf]), 3, torch.float32).tolist() == [math.inf, 0.0]
    with pytest.raises(ValueError, match="merges must be an int >= 0"):
        share_sum_bound(torch.tensor([lse]), 3, merges=-1)


def test_gradient_rounding_bound_equals_its_formula_on_a_hand_sized_case() -> None:
    q = torch.tensor([[1.0, 2.0]], dtype=F64)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 1.0]], dtype=F64)
    v = torch.tensor([[1.0], [-2.0], [3.0]], dtype=F64)
    do = torch.tensor([[0.5]], dtype=F64)
    dq, dk, dv = gradient_rounding_bound(q, k, v, do)
    eps, tiny, sc = 2.0**-52, 2.0**-1022, 1 / math.sqrt(2)
    s = [1 * sc, 2 * sc, 1 * sc]
    p = [math.exp(x) / sum(math.exp(y) for y in s) for x in s]
    big, n_k, n_q, d_k, d_v = 3 * sc, 3, 1, 2, 1
    star = big + math.log(n_k)
    rho = (2 * d_k + 6) * big + 3 * star + 4 * n_k + 3 + 2 * math.log(n_k)
    alpha = math.expm1(2 * (d_k + 3) * big * eps) / eps + 6 * n_k + 2
    w = eps * (rho + d_v + max(alpha + d_v, rho + d_v + n_k) + 5 + max(n_k, n_q))
    row = 0.5 * (p[0] * 1 + p[1] * 2 + p[2] * 3)  # rowsum(|dO| * P|V|)
    x = [0.5 * abs(vj) + row for vj in (1.0, -2.0, 3.0)]  # |dO||V|^T + row
    ds = [pj * xj * sc for pj, xj in zip(p, x)]
    xs = max(x) * sc + 2
    assert dv[:, 0].tolist() == pytest.approx([w * pj * 0.5 + 2 * tiny * 1.5 for pj in p], rel=1e-12, abs=0)
    expected_dq = [w * (ds[0] * 1 + ds[2] * 1), w * (ds[1] + ds[2])]
    assert dq[0].tolist() == pytest.approx([e + 2 * n_k * tiny * (xs * 1 + 1) for e in expected_dq], rel=1e-12, abs=0)
    assert dk[:, 1].tolist() == pytest.approx([w * dj * 2 + 2 * tiny * (xs * 2 + 1) for dj in ds], rel=1e-12, abs=0)


# ---- problems built to break a bound ----------------------------------------------------------------------
@st.composite
def hard_problems(draw: st.DrawFn) -> dict:
    """Float32 or float64 inputs with lengths 1-41, huge or tiny scales, rising, underflowing,
    subnormal or huge near-tied scores, cancelling, one-hot, tiny or huge values, and a mask
    or none."""
    dtype = draw(st.sampled_from([torch.float32, F64]))
    n_q, n_k, d_k = draw(st.integers(1, 9)), draw(st.integers(1, 41)), draw(st.integers(1, 6))
    d_v = d_k if draw(st.booleans()) else draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(n_q, d_k, generator=g, dtype=F64) * 10.0 ** draw(st.sampled_from([-25, -3, 0, 0, 1, 2, 3]))
    k = torch.randn(n_k, d_k, generator=g, dtype=F64)
    keys = draw(st.sampled_from(["random", "rising", "underflow", "subnormal", "near-tied"]))
    if keys == "near-tied":  # scores of 1e4 to 1e8 that tie to within a few units (a cold reader's break)
        size, spread = draw(st.sampled_from([1e4, 1e6, 1e8])), draw(st.sampled_from([0.5, 4.0, 32.0]))
        q = q.abs() + 0.5  # every score of one sign, so the common part does not cancel
        k = size * math.sqrt(d_k) / q.sum(-1).amax() + spread * torch.randn(n_k, d_k, generator=g, dtype=F64) \
            / q.norm(dim=-1).amax()
    elif keys == "subnormal":  # products q_l k_l below the smallest normal number: scores underflow too
        tiny = 1e-23 if dtype == torch.float32 else 1e-160
        q, k = q / q.abs().amax().clamp_min(1e-300) * tiny, k * tiny
    elif keys == "rising":  # every key's score above the last: the running max moves at every key
        q, k = q.abs() + 0.1, torch.linspace(-3, 3, n_k, dtype=F64)[:, None].expand(n_k, d_k).clone()
    elif keys == "underflow":  # key 0 far above the rest: their weights underflow
        gap = draw(st.sampled_from([80.0, 104.0, 750.0, 800.0])) * math.sqrt(d_k)
        q = torch.zeros(n_q, d_k, dtype=F64)
        q[:, 0] = 1.0
        k = torch.zeros(n_k, d_k, dtype=F64)
        k[1:, 0] = -gap
    v = torch.randn(n_k, d_v, generator=g, dtype=F64)
    values = draw(st.sampled_from(["random", "cancel", "one-hot", "tiny", "huge"]))
    if values == "cancel":  # pairs that cancel, plus a small remainder
        v[1::2] = -v[:-1:2] * (1 - 1e-6)
    elif values == "one-hot":
        v = torch.zeros_like(v)
        v[min(1, n_k - 1), 0] = 1.0
    elif values in ("tiny", "huge"):
        v = v * (1e-36 if values == "tiny" else 1e30)
    mask = None
    if draw(st.booleans()):
        mask = torch.rand(n_q, n_k, generator=g) < 0.6
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return dict(q=q, k=k, v=v, mask=mask, block_q=draw(st.integers(1, 10)), block_k=draw(st.integers(1, 12)),
                splits=draw(st.integers(1, n_k)))


def _within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    gap = (actual.detach().double() - expected.detach().double()).abs()
    assert (gap <= bound).all(), f"{what}: gap {gap.max():.3g} over the bound {bound.flatten()[(gap - bound).argmax()]:.3g}"


@hunt(12)
@given(hard_problems())
def test_rounding_bound_survives_a_hunt(p: dict) -> None:
    q, k, v, mask = p["q"], p["k"], p["v"], p["mask"]
    exact, _ = attention(q.double(), k.double(), v.double(), mask=mask)
    bound, lse_bound = rounding_bound(q, k, v, mask)
    r = blockwise_attention(q, k, v, mask, block_q=p["block_q"], block_k=p["block_k"])
    _within(r.out, exact, bound, "tiles")
    _within(attention(q, k, v, mask=mask)[0], exact, bound, "attention()")
    with sdpa_kernel(SDPBackend.MATH):
        _within(F.scaled_dot_product_attention(q[None, None], k[None, None], v[None, None],
                                               attn_mask=mask)[0, 0], exact, bound, "SDPA math")
    if q.shape[-1] == v.shape[-1]:  # torch's CPU flash kernel needs d_v = d_k
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            _within(F.scaled_dot_product_attention(q[None, None], k[None, None], v[None, None],
                                                   attn_mask=mask)[0, 0], exact, bound, "SDPA flash")
    s = (q.double() @ k.double().T) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s if mask is None else s.masked_fill(~mask, -math.inf), -1)
    fin = torch.isfinite(lse)
    _within(r.lse[fin], lse[fin], lse_bound[fin], "tiles' lse")
    splits = p["splits"]  # a chain of splits - 1 merges
    out, parts = split_k_attention(q, k, v, mask, num_splits=splits, block_k=p["block_k"])
    chain, chain_lse = rounding_bound(q, k, v, mask, merges=splits - 1)
    _within(out, exact, chain, f"split-K into {splits}")
    level = parts  # the same partials merged as a tree
    while len(level) > 1:
        level = [merge(a, b) for a, b in zip(level[::2], level[1::2])] + level[len(level) // 2 * 2:]
    _within(level[0].out, exact, rounding_bound(q, k, v, mask, merges=math.ceil(math.log2(splits)))[0], "tree")
    _within(level[0].lse[fin], lse[fin], chain_lse[fin], "merged lse")


@hunt(10)
@given(hard_problems(), st.sampled_from(BACKWARD_ORDERS))
def test_gradient_rounding_bound_survives_a_hunt(p: dict, order: str) -> None:
    q, k, v, mask = p["q"], p["k"], p["v"], p["mask"]
    g = torch.Generator().manual_seed(p["splits"])
    d_out = (torch.rand(q.shape[0], v.shape[1], generator=g, dtype=F64) - 0.5).to(q.dtype)
    d_lse = (torch.rand(q.shape[0], generator=g, dtype=F64) - 0.5).to(q.dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    r = blockwise_attention(*leaves, mask, block_q=p["block_q"], block_k=p["block_k"], backward_order=order)
    fin = torch.isfinite(r.lse)
    tiled = torch.autograd.grad((r.out * d_out).sum() + (torch.where(fin, r.lse, 0) * d_lse).sum(), leaves)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    s = (refs[0] @ refs[1].T) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s if mask is None else s.masked_fill(~mask, -math.inf), -1)
    loss = (attention(*refs, mask=mask)[0] * d_out).sum() + (torch.where(torch.isfinite(lse), lse, 0) * d_lse).sum()
    naive = torch.autograd.grad(loss, refs)
    # Overflow is not rounding: where a float32 gradient overflows (values of 1e30 against
    # keys of 2e8 reach float32's 3.4e38 inside a product), no finite bound holds; discarded.
    assume(all(bool(torch.isfinite(t).all()) for t in (*tiled, *naive)))
    for a, b, bound, name in zip(tiled, naive, gradient_rounding_bound(q, k, v, d_out, mask, d_lse=d_lse), "QKV"):
        _within(a, b, bound, f"d{name}, {order}")


@hunt(10)
@given(st.integers(20, 26), st.integers(2, 12), st.sampled_from([1.0, -1.0]), st.data(),
       st.sampled_from([torch.float32, F64]))
def test_share_sum_bound_survives_large_scores(e: int, parts: int, sign: float, data: st.DataObject,
                                               dtype: torch.dtype) -> None:
    """Scores of +-2^20 to 2^26 in float32 (2^49 to 2^55 in float64: the same u |lse|, 1/16 to 4),
    near-tied to within 3 ulps, 1 to 3 keys per worker: the log-sum-exp of the partials rounds by
    up to u |lse|, not small, and the shares' sum moves by e^delta - 1. The linear count of an
    earlier version (u (|lse| + 2K + 2 + 5 ln K)) breaks here in a few examples. The shares are
    also summed against the lse of a chain of merges (merges = K - 1) and of a pairwise tree."""
    mantissa = 24 if dtype == torch.float32 else 53
    e += mantissa - 24  # float64: 2^49 to 2^55
    ulp = 2.0 ** (e - mantissa)  # the spacing just below 2^e
    n = parts * data.draw(st.integers(1, 3))
    offsets = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    k = torch.tensor([[sign * (2.0**e - c * ulp)] for c in offsets], dtype=F64).to(dtype)  # exact
    q = torch.ones(1, 1, dtype=dtype)
    v = torch.randn(n, 2, generator=torch.Generator().manual_seed(n), dtype=F64).to(dtype)
    _, chunks = split_k_attention(q, k, v, scale=1.0, num_splits=parts)
    lses = torch.stack([c.lse for c in chunks])  # (parts, 1)
    lse_all = torch.logsumexp(lses, 0)
    total = torch.exp(lses - lse_all).sum(0)  # the shares, summed
    _within(total, torch.ones(1), share_sum_bound(lse_all, parts), f"{parts} shares, one logsumexp")
    chain = chunks[0]
    for c in chunks[1:]:
        chain = merge(chain, c)
    total = torch.exp(lses - chain.lse).sum(0)
    _within(total, torch.ones(1), share_sum_bound(chain.lse, parts, merges=parts - 1), f"a chain of {parts - 1}")
    level = chunks
    while len(level) > 1:
        level = [merge(a, b) for a, b in zip(level[::2], level[1::2])] + level[len(level) // 2 * 2:]
    total = torch.exp(lses - level[0].lse).sum(0)
    _within(total, torch.ones(1), share_sum_bound(level[0].lse, parts, merges=math.ceil(math.log2(parts))),
            "a tree")


def test_share_sum_bound_holds_where_the_linear_count_broke() -> None:
    """A cold reader's break: 8 float32 keys, one per worker, scores 2^24 - 1 (seven) and
    2^24 - 2: the log-sum-exp of the partials rounds to 2^24 against an exact 2^24 + 0.997, and
    the shares sum to 2.71. The linear count gave 1.0000017; e^x - 1 gives 1.7183."""
    k = torch.tensor([[2.0**24 - 1]] * 7 + [[2.0**24 - 2]])
    _, chunks = split_k_attention(torch.ones(1, 1), k, torch.ones(8, 1), scale=1.0, num_splits=8)
    lses = torch.stack([c.lse for c in chunks])  # (8, 1)
    lse_all = torch.logsumexp(lses, 0)
    assert lse_all.item() == 2.0**24  # rounded down by 0.997
    gap = (torch.exp(lses - lse_all).sum(0) - 1).abs()
    linear = 2.0**-24 * (2.0**24 + 16 + 2 + 5 * math.log(8))
    assert gap.item() > 1.7 > linear  # the break is real
    assert (gap <= share_sum_bound(lse_all, 8)).all()


@pytest.mark.parametrize(("base", "parts"), [(16.0, 64), (64.0, 20), (1024.0, 8), (1024.0, 20)])
def test_share_sum_bound_counts_a_chain_of_merges(base: float, parts: int) -> None:
    """A cold reader's chain: one float32 partial at lse = base and parts - 1 at
    base + ln(e^h - 1), h = 0.45 ulp, so that every merge() absorbs the next partial and
    rounds its lse down by h: after K - 1 merges the lse is (K - 1) h low, 6 to 16 times what
    one logsumexp may lose (merges=0), and within the chain's count (merges=K - 1)."""
    h = 0.45 * float(torch.finfo(torch.float32).eps) * base  # base is a power of 2: its ulp is eps base
    lses = [base] + [base + math.log(math.expm1(h))] * (parts - 1)
    chunks = [Partial(torch.zeros(1, 1), torch.tensor([x])) for x in lses]
    chain = chunks[0]
    for c in chunks[1:]:
        chain = merge(chain, c)
    assert chain.lse.item() == base  # every merge absorbed its partial
    gap = (sum(torch.exp(c.lse - chain.lse) for c in chunks) - 1).abs()
    assert (gap > 5 * share_sum_bound(chain.lse, parts)).all()  # one logsumexp's count: broken
    assert (gap <= share_sum_bound(chain.lse, parts, merges=parts - 1)).all()


@hunt(8)
@given(st.sampled_from([0.0, 1e-12, 1e-6, 1e-3, 0.5]), st.integers(1, 9), st.integers(0, 2**16), st.booleans())
def test_output_projection_bound_survives_cancelling_heads(c: float, n: int, seed: int, causal: bool) -> None:
    """Two identical heads, and W^O's rows for head 1 = -(1 - c) times head 0's: the output is a
    c-sized remainder of large terms. Sized by the result (assert_rounding_close), c = 1e-3 failed
    by 9x and exact cancellation by 1e13x; sized by |concat| |W^O| + |b^O| it holds."""
    torch.manual_seed(seed)
    mha = MultiHeadAttention(8, 2, dtype=torch.float32)
    with torch.no_grad():
        for w, b in ((mha.w_q, mha.b_q), (mha.w_k, mha.b_k), (mha.w_v, mha.b_v)):
            w[:, 4:] = w[:, :4]  # head 1 = head 0
            b[4:] = b[:4]
        mha.w_o[4:] = -(1 - c) * mha.w_o[:4]
        mha.b_o.zero_()
    x = torch.randn(2, n, 8)
    mask = causal_mask(n) if causal else None
    ref, _ = mha(x, x, x, mask=mask)
    with torch.no_grad():
        heads = [F.linear(x, w.T, b).view(2, n, 2, 4).transpose(1, 2)
                 for w, b in ((mha.w_q, mha.b_q), (mha.w_k, mha.b_k), (mha.w_v, mha.b_v))]
        r = blockwise_attention(*heads, causal=causal, block_q=3, block_k=2)
        out = r.out.transpose(1, 2).reshape(2, n, 8) @ mha.w_o + mha.b_o
    bound = output_projection_bound(rounding_bound(*heads, mask)[0], r.out, mha.w_o, mha.b_o)
    _within(out, ref, bound, f"c = {c}")


def test_output_projection_bound_refuses_mismatched_shapes() -> None:
    heads = torch.zeros(2, 3, 5, 4)
    with pytest.raises(ValueError, match=r"heads must have shape \(\.\.\., h, n, d_v\) and head_bound the same"):
        output_projection_bound(heads[0, 0], heads[0, 0], torch.zeros(12, 8))
    with pytest.raises(ValueError, match=r"w_o must have shape \(12, d_model\) for 3 heads of width 4, got \(8, 8\)"):
        output_projection_bound(heads, heads, torch.zeros(8, 8))
    with pytest.raises(ValueError, match="merges must be an int >= 0"):
        rounding_bound(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(4, 1), merges=-1)
    with pytest.raises(ValueError, match="lam must be a number > 0"):
        typical_rounding_bound(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(4, 1), lam=0)
    for bad in ({"merges": -1}, {"lam": 0}):  # the one-pass form refuses what the two refuse
        with pytest.raises(ValueError, match="merges must be an int >= 0|lam must be a number > 0"):
            worst_and_typical_bounds(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(4, 1), **bad)


def test_worst_and_typical_bounds_equal_the_two_functions() -> None:
    """One pass over the scores gives, bit for bit, rounding_bound's two bounds and
    typical_rounding_bound's tolerance: with and without a mask (a query with no allowed key
    too), merges, lam, scale, float32 and float16."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 5, 4, generator=g), torch.randn(2, 7, 4, generator=g), torch.randn(2, 7, 3, generator=g)
    mask = torch.rand(2, 5, 7, generator=g) < 0.6
    mask[0, 1] = False
    for m, kw in ((None, {}), (mask, {"merges": 3, "lam": 5.0}), (mask, {"scale": 0.3})):
        for dt in (torch.float32, torch.float16):
            args = (q.to(dt), k.to(dt), v.to(dt), m)
            both = worst_and_typical_bounds(*args, **kw)
            worst = rounding_bound(*args, **{x: y for x, y in kw.items() if x != "lam"})
            typical = typical_rounding_bound(*args, **{x: y for x, y in kw.items() if x != "merges"})
            for got, want in zip(both, (*worst, typical)):
                assert got.shape == want.shape and torch.equal(got, want)


# ---- half precision: float32 accumulators, one rounding at the end --------------------------------------
@hunt(4)
@given(st.sampled_from([torch.float16, torch.bfloat16]), st.integers(1, 24), st.integers(1, 40), st.integers(1, 16),
       st.sampled_from([1.0, 1e3, 1e-3, 1e-5, 1e-6, 1e-7]), st.sampled_from([0.1, 1.0, 4.0]),
       st.sampled_from([1.0, 1e-4, 1e3]), st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**16))
def test_hunt_half_precision_output_and_gradient_bounds(dtype: torch.dtype, n_q: int, n_k: int, d: int,
                                                        v_scale: float, qk_scale: float, do_scale: float,
                                                        bq: int, bk: int, seed: int) -> None:
    """The tiles in float16 and bfloat16 against float64, output and dQ, dK, dV in both backward
    orders, within half_tile_bounds plus the final rounding. Steered to subnormal outputs (values
    of 1e-5 to 1e-7 in float16: the case where D's rounding is tau u, not u |o|), sharp scores,
    tiny and large dO, blocks of any size; examples that overflow are discarded."""
    g = torch.Generator().manual_seed(seed)
    q, k = (qk_scale * torch.randn(n, d, generator=g, dtype=F64) for n in (n_q, n_k))
    v = v_scale * torch.randn(n_k, d, generator=g, dtype=F64)
    do = do_scale * torch.randn(n_q, d, generator=g, dtype=F64)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    u, tiny = torch.finfo(dtype).eps / 2, torch.finfo(dtype).tiny * torch.finfo(dtype).eps / 2
    q64, k64, v64 = (t.double() for t in (q, k, v))
    refs = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    exact = attention(*refs)[0]
    exact_g = torch.autograd.grad((exact * do.double()).sum(), refs)
    for order in BACKWARD_ORDERS:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = blockwise_attention(*leaves, block_q=bq, block_k=bk, backward_order=order).out
        grads = torch.autograd.grad((out * do).sum(), leaves)
        assume(all(torch.isfinite(t).all() for t in (out, *grads)))  # a range failure, not rounding
        out_b, grad_b = half_tile_bounds(q, k, v, do, out.detach())
        _within(out.detach(), exact.detach(), out_b + u * (exact.detach().abs() + out_b) + tiny, "the output")
        for name, a, e, b in zip(("dQ", "dK", "dV"), grads, exact_g, grad_b):
            _within(a, e, b + u * (e.abs() + b) + tiny, name)


# ---- the gate: passes what is right, refuses one tile of keys dropped --------------------------------
@hunt(5)
@given(st.integers(200, 700), st.integers(0, 2**16))
def test_typical_bound_passes_float32_kernels_and_refuses_a_dropped_tile(n: int, seed: int) -> None:
    """The gate of benchmarks/bench_blockwise.py at small sizes: tiles of n // 8 keys, so a dropped
    tile loses an eighth of the softmax's mass; the worst-case bound is the proof, this the gate."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, 32, generator=g) for _ in range(3))
    rows = torch.arange(0, n, 37)
    exact, _ = attention(q[rows].double(), k.double(), v.double())
    gate = typical_rounding_bound(q[rows], k, v)
    b = n // 8
    for out in (attention(q[rows], k, v)[0], blockwise_attention(q[rows], k, v, block_q=64, block_k=b).out,
                F.scaled_dot_product_attention(q[rows][None, None], k[None, None], v[None, None])[0, 0]):
        _within(out, exact, gate, "a float32 kernel")
    dropped = blockwise_attention(q[rows], k[:-b], v[:-b], block_q=64, block_k=b).out
    assert not ((dropped.double() - exact).abs() <= gate).all()


def test_near_tied_huge_scores_stay_within_the_bound() -> None:
    """A cold reader's break of the linear bound: one float32 query, d_k = 1, two scores near
    2e8 that tie to within 31.5 (float32 rounds their gap to 16), values 0 and 1. The weights
    then err by e^delta - 1 with delta far from small; the first-order 2 (d_k + 3) u S that the
    bound used to count was exceeded 2.9e4 times. Counted as e^x - 1, the bound holds."""
    q = torch.tensor([[1.970224142074585]])
    k = torch.tensor([[100788512.0], [100788496.0]])
    v = torch.tensor([[0.0], [1.0]])
    out32, _ = attention(q, k, v)
    out64, _ = attention(q.double(), k.double(), v.double())
    gap = (out32.double() - out64).abs()
    assert gap.item() > 1e-8  # the break is real: far beyond a float32 rounding of 0.5
    out_b, _ = rounding_bound(q, k, v)
    assert (gap <= out_b).all()
