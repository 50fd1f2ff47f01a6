"""Tests of attnlib.blockwise: attention tile by tile, the log-sum-exp merge, the backward.

References: :func:`attnlib.attention` (the n x n weights written out),
``torch.nn.functional.scaled_dot_product_attention`` and :class:`attnlib.MultiHeadAttention`
with the same weights; gradients against autograd through the naive version. Everything in
float64, tolerances from :func:`attnlib.assert_rounding_close` (derived, not tuned).
"""

from __future__ import annotations

import itertools
import math

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from strategies import examples, half_tile_bounds

import attnlib.blockwise as bw
from attnlib import MultiHeadAttention, attention
from attnlib.blockwise import (
    BACKWARD_ORDERS,
    BlockwiseResult,
    Partial,
    attend_block,
    blockwise_attention,
    gradient_rounding_bound,
    intermediate_bytes,
    merge,
    rounding_bound,
    split_k_attention,
    tile_counts,
)
from attnlib.blockwise_bounds import output_projection_bound
from attnlib.decoding import causal_mask

FAST = examples(25)
F64 = torch.float64


def _close(actual: torch.Tensor, expected: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | None = None) -> None:
    """|actual - expected| within attnlib.blockwise.rounding_bound, elementwise."""
    bound, _ = rounding_bound(q, k, v, mask)
    gap = (actual.detach().double() - expected.detach().double()).abs()
    assert (gap <= bound).all(), f"gap {gap.max():.3g} over the bound {bound.flatten()[gap.argmax()]:.3g}"


def _lse_close(actual: torch.Tensor, expected: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               mask: torch.Tensor | None = None) -> None:
    _, bound = rounding_bound(q, k, k[..., :1], mask)
    fin = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), fin)  # -inf exactly where no key is allowed
    assert ((actual - expected)[fin].abs() <= bound[fin]).all()


@st.composite
def problems(draw: st.DrawFn, causal_ok: bool = True) -> dict:
    """q, k, v (float64, entries in [-2, 2]), a mask kind, block sizes, batch dims."""
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    n_q, n_k = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    d_k, d_v = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    kind = draw(st.sampled_from(["none", "random", "causal", "padding"] if causal_ok else ["none", "random", "padding"]))
    if kind == "causal" and n_k < n_q:
        n_k = n_q
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)

    def u(*shape: int) -> torch.Tensor:
        return 4 * torch.rand(*shape, generator=g, dtype=F64) - 2

    mask = None
    if kind == "random":  # some rows may allow nothing
        mask = torch.rand(*batch, n_q, n_k, generator=g) < draw(st.sampled_from([0.3, 0.7]))
    elif kind == "padding":  # per sequence: the last keys are padding, broadcast over queries
        keep = draw(st.integers(0, n_k))
        mask = (torch.arange(n_k) < keep).expand(*batch, 1, n_k)
    return dict(q=u(*batch, n_q, d_k), k=u(*batch, n_k, d_k), v=u(*batch, n_k, d_v), mask=mask,
                causal=kind == "causal", block_q=draw(st.integers(1, 13)), block_k=draw(st.integers(1, 13)))


def _full_mask(p: dict) -> torch.Tensor | None:
    """The mask attention() needs for problem p (the causal one written out)."""
    n_q, n_k = p["q"].shape[-2], p["k"].shape[-2]
    if p["causal"]:
        return causal_mask(n_q, n_k)
    return p["mask"]


