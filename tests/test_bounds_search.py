"""Hunts for a break in every rounding bound the book or the tests call derived.

Random dense inputs reach a few per cent of a worst-case bound and prove little. Each
property here draws inputs steered to where bounds fail (``strategies.hostile``:
cancellation, sparse and aligned weights, exact products with the error all in the sums,
gemm's order of additions, tiny and huge entries; large positions; lengths that are not
powers of two) and asserts the bound. A bound that broke was derived again (the history is
in the functions' docstrings), never widened by a factor.

Under ``make test`` (the ``ci`` profile) each hunt runs a few examples; ``.ci/run`` runs
this file again under the ``thorough`` profile, at least 2,000 examples per hunt
(``strategies.hunt``). Results that overflow are discarded (``assume``): no finite bound
holds there.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from attnlib import MultiHeadAttention, SeparateHeadsAttention, assert_rounding_close, attention, rounding_tolerance
from attnlib.decoding import rope_rotation, score_terms
from attnlib.decoding.positions import score_terms_bound
from attnlib.decoding.rope import rope_angle_error, rope_angles, rope_merged_bound
from strategies import hostile, hunt

F64, F32 = torch.float64, torch.float32


def _finite(*ts: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


# ---- chapter 8: the four-term split of an additive-position score ------------------------------


@st.composite
def _four_term_inputs(draw: st.DrawFn) -> tuple[torch.Tensor, ...]:
    n_q, n_k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    d_model, d_k = draw(st.integers(1, 70)), draw(st.integers(1, 9))
    x_q, x_k = draw(hostile((n_q, d_model))), draw(hostile((n_k, d_model)))
    if draw(st.booleans()):  # position vectors that nearly cancel the tokens: x + e far below both
        e_q = -x_q * (1 - draw(st.sampled_from([0.0, 2.0**-30, 1e-6])))
        e_k = -x_k * (1 - draw(st.sampled_from([0.0, 2.0**-30, 1e-6])))
    else:
        e_q, e_k = draw(hostile((n_q, d_model))), draw(hostile((n_k, d_model)))
    w_q = draw(hostile((d_k, d_model))).T.contiguous()  # (d_model, d_k): the sums run over d_model
    w_k = draw(hostile((d_k, d_model))).T.contiguous()
    return x_q, e_q, x_k, e_k, w_q, w_k


@given(inputs=_four_term_inputs())
@hunt(4)
def test_hunt_four_term_split(inputs: tuple[torch.Tensor, ...]) -> None:
    x_q, e_q, x_k, e_k, w_q, w_k = inputs
    total = score_terms(*inputs).total()
    score = ((x_q + e_q) @ w_q) @ ((x_k + e_k) @ w_k).T
    bound = score_terms_bound(*inputs)
    assume(_finite(total, score, bound))
    assert ((total - score).abs() <= bound).all()


# ---- chapter 8: RoPE's merged matrix and its angles --------------------------------------------


@given(w_q=hostile((6, 16), exponents=20), w_k=hostile((6, 16), exponents=20), half=st.integers(1, 8),
       p=st.integers(0, 60), j=st.integers(0, 60), shift=st.sampled_from([1, 4000, 65_537, 10**6, 10**7, 2**24 + 1, 2**31 + 7]),  # past float32: 2**24 + 1
       base=st.sampled_from([10000.0, 500000.0, 12345.0, 1.5]))
@hunt(4)
def test_hunt_rope_merged_matrix(w_q: torch.Tensor, w_k: torch.Tensor, half: int, p: int, j: int, shift: int,
                                 base: float) -> None:
    d_k = 2 * half
    w_q, w_k = w_q[:, :d_k], w_k[:, :d_k]  # (d_model, d_k), hostile along the rotation's pairs

    def merged(a: int, b: int) -> torch.Tensor:
        return w_q @ rope_rotation(a, d_k, base) @ rope_rotation(b, d_k, base).T @ w_k.T

    gap = (merged(p + shift, j + shift) - merged(p, j)).abs()
    bound = rope_merged_bound(w_q, w_k, p + shift, j + shift, base) + rope_merged_bound(w_q, w_k, p, j, base)
    assume(_finite(gap, bound))
    assert (gap <= bound).all()


@given(position=st.one_of(st.integers(0, 1000), st.integers(0, 2**40)), d_k=st.integers(1, 160).map(lambda h: 2 * h),
       pair=st.floats(0, 1), base=st.one_of(st.sampled_from([10000.0, 500000.0, 1e6]), st.floats(1.001, 1e9)))
@hunt(4)
def test_hunt_rope_angles_against_exact_arithmetic(position: int, d_k: int, pair: float, base: float) -> None:
    """float64 angles p omega_l against 120-bit arithmetic, within rope_angle_error."""
    mpmath = pytest.importorskip("mpmath")
    l = min(int(pair * d_k / 2), d_k // 2 - 1)
    angle = rope_angles(torch.tensor([position]), d_k, base)[0, l].item()
    with mpmath.workprec(120):
        exact = mpmath.mpf(position) * mpmath.power(mpmath.mpf(base), -mpmath.mpf(2 * l) / d_k)
        err = float(abs(mpmath.mpf(angle) - exact))
    assert err <= rope_angle_error(torch.tensor([position]), d_k, base)[0, l].item()


# ---- chapter 5: dL/db^K, zero in exact arithmetic, sized by the sum it comes from -----------------
# (Adam's gap between the forms, at most 2 T lr max|g| / eps, follows from Adam's update and
# is checked with torch's Adam in the chapter; the hunt attacks the bound on |g| itself.)


def _bk_noise_bound(module: MultiHeadAttention, x: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
    """Chapter 5's bound, per entry of b^K: eps64 (B n + 2n + 4) sum_t |q_t| sum_j A_tj |dA_tj| / sqrt(d_k)."""
    B, n, d = x.shape
    h, d_k = module.num_heads, module.d_k

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, n, h, d_k).transpose(1, 2)

    with torch.no_grad():
        q, k, v = (split(x @ getattr(module, f"w_{r}") + getattr(module, f"b_{r}")) for r in "qkv")
        a = attention(q, k, v)[1]  # (B, h, n, n)
        d_a = split(g_out @ module.w_o.T) @ v.mT  # (B, h, n, n): dL/dA
        size = (q.abs() * (a * d_a.abs()).sum(-1, keepdim=True)).sum((0, 2)) / math.sqrt(d_k)  # (h, d_k)
    return rounding_tolerance(F64, B * n, 2 * n, 4) * size.flatten()


