"""attnlib.decoding.positions and attnlib.decoding.bloom: positions seen through W_QK (chapter 8).

Additive positions: the four score terms add up to the score of x + p (to a derived
bound); the sinusoids follow Vaswani et al.'s formula. RoPE: the merged matrix between a
query at i and a key at j is W^Q R_{i-j} W^K^T, unchanged by a common shift. ALiBi: the
slopes follow Press et al.'s rule and agree with Hugging Face BLOOM's
``build_alibi_tensor`` for any number of heads (up to a constant per row, which a softmax
ignores); ``AlibiAttention`` read with ``read_bloom`` reproduces the REAL ``BloomAttention``
in one pass and in cached decoding. MLA: with decoupled RoPE, absorbed == not absorbed;
with RoPE on the content keys, absorption fails. Every error path has a test.
"""

from __future__ import annotations

import math
import warnings
from types import ModuleType

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnlib import AttentionWeights, LatentAttention, masked_softmax, rounding_tolerance
from attnlib.decoding import (
    AlibiAttention,
    KVCache,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    causal_mask,
    rope_rotation,
    score_terms,
    sinusoidal_positions,
)
from attnlib.decoding.positions import score_terms_bound
from attnlib.decoding.rope import rope_angle_error, rope_angles, rope_frequency_error, rope_merged_bound
from attnlib.interop import read_bloom, write_bloom
from strategies import DTYPE, TOL, examples

F64 = torch.float64
FEW = examples(15)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _bloom() -> ModuleType:
    """transformers' BLOOM module, imported on first use (importing it takes seconds)."""
    return pytest.importorskip("transformers.models.bloom.modeling_bloom")


# ---- additive positions -------------------------------------------------------------------


def test_sinusoidal_positions_follow_the_formula() -> None:
    pe = sinusoidal_positions(5, 6, base=100.0)
    assert pe.shape == (5, 6) and pe.dtype == F64
    for p in range(5):
        for l in range(3):
            angle = p / 100.0 ** (2 * l / 6)
            assert pe[p, 2 * l].item() == pytest.approx(math.sin(angle), abs=1e-15)
            assert pe[p, 2 * l + 1].item() == pytest.approx(math.cos(angle), abs=1e-15)
    assert sinusoidal_positions(3, 4, dtype=torch.float32).dtype == torch.float32


@given(n=st.integers(2, 6), shift=st.integers(1, 500), half=st.integers(1, 4))
@FEW
def test_sinusoids_have_offset_only_dot_products(n: int, shift: int, half: int) -> None:
    pe = sinusoidal_positions(n + shift, 2 * half)
    near, far = pe[:n], pe[shift:]
    torch.testing.assert_close(far @ far.T, near @ near.T, **TOL)