def _naive_lse(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (..., n_q, n_k)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(s, -1)  # (..., n_q), -inf for an empty row


# ---- forward: the same output as attention(), SDPA and MultiHeadAttention ----------------------
@FAST
@given(problems())
def test_blockwise_equals_attention_and_sdpa(p: dict) -> None:
    r = blockwise_attention(p["q"], p["k"], p["v"], p["mask"], causal=p["causal"],
                            block_q=p["block_q"], block_k=p["block_k"])
    assert isinstance(r, BlockwiseResult)
    mask = _full_mask(p)
    ref, _ = attention(p["q"], p["k"], p["v"], mask=mask)
    _close(r.out, ref, p["q"], p["k"], p["v"], mask)
    sdpa = F.scaled_dot_product_attention(p["q"], p["k"], p["v"], attn_mask=mask)
    _close(r.out, sdpa, p["q"], p["k"], p["v"], mask)
    lse = _naive_lse(p["q"], p["k"], mask)
    _lse_close(r.lse, lse, p["q"], p["k"], mask)
    assert (r.out[~torch.isfinite(lse)] == 0).all()


@FAST
@given(st.integers(1, 4).map(lambda h: 4 * h), st.integers(1, 9), st.integers(1, 9), st.booleans(),
       st.integers(1, 10), st.integers(0, 2**16))
def test_blockwise_heads_equal_multihead_attention_with_the_same_weights(
        d_model: int, n: int, block: int, causal: bool, block_k: int, seed: int) -> None:
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_model, 4, dtype=F64)
    x = torch.randn(2, n, d_model, dtype=F64)  # (B, n, d_model)
    mask = causal_mask(n) if causal else None
    ref, _ = mha(x, x, x, mask=mask)
    with torch.no_grad():
        roles = ((mha.w_q, mha.b_q), (mha.w_k, mha.b_k), (mha.w_v, mha.b_v))
        # the layer's own projection call (F.linear), so the heads are the layer's, bit for bit
        heads = [torch.nn.functional.linear(x, w.T, b).view(2, n, 4, mha.d_k).transpose(1, 2) for w, b in roles]
        r = blockwise_attention(*heads, causal=causal, block_q=block, block_k=block_k)  # (B, h, n, d_k)
        _close(r.out, attention(*heads, mask=mask)[0], *heads, mask)  # per head
        out = r.out.transpose(1, 2).reshape(2, n, d_model) @ mha.w_o + mha.b_o  # (B, n, d_model)
    # the heads' bound carried through W^O, sized by |concat| |W^O| + |b^O| (not by the result)
    head_bound, _ = rounding_bound(*heads, mask)
    bound = output_projection_bound(head_bound, r.out, mha.w_o, mha.b_o)
    assert ((out - ref.detach()).abs() <= bound).all()


def test_single_query_and_its_mask_follow_attention() -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=g, dtype=F64) for s in ((5,), (9, 5), (9, 3)))
    mask = torch.tensor([True, False] * 4 + [True])
    r = blockwise_attention(q, k, v, mask, block_k=2)
    ref, _ = attention(q, k, v, mask)
    assert r.out.shape == (3,) and r.lse.shape == ()
    _close(r.out, ref, q[None], k, v, mask[None])
    assert r.skipped == 0 and r.computed == 5


# ---- a query with no allowed key: zero output, -inf lse, zero gradients ---------------------------
def test_a_query_with_no_allowed_key_reads_zero_with_zero_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 3, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(6, 3, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(6, 2, generator=g, dtype=F64, requires_grad=True)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1] = False  # query 1 may read nothing
    r = blockwise_attention(q, k, v, mask, block_q=2, block_k=4)
    assert (r.out[1] == 0).all() and r.lse[1] == float("-inf")
    ref, _ = attention(q, k, v, mask)
    assert torch.equal(r.out[1], ref[1])
    r.out[1].sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and (t.grad == 0).all()  # finite, and zero
    p1 = attend_block(q.detach(), k.detach(), v.detach(), mask)
    assert (p1.out[1] == 0).all() and p1.lse[1] == float("-inf")
    empty = Partial(torch.zeros(1, 2, dtype=F64), torch.full((1,), float("-inf"), dtype=F64))
    both = merge(empty, empty)
    assert (both.out == 0).all() and both.lse.item() == float("-inf")  # not NaN


