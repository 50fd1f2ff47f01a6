"""attnlib.decoding: RoPE, the caches and multi-head latent attention.

RoPE is checked against Hugging Face's own Llama functions (``rotate_half``,
``apply_rotary_pos_emb``, ``LlamaRotaryEmbedding``) and for its defining property:
the scores depend on the offset only. MLA is checked against a literal, head-by-head
reading of DeepSeek-V2's equations (every path: naive, absorbed, fused, cached), two ways
against itself (naive == absorbed) and against decoding with its cache. Every error path has a test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlib import LatentAttention, LatentCache, assert_rounding_close
from attnlib.decoding import (
    KVCache,
    apply_rope,
    causal_mask,
    kv_cache_bytes_per_token,
    latent_cache_bytes_per_token,
    rope_angles,
    rope_inv_freq,
    rope_rotation,
    rotate_half,
)
from strategies import DTYPE, SETTINGS, TOL


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---- RoPE ------------------------------------------------------------------------------------


def test_inv_freq_formula() -> None:
    f = rope_inv_freq(8, 10000.0)
    expected = torch.tensor([10000.0 ** (-2 * j / 8) for j in range(4)], dtype=DTYPE)
    torch.testing.assert_close(f, expected, atol=0, rtol=1e-15)
    assert f[0] == 1.0
    assert rope_angles(torch.tensor([0, 1, 2]), 8).shape == (3, 4)


def test_rope_matches_hugging_face_llama() -> None:
    transformers_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    d_k, h, n, base = 8, 2, 7, 500.0
    config = LlamaConfig(hidden_size=d_k * h, num_attention_heads=h, rope_theta=base)
    rotary = transformers_llama.LlamaRotaryEmbedding(config)
    torch.testing.assert_close(rotary.inv_freq.double(), rope_inv_freq(d_k, base), atol=0, rtol=1e-6)
    x = _randn(2, h, n, d_k, dtype=torch.float32)
    positions = torch.arange(3, 3 + n)[None]  # (1, n)
    cos, sin = rotary(x, positions)  # (1, n, d_k)
    theirs, _ = transformers_llama.apply_rotary_pos_emb(x, x, cos, sin)
    ours = apply_rope(x, positions[0], base)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rotate_half(x), transformers_llama.rotate_half(x), atol=0, rtol=0)


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 50), st.integers(0, 2**31 - 1))
def test_rope_scores_depend_on_the_offset_only(half: int, n: int, shift: int, seed: int) -> None:
    d_k = 2 * half
    q, k = _randn(2, n, d_k, seed=seed), _randn(2, n, d_k, seed=seed + 1)
    pos = torch.arange(n)
    scores = apply_rope(q, pos) @ apply_rope(k, pos).transpose(-2, -1)  # (2, n, n)
    shifted = apply_rope(q, pos + shift) @ apply_rope(k, pos + shift).transpose(-2, -1)
    torch.testing.assert_close(shifted, scores, atol=1e-9, rtol=1e-9)


@SETTINGS
@given(st.integers(1, 4), st.integers(-20, 20), st.integers(-20, 20))
def test_rope_is_multiplication_by_an_orthogonal_matrix(half: int, p: int, s: int) -> None:
    d_k = 2 * half
    x = _randn(3, d_k, seed=p + 100)
    r_p, r_s = rope_rotation(p, d_k), rope_rotation(s, d_k)
    torch.testing.assert_close(apply_rope(x, torch.full((3,), p)), x @ r_p, **TOL)
    torch.testing.assert_close(r_p @ r_p.T, torch.eye(d_k, dtype=DTYPE), **TOL)
    torch.testing.assert_close(r_p @ r_s.T, rope_rotation(p - s, d_k), **TOL)
    torch.testing.assert_close(rope_rotation(0, d_k), torch.eye(d_k, dtype=DTYPE), atol=0, rtol=0)


def test_rope_keeps_dtype_and_default_positions() -> None:
    x = _randn(4, 6, dtype=torch.float32)
    y = apply_rope(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y[0], x[0], atol=0, rtol=0)  # position 0 turns nothing
    # the default positions are 0..n-1: row p is x_p R_p, with R_p built apart (float64, rope_rotation);
    # float32 rounds cos and sin once each and the pair's two products and their sum: eps32 x (2 + 2)
    expected = torch.stack([x[p].double() @ rope_rotation(p, 6) for p in range(4)])  # (4, 6)
    assert_rounding_close(y, expected, 2, 2, dtype=torch.float32)
    with pytest.raises(AssertionError, match="more than rounding allows"):  # positions 1..n would not pass
        assert_rounding_close(apply_rope(x, torch.arange(1, 5)), expected, 2, 2, dtype=torch.float32)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # rotations keep lengths
    assert rope_rotation(1, 4, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: rope_inv_freq(5), ValueError, r"^d_k must be even, got 5: RoPE pairs dimension l with l \+ d_k/2$"),
        (lambda: rope_inv_freq(0), ValueError, "d_k must be a positive int"),
        (lambda: rope_inv_freq(True), TypeError, "d_k must be a positive int, got bool True"),
        (lambda: rope_inv_freq(4, base=1.0), ValueError, "base"),
        (lambda: rope_inv_freq(4, base="10"), TypeError, "base"),
        (lambda: rope_angles([0, 1], 4), TypeError, "positions must be a torch.Tensor"),
        (lambda: rope_angles(torch.tensor([True]), 4), ValueError, "positions must be integer or real"),
        (lambda: apply_rope([[1.0, 2.0]]), TypeError, "x must be a torch.Tensor"),
        (lambda: apply_rope(torch.ones(4)), ValueError, r"x must be a floating-point tensor of shape \(\.\.\., n, d_k\)"),
        (lambda: apply_rope(torch.ones(2, 4, dtype=torch.long)), ValueError, "floating-point"),
        (lambda: apply_rope(torch.ones(2, 3)), ValueError,
         r"^d_k \(the last dimension of x\) must be even, got 3: RoPE pairs dimension l with l \+ d_k/2$"),
        (lambda: apply_rope(torch.ones(2, 4), torch.arange(3)), ValueError, r"positions of shape \(3,\)"),
        (lambda: apply_rope(torch.ones(2, 4), [0, 1]), TypeError, "positions must be a torch.Tensor or None"),
        (lambda: rope_rotation(True, 4), TypeError, "position must be an int or float"),
        (lambda: causal_mask(0), ValueError, "n_q must be a positive int"),
        (lambda: causal_mask(3, 2), ValueError, r"n_k \(2\) must be >= n_q \(3\)"),
        (lambda: kv_cache_bytes_per_token(0, 4), ValueError, "num_kv_heads"),
        (lambda: kv_cache_bytes_per_token(1, 4, dtype="float32"), TypeError, "dtype must be a torch.dtype"),
        (lambda: latent_cache_bytes_per_token(4, -2), ValueError, "d_r must be a non-negative int"),
    ],
)
def test_rope_and_helper_errors(call: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()  # type: ignore[operator]


def test_causal_mask_for_new_queries_after_a_cache() -> None:
    torch.testing.assert_close(causal_mask(4), torch.ones(4, 4, dtype=torch.bool).tril(), atol=0, rtol=0)
    m = causal_mask(2, 5)  # queries at positions 3 and 4
    assert m.tolist() == [[True] * 4 + [False], [True] * 5]
    torch.testing.assert_close(causal_mask(3, 7), torch.ones(7, 7, dtype=torch.bool).tril()[4:], atol=0, rtol=0)


def test_bytes_per_token_formulas() -> None:
    assert kv_cache_bytes_per_token(32, 128, dtype=torch.float16) == 2 * 32 * 128 * 2  # Llama-2 7B, one layer
    assert kv_cache_bytes_per_token(8, 128, dtype=torch.bfloat16) == 4096  # Llama-3 8B (GQA)
    assert kv_cache_bytes_per_token(2, 4, d_v=6) == 2 * 10 * 4
    assert latent_cache_bytes_per_token(512, 64, dtype=torch.bfloat16) == 1152  # DeepSeek-V2
    assert latent_cache_bytes_per_token(8, 0, dtype=torch.float64) == 64


# ---- MLA -------------------------------------------------------------------------------------


def _mla(seed: int, d_model: int = 12, h: int = 3, d_c: int = 5, d_r: int = 4, **kw: int) -> LatentAttention:
    torch.manual_seed(seed)
    return LatentAttention(d_model, h, d_c, d_r, dtype=DTYPE, **kw)  # type: ignore[arg-type]


@st.composite
def mla_cases(draw: st.DrawFn) -> tuple[LatentAttention, torch.Tensor]:
    h = draw(st.integers(1, 3))
    d_k = draw(st.integers(1, 4))
    d_v = draw(st.integers(1, 4))
    d_c = draw(st.integers(1, 6))
    d_r = 2 * draw(st.integers(0, 2))
    d_model = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    torch.manual_seed(seed)
    mla = LatentAttention(d_model, h, d_c, d_r, d_k=d_k, d_v=d_v, dtype=DTYPE)
    x = _randn(draw(st.integers(1, 2)), draw(st.integers(1, 6)), d_model, seed=seed)
    return mla, x


@SETTINGS
@given(mla_cases(), st.sampled_from(["none", "causal", "per_head"]))
def test_mla_absorbed_equals_naive(case: tuple[LatentAttention, torch.Tensor], kind: str) -> None:
    mla, x = case
    B, t, _ = x.shape
    mask = None if kind == "none" else causal_mask(t)
    if kind == "per_head":  # (B, h, t, t), each row keeps its first key
        mask = torch.rand(B, mla.num_heads, t, t, generator=torch.Generator().manual_seed(t)) < 0.5
        mask[..., 0] = True
    out_n, w_n = mla(x, mask=mask)
    out_a, w_a = mla(x, mask=mask, absorb=True)
    assert out_n.shape == x.shape and w_n is not None and w_n.shape == (x.shape[0], mla.num_heads, x.shape[1], x.shape[1])
    torch.testing.assert_close(out_a, out_n, **TOL)
    torch.testing.assert_close(w_a, w_n, **TOL)
    for absorb in (False, True):  # the fused path (SDPA) computes the same
        out_f, w_f = mla(x, mask=mask, need_weights=False, absorb=absorb)
        assert w_f is None
        torch.testing.assert_close(out_f, out_n, **TOL)


@SETTINGS
@given(mla_cases(), st.integers(1, 5), st.booleans())
def test_mla_cached_decoding_equals_the_causal_pass(
    case: tuple[LatentAttention, torch.Tensor], prefill: int, absorb: bool
) -> None:
    mla, x = case
    B, n, _ = x.shape
    prefill = min(prefill, n)
    full, w_full = mla(x, mask=causal_mask(n))
    cache = LatentCache()
    outs = [mla(x[:, :prefill], cache=cache, absorb=absorb)[0]]
    for t in range(prefill, n):
        out, w = mla(x[:, t : t + 1], cache=cache, absorb=not absorb)  # mix the two ways
        assert w is not None and w.shape == (B, mla.num_heads, 1, t + 1)
        torch.testing.assert_close(w, w_full[:, :, t : t + 1, : t + 1], **TOL)  # type: ignore[index]
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL)
    assert len(cache) == n
    assert cache.nbytes == B * n * (mla.d_c + mla.d_r) * 8 == B * n * mla.cache_bytes_per_token()
    assert cache.latents is not None and cache.latents.shape == (B, n, mla.d_c)
    assert cache.rope_keys is not None and cache.rope_keys.shape == (B, n, mla.d_r)


@pytest.mark.parametrize("absorb", [False, True])
def test_mla_fused_cached_decoding_equals_the_causal_pass(absorb: bool) -> None:
    mla = _mla(4)
    x = _randn(2, 6, 12, seed=7)
    full, _ = mla(x, mask=causal_mask(6))
    cache = LatentCache()
    outs = [mla(x[:, :2], need_weights=False, cache=cache, absorb=absorb)[0]]
    outs += [mla(x[:, t : t + 1], need_weights=False, cache=cache, absorb=absorb)[0] for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL)


def test_mla_absorbed_matrices_are_the_products() -> None:
    mla = _mla(0)
    h, d_k, d_c = 3, 4, 5
    for i in range(h):
        w_q_i = mla.w_q[:, i * d_k : (i + 1) * d_k]  # (d_model, d_k)
        w_uk_i = mla.w_uk[:, i * d_k : (i + 1) * d_k]  # (d_c, d_k)
        torch.testing.assert_close(mla.w_q_absorbed[i], w_q_i @ w_uk_i.T, **TOL)
        w_uv_i = mla.w_uv[:, i * d_k : (i + 1) * d_k]  # (d_c, d_v)
        torch.testing.assert_close(mla.w_o_absorbed[i], w_uv_i @ mla.w_o[i * d_k : (i + 1) * d_k], **TOL)
    assert mla.w_q_absorbed.shape == (h, 12, d_c) and mla.w_o_absorbed.shape == (h, d_c, 12)


# ---- MLA against DeepSeek-V2's equations, head by head --------------------------------------
#
# DeepSeek-AI (2024), "DeepSeek-V2", arXiv:2405.04434, section 2.1, written with column
# vectors (W h); attnlib stores every weight (d_in, d_out) and computes h @ W, so the
# paper's W x reads x @ W below. With h_t the input of token t:
#   c^KV_t = W^DKV h_t,  k^C_t = W^UK c^KV_t,  v^C_t = W^UV c^KV_t,  k^R_t = RoPE(W^KR h_t)
#   c^Q_t = W^DQ h_t,    q^C_t = W^UQ c^Q_t,   q^R_t = RoPE(W^QR c^Q_t)
#   q_{t,i} = [q^C_{t,i}; q^R_{t,i}],  k_{j,i} = [k^C_{j,i}; k^R_j]  (k^R shared by all heads)
#   o_{t,i} = sum_j softmax_j(q_{t,i} . k_{j,i} / sqrt(d_h + d_h^R)) v^C_{j,i}
#   u_t = W^O [o_{t,1}; ...; o_{t,n_h}]
# LatentAttention leaves out the queries' low-rank compression: c^Q_t = h_t (W^DQ = I),
# so W^UQ is its w_q and W^QR its w_qr. The other names: W^DKV = w_dkv, W^UK = w_uk,
# W^UV = w_uv, W^KR = w_kr, W^O = w_o; d_h = d_k, d_h^R = d_r, n_h = num_heads; head i
# owns columns i*d_h:(i+1)*d_h of W^UQ and W^UK (i*d_h^R:.. of W^QR, i*d_v:.. of W^UV) and
# rows i*d_v:(i+1)*d_v of W^O. RoPE turns the pairs (x_m, x_{m+d/2}) (the rotate-half
# pairing of attnlib and of Hugging Face's DeepSeek-V2 port) by p * base^(-2m/d).


def _rope_one(x: torch.Tensor, p: int, base: float) -> torch.Tensor:
    """RoPE of one vector x (d,) at position p, one 2-D rotation per pair."""
    d = x.shape[0]
    out = x.clone()
    for m in range(d // 2):
        angle = p * base ** (-2 * m / d)
        a, b = x[m], x[m + d // 2]
        out[m] = a * math.cos(angle) - b * math.sin(angle)
        out[m + d // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def deepseek_v2_mla(
    mla: LatentAttention, x: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The equations above, one token, head and key at a time, from ``mla``'s weights.

    x: (B, t, d_model), positions 0..t-1; mask: bool, True = may attend, broadcast to
    (B, h, t, t). Returns u (B, t, d_model) and the softmax weights (B, h, t, t)."""
    B, t, _ = x.shape
    n_h, d_h, d_hr, d_v = mla.num_heads, mla.d_k, mla.d_r, mla.d_v
    allowed = torch.ones(B, n_h, t, t, dtype=torch.bool) if mask is None else mask.expand(B, n_h, t, t)
    w_dq = torch.eye(mla.d_model, dtype=x.dtype)  # no query compression in LatentAttention
    u = torch.zeros(B, t, mla.d_model, dtype=x.dtype)
    weights = torch.zeros(B, n_h, t, t, dtype=x.dtype)
    for b in range(B):
        h = x[b]  # (t, d_model): h_1..h_t as rows
        c_kv = [h[j] @ mla.w_dkv for j in range(t)]  # c^KV_j (d_c,)
        k_r = [_rope_one(h[j] @ mla.w_kr, j, mla.rope_base) for j in range(t)]  # k^R_j (d_h^R,)
        for s in range(t):  # the query token
            c_q = h[s] @ w_dq  # c^Q_s (d_model,)
            o = []
            for i in range(n_h):
                cols, rcols = slice(i * d_h, (i + 1) * d_h), slice(i * d_hr, (i + 1) * d_hr)
                vcols = slice(i * d_v, (i + 1) * d_v)
                q_c = c_q @ mla.w_q[:, cols]  # q^C_{s,i} = W^UQ_i c^Q_s
                q_r = _rope_one(c_q @ mla.w_qr[:, rcols], s, mla.rope_base)  # q^R_{s,i}
                q = torch.cat([q_c, q_r])  # (d_h + d_h^R,)
                scores = []
                for j in range(t):
                    k = torch.cat([c_kv[j] @ mla.w_uk[:, cols], k_r[j]])  # [k^C_{j,i}; k^R_j]
                    scores.append(torch.dot(q, k) / math.sqrt(d_h + d_hr))
                keys = [j for j in range(t) if allowed[b, i, s, j]]
                top = max(scores[j] for j in keys)
                e = {j: torch.exp(scores[j] - top) for j in keys}
                total = sum(e.values())
                o_i = torch.zeros(d_v, dtype=x.dtype)
                for j in keys:
                    weights[b, i, s, j] = e[j] / total
                    o_i = o_i + weights[b, i, s, j] * (c_kv[j] @ mla.w_uv[:, vcols])  # a_j v^C_{j,i}
                o.append(o_i)
            u[b, s] = torch.cat(o) @ mla.w_o  # W^O [o_{s,1}; ...; o_{s,n_h}]
    return u, weights