@given(heads=st.sampled_from([(4, 1), (6, 2), (8, 4), (12, 3)]), B=st.integers(1, 3), n=st.integers(1, 9),
       x_exp=st.integers(-30, 8), bias_exp=st.integers(-20, 3), seed=st.integers(0, 2**31 - 1),
       aligned=st.booleans())
@hunt(3)
def test_hunt_bias_key_gradient_noise(heads: tuple[int, int], B: int, n: int, x_exp: int,
                                                     bias_exp: int, seed: int, aligned: bool) -> None:
    d, h = heads
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d, h, dtype=F64)
    with torch.no_grad():
        for b in (mha.b_q, mha.b_k, mha.b_v, mha.b_o):
            b.normal_(0, 2.0**bias_exp)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, d, generator=g, dtype=F64) * 2.0**x_exp
    if aligned:  # every token the same up to a scale: scores that tie, keys that cancel
        x = x[:, :1] * torch.linspace(1, 2, n, dtype=F64)[None, :, None]
    g_out = torch.randn(B, n, d, generator=g, dtype=F64)
    sep = SeparateHeadsAttention.from_fused(copy.deepcopy(mha))
    for module in (mha, sep):  # both forms: the same bound, other rounding
        (module(x, x, x)[0] * g_out).sum().backward()
        grad = torch.cat([p.grad for name, p in module.named_parameters() if name.startswith("b_k")])
        fused = module if isinstance(module, MultiHeadAttention) else module.to_fused()
        assert (grad.abs() <= _bk_noise_bound(fused, x, g_out)).all()