# ---- the backward, from the saved log-sum-exp ---------------------------------------------------
@FAST
@given(problems(), st.sampled_from(BACKWARD_ORDERS))
def test_gradients_equal_autograd_through_the_naive_version(p: dict, order: str) -> None:
    q, k, v = (p[n].clone().requires_grad_() for n in ("q", "k", "v"))
    mask = _full_mask(p)
    g = torch.Generator().manual_seed(1)
    r = blockwise_attention(q, k, v, p["mask"], causal=p["causal"], block_q=p["block_q"], block_k=p["block_k"],
                            backward_order=order)
    d_out = torch.rand(r.out.shape, generator=g, dtype=F64) - 0.5
    d_lse = torch.rand(r.lse.shape, generator=g, dtype=F64) - 0.5
    fin = torch.isfinite(r.lse)
    loss = (r.out * d_out).sum() + (torch.where(fin, r.lse, 0) * d_lse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    ref, _ = attention(q, k, v, mask=mask)
    lse = _naive_lse(q, k, mask)
    loss_ref = (ref * d_out).sum() + (torch.where(torch.isfinite(lse), lse, 0) * d_lse).sum()
    refs = torch.autograd.grad(loss_ref, (q, k, v))
    for a, b, bound in zip(grads, refs, gradient_rounding_bound(q, k, v, d_out, mask, d_lse=d_lse)):
        assert ((a - b).abs() <= bound).all(), f"gap {(a - b).abs().max():.3g}"




def test_backward_saves_no_n_by_n_tensor() -> None:
    n, d = 64, 4
    q, k, v = (torch.randn(n, d, dtype=F64, requires_grad=True) for _ in range(3))
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        blockwise_attention(q, k, v, block_q=8, block_k=8).out.sum().backward()
    assert saved and all(math.prod(s) <= n * d for s in saved), saved  # q, k, v, out, lse
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        attention(q, k, v)[0].sum()
    assert (n, n) in saved  # the naive version keeps its weights for the backward


# ---- tiles: skipped, not computed ------------------------------------------------------------------
@pytest.mark.parametrize("n_q,n_k,bq,bk", [(8, 8, 2, 2), (5, 9, 2, 3), (16, 16, 4, 8), (7, 7, 7, 7), (3, 10, 4, 1)])
def test_causal_tiles_above_the_diagonal_are_skipped_not_computed(
        n_q: int, n_k: int, bq: int, bk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = bw._scores
    monkeypatch.setattr(bw, "_scores", lambda *a: calls.append(1) or real(*a))
    q, k, v = torch.randn(n_q, 3, dtype=F64), torch.randn(n_k, 3, dtype=F64), torch.randn(n_k, 2, dtype=F64)
    r = blockwise_attention(q, k, v, causal=True, block_q=bq, block_k=bk)
    assert (r.computed, r.skipped) == tile_counts(n_q, n_k, bq, bk, causal=True)
    assert len(calls) == r.computed  # a skipped tile's scores are never computed
    tq, tk = -(-n_q // bq), -(-n_k // bk)
    assert r.computed + r.skipped == tq * tk
    # brute force: a tile is skipped exactly when the causal mask allows nothing in it
    m = causal_mask(n_q, n_k)
    empty = sum(not m[i:i + bq, j:j + bk].any() for i in range(0, n_q, bq) for j in range(0, n_k, bk))
    assert r.skipped == empty
    _close(r.out, attention(q, k, v, mask=m)[0], q, k, v, m)


def test_tile_counts_arithmetic() -> None:
    assert tile_counts(8, 8, 2, 2) == (16, 0)
    assert tile_counts(8, 8, 2, 2, causal=True) == (10, 6)  # 4 * 5 / 2 on and below the diagonal
    n = 32_768
    computed, skipped = tile_counts(n, n, 256, 256, causal=True)
    assert computed == 128 * 129 // 2 and skipped == 128 * 127 // 2


def test_an_all_false_tile_of_a_general_mask_is_skipped() -> None:
    q, k, v = torch.randn(4, 3, dtype=F64), torch.randn(6, 3, dtype=F64), torch.randn(6, 2, dtype=F64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:2, 3:] = False  # the tile (queries 0-1, keys 3-5)
    r = blockwise_attention(q, k, v, mask, block_q=2, block_k=3)
    assert (r.computed, r.skipped) == (3, 1)
    _close(r.out, attention(q, k, v, mask)[0], q, k, v, mask)


# ---- the merge -------------------------------------------------------------------------------------
@FAST
@given(st.integers(1, 5), st.integers(2, 12), st.integers(0, 2**16), st.data())
def test_partials_merged_in_any_order_give_the_full_attention(n_q: int, n_k: int, seed: int, data: st.DataObject) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (4 * torch.rand(*s, generator=g, dtype=F64) - 2 for s in ((n_q, 3), (n_k, 3), (n_k, 2)))
    cuts = sorted(data.draw(st.sets(st.integers(1, n_k - 1), max_size=4)))
    bounds = [0, *cuts, n_k]
    parts = [attend_block(q, k[a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])]
    order = data.draw(st.permutations(range(len(parts))))
    total = parts[order[0]]
    for i in order[1:]:
        total = merge(total, parts[i])
    ref, _ = attention(q, k, v)
    _close(total.out, ref, q, k, v)
    _lse_close(total.lse, _naive_lse(q, k, None), q, k)


def test_merge_is_commutative_and_associative_to_rounding() -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 4, generator=g, dtype=F64), torch.randn(9, 4, generator=g, dtype=F64), torch.randn(9, 2, generator=g, dtype=F64)
    a, b, c = (attend_block(q, k[i:i + 3], v[i:i + 3]) for i in (0, 3, 6))
    for x, y in itertools.combinations([merge(a, b), merge(b, a)], 2):
        _close(x.out, y.out, q, k[:6], v[:6])
    _close(merge(merge(a, b), c).out, merge(a, merge(b, c)).out, q, k, v)


@FAST
@given(st.integers(1, 3), st.integers(1, 20), st.integers(1, 20), st.integers(0, 2**16))
def test_split_k_equals_attention(n_q: int, n_k: int, splits: int, seed: int) -> None:
    splits = min(splits, n_k)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g, dtype=F64) for s in ((2, n_q, 4), (2, n_k, 4), (2, n_k, 3)))
    mask = torch.rand(2, n_q, n_k, generator=g) < 0.6
    out, parts = split_k_attention(q, k, v, mask, num_splits=splits, block_k=3)
    assert len(parts) == splits
    _close(out, attention(q, k, v, mask)[0], q, k, v, mask)
    one, _ = split_k_attention(q[0, 0], k[0], v[0], num_splits=splits)  # a single query
    assert one.shape == (3,)
    _close(one, attention(q[0, 0], k[0], v[0])[0], q[0, :1], k[0], v[0])