def _mask_of(kind: str, mla: LatentAttention, x: torch.Tensor) -> torch.Tensor | None:
    B, t, _ = x.shape
    if kind == "none":
        return None
    if kind == "causal":
        return causal_mask(t)
    m = torch.rand(B, mla.num_heads, t, t, generator=torch.Generator().manual_seed(t)) < 0.5  # (B, h, t, t)
    m[..., 0] = True  # every query keeps a key
    return m


@SETTINGS
@given(mla_cases(), st.sampled_from(["none", "causal", "per_head"]))
def test_mla_equals_the_deepseek_v2_equations(case: tuple[LatentAttention, torch.Tensor], kind: str) -> None:
    """Naive and absorbed, with weights (attnlib's softmax) and without (PyTorch's SDPA)."""
    mla, x = case
    mask = _mask_of(kind, mla, x)
    with torch.no_grad():
        ref_out, ref_w = deepseek_v2_mla(mla, x, mask)
        for absorb in (False, True):
            out, w = mla(x, mask=mask, absorb=absorb)
            torch.testing.assert_close(out, ref_out, **TOL)
            torch.testing.assert_close(w, ref_w, **TOL)
            out_f, _ = mla(x, mask=mask, need_weights=False, absorb=absorb)
            torch.testing.assert_close(out_f, ref_out, **TOL)


