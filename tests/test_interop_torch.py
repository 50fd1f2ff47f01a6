"""attnlib.interop: the torch ``nn.MultiheadAttention`` and separate ``nn.Linear`` layouts.

Round trips are exact (the conversions only transpose, slice and copy), and a
layout read back computes the same function as the module it was read from.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnlib import MultiHeadAttention, attention
from attnlib.interop import (
    AttentionWeights,
    read_separate_linear,
    read_torch_mha,
    torch_attn_mask,
    write_separate_linear,
    write_torch_mha,
)
from strategies import DTYPE, EXACT, TOL, assert_same_weights, examples, random_weights

sizes = st.tuples(st.integers(1, 4), st.integers(1, 4)).map(lambda t: (t[0] * t[1], t[0]))  # (d_model, h)


@examples(30)
@given(sizes, st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
def test_torch_mha_round_trip(dh: tuple[int, int], bias: bool, batch_first: bool, seed: int) -> None:
    """weights -> torch layout -> weights is the identity; the torch module computes
    softmax((x W^Q)(y W^K)^T / sqrt(d_k)) (y W^V) W^O per head, like attnlib."""
    d_model, h = dh
    w = random_weights(d_model, bias, seed)
    m = write_torch_mha(w, h, batch_first=batch_first).eval()
    assert m.batch_first == batch_first and m.in_proj_weight.shape == (3 * d_model, d_model)
    # the packed layout, spelled out: [W^Q | W^K | W^V] transposed to (out, in)
    torch.testing.assert_close(m.in_proj_weight[:d_model], w.w_q.T, **EXACT)
    torch.testing.assert_close(m.in_proj_weight[2 * d_model :], w.w_v.T, **EXACT)
    torch.testing.assert_close(m.out_proj.weight, w.w_o.T, **EXACT)
    assert_same_weights(read_torch_mha(m), w)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 3, d_model, generator=g, dtype=DTYPE)
    y = torch.randn(2, 5, d_model, generator=g, dtype=DTYPE)
    xt, yt = (x, y) if batch_first else (x.transpose(0, 1), y.transpose(0, 1))
    out_t, _ = m(xt, yt, yt, need_weights=False)
    out_t = out_t if batch_first else out_t.transpose(0, 1)
    out_a, _ = MultiHeadAttention.from_projections(w, h)(x, y, y)
    torch.testing.assert_close(out_a, out_t, **TOL)


@examples(30)
@given(sizes, st.booleans(), st.integers(0, 2**31 - 1), st.sampled_from([None, 1, 3]))
def test_separate_linear_round_trip(dh: tuple[int, int], bias: bool, seed: int, width: int | None) -> None:
    """weights -> four nn.Linear -> weights is the identity, and the four layers with
    per-head attention between them compute what MultiHeadAttention computes; also for
    heads of another width than d_model / h (``width``: d_k)."""
    d_model, h = dh
    d_k = d_model // h if width is None else width
    w = random_weights(d_model, bias, seed, heads_width=h * d_k)
    layers = write_separate_linear(w)
    assert set(layers) == {"q", "k", "v", "o"}
    for name, lin in layers.items():
        torch.testing.assert_close(lin.weight, getattr(w, f"w_{name}").T, **EXACT)  # (out, in)
        assert (lin.bias is None) == (not bias)
    pairs = [(lin.weight, lin.bias) for lin in layers.values()]
    assert_same_weights(read_separate_linear(*pairs), w)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, d_model, generator=g, dtype=DTYPE)  # (B, n, d_model)

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(2, 4, h, d_k).transpose(1, 2)  # (B, h, n, d_k)

    heads, _ = attention(split(layers["q"](x)), split(layers["k"](x)), split(layers["v"](x)))  # (B, h, n, d_v)
    out = layers["o"](heads.transpose(1, 2).reshape(2, 4, h * d_k))  # (B, n, d_model)
    torch.testing.assert_close(out, MultiHeadAttention.from_projections(w, h)(x, x, x)[0], **TOL)


def test_read_copies_not_views() -> None:
    m = nn.MultiheadAttention(4, 2, dtype=DTYPE)
    w = read_torch_mha(m)
    with torch.no_grad():
        m.in_proj_weight.zero_()
    assert w.w_q.abs().sum() > 0


def test_torch_attn_mask() -> None:
    mask = torch.tensor([[True, False], [True, True]])
    assert torch.equal(torch_attn_mask(mask), torch.tensor([[False, True], [False, False]]))
    with pytest.raises(ValueError, match="mask must have dtype torch.bool, got torch.float32"):
        torch_attn_mask(mask.float())


def test_torch_attn_mask_matches_torch() -> None:
    """A causal attnlib mask converted for torch gives the same output as attnlib."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2, dtype=DTYPE)
    x = torch.randn(1, 4, 8, dtype=DTYPE)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()  # True = may attend
    out_t, _ = mha.to_torch()(x, x, x, attn_mask=torch_attn_mask(causal))
    torch.testing.assert_close(mha(x, x, x, mask=causal)[0], out_t, **TOL)