@given(n_q=st.integers(1, 5), n_k=st.integers(1, 5), d_model=st.integers(1, 8), d_k=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
@FEW
def test_four_terms_add_up_to_the_score(n_q: int, n_k: int, d_model: int, d_k: int, seed: int) -> None:
    x_q, e_q = _randn(2, n_q, d_model, seed=seed), _randn(2, n_q, d_model, seed=seed + 1)
    x_k, e_k = _randn(2, n_k, d_model, seed=seed + 2), _randn(2, n_k, d_model, seed=seed + 3)
    w_q, w_k = _randn(d_model, d_k, seed=seed + 4), _randn(d_model, d_k, seed=seed + 5)
    terms = score_terms(x_q, e_q, x_k, e_k, w_q, w_k)
    score = ((x_q + e_q) @ w_q) @ ((x_k + e_k) @ w_k).mT  # (2, n_q, n_k)
    assert ((terms.total() - score).abs() <= score_terms_bound(x_q, e_q, x_k, e_k, w_q, w_k)).all()
    torch.testing.assert_close(terms.content_content, (x_q @ w_q @ w_k.T) @ x_k.mT, **TOL)
    torch.testing.assert_close(terms.position_content, (e_q @ w_q @ w_k.T) @ x_k.mT, **TOL)


def _dot_left_to_right(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(m, d) x (d, k) -> (m, k), each sum added from left to right: one order a matrix
    product may use (this machine's BLAS does, for these shapes), written out so that the
    test adds in it on every machine."""
    return torch.cumsum(a[:, :, None] * b[None], dim=1)[:, -1]


def test_four_terms_bound_counts_both_projections() -> None:
    """An input laid out for left-to-right sums: x = [1, t, .., t] with t just below
    u = 2^-53, so that 1 + t + .. + t rounds to 1 in the projection of x + e and not in
    those of x and e apart. The gap reaches 2 d_model eps: more than the one-projection
    count eps (d_model + d_k + 4), within score_terms_bound, eps (2 d_model + d_k + 2.5)."""
    eps, lr = torch.finfo(F64).eps, _dot_left_to_right
    for d_model, d_k in ((16, 8), (64, 1), (64, 8)):
        x = torch.full((1, d_model), 2.0**-53 - 2.0**-63, dtype=F64)
        x[0, 0] = 1.0
        e = torch.full((1, d_model), 2.0**-62, dtype=F64)
        e[0, 0] = 0.0
        w = torch.ones(d_model, d_k, dtype=F64)
        cx, ce = lr(x, w), lr(e, w)
        four = [lr(a, b.T) for a in (cx, ce) for b in (cx, ce)]
        gap = ((((four[0] + four[1]) + four[2]) + four[3]) - lr(lr(x + e, w), lr(x + e, w).T)).abs().item()
        size = (((x.abs() + e.abs()) @ w) @ ((x.abs() + e.abs()) @ w).T).item()
        assert gap > rounding_tolerance(F64, d_model, d_k, 4) * size  # the old count breaks
        assert gap > 1.8 * d_model * eps * size
        assert gap <= score_terms_bound(x, e, x, e, w, w).item()
        # score_terms itself, in whatever order this machine's BLAS adds: within the bound
        native = (score_terms(x, e, x, e, w, w).total() - ((x + e) @ w) @ ((x + e) @ w).T).abs()
        assert (native <= score_terms_bound(x, e, x, e, w, w)).all()


def test_four_terms_bound_covers_underflow() -> None:
    """Entries so small that the products are subnormal: the relative part underflows to 0,
    the absolute part (the subnormals' spacing per rounding) still holds, and is tiny."""
    x, e = (_randn(3, 6, seed=s) * 2.0**-520 for s in (0, 1))
    w_q = _randn(6, 4, seed=3) * 2.0**-10  # projections near 2^-530, scores near 2^-1060
    terms = score_terms(x, e, x, e, w_q, w_q)
    score = ((x + e) @ w_q) @ ((x + e) @ w_q).mT
    bound = score_terms_bound(x, e, x, e, w_q, w_q)
    assert ((terms.total() - score).abs() <= bound).all() and (bound < 1e-300).all()
    assert (score != 0).all() and (score.abs() < torch.finfo(F64).smallest_normal).all()


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: sinusoidal_positions(0, 4), ValueError, "n"),
        (lambda: sinusoidal_positions(3, 5), ValueError, "d_model"),
        (lambda: sinusoidal_positions(3, 4, base=1.0), ValueError, "base"),
        (lambda: sinusoidal_positions(3, 4, base=True), TypeError, "base must be a number > 1, got bool True"),
        (lambda: sinusoidal_positions(3, 4.0), TypeError, "d_model must be a positive int, got float"),
        (lambda: sinusoidal_positions(3, 5), ValueError,
         r"d_model must be even, got 5: sin and cos fill each pair of dimensions 2l, 2l \+ 1$"),
        (lambda: score_terms([1.0], _randn(2, 3), _randn(2, 3), _randn(2, 3), _randn(3, 2), _randn(3, 2)),
         TypeError, "x_q"),
        (lambda: score_terms(_randn(2, 3), _randn(2, 3), _randn(2, 3), _randn(2, 3), _randn(3, 2), _randn(3, 1)),
         ValueError, "w_q and w_k"),
        (lambda: score_terms(_randn(2, 3), _randn(3, 3), _randn(2, 3), _randn(2, 3), _randn(3, 2), _randn(3, 2)),
         ValueError, "x_q and e_q"),
        (lambda: score_terms(_randn(2, 3), _randn(2, 3), _randn(2, 4), _randn(2, 4), _randn(3, 2), _randn(3, 2)),
         ValueError, "x_k must have shape"),
        (lambda: score_terms(_randn(3), _randn(3), _randn(2, 3), _randn(2, 3), _randn(3, 2), _randn(3, 2)),
         ValueError, "x_q must have shape"),
    ],
)
def test_additive_errors(call: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()  # type: ignore[operator]


# ---- RoPE's merged matrix -------------------------------------------------------------------


@given(i=st.integers(0, 50), j=st.integers(0, 50), shift=st.integers(-20, 2000), half=st.integers(1, 4))
@FEW
def test_rope_merged_matrix_depends_on_the_offset_only(i: int, j: int, shift: int, half: int) -> None:
    d_k = 2 * half
    w_q, w_k = _randn(6, d_k, seed=i), _randn(6, d_k, seed=j + 100)

    def merged(a: int, b: int) -> torch.Tensor:  # W^Q R_a R_b^T W^K^T
        return w_q @ rope_rotation(a, d_k) @ rope_rotation(b, d_k).T @ w_k.T

    for a, b in ((i + shift, j + shift), (i - j, 0)):  # a common shift; W^Q R_{i-j} W^K^T
        bound = rope_merged_bound(w_q, w_k, a, b) + rope_merged_bound(w_q, w_k, i, j)  # each vs the exact
        assert ((merged(a, b) - merged(i, j)).abs() <= bound).all()
    x_q, x_k = _randn(1, 6, seed=1), _randn(1, 6, seed=2)  # the scores of RoPE(x W) meet through it
    score = apply_rope(x_q @ w_q, torch.tensor([i])) @ apply_rope(x_k @ w_k, torch.tensor([j])).T
    torch.testing.assert_close(score, x_q @ merged(i, j) @ x_k.T, **TOL)


def _merged_gap_over_bound(w_q: torch.Tensor, w_k: torch.Tensor, pairs: list[tuple[int, int]], shifts: tuple[int, ...],
                           size: torch.Tensor | None = None) -> float:
    """The largest gap / bound between W^Q R_{p+s} R_{j+s}^T W^K^T and the same at (p, j); the
    bound is rope_merged_bound's, or, with ``size``, the old eps64 (p + s + j + s + 2 + 3 d_k) x size."""
    d_k, worst = w_q.shape[1], 0.0
    for p, j in pairs:
        ref = w_q @ rope_rotation(p, d_k) @ rope_rotation(j, d_k).T @ w_k.T
        for s in shifts:
            gap = (w_q @ rope_rotation(p + s, d_k) @ rope_rotation(j + s, d_k).T @ w_k.T - ref).abs()
            if size is None:
                bound = rope_merged_bound(w_q, w_k, p + s, j + s) + rope_merged_bound(w_q, w_k, p, j)
            else:
                bound = rounding_tolerance(F64, p + s + 1, j + s + 1, 2, 3 * d_k) * size
            worst = max(worst, float((gap / bound).nan_to_num(nan=0.0, posinf=math.inf).max()))
    return worst


def test_rope_merged_bound_holds_where_the_old_size_broke() -> None:
    """Two heads the old size |W^Q| |W^K|^T could not bound: a hand-built one (row 0 of W^Q =
    0.5 e_1, row 0 of W^K = 0.5 e_5, one rotation pair: the old size is 0 at entry (0, 0), the
    rounding is not) and a pruned-looking one (70 % zeros). The size through the rotations,
    |W^Q| |R_p| |R_j|^T |W^K|^T, and the rotations' own errors hold for both."""
    pairs, shifts = [(p, j) for p in (0, 5, 19, 46) for j in (0, 3, 34)], (0, 1, 100, 4000, 10**6)
    w_q, w_k = torch.zeros(6, 8, dtype=F64), torch.zeros(6, 8, dtype=F64)
    w_q[0, 1], w_k[0, 5] = 0.5, 0.5
    assert (w_q.abs() @ w_k.abs().T)[0, 0] == 0
    assert _merged_gap_over_bound(w_q, w_k, pairs, shifts, size=w_q.abs() @ w_k.abs().T) == math.inf
    assert _merged_gap_over_bound(w_q, w_k, pairs, shifts) <= 1
    g = torch.Generator().manual_seed(0)
    w_q = torch.randn(6, 8, generator=g, dtype=F64) * (torch.rand(6, 8, generator=g) > 0.7)
    w_k = torch.randn(6, 8, generator=g, dtype=F64) * (torch.rand(6, 8, generator=g) > 0.7)
    assert _merged_gap_over_bound(w_q, w_k, pairs, shifts, size=w_q.abs() @ w_k.abs().T) > 1
    assert _merged_gap_over_bound(w_q, w_k, pairs, shifts) <= 1


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_rope_angles_against_exact_arithmetic(base: float) -> None:
    """The angles p omega_l of rope_angles against 200-bit arithmetic (mpmath), positions up
    to 10^6: within rope_angle_error everywhere; and more than one eps64 per radian where
    2l/d_k is rounded (d_k = 80, 96, 120), the rounding amplified by ln(base)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.prec = 200
    eps, pos = torch.finfo(F64).eps, torch.tensor([1, 7, 1000, 65537, 999_983, 10**6])
    per_radian = {}
    for d_k in (8, 80, 96, 120, 128):
        angles, bound = rope_angles(pos, d_k, base), rope_angle_error(pos, d_k, base)  # (n, d_k/2)
        worst = 0.0
        for a, p in enumerate(pos.tolist()):
            for l in range(d_k // 2):
                exact = mpmath.mpf(p) * mpmath.power(mpmath.mpf(base), -mpmath.mpf(2 * l) / d_k)
                err = abs(mpmath.mpf(angles[a, l].item()) - exact)
                assert err <= bound[a, l].item()
                worst = max(worst, float(err / exact) / eps)
        per_radian[d_k] = worst
    assert max(per_radian[d] for d in (80, 96, 120)) > 1.5  # the old "eps64 per radian" fails
    ln_base = math.log(base)
    assert rope_frequency_error(80, base).max().item() > 0.5 * ln_base * eps  # the amplification, counted


def test_rope_merged_matrix_changes_with_the_offset_and_its_sign() -> None:
    w_q, w_k = _randn(6, 8, seed=1), _randn(6, 8, seed=2)
    m = w_q @ rope_rotation(4, 8) @ w_k.T
    for other in (5, -4):  # another offset; the transposed guess R_{j-i}
        assert (w_q @ rope_rotation(other, 8) @ w_k.T - m).abs().max() > 0.1


# ---- ALiBi ------------------------------------------------------------------------------------


def test_alibi_slopes_of_powers_of_two_are_geometric() -> None:
    torch.testing.assert_close(alibi_slopes(8), 2.0 ** -torch.arange(1, 9, dtype=F64), **TOL)
    for h in (1, 2, 4, 16, 64):
        m = alibi_slopes(h)
        torch.testing.assert_close(m, (2.0 ** (-8.0 / h)) ** torch.arange(1, h + 1, dtype=F64), **TOL)
    # 6 heads: the 4 slopes of 4 heads, then every other slope of 8 heads
    torch.testing.assert_close(alibi_slopes(6), torch.cat([alibi_slopes(4), alibi_slopes(8)[0::2][:2]]), **TOL)
    assert alibi_slopes(3, dtype=torch.float32).dtype == torch.float32


@given(h=st.integers(1, 130))
@FEW
def test_alibi_slopes_match_bloom(h: int) -> None:
    theirs = _bloom()._get_alibi_slopes(h, torch.device("cpu")).to(F64)  # float32 powers of a rounded base
    torch.testing.assert_close(alibi_slopes(h), theirs, rtol=rounding_tolerance(torch.float32, h + 1), atol=0)


@given(h=st.integers(1, 40), n=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
@FEW
def test_alibi_bias_matches_build_alibi_tensor_up_to_a_row_constant(h: int, n: int, seed: int) -> None:
    ours = alibi_bias(h, n)  # (h, n, n): -m (i - j)
    theirs = _bloom().build_alibi_tensor(torch.ones(1, n, dtype=F64), h, F64)  # (h, 1, n): m j
    gap = ours - theirs  # -m i + rounding of BLOOM's float32 slopes
    slope_tol = rounding_tolerance(torch.float32, h + 1)
    torch.testing.assert_close(gap, gap[..., :1].expand_as(gap), rtol=0, atol=n * slope_tol)
    scores = _randn(h, n, n, seed=seed)
    mask = causal_mask(n)
    torch.testing.assert_close(masked_softmax(scores + ours, mask), masked_softmax(scores + theirs, mask),
                               rtol=0, atol=4 * n * slope_tol)


def test_alibi_bias_for_queries_after_a_cache() -> None:
    full = alibi_bias(3, 7)  # (h, 7, 7)
    torch.testing.assert_close(alibi_bias(3, 2, 7), full[:, 5:], rtol=0, atol=0)  # the last 2 queries
    m = alibi_slopes(3)
    assert alibi_bias(3, 1, 4)[:, 0, 1].tolist() == (-m * 2).tolist()  # query 3, key 1: -2 m
    assert alibi_bias(2, 3, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: alibi_slopes(0), ValueError, "num_heads"),
        (lambda: alibi_slopes(2.0), TypeError, "num_heads must be a positive int, got float 2.0"),
        (lambda: alibi_slopes(True), TypeError, "num_heads must be a positive int, got bool True"),
        (lambda: alibi_bias(2, 3, 2.5), TypeError, "n_k must be a positive int, got float"),
        (lambda: alibi_bias(2, 0), ValueError, "n_q"),
        (lambda: alibi_bias(2, 3, 2), ValueError, "n_k"),
        (lambda: AlibiAttention(8, 2, num_kv_heads=1), ValueError, "num_kv_heads"),
        (lambda: AlibiAttention(8, 2, rope_base=10000.0), ValueError, "rope_base"),
    ],
)
def test_alibi_errors(call: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()  # type: ignore[operator]


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """(B, n, h*d_k) -> (B, h, n, d_k)."""
    B, n, d = t.shape
    return t.view(B, n, h, d // h).transpose(1, 2)


def _alibi_layer(d_model: int = 12, h: int = 3, seed: int = 0) -> AlibiAttention:
    torch.manual_seed(seed)
    layer = AlibiAttention(d_model, h, dtype=F64)
    with torch.no_grad():
        for b in (layer.b_q, layer.b_k, layer.b_v, layer.b_o):
            b.normal_()
    return layer


def test_alibi_attention_is_the_formula() -> None:
    layer, x = _alibi_layer(), _randn(2, 5, 12)
    out, w = layer(x, x, x, mask=causal_mask(5))
    q = _heads(x @ layer.w_q + layer.b_q, 3)  # (B, h, n, d_k)
    k = _heads(x @ layer.w_k + layer.b_k, 3)
    v = _heads(x @ layer.w_v + layer.b_v, 3)
    want = masked_softmax(q @ k.mT / 2.0 + alibi_bias(3, 5), causal_mask(5))  # d_k = 4
    torch.testing.assert_close(w, want, **TOL)
    merged = (want @ v).transpose(1, 2).reshape(2, 5, 12)  # (B, n, h*d_k)
    torch.testing.assert_close(out, merged @ layer.w_o + layer.b_o, **TOL)
    fused, none = layer(x, x, x, mask=causal_mask(5), need_weights=False)  # SDPA with the bias
    assert none is None
    torch.testing.assert_close(fused, out, **TOL)
    fused_nomask, _ = layer(x, x, x, need_weights=False)
    torch.testing.assert_close(fused_nomask, layer(x, x, x)[0], **TOL)
    assert "alibi=True" in repr(layer)


@given(prefill=st.integers(1, 5), steps=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
@FEW
def test_alibi_decoding_with_a_cache_equals_the_causal_pass(prefill: int, steps: int, seed: int) -> None:
    layer, x = _alibi_layer(seed=seed % 1000), _randn(1, prefill + steps, 12, seed=seed)
    n = prefill + steps
    with torch.no_grad():
        full, _ = layer(x, x, x, mask=causal_mask(n))
        cache = KVCache()
        outs = [layer(x[:, :prefill], x[:, :prefill], x[:, :prefill], cache=cache)[0]]
        for t in range(prefill, n):
            x_t = x[:, t : t + 1]
            outs.append(layer(x_t, x_t, x_t, cache=cache)[0])
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)
    plain = _heads(x @ layer.w_k + layer.b_k, 3)  # no position in the cached keys
    torch.testing.assert_close(cache.keys, plain, **TOL)


# ---- BLOOM: the real attention class and its layout --------------------------------------------


def _bloom_attention(hidden: int, heads: int, seed: int = 0) -> nn.Module:
    bloom = _bloom()
    torch.manual_seed(seed)
    attn = bloom.BloomAttention(bloom.BloomConfig(hidden_size=hidden, n_head=heads, n_layer=1), layer_idx=0)
    attn = attn.to(F64).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.3)
    return attn


@pytest.mark.parametrize("heads, d_k", [(4, 4), (6, 2), (3, 6)])
def test_alibi_attention_reproduces_bloom_attention(heads: int, d_k: int) -> None:
    d, n = heads * d_k, 7
    hf = _bloom_attention(d, heads)
    ours = AlibiAttention.from_projections(read_bloom(hf), heads)
    x = _randn(2, n, d, seed=3)
    alibi = _bloom().build_alibi_tensor(torch.ones(2, n, dtype=F64), heads, F64)
    additive = torch.zeros(n, n, dtype=F64).masked_fill(~causal_mask(n), float("-inf"))[None, None]
    with torch.no_grad():
        hf_out, hf_w = hf(x, torch.zeros_like(x), alibi, additive)
        out, w = ours(x, x, x, mask=causal_mask(n))
    tol = 1e-5  # BLOOM's softmax runs in float32; float64 everywhere else
    torch.testing.assert_close(w, hf_w, rtol=tol, atol=tol)
    torch.testing.assert_close(out, hf_out, rtol=tol, atol=tol)


def test_alibi_attention_reproduces_a_bloom_model_layer() -> None:
    """A whole BloomModel builds its own ALiBi tensor and causal mask; its layer-0 weights
    are AlibiAttention's on the layer's normalised input."""
    from transformers import BloomConfig, BloomModel

    torch.manual_seed(0)
    model = BloomModel(BloomConfig(hidden_size=24, n_head=3, n_layer=1, vocab_size=10)).to(F64).eval()
    block = model.h[0]
    with torch.no_grad():
        for p in block.self_attention.parameters():
            p.normal_(0.0, 0.3)
    ids = torch.randint(0, 10, (2, 7), generator=torch.Generator().manual_seed(1))
    ours = AlibiAttention.from_projections(read_bloom(block.self_attention), 3)
    with torch.no_grad():
        hf_w = model(input_ids=ids, output_attentions=True).attentions[0]  # (B, h, n, n)
        x = block.input_layernorm(model.word_embeddings_layernorm(model.word_embeddings(ids)))
        _, w = ours(x, x, x, mask=causal_mask(7))
    torch.testing.assert_close(w, hf_w, rtol=1e-5, atol=1e-5)  # BLOOM's softmax runs in float32


def test_alibi_cached_decoding_matches_bloom_dynamic_cache() -> None:
    from transformers import DynamicCache

    hf, n = _bloom_attention(12, 3), 6
    ours = AlibiAttention.from_projections(read_bloom(hf), 3)
    x = _randn(1, n, 12, seed=4)
    alibi = _bloom().build_alibi_tensor(torch.ones(1, n, dtype=F64), 3, F64)
    hf_cache, cache, hf_outs, outs = DynamicCache(config=_hf_config(hf)), KVCache(), [], []
    with torch.no_grad():
        for a, b in ((0, 3), (3, 4), (4, 6)):
            step = x[:, a:b]
            mask = torch.zeros(b - a, b, dtype=F64).masked_fill(~causal_mask(b - a, b), float("-inf"))
            hf_outs.append(hf(step, torch.zeros_like(step), alibi[:, :, :b], mask[None, None], layer_past=hf_cache)[0])
            outs.append(ours(step, step, step, cache=cache)[0])
    torch.testing.assert_close(torch.cat(outs, 1), torch.cat(hf_outs, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.keys, hf_cache.layers[0].keys, **TOL)
    torch.testing.assert_close(cache.values, hf_cache.layers[0].values, **TOL)


def _hf_config(attn: nn.Module) -> object:
    bloom = _bloom()
    return bloom.BloomConfig(hidden_size=attn.hidden_size, n_head=attn.num_heads, n_layer=1)


@given(heads=st.integers(1, 4), d_k=st.integers(1, 4), bias=st.booleans(), seed=st.integers(0, 2**31 - 1),
       d_model=st.sampled_from([None, 5]))
@FEW
def test_bloom_layout_round_trips(heads: int, d_k: int, bias: bool, seed: int, d_model: int | None) -> None:
    """BLOOM's heads are d / h wide; the layout reads heads of another width (d_model = 5) too."""
    hd = heads * d_k
    d = hd if d_model is None else d_model
    names = ("w_q", "w_k", "w_v", "w_o")
    tensors = {name: _randn(*((hd, d) if name == "w_o" else (d, hd)), seed=seed + i) for i, name in enumerate(names)}
    if bias:
        tensors.update({f"b_{c}": _randn(d if c == "o" else hd, seed=seed + 10 + i) for i, c in enumerate("qkvo")})
    w = AttentionWeights(**tensors)
    back = read_bloom(write_bloom(w, heads), num_heads=heads)
    for name in names:
        assert torch.equal(getattr(back, name), getattr(w, name))
    for c in "qkvo":
        want = getattr(w, f"b_{c}")
        assert torch.equal(getattr(back, f"b_{c}"), want if bias else torch.zeros(d if c == "o" else hd, dtype=F64))
    # the fused rows are grouped by head: head u's query, key and value rows in turn
    fused = write_bloom(w, heads)["query_key_value"].weight.view(heads, 3, d_k, d)
    assert torch.equal(fused[heads - 1, 1], w.w_k[:, (heads - 1) * d_k :].T)


def test_read_bloom_refuses_another_number_of_heads_than_written() -> None:
    """BLOOM's rows are grouped by head: read with h = 4, a layout written with h = 2 gave every
    head mixed rows and no shape went wrong. write_bloom's layers carry num_heads, as BLOOM's."""
    w = AttentionWeights(*(_randn(8, 8, seed=i) for i in range(4)))
    layers = write_bloom(w, 2)
    assert layers.num_heads == 2
    with pytest.raises(ValueError, match=r"num_heads=4 disagrees with attn.num_heads=2"):
        read_bloom(layers, num_heads=4)
    assert torch.equal(read_bloom(layers).w_k, w.w_k)


def test_write_bloom_loads_into_bloom_attention() -> None:
    hf = _bloom_attention(12, 3, seed=1)
    w = read_bloom(hf)
    fresh = _bloom_attention(12, 3, seed=2)
    fresh.load_state_dict(write_bloom(w, 3).state_dict())
    back = read_bloom(fresh)
    assert all(torch.equal(getattr(back, k), getattr(w, k)) for k in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_o"))


def test_bloom_errors() -> None:
    hf = _bloom_attention(12, 3)
    with pytest.raises(ValueError, match="disagrees"):
        read_bloom(hf, num_heads=2)
    layers = write_bloom(read_bloom(hf), 3)
    bare = nn.ModuleDict(dict(layers.items()))  # the same layers, without num_heads
    with pytest.raises(ValueError, match="num_heads must be given"):
        read_bloom(bare)
    with pytest.raises(ValueError, match=r"query_key_value.weight must be \(3\*h\*d_k, d\) and dense.weight \(d, h\*d_k\) with num_heads=5"):
        read_bloom(bare, num_heads=5)
    with pytest.raises(TypeError, match="dense"):
        read_bloom(nn.ModuleDict({"query_key_value": layers["query_key_value"]}), num_heads=3)
    no_bias = nn.ModuleDict({"query_key_value": layers["query_key_value"], "dense": nn.Linear(12, 12, bias=False)})
    assert read_bloom(no_bias, num_heads=3).b_o is not None  # issue 30: a missing bias reads as zeros
    hf.attention_dropout.p = 0.1  # hf is in eval mode: its dropout is off, nothing is lost
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_bloom(hf)
    with pytest.warns(UserWarning, match=r"attention_dropout=0.1 is not read: attnlib has no dropout"):
        read_bloom(hf.train())
    with pytest.raises(TypeError, match="AttentionWeights"):
        write_bloom(layers, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divide"):
        write_bloom(AttentionWeights(*(_randn(6, 6) for _ in range(4))), 4)


# ---- MLA: decoupled RoPE is what makes absorption exact -------------------------------------------


@given(h=st.integers(1, 3), d_c=st.integers(1, 6), half=st.integers(1, 3), n=st.integers(1, 5),
       seed=st.integers(0, 2**31 - 1))
@FEW
def test_decoupled_rope_absorbed_equals_not_absorbed(h: int, d_c: int, half: int, n: int, seed: int) -> None:
    torch.manual_seed(seed)
    mla = LatentAttention(4 * h, h, d_c=d_c, d_r=2 * half, dtype=DTYPE)
    x = _randn(2, n, 4 * h, seed=seed)
    with torch.no_grad():
        out_a, w_a = mla(x, mask=causal_mask(n), absorb=True)
        out_n, w_n = mla(x, mask=causal_mask(n))
    torch.testing.assert_close(out_a, out_n, **TOL)
    torch.testing.assert_close(w_a, w_n, **TOL)


def test_rope_on_the_content_keys_breaks_absorption() -> None:
    torch.manual_seed(0)
    mla = LatentAttention(16, 2, d_c=8, d_r=2, dtype=DTYPE)  # d_k = 8
    x, pos = _randn(1, 9, 16), torch.arange(9)
    with torch.no_grad():
        c = x @ mla.w_dkv  # (1, n, d_c)
        q = (x @ mla.w_q).view(1, 9, 2, 8).transpose(1, 2)  # (1, h, n, d_k)
        k = (c @ mla.w_uk).view(1, 9, 2, 8).transpose(1, 2)
        coupled = apply_rope(q, pos) @ apply_rope(k, pos).mT
        absorbed = torch.einsum("bhtd,chd->bhtc", q, mla.w_uk.view(8, 2, 8)) @ c[:, None].mT
    torch.testing.assert_close(absorbed, q @ k.mT, **TOL)  # without RoPE: exact
    assert (absorbed - coupled).abs().max() > 0.1 * coupled.abs().max()