# ---- rounding_tolerance: one inner product, two orders ---------------------------------------------


@given(n=st.integers(1, 700), data=st.data(), dtype=st.sampled_from([F64, F32]))
@hunt(5)
def test_hunt_rounding_tolerance_two_orders_of_one_inner_product(n: int, data: st.DataObject,
                                                                 dtype: torch.dtype) -> None:
    """Two evaluations of sum_i x_i y_i (BLAS's dot, a left-to-right loop, torch's reduction of
    the products) differ by at most rounding_tolerance(dtype, n) x sum_i |x_i y_i|, absent
    underflow (products below the smallest normal are discarded)."""
    x = data.draw(hostile((n,), dtype=dtype, exponents=20))
    y = data.draw(hostile((n,), dtype=dtype, exponents=20))
    prods = x * y
    tiny = torch.finfo(dtype).smallest_normal
    assume(bool(((prods == 0) | (prods.abs() >= tiny / torch.finfo(dtype).eps)).all()))
    dot = x @ y
    loop = torch.zeros((), dtype=dtype)
    for t in prods.flip(0):
        loop = loop + t
    reduced = prods.sum()
    size = (x.abs().to(F64) * y.abs().to(F64)).sum()
    assume(_finite(dot, loop, reduced, size))
    tol = rounding_tolerance(dtype, n) * size
    for a, b in ((dot, loop), (dot, reduced), (loop, reduced)):
        assert (a.to(F64) - b.to(F64)).abs() <= tol


# ---- chapter 8: Hugging Face's float32 RoPE angles, and read_llama's frequency check -------------


def _hf_rotary(d_k: int, base: float) -> torch.nn.Module:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(hidden_size=d_k, num_attention_heads=1, head_dim=d_k, rope_theta=base,
                               intermediate_size=8, num_hidden_layers=1, vocab_size=8)
    return llama.LlamaRotaryEmbedding(config)


@given(d_k=st.integers(1, 80).map(lambda h: 2 * h), base=st.one_of(st.sampled_from([10000.0, 500000.0]),
       st.floats(1.01, 1e8)), positions=st.lists(st.one_of(st.integers(0, 2**17), st.integers(0, 2**31)),
       min_size=1, max_size=4), v=hostile((1, 160), exponents=20))
@hunt(2)
def test_hunt_float32_rope_of_hugging_face(d_k: int, base: float, positions: list[int], v: torch.Tensor) -> None:
    """LlamaRotaryEmbedding's float32 cos and sin rotate a float64 vector to within
    2 (angle error + eps32) (|v_l| + |v_(l + d_k/2)|) of apply_rope's float64 rotation, with
    the angle error rope_angle_error(..., float32): chapter 8's allowance at long positions."""
    from attnlib.decoding import apply_rope

    v = v[:, :d_k]  # (1, d_k)
    pos = torch.tensor(positions)
    cos, sin = _hf_rotary(d_k, base)(v[None].float(), pos[None])  # (1, n, d_k) float32
    half = d_k // 2
    theirs = v * cos[0].to(F64) + torch.cat([-v[:, half:], v[:, :half]], -1) * sin[0].to(F64)  # (n, d_k)
    ours = apply_rope(v.expand(len(positions), d_k), pos, base)
    angle = rope_angle_error(pos, d_k, base, F32) + rope_angle_error(pos, d_k, base)  # (n, d_k/2)
    per_pair = 2 * (angle + torch.finfo(F32).eps + 4 * torch.finfo(F64).eps)  # cos and sin: one ulp each, then float64
    pair_size = v[:, :half].abs() + v[:, half:].abs()  # (1, d_k/2)
    bound = torch.cat([per_pair * pair_size] * 2, -1)  # (n, d_k)
    assume(_finite(ours, theirs))
    assert ((theirs - ours).abs() <= bound).all()