def test_float32_against_a_float64_reference() -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(*s, generator=g, dtype=F64) for s in ((2, 50, 16), (2, 70, 16), (2, 70, 8)))
    q, k, v = q.float().double(), k.float().double(), v.float().double()  # float32 inputs, exactly
    r = blockwise_attention(q.float(), k.float(), v.float(), block_q=16, block_k=16)
    _close(r.out, attention(q, k, v)[0], q.float(), k.float(), v.float())  # float32's eps


def test_float32_underflow_is_inside_the_bound() -> None:
    """Key 0 scores 0, the others -104: their weights e^-104 = 6.8e-46 are below float32's smallest
    subnormal, so every float32 evaluation returns 0 where the exact output is 6.8e-46. Only the
    bound's absolute (underflow) term covers that: the relative part is 1e-50."""
    n, d = 1024, 64
    q = torch.zeros(1, d)
    q[0, 0] = 1.0
    k = torch.zeros(n, d)
    k[1:, 0] = -104.0 * math.sqrt(d)  # scores 0, -104, ..., -104
    v = torch.zeros(n, d)
    v[1, 0] = 1.0  # column 0 reads key 1 only
    exact = attention(q.double(), k.double(), v.double())[0]
    assert 6e-46 < exact[0, 0] < 7e-46
    for out in (attention(q, k, v)[0], blockwise_attention(q, k, v, block_q=1, block_k=100).out,
                F.scaled_dot_product_attention(q[None, None], k[None, None], v[None, None])[0, 0]):
        assert out[0, 0] == 0  # underflow: 0 in float32
        _close(out, exact, q, k, v)