def test_error_weights_shape() -> None:
    w = random_weights(4, True, 0)
    with pytest.raises(ValueError, match=r"w_k must have shape \(d_model, h\*d_k\) = \(4, 4\) for w_q of shape \(4, 4\), got \(4, 3\)"):
        AttentionWeights(w.w_q, w.w_k[:, :3], w.w_v, w.w_o)
    with pytest.raises(ValueError, match=r"b_o must have shape \(d_model,\) = \(4,\) for w_q of shape \(4, 4\), got \(5,\)"):
        AttentionWeights(w.w_q, w.w_k, w.w_v, w.w_o, w.b_q, w.b_k, w.b_v, torch.zeros(5))
    with pytest.raises(ValueError, match=r"w_o must have shape \(h\*d_v, d_model\) = \(4, 4\) for w_q of shape \(4, 4\), got \(4, 3\)"):
        AttentionWeights(w.w_q, w.w_k, w.w_v, w.w_o[:, :3])
    with pytest.raises(ValueError, match=r"w_q must have shape \(d_model, h\*d_k\), got \(4,\)"):
        AttentionWeights(w.w_q[0], w.w_k, w.w_v, w.w_o)
    with pytest.raises(ValueError, match="biases must be given for all four projections or for none"):
        AttentionWeights(w.w_q, w.w_k, w.w_v, w.w_o, b_q=w.b_q)


def test_error_separate_linear_shapes() -> None:
    """q, k, v: (h*d_k, d_model); o: (d_model, h*d_v): square in the paper, not necessarily."""
    sq, rect = torch.zeros(4, 4), torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"k weight must have shape \(h\*d_k, d_model\) = \(4, 4\) to match q's, got \(4, 3\)"):
        read_separate_linear((sq, None), (rect, None), (sq, None), (sq, None))
    with pytest.raises(ValueError, match=r"o weight must have shape \(d_model, h\*d_v\) = \(4, 4\) to match q's, got \(4,\)"):
        read_separate_linear((sq, None), (sq, None), (sq, None), (sq[0], None))
    with pytest.raises(ValueError, match=r"q weight must have shape \(h\*d_k, d_model\), got \(4,\)"):
        read_separate_linear((sq[0], None), (sq, None), (sq, None), (sq, None))
    w = read_separate_linear((rect.T, None), (rect.T, None), (rect.T, None), (rect, None))  # h*d_k = 3, d_model = 4
    assert (w.d_model, w.heads_width, w.w_o.shape) == (4, 3, (3, 4))


@pytest.mark.parametrize(
    "q",
    [torch.zeros(4, 4), ([[0.0]], None), (torch.zeros(4, 4), [0.0] * 4), (torch.zeros(4, 4),)],
    ids=["bare tensor", "list weight", "list bias", "one element"],
)
def test_error_separate_linear_not_a_pair(q: object) -> None:
    sq = (torch.zeros(4, 4), None)
    with pytest.raises(TypeError, match=r"q must be a \(weight, bias\) pair of tensors"):
        read_separate_linear(q, sq, sq, sq)  # type: ignore[arg-type]


def test_read_torch_mha_warns_about_dropout_in_training_mode_only() -> None:
    """The readers' one rule (read_bloom and read_llama too): dropout is not read; a layer in
    training mode is told so, a layer in eval mode (dropout off) is read silently."""
    m = nn.MultiheadAttention(4, 2, dropout=0.1)
    with pytest.warns(UserWarning, match=r"dropout=0.1 is not read: attnlib has no dropout"):
        w = read_torch_mha(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(read_torch_mha(m.eval()).w_q, w.w_q, atol=0, rtol=0)
    m.train()
    with pytest.warns(UserWarning, match="dropout"):
        mha = MultiHeadAttention.from_torch(m)
    torch.testing.assert_close(mha.w_q.detach(), w.w_q)
    x = torch.randn(2, 3, 4)
    m.batch_first = True
    with torch.no_grad():
        torch.testing.assert_close(mha(x, x, x)[0], m.eval()(x, x, x)[0])  # the same layer in eval mode


def test_error_read_torch_mha_half_bias() -> None:
    m = nn.MultiheadAttention(4, 2, bias=True)
    m.out_proj.register_parameter("bias", None)
    with pytest.raises(ValueError, match="in_proj_bias and out_proj.bias must both exist or both be absent"):
        read_torch_mha(m)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kdim": 2}, "kdim=2 and vdim=4 must equal embed_dim=4"),
        ({"add_bias_kv": True}, "add_bias_kv=True is not supported"),
        ({"add_zero_attn": True}, "add_zero_attn=True is not supported"),
    ],
)
def test_error_read_torch_mha_unsupported(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_torch_mha(nn.MultiheadAttention(4, 2, **kwargs))  # type: ignore[arg-type]


def test_error_read_torch_mha_wrong_type() -> None:
    with pytest.raises(TypeError, match="expected torch.nn.MultiheadAttention, got Linear"):
        read_torch_mha(nn.Linear(4, 4))  # type: ignore[arg-type]