@SETTINGS
@given(mla_cases(), st.integers(1, 5), st.booleans(), st.booleans())
def test_mla_cached_decoding_equals_the_deepseek_v2_equations(
    case: tuple[LatentAttention, torch.Tensor], prefill: int, absorb: bool, need_weights: bool
) -> None:
    """A prefill, then one token at a time through a LatentCache, equals the causal pass."""
    mla, x = case
    B, n, _ = x.shape
    prefill = min(prefill, n)
    with torch.no_grad():
        ref_out, ref_w = deepseek_v2_mla(mla, x, causal_mask(n))
        cache = LatentCache()
        outs = []
        for lo, hi in [(0, prefill), *((t, t + 1) for t in range(prefill, n))]:
            out, w = mla(x[:, lo:hi], need_weights=need_weights, cache=cache, absorb=absorb)
            if need_weights:
                torch.testing.assert_close(w, ref_w[:, :, lo:hi, :hi], **TOL)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), ref_out, **TOL)


def test_mla_rope_part_sees_relative_positions_only() -> None:
    """The content part has no position, the rotary part only offsets: a cache started
    later (positions shifted) gives the same outputs."""
    mla = _mla(1)
    x = _randn(1, 4, 12, seed=3)
    cache = LatentCache()
    mla(_randn(1, 3, 12, seed=4), cache=cache)  # three earlier tokens
    c = cache.latents
    # Attending only to the new tokens equals a fresh pass whose positions start at 0:
    fresh, _ = mla(x, mask=causal_mask(4))
    late, w_late = mla(x, cache=cache)  # positions 3..6, keys 0..6
    assert c is not None and w_late is not None
    # not equal in general (the new queries also read the 3 earlier tokens) ...
    assert not torch.allclose(late, fresh)
    # ... but with the earlier tokens' weights removed and renormalised they are:
    w_new = w_late[..., 3:] / w_late[..., 3:].sum(-1, keepdim=True)  # (1, h, 4, 4)
    _, w_fresh = mla(x, mask=causal_mask(4))
    torch.testing.assert_close(w_new, w_fresh, **TOL)  # type: ignore[arg-type]