@pytest.mark.parametrize(("dtype", "v_scale"), [(torch.float16, 1.0), (torch.bfloat16, 1.0), (torch.float16, 1e-6)])
def test_half_inputs_accumulate_in_float32_within_the_derived_bound(dtype: torch.dtype, v_scale: float) -> None:
    """Half-precision inputs are computed in float32 and rounded once, at the end: within
    u_half |exact| + one float32 evaluation's bound (half of rounding_bound's) of float64.
    ``v_scale=1e-6``: values, and so outputs, subnormal in float16, where rounding errs by half
    the subnormals' spacing (tau u) rather than u |o|; D reads those outputs (a cold reader's
    break: without D's tau u sum|dO| term, dQ was 3.35 times the bound and dK 2.88 times)."""
    g = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(*s, generator=g).to(dtype) for s in ((70, 16), (90, 16), (90, 16), (70, 16)))
    v = (v.double() * v_scale).to(dtype)
    r = blockwise_attention(q, k, v, block_q=16, block_k=24)
    assert r.out.dtype == dtype and r.lse.dtype == torch.float32
    u = torch.finfo(dtype).eps / 2
    tiny = torch.finfo(dtype).tiny * u  # below the smallest normal, rounding errs by half the subnormals' spacing
    q64, k64, v64 = (t.double() for t in (q, k, v))
    exact = attention(q64, k64, v64)[0]
    one32, grad_bounds = half_tile_bounds(q, k, v, do, r.out)
    assert ((r.out.double() - exact).abs() <= one32 + u * (exact.abs() + one32) + tiny).all()
    for order in BACKWARD_ORDERS:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        grads = torch.autograd.grad((blockwise_attention(*leaves, block_q=16, block_k=24, backward_order=order).out
                                     * do).sum(), leaves)
        assert all(gr.dtype == dtype for gr in grads)
        refs64 = [t.clone().requires_grad_() for t in (q64, k64, v64)]
        exact_g = torch.autograd.grad((attention(*refs64)[0] * do.double()).sum(), refs64)
        for a, e, one in zip(grads, exact_g, grad_bounds):
            assert ((a.double() - e).abs() <= one + u * (e.abs() + one) + tiny).all()