@given(d_k=st.integers(1, 256).map(lambda h: 2 * h),
       base=st.one_of(st.sampled_from([10000.0, 500000.0, 1e6]), st.floats(1.01, 1e9)))
@hunt(2)
def test_hunt_read_llama_accepts_the_default_frequencies(d_k: int, base: float) -> None:
    """Hugging Face's float32 inv_freq, for any theta and head width, passes read_llama's
    frequency check (derived from rope_frequency_error, the ln(base) amplification counted)."""
    from attnlib.interop import read_llama

    attn = torch.nn.Module()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(attn, name, torch.nn.Linear(d_k, d_k, bias=False))
    attn.register_buffer("inv_freq", _hf_rotary(d_k, base).inv_freq)
    assert read_llama(attn, num_heads=1, rope_base=base).rope_base == base


# ---- chapter 11's composition scores, through the factors ---------------------------------------


@given(r=st.integers(1, 4), data=st.data(), mode=st.sampled_from(["plain", "orthogonal", "gauge", "cancel"]))
@hunt(4)
def test_hunt_composition_score_against_the_dense_ratio(r: int, data: st.DataObject, mode: str) -> None:
    """tests/test_induction.py's bound on composition_score against the dense ratio:
    eps64 (5 + 2r + 10) times max(1, how much larger the factors are than their products)."""
    from attnlib import FactoredMatrix
    from attnlib.induction import composition_score

    la, ra = data.draw(hostile((6, r), exponents=30)), data.draw(hostile((r, 5), exponents=30))
    lb, rb = data.draw(hostile((5, r), exponents=30)), data.draw(hostile((r, 7), exponents=30))
    if mode == "orthogonal" and r < 5:  # what a writes, b cannot read: the score is rounding only
        q, _ = torch.linalg.qr(torch.randn(5, 5, generator=torch.Generator().manual_seed(r), dtype=F64))
        ra = ra @ q[:, :r] @ q[:, :r].T
        lb = lb - q[:, :r] @ (q[:, :r].T @ lb)
    elif mode == "gauge":  # an ill-conditioned A between the factors: L A, A^-1 R
        gauge = torch.diag(torch.logspace(0, -8, r, dtype=F64))
        la, ra = la @ gauge, torch.linalg.inv(gauge) @ ra
    elif mode == "cancel" and r >= 2:  # nearly dependent columns of L, opposite rows of R
        la[:, 1], ra[1] = la[:, 0] * (1 + 2.0**-30), -ra[0]
    a, b = FactoredMatrix(la, ra), FactoredMatrix(lb, rb)
    fa, fb = a.full(), b.full()
    assume(bool(fa.norm() > 0) and bool(fb.norm() > 0) and bool((fa @ fb).norm() > 0))
    c = composition_score(a, b)
    dense = (fa @ fb).norm() / (fa.norm() * fb.norm())
    scale = max(float(la.norm() * ra.norm() / fa.norm()) * float(lb.norm() * rb.norm() / fb.norm()), 1.0)
    assume(_finite(c, dense) and math.isfinite(scale))
    assert abs(c - dense).item() <= rounding_tolerance(F64, 5, r, r, 5, 5) * scale


# ---- chapter 4: the pair and the merged W^QK give the same float32 scores -----------------------


