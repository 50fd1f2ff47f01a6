"""Paths that only unit tests guard, checked by their values against a reference written
apart, one head (and one sequence) at a time.

Planting bugs showed five paths where strict nbval misses a bug and only a unit test can
catch it: the mask's order in the fused (``need_weights=False``) grouped path and in the
absorbed MLA path, ALiBi's fused-path mask, :func:`attnlib.blockwise.tile_counts` and the
sign convention of singular vectors. Each test below compares values, with masks that differ
per sequence, per head and per query (so a mask handed to the wrong head, sequence or row
changes an output), and each was seen to fail with its bug planted.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlib import LatentAttention, masked_softmax
from attnlib.blockwise import blockwise_attention, tile_counts
from attnlib.decoding import AlibiAttention, DecoderAttention, alibi_bias, apply_rope
from attnlib.lowrank import FactoredMatrix, fix_signs
from strategies import TOL, examples

F64 = torch.float64


def _mask(B: int, h: int, n_q: int, n_k: int, seed: int) -> torch.Tensor:
    """(B, h, n_q, n_k): random, different for every sequence, head and query, each row with
    at least one allowed key."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, h, n_q, n_k, generator=g) < 0.5
    keep = torch.randint(0, n_k, (B, h, n_q, 1), generator=g)
    return m.scatter(-1, keep, True)