@pytest.mark.parametrize(("dtype", "causal"), [(F64, False), (torch.float32, True), (torch.bfloat16, False)])
def test_both_backward_orders_give_the_same_gradients_bit_for_bit(dtype: torch.dtype, causal: bool) -> None:
    """Each gradient receives its tile terms in the same order in both loops (dK_j, dV_j over the
    query tiles ascending, dQ_i over the key tiles ascending): the same numbers, not just close."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, n, d, generator=g, dtype=F64).to(dtype) for n, d in ((70, 8), (101, 8), (101, 5)))
    do = torch.randn(2, 70, 5, generator=g, dtype=F64).to(dtype)
    mask = None if causal else torch.rand(70, 101, generator=g) < 0.6
    grads = []
    for order in BACKWARD_ORDERS:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = blockwise_attention(*leaves, mask, causal=causal, block_q=16, block_k=24, backward_order=order).out
        grads.append(torch.autograd.grad((out * do).sum(), leaves))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_backward_order_is_checked() -> None:
    with pytest.raises(ValueError, match=r"backward_order must be one of \('kv_outer', 'q_outer'\), got 'k_outer'"):
        blockwise_attention(Q, K, V, backward_order="k_outer")
    with pytest.raises(TypeError, match="backward_order must be a str, got int"):
        blockwise_attention(Q, K, V, backward_order=1)  # type: ignore[arg-type]


# ---- memory -----------------------------------------------------------------------------------------
def test_intermediate_bytes() -> None:
    q, k, v = torch.randn(10, 4), torch.randn(12, 4), torch.randn(12, 3)
    _, w = attention(q, k, v)
    assert intermediate_bytes(10, 12, 3) == 2 * w.nbytes  # scores and weights, float32
    # blockwise: one tile (4, 5), acc and P V (4, 3) each, five (4,) vectors, lse (10,)
    assert intermediate_bytes(10, 12, 3, block_q=4, block_k=5) == 4 * (20 + 2 * 12 + 5 * 4 + 10)
    assert intermediate_bytes(10, 12, 3, block_q=64, block_k=64, dtype=torch.float64) == 8 * (120 + 2 * 30 + 50 + 10)
    assert intermediate_bytes(10, 12, 3, batch=3) == 3 * intermediate_bytes(10, 12, 3)
    # bfloat16: float32 numbers, and the float32 copies of the query tile (4, 4) and value tile (5, 3)
    assert intermediate_bytes(10, 12, 3, block_q=4, block_k=5, dtype=torch.bfloat16, d_k=4) == \
        4 * (20 + 2 * 12 + 5 * 4 + 10 + 16 + 15)


# ---- errors: each path --------------------------------------------------------------------------------
Q, K, V = torch.randn(4, 3), torch.randn(6, 3), torch.randn(6, 2)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(block_q=0), ValueError, "block_q must be a positive int, got 0"),
    (dict(block_k=-2), ValueError, "block_k must be a positive int, got -2"),
    (dict(block_q=True), TypeError, "block_q must be a positive int, got bool"),
    (dict(block_k=2.0), TypeError, "block_k must be a positive int, got float"),
    (dict(causal=1), TypeError, "causal must be a bool, got int"),
    (dict(scale=-1.0), ValueError, "scale must be a finite number >= 0"),
    (dict(scale="big"), TypeError, "scale must be a real number"),
    (dict(mask=torch.ones(4, 6)), ValueError, "mask must have dtype torch.bool"),
    (dict(mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, r"mask of shape \(5, 6\) does not broadcast"),
])
def test_blockwise_attention_refuses_bad_arguments(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        blockwise_attention(Q, K, V, **kwargs)


def test_blockwise_attention_refuses_bad_tensors() -> None:
    with pytest.raises(ValueError, match=r"q and k must have the same width d_k: q has shape \(4, 3\)"):
        blockwise_attention(Q, K[:, :2], V)
    with pytest.raises(ValueError, match=r"k and v must have the same number of rows"):
        blockwise_attention(Q, K, V[:5])
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        blockwise_attention(Q, [[1.0]], V)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"causal attention needs n_k >= n_q .* q has shape \(4, 3\), k has shape \(2, 3\)"):
        blockwise_attention(Q, K[:2], V[:2], causal=True)


def test_attend_block_and_merge_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match=r"q must have shape \(\.\.\., n_q, d_k\), got \(3,\)"):
        attend_block(Q[0], K, V)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        attend_block(None, K, V)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"q must have shape \(\.\.\., n_q, d_k\), got \(3,\)"):
        rounding_bound(Q[0], K, V)
    with pytest.raises(ValueError, match=r"q must have shape \(\.\.\., n_q, d_k\), got \(3,\)"):
        gradient_rounding_bound(Q[0], K, V, torch.ones(2))
    with pytest.raises(ValueError, match=r"d_out must have the output's shape \(4, 2\), got \(4, 3\)"):
        gradient_rounding_bound(Q, K, V, torch.ones(4, 3))
    with pytest.raises(ValueError, match=r"mask of shape \(3, 6\) does not broadcast"):
        attend_block(Q, K, V, torch.ones(3, 6, dtype=torch.bool))
    p = attend_block(Q, K, V)
    with pytest.raises(TypeError, match="b must be an attnlib.blockwise.Partial, got tuple"):
        merge(p, (p.out, p.lse))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"a.lse must have shape \(4,\) .* got \(3,\)"):
        merge(Partial(p.out, p.lse[:3]), p)
    with pytest.raises(ValueError, match=r"a.out and b.out must have one shape, got \(4, 2\) and \(3, 2\)"):
        merge(p, Partial(p.out[:3], p.lse[:3]))


def test_split_k_tile_counts_and_bytes_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="num_splits must be at most n_k = 6"):
        split_k_attention(Q, K, V, num_splits=7)
    with pytest.raises(ValueError, match="num_splits must be a positive int, got 0"):
        split_k_attention(Q, K, V, num_splits=0)
    with pytest.raises(ValueError, match="block_k must be a positive int, got 0"):
        tile_counts(4, 4, 2, 0)
    with pytest.raises(ValueError, match="give both block_q and block_k"):
        intermediate_bytes(4, 4, 2, block_q=2)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        intermediate_bytes(4, 4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="n_q must be a positive int, got 0"):
        intermediate_bytes(0, 4, 2)