@given(n=st.integers(1, 6), heads=st.sampled_from([(8, 2), (12, 3), (16, 4), (10, 5)]), data=st.data())
@hunt(4)
def test_hunt_pair_and_merged_scores_in_float32(n: int, heads: tuple[int, int], data: st.DataObject) -> None:
    """Chapter 4's bound between (X W_i^Q)(X W_i^K)^T and (X W_i^QK) X^T in float32:
    eps32 (2 d_model + d_k) (|X| |W_i^Q|)(|X| |W_i^K|)^T, absent underflow."""
    d, h = heads
    d_k = d // h
    x = data.draw(hostile((n, d), dtype=F32, exponents=12))
    w_q = data.draw(hostile((h * d_k, d), dtype=F32, exponents=12)).T.contiguous()  # (d, h*d_k)
    w_k = data.draw(hostile((h * d_k, d), dtype=F32, exponents=12)).T.contiguous()
    q = (x @ w_q).view(n, h, d_k).transpose(0, 1)  # (h, n, d_k)
    k = (x @ w_k).view(n, h, d_k).transpose(0, 1)
    pair = q @ k.mT  # (h, n, n)
    w_qk = w_q.view(d, h, d_k).transpose(0, 1) @ w_k.view(d, h, d_k).permute(1, 2, 0)  # (h, d, d)
    merged = (x @ w_qk) @ x.T  # (h, n, n)
    q_abs = (x.abs().double() @ w_q.abs().double()).view(n, h, d_k).transpose(0, 1)
    k_abs = (x.abs().double() @ w_k.abs().double()).view(n, h, d_k).transpose(0, 1)
    size = q_abs @ k_abs.mT  # (h, n, n)
    normal = torch.finfo(F32).smallest_normal / torch.finfo(F32).eps
    terms = [x.double().abs()[:, None, :] * w_q.double().abs().T[None]]  # every product of the first sums
    assume(bool((size == 0).logical_or(size >= normal * d).all()) and all(
        bool(((t == 0) | (t >= normal)).all()) for t in terms))
    assume(_finite(pair, merged, size))
    assert ((merged.double() - pair.double()).abs() <= rounding_tolerance(F32, d, d, d_k) * size).all()


# ---- chapter 8: transformers' eager Llama attention against attnlib's, in float64 -------------


@given(heads=st.sampled_from([(4, 2, 4), (2, 1, 6), (4, 4, 2)]), n=st.integers(1, 7),
       start=st.sampled_from([0, 9, 1000, 65_000]), x_exp=st.integers(-4, 3), data=st.data(),
       cancel=st.booleans(), base=st.sampled_from([10000.0, 12345.0, 500000.0]))