def test_mla_without_rope_and_with_float32() -> None:
    torch.manual_seed(0)
    mla = LatentAttention(8, 2, 3, 0)
    assert mla.w_qr.shape == (8, 0) and mla.w_kr.shape == (8, 0)
    x = torch.randn(2, 3, 8)
    out_n, _ = mla(x)
    out_a, w = mla(x, absorb=True, need_weights=False)
    assert w is None
    torch.testing.assert_close(out_a, out_n, atol=1e-5, rtol=1e-5)
    assert mla.cache_bytes_per_token() == 3 * 4
    assert "d_c=3" in repr(mla)


def test_mla_gradients_flow_through_both_ways() -> None:
    mla = _mla(2)
    x = _randn(2, 3, 12, seed=5)
    grads = []
    for absorb in (False, True):
        mla.zero_grad()
        out, _ = mla(x, mask=causal_mask(3), absorb=absorb)
        out.pow(2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in mla.named_parameters()})  # type: ignore[union-attr]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], **TOL)


def test_latent_cache_repr_and_clear() -> None:
    mla = _mla(0)
    cache = LatentCache()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.batch_size is None and cache.dtype is None
    assert cache.latents is None and cache.rope_keys is None and cache.device is None
    assert repr(cache) == "LatentCache(empty)"
    mla(_randn(2, 3, 12), cache=cache)
    assert repr(cache) == "LatentCache(len=3, latents=(2, 3, 5), rope_keys=(2, 3, 4), dtype=torch.float64)"
    other = _mla(1)
    with pytest.raises(ValueError, match="another module"):
        other(_randn(2, 1, 12), cache=cache)
    cache.clear()
    assert len(cache) == 0
    other(_randn(2, 1, 12), cache=cache)  # a cleared cache may serve another module
    assert len(cache) == 1


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda m, c: m([1.0]), TypeError, "x must be a torch.Tensor"),
        (lambda m, c: m(_randn(2, 3, 11)), ValueError, r"x must have shape \(B, t, d_model=12\) with t >= 1, got \(2, 3, 11\)"),
        (lambda m, c: m(_randn(2, 0, 12)), ValueError, "t >= 1"),
        (lambda m, c: m(_randn(3, 12)), ValueError, r"got \(3, 12\)"),
        (lambda m, c: m(_randn(1, 2, 12, dtype=torch.float32)), ValueError, "dtype torch.float32"),
        (lambda m, c: m(_randn(1, 2, 12), mask=torch.ones(3, 3, dtype=torch.bool)), ValueError, "does not broadcast"),
        (lambda m, c: m(_randn(1, 2, 12), mask=torch.ones(2, 2)), ValueError, "torch.bool"),
        (lambda m, c: m(_randn(3, 2, 12), mask=torch.ones(3, 2, 2, dtype=torch.bool)), ValueError,
         r"mask of shape \(3, 2, 2\) is 3-D, which is ambiguous .* mask\[:, None\] .* mask\[None\]"),
        (lambda m, c: m(_randn(2, 1, 12), cache=KVCache()), TypeError, "cache must be an attnlib.LatentCache"),
        (lambda m, c: m(_randn(2, 1, 12), cache=c, mask=causal_mask(1)), ValueError, "mask cannot be combined with cache"),
        (lambda m, c: m(_randn(3, 1, 12), cache=c), ValueError, "batch size 3 does not match the LatentCache's batch size 2"),
    ],
)
def test_mla_errors(call: object, exc: type[Exception], match: str) -> None:
    mla = _mla(0)
    cache = LatentCache()
    mla(_randn(2, 2, 12), cache=cache)
    with pytest.raises(exc, match=match):
        call(mla, cache)  # type: ignore[operator]