def _softmax_rows(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """One row of weights at a time, from the definition (no masked_softmax)."""
    e = torch.where(allowed, (scores - scores[allowed].max()).exp(), torch.zeros_like(scores))
    return e / e.sum(-1, keepdim=True)


# ---- the fused grouped path: head i reads group i // (h/g), with its own mask -----------------


@pytest.mark.parametrize("h, g", [(4, 2), (6, 3), (6, 1)])
def test_fused_grouped_path_masks_each_head_with_its_own_mask(h: int, g: int) -> None:
    torch.manual_seed(h + g)
    d_k, B, n = 3, 2, 5
    layer = DecoderAttention(h * d_k, h, num_kv_heads=g, dtype=F64)
    x = torch.randn(B, n, h * d_k, dtype=F64)
    mask = _mask(B, h, n, n, seed=h * g)
    with torch.no_grad():
        fused, none = layer(x, x, x, mask=mask, need_weights=False)
        q = (x @ layer.w_q + layer.b_q).view(B, n, h, d_k)
        k = (x @ layer.w_k + layer.b_k).view(B, n, g, d_k)
        v = (x @ layer.w_v + layer.b_v).view(B, n, g, d_k)
    assert none is None
    heads = torch.zeros(B, n, h, d_k, dtype=F64)
    for b in range(B):
        for i in range(h):
            kv = i // (h // g)  # the group head i belongs to
            w = _softmax_rows(q[b, :, i] @ k[b, :, kv].T / math.sqrt(d_k), mask[b, i])  # (n, n)
            heads[b, :, i] = w @ v[b, :, kv]
    want = heads.reshape(B, n, h * d_k) @ layer.w_o.detach() + layer.b_o.detach()
    torch.testing.assert_close(fused, want, **TOL)


# ---- absorbed MLA: the h*t stacked rows each keep their head's and query's mask ---------------


@pytest.mark.parametrize("need_weights", [False, True])
def test_absorbed_mla_masks_each_head_and_query_with_its_own_mask(need_weights: bool) -> None:
    torch.manual_seed(1)
    B, t, h, d_k, d_c, d_r = 2, 5, 3, 4, 6, 2
    mla = LatentAttention(h * 4, h, d_c=d_c, d_r=d_r, dtype=F64)
    x = torch.randn(B, t, h * 4, dtype=F64)
    mask = _mask(B, h, t, t, seed=2)
    with torch.no_grad():
        out, _ = mla(x, mask=mask, absorb=True, need_weights=need_weights)
        pos = torch.arange(t)
        c, k_r = x @ mla.w_dkv, apply_rope(x @ mla.w_kr, pos, mla.rope_base)  # (B, t, d_c), (B, t, d_r)
        q_c = (x @ mla.w_q).view(B, t, h, d_k)
        q_r = apply_rope((x @ mla.w_qr).view(B, t, h, d_r).transpose(1, 2), pos, mla.rope_base)  # (B, h, t, d_r)
        w_uk, w_uv = mla.w_uk.view(d_c, h, d_k), mla.w_uv.view(d_c, h, mla.d_v)
        heads = torch.zeros(B, t, h, mla.d_v, dtype=F64)
        for b in range(B):
            for i in range(h):  # DeepSeek-V2's equations, one head and one sequence at a time
                k_c = c[b] @ w_uk[:, i]  # (t, d_k)
                scores = (q_c[b, :, i] @ k_c.T + q_r[b, i] @ k_r[b].T) / math.sqrt(d_k + d_r)
                heads[b, :, i] = _softmax_rows(scores, mask[b, i]) @ (c[b] @ w_uv[:, i])
        want = heads.reshape(B, t, -1) @ mla.w_o
    torch.testing.assert_close(out, want, **TOL)


# ---- ALiBi's fused path: the bias and the mask, per head ---------------------------------------


def test_alibi_fused_path_applies_each_heads_mask_and_bias() -> None:
    torch.manual_seed(2)
    B, n, h, d_k = 2, 6, 3, 4
    layer = AlibiAttention(h * d_k, h, dtype=F64)
    x = torch.randn(B, n, h * d_k, dtype=F64)
    mask = _mask(B, h, n, n, seed=3)  # not causal: the bias's sign for later keys counts too
    with torch.no_grad():
        fused, _ = layer(x, x, x, mask=mask, need_weights=False)
        explicit, weights = layer(x, x, x, mask=mask)
        q = (x @ layer.w_q + layer.b_q).view(B, n, h, d_k)
        k = (x @ layer.w_k + layer.b_k).view(B, n, h, d_k)
        v = (x @ layer.w_v + layer.b_v).view(B, n, h, d_k)
    bias = alibi_bias(h, n)  # (h, n, n)
    heads = torch.zeros(B, n, h, d_k, dtype=F64)
    for b in range(B):
        for i in range(h):
            w = _softmax_rows(q[b, :, i] @ k[b, :, i].T / math.sqrt(d_k) + bias[i], mask[b, i])
            torch.testing.assert_close(weights[b, i], w, **TOL)
            heads[b, :, i] = w @ v[b, :, i]
    want = heads.reshape(B, n, -1) @ layer.w_o.detach() + layer.b_o.detach()
    torch.testing.assert_close(fused, want, **TOL)
    torch.testing.assert_close(explicit, want, **TOL)


# ---- tile_counts: the causal rule, tile by tile ------------------------------------------------


def _tiles_by_hand(n_q: int, n_k: int, bq: int, bk: int) -> tuple[int, int]:
    """Count the tiles holding at least one allowed (query, key) pair: query a sits at
    position n_k - n_q + a and may read keys 0..that position."""
    computed = skipped = 0
    for i0 in range(0, n_q, bq):
        for j0 in range(0, n_k, bk):
            allowed = any(j <= n_k - n_q + a for a in range(i0, min(i0 + bq, n_q))
                          for j in range(j0, min(j0 + bk, n_k)))
            computed += allowed
            skipped += not allowed
    return computed, skipped


@given(n_q=st.integers(1, 20), extra=st.integers(0, 12), bq=st.integers(1, 9), bk=st.integers(1, 9))
@examples(40)
def test_tile_counts_match_the_causal_rule_tile_by_tile(n_q: int, extra: int, bq: int, bk: int) -> None:
    n_k = n_q + extra
    assert tile_counts(n_q, n_k, bq, bk, causal=True) == _tiles_by_hand(n_q, n_k, bq, bk)
    tq, tk = -(-n_q // bq), -(-n_k // bk)
    assert tile_counts(n_q, n_k, bq, bk) == (tq * tk, 0)


def test_tile_counts_are_what_blockwise_attention_computes() -> None:
    g = torch.Generator().manual_seed(0)
    for n_q, n_k, bq, bk in ((7, 7, 2, 3), (5, 11, 4, 2), (9, 9, 3, 3), (1, 6, 1, 4)):
        q, k = torch.randn(n_q, 4, generator=g, dtype=F64), torch.randn(n_k, 4, generator=g, dtype=F64)
        r = blockwise_attention(q, k, k, causal=True, block_q=bq, block_k=bk)
        assert (r.computed, r.skipped) == tile_counts(n_q, n_k, bq, bk, causal=True) == _tiles_by_hand(n_q, n_k, bq, bk)


# ---- singular vectors: the entry of largest magnitude of each column of U is positive --------


def test_fix_signs_values_on_a_hand_made_pair() -> None:
    u = torch.tensor([[0.1, 0.6, 0.0], [-0.9, -0.6, 0.0], [0.3, 0.2, 0.0]], dtype=F64)  # (m=3, k=3)
    vh = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=F64)  # (k=3, n=2)
    fu, fvh = fix_signs(u, vh)
    # column 0: largest |entry| is -0.9, flipped; column 1: a tie of 0.6 and -0.6, the first
    # one decides (kept); column 2: all zero, kept
    want_u = torch.tensor([[-0.1, 0.6, 0.0], [0.9, -0.6, 0.0], [-0.3, 0.2, 0.0]], dtype=F64)
    want_vh = torch.tensor([[-1.0, -2.0], [3.0, 4.0], [5.0, 6.0]], dtype=F64)
    assert torch.equal(fu, want_u) and torch.equal(fvh, want_vh)
    assert torch.equal(fu @ fvh, u @ vh)
    # batched, each matrix on its own: -u gets the same nonzero columns back (its zero column
    # and the matching row of vh keep their sign)
    bu, bvh = fix_signs(torch.stack([u, -u]), torch.stack([vh, -vh]))
    assert torch.equal(bu, torch.stack([want_u, want_u]))
    assert torch.equal(bvh[0], want_vh)
    assert torch.equal(bvh[1], torch.cat([want_vh[:2], -want_vh[2:]]))


def test_factored_svd_signs_follow_the_rule_whatever_lapack_returns() -> None:
    g = torch.Generator().manual_seed(4)
    fm = FactoredMatrix(torch.randn(6, 3, generator=g, dtype=F64), torch.randn(3, 5, generator=g, dtype=F64))
    u, s, vh = fm.svd()
    top = u.abs().argmax(0)  # (k,): the row of each column's largest entry
    assert (u[top, torch.arange(u.shape[1])] > 0).all()
    torch.testing.assert_close(u @ torch.diag(s) @ vh, fm.full(), **TOL)
    flipped = FactoredMatrix(-fm.left, -fm.right)  # the same matrix, factors of the other sign
    fu, fs, fvh = flipped.svd()
    torch.testing.assert_close(fu, u, **TOL)
    torch.testing.assert_close(fvh, vh, **TOL)