@hunt(2)
def test_hunt_llama_float32_softmax_and_rope(heads: tuple[int, int, int], n: int, start: int, x_exp: int,
                                            data: st.DataObject, cancel: bool, base: float) -> None:
    """LlamaAttention (float64, float32 cos/sin and softmax) against attnlib's DecoderAttention
    read from it: each weight within eps32 x float32_attention_widths of itself, each output
    within as much of (|A| |V|) |W^O| (chapter 8). Steered to large scores, positions far
    from 0, and heads that cancel through W^O."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from attnlib.decoding import DecoderAttention, apply_rope, causal_mask, float32_attention_widths, read_llama

    h, g, d_k = heads
    d = h * d_k
    config = llama.LlamaConfig(hidden_size=d, num_attention_heads=h, num_key_value_heads=g, rope_theta=base,
                               intermediate_size=8, num_hidden_layers=1, vocab_size=8)
    config._attn_implementation = "eager"
    attn = llama.LlamaAttention(config, layer_idx=0).to(F64).eval()
    with torch.no_grad():
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            lin.weight.copy_(data.draw(hostile(tuple(lin.weight.shape), exponents=4)))
        if cancel and h >= 2:  # head 1 writes -(1 - c) times what head 0 writes
            attn.q_proj.weight[d_k:2 * d_k] = attn.q_proj.weight[:d_k]
            attn.o_proj.weight[:, d_k:2 * d_k] = -(1 - 2.0**-20) * attn.o_proj.weight[:, :d_k]
            if g == h:
                attn.k_proj.weight[d_k:2 * d_k] = attn.k_proj.weight[:d_k]
                attn.v_proj.weight[d_k:2 * d_k] = attn.v_proj.weight[:d_k]
    x = data.draw(hostile((1, n, d), exponents=0)) * 2.0**x_exp
    pos = torch.arange(start, start + n)
    cos, sin = llama.LlamaRotaryEmbedding(config)(x, pos[None])
    additive = torch.zeros(n, n, dtype=F64).masked_fill(~causal_mask(n), float("-inf"))
    ours = DecoderAttention.from_grouped_weights(read_llama(attn))
    with torch.no_grad():
        hf_out, hf_w = attn(x, position_embeddings=(cos, sin), attention_mask=additive[None, None])
        out, w = ours(x, x, x, mask=causal_mask(n))
        q = apply_rope((x @ ours.w_q).view(1, n, h, d_k).transpose(1, 2), pos, base)
        k = apply_rope((x @ ours.w_k).view(1, n, g, d_k).transpose(1, 2), pos, base).repeat_interleave(h // g, 1)
        v = (x @ ours.w_v).view(1, n, g, d_k).transpose(1, 2).repeat_interleave(h // g, 1)
    scores = (q @ k.mT / math.sqrt(d_k)).masked_fill(~causal_mask(n), float("-inf"))
    assume(_finite(hf_out, out, scores.nan_to_num(neginf=0.0)))
    try:
        widths = float32_attention_widths(scores, q, k, pos, base)
    except ValueError:  # e^y - 1 past a float (RoPE's float32 angles far out, huge |q| |k|): no bound
        assume(False)
        raise
    out_size = (w @ v.abs()).transpose(1, 2).reshape(1, n, d) @ ours.w_o.abs()
    assert_rounding_close(w, hf_w, *widths, dtype=F32, size=w)
    # the outputs: the weights' float32 error carried through V and W^O, plus float64's own
    # rounding of x W^V, A V and W^O, sized by their terms (|x| |W^V| where x W^V cancels:
    # a constant x with aligned rows of W^V gives |V| far below its terms)
    v_terms = (x.abs() @ ours.w_v.abs()).view(1, n, g, d_k).transpose(1, 2).repeat_interleave(h // g, 1)
    terms = (w @ v_terms).transpose(1, 2).reshape(1, n, d) @ ours.w_o.abs()
    # and a weight that float32 rounds into or below its subnormals is off by up to
    # W eps32 x its smallest normal absolutely (the weights' check above allows it), each
    # such error times |v_j| over the allowed keys, then |W^O|
    under = (causal_mask(n).double() @ v.abs()).transpose(1, 2).reshape(1, n, d) @ ours.w_o.abs()
    bound = (rounding_tolerance(F32, *widths, 1) * (out_size + torch.finfo(F32).smallest_normal * under)
             + rounding_tolerance(torch.float64, d, n, h * d_k, 2) * terms)
    gap = (out - hf_out).abs()
    assert (gap <= bound).all(), f"outputs differ by {float((gap - bound).amax()):.3g} beyond the bound"


# ---- chapter 8: the float32 softmax of eager Llama and BLOOM, near-tied and huge scores -----------


@given(n=st.integers(1, 40), size=st.sampled_from([0.0, 1.0, 1e2, 1e4, 1e6, 1e8, 1e9]),
       gap=st.sampled_from([0.0, 0.25, 3.0, 20.0, 45.0, 100.0]), data=st.data(), masked=st.booleans())
@hunt(4)
def test_hunt_float32_softmax_widths(n: int, size: float, gap: float, data: st.DataObject, masked: bool) -> None:
    """float32_attention_widths against transformers' softmax (float32, of float64 scores),
    steered to scores that are huge and tie to within what float32 resolves there."""
    from attnlib.decoding import float32_attention_widths

    spread = data.draw(hostile((2, n), exponents=6))[0]  # (n,)
    scores = (size * data.draw(st.sampled_from([1.0, -1.0])) + gap * spread.tanh())[None]  # (1, n)
    if masked and n > 1:  # some keys masked out, as a causal row has
        scores[0, data.draw(st.integers(1, n - 1)):] = float("-inf")
    exact = torch.softmax(scores, -1)
    hf = torch.softmax(scores, -1, dtype=F32).to(F64)
    assert_rounding_close(hf, exact, *float32_attention_widths(scores), dtype=F32, size=exact)