def test_latent_cache_update_refuses_latents_and_rope_keys_that_do_not_pair_up() -> None:
    cache, m = LatentCache(), torch.nn.Identity()
    with pytest.raises(ValueError, match=r"latents of shape \(1, 3, 5\) and rope_keys of shape \(1, 2, 4\) must have the same \(B, t\)"):
        cache.update(m, torch.zeros(1, 3, 5), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match=r"latents must have shape \(B, t, d_c\), got \(3, 5\)"):
        cache.update(m, torch.zeros(3, 5), torch.zeros(1, 3, 4))
    assert len(cache) == 0


def test_latent_cache_dtype_mismatch() -> None:
    mla = _mla(0)
    cache = LatentCache()
    mla(_randn(1, 2, 12), cache=cache)
    mla.float()
    with pytest.raises(ValueError, match="dtype torch.float32 does not match the LatentCache's dtype torch.float64"):
        mla(_randn(1, 1, 12, dtype=torch.float32), cache=cache)


@pytest.mark.parametrize(("absorb", "need_weights"), [(False, True), (True, True), (True, False)])
def test_mla_cached_decoding_under_autocast(absorb: bool, need_weights: bool) -> None:
    """The latents are bfloat16 under autocast while x stays float32: the cache takes them."""
    mla = _mla(0).float()
    x = _randn(2, 6, 12, dtype=torch.float32)
    with torch.no_grad():
        ref, _ = mla(x, mask=causal_mask(6))
        cache = LatentCache()
        with torch.autocast("cpu", torch.bfloat16):
            outs = [mla(t, need_weights=need_weights, cache=cache, absorb=absorb)[0] for t in (x[:, :4], x[:, 4:5], x[:, 5:])]
    assert cache.dtype == torch.bfloat16 and len(cache) == 6
    torch.testing.assert_close(torch.cat(outs, dim=1).float(), ref, atol=0.05, rtol=0.05)


@pytest.mark.parametrize(
    ("args", "kw", "match"),
    [
        ((12, 3, 5, 3), {}, r"^d_r must be even, got 3: RoPE pairs dimension l with l \+ d_r/2$"),
        ((12, 3, 0, 2), {}, "d_c must be a positive int"),
        ((12, 5, 4, 2), {}, r"d_model \(12\) must be divisible by num_heads \(5\)"),
        ((12, 0, 4, 2), {}, "num_heads must be a positive int"),
        ((12, 3, 4, 2), {"d_k": 0}, "d_k must be a positive int"),
        ((12, 3, 4, -2), {}, "d_r must be a non-negative int"),
        ((12, 3, 4, 2), {"rope_base": 0.5}, "base"),
    ],
)
def test_mla_constructor_errors(args: tuple[int, ...], kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LatentAttention(*args, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "kw", "match"),
    [
        ((True, 1, 4, 2), {}, "d_model must be a positive int, got bool True"),
        ((12, 3, 4, 2), {"d_v": 1.5}, "d_v must be a positive int, got float 1.5"),
        ((12, 3, 4, 2), {"rope_base": "1e4"}, "rope_base"),
        ((12, 3, 4, 2.0), {}, "d_r must be a positive int"),
    ],
)
def test_mla_constructor_type_errors(args: tuple[int, ...], kw: dict[str, object], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        LatentAttention(*args, **kw)  # type: ignore[arg-type]


def test_mla_d_k_need_not_divide_d_model() -> None:
    mla = LatentAttention(10, 3, 4, 2, d_k=2, d_v=5)
    assert mla.w_q.shape == (10, 6) and mla.w_uv.shape == (4, 15) and mla.w_o.shape == (15, 10)
    out, w = mla(torch.randn(1, 2, 10))
    assert out.shape == (1, 2, 10) and w is not None and w.shape == (1, 3, 2, 2)


# ---- what update returns: everything cached, in order, and a copy of the first input ---------


def test_kv_cache_update_returns_all_cached_keys_and_values_in_order() -> None:
    """``update`` hands back every cached key and value, old ones first, with their values: a
    layer attends to what it returns, so a wrong return (the new keys only, the old ones
    only, another order, the first input itself) changes outputs; checked here directly."""
    cache, owner = KVCache(), torch.nn.Identity()
    k0, v0 = _randn(2, 3, 4, 5, seed=1), _randn(2, 3, 4, 6, seed=2)  # (B, g, t, d_k), (B, g, t, d_v)
    keys, values = cache.update(owner, k0, v0)
    assert torch.equal(keys, k0) and torch.equal(values, v0)
    assert keys.data_ptr() != k0.data_ptr()  # a copy: changing the input later changes no cached key
    first = k0.clone()
    k0.add_(1.0)
    assert torch.equal(cache.keys, first) and not torch.equal(cache.keys, k0)
    k1, v1 = _randn(2, 3, 1, 5, seed=3), _randn(2, 3, 1, 6, seed=4)
    keys, values = cache.update(owner, k1, v1)
    assert torch.equal(keys[:, :, :4], first) and torch.equal(keys[:, :, 4:], k1)
    assert torch.equal(values, torch.cat([v0, v1], dim=2))
    assert torch.equal(keys, cache.keys) and torch.equal(values, cache.values)
    k2, v2 = _randn(2, 3, 2, 5, seed=5), _randn(2, 3, 2, 6, seed=6)
    keys, values = cache.update(owner, k2, v2)
    assert keys.shape == (2, 3, 7, 5) and len(cache) == 7
    assert torch.equal(keys[:, :, 5:], k2) and torch.equal(values[:, :, 4:5], v1)


def test_latent_cache_update_returns_all_cached_latents_and_rope_keys_in_order() -> None:
    cache, owner = LatentCache(), torch.nn.Identity()
    c0, r0 = _randn(2, 3, 5, seed=1), _randn(2, 3, 4, seed=2)  # (B, t, d_c), (B, t, d_r)
    c1, r1 = _randn(2, 2, 5, seed=3), _randn(2, 2, 4, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(cache.update(owner, c0, r0), (c0, r0)))
    latents, rope_keys = cache.update(owner, c1, r1)
    assert torch.equal(latents, torch.cat([c0, c1], dim=1)) and torch.equal(rope_keys, torch.cat([r0, r1], dim=1))
    assert torch.equal(latents, cache.latents) and torch.equal(rope_keys, cache.rope_keys)
