"""The packed layouts of attnlib.interop: nanoGPT's packed nn.Linear and GPT-2's Conv1D.

Round trips are exact (the conversions only transpose, cut and concatenate), and each
layout, run the way its home library runs it, computes attnlib's function.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

from attnlib import MultiHeadAttention
from attnlib.interop import (
    read_conv1d,
    read_packed_linear,
    read_separate_linear,
    write_conv1d,
    write_packed_linear,
    write_separate_linear,
    write_torch_mha,
)
from strategies import assert_same_weights, examples, random_weights

# (d_model, num_heads) with d_model divisible by num_heads, small enough to be fast
dims = st.sampled_from([(4, 1), (4, 2), (6, 3), (8, 2), (8, 4), (12, 3), (16, 4)])
# (d_model, num_heads, h*d_k): the paper's h*d_k = d_model, or heads of another width
widths = dims.flatmap(lambda dh: st.tuples(st.just(dh[0]), st.just(dh[1]), st.sampled_from([dh[0], dh[1], 3 * dh[1]])))
seeds = st.integers(0, 2**16)


def causal(n: int) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()  # (n, n), True = may attend


def split_heads(t: Tensor, h: int) -> Tensor:
    B, n, d = t.shape
    return t.view(B, n, h, d // h).transpose(1, 2)  # (B, h, n, d_k)


def packed_forward(c_attn: nn.Module, c_proj: nn.Module, x: Tensor, h: int) -> Tensor:
    """Causal self-attention the way nanoGPT (and GPT-2) run a packed projection
    (``D = h*d_k``, ``d`` in nanoGPT)."""
    B, n, d = x.shape
    q, k, v = c_attn(x).chunk(3, dim=2)  # each (B, n, D)
    q, k, v = split_heads(q, h), split_heads(k, h), split_heads(v, h)  # (B, h, n, d_k)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, h, n, n)
    scores = scores.masked_fill(~causal(n), float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v  # (B, h, n, d_k)
    y = y.transpose(1, 2).contiguous().view(B, n, -1)  # (B, n, D)
    return c_proj(y)  # (B, n, d)


class Conv1DLike(nn.Module):
    """GPT-2's Conv1D semantics without transformers: ``y = x @ weight + bias``."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias  # (in, out), (out,)

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight  # (..., out)
        return y if self.bias is None else y + self.bias


# ---- round trips -------------------------------------------------------------------


@examples(30)
@given(widths, st.booleans(), seeds)
def test_packed_linear_round_trip(dhw: tuple[int, int, int], bias: bool, seed: int) -> None:
    d, _, hd = dhw
    w = random_weights(d, bias, seed, heads_width=hd)
    layers = write_packed_linear(w)
    assert layers["c_attn"].weight.shape == (3 * hd, d) and layers["c_proj"].weight.shape == (d, hd)
    pairs = {name: (lin.weight, lin.bias) for name, lin in layers.items()}
    assert_same_weights(read_packed_linear(**pairs), w)


@examples(30)
@given(widths, st.booleans(), seeds)
def test_conv1d_round_trip(dhw: tuple[int, int, int], bias: bool, seed: int) -> None:
    d, _, hd = dhw
    w = random_weights(d, bias, seed, heads_width=hd)
    tensors = write_conv1d(w)
    assert tensors["c_attn"][0].shape == (d, 3 * hd) and tensors["c_proj"][0].shape == (hd, d)
    assert_same_weights(read_conv1d(**tensors), w)


@examples(25)
@given(dims, st.booleans(), seeds)
def test_layouts_read_then_write_gives_the_stored_tensors(dh: tuple[int, int], bias: bool, seed: int) -> None:
    """The other direction: tensors in a layout -> attnlib -> the same tensors."""
    d = dh[0]
    g = torch.Generator().manual_seed(seed)
    w_attn, w_proj = torch.randn(3 * d, d, generator=g), torch.randn(d, d, generator=g)
    b_attn = torch.randn(3 * d, generator=g) if bias else None
    b_proj = torch.randn(d, generator=g) if bias else None
    back = write_packed_linear(read_packed_linear((w_attn, b_attn), (w_proj, b_proj)))
    assert torch.equal(back["c_attn"].weight, w_attn) and torch.equal(back["c_proj"].weight, w_proj)
    again = write_conv1d(read_conv1d((w_attn.T, b_attn), (w_proj, b_proj)))
    assert torch.equal(again["c_attn"][0], w_attn.T) and torch.equal(again["c_proj"][0], w_proj)
    if bias:
        assert torch.equal(back["c_attn"].bias, b_attn) and torch.equal(back["c_proj"].bias, b_proj)
        assert torch.equal(again["c_attn"][1], b_attn) and torch.equal(again["c_proj"][1], b_proj)  # type: ignore[arg-type]


def test_packed_layouts_are_transposes_of_each_other() -> None:
    """nanoGPT's c_attn.weight is torch MHA's in_proj_weight and GPT-2's c_attn.weight transposed."""
    w = random_weights(8, True, 0)
    packed = write_packed_linear(w)["c_attn"].weight.detach()  # (3d, d)
    mha = write_torch_mha(w, num_heads=2)
    assert torch.equal(packed, mha.in_proj_weight.detach())
    assert torch.equal(packed, write_conv1d(w)["c_attn"][0].T)


def test_readers_copy() -> None:
    w_attn, w_proj = torch.randn(12, 4), torch.randn(4, 4)
    for read, t in ((read_packed_linear, w_attn), (read_conv1d, w_attn.T.contiguous())):
        weights = read((t, None), (w_proj, None))
        t.zero_()
        w_proj.zero_()
        assert weights.w_q.abs().sum() > 0 and weights.w_o.abs().sum() > 0
        w_proj = torch.randn(4, 4)


# ---- same function -----------------------------------------------------------------


@examples(25)
@given(dims, st.booleans(), seeds, st.integers(1, 5))
def test_packed_linear_computes_attnlib_function(dh: tuple[int, int], bias: bool, seed: int, n: int) -> None:
    d, h = dh
    w = random_weights(d, bias, seed)
    x = torch.randn(2, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    layers = {k: lin.double() for k, lin in write_packed_linear(w).items()}
    with torch.no_grad():
        theirs = packed_forward(layers["c_attn"], layers["c_proj"], x, h)
        ours, _ = MultiHeadAttention.from_projections(w, h)(x, x, x, mask=causal(n))
    torch.testing.assert_close(ours, theirs)


@examples(25)
@given(dims, st.booleans(), seeds, st.integers(1, 5))
def test_conv1d_layout_computes_attnlib_function(dh: tuple[int, int], bias: bool, seed: int, n: int) -> None:
    d, h = dh
    w = random_weights(d, bias, seed)
    x = torch.randn(2, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    t = write_conv1d(w)
    with torch.no_grad():
        theirs = packed_forward(Conv1DLike(*t["c_attn"]), Conv1DLike(*t["c_proj"]), x, h)
        ours, _ = MultiHeadAttention.from_projections(w, h)(x, x, x, mask=causal(n))
    torch.testing.assert_close(ours, theirs)


def test_conv1d_layout_matches_transformers_conv1d() -> None:
    """The layout is the one transformers' own Conv1D (GPT-2) uses: load and compare."""
    from transformers.pytorch_utils import Conv1D

    d, h, n = 8, 2, 5
    w = random_weights(d, True, 1)
    t = write_conv1d(w)
    c_attn, c_proj = Conv1D(3 * d, d).double(), Conv1D(d, d).double()  # Conv1D(nf=out, nx=in)
    assert c_attn.weight.shape == (d, 3 * d)
    with torch.no_grad():
        for conv, (weight, bias) in ((c_attn, t["c_attn"]), (c_proj, t["c_proj"])):
            conv.weight.copy_(weight)
            conv.bias.copy_(bias)  # type: ignore[arg-type]
        x = torch.randn(3, n, d, dtype=torch.float64)
        theirs = packed_forward(c_attn, c_proj, x, h)
        ours, _ = MultiHeadAttention.from_projections(w, h)(x, x, x, mask=causal(n))
        torch.testing.assert_close(ours, theirs)
        # and reading transformers' tensors back gives the weights we started from
        assert_same_weights(read_conv1d((c_attn.weight, c_attn.bias), (c_proj.weight, c_proj.bias)), w)


@examples(25)
@given(widths, st.booleans(), seeds)
def test_every_layout_computes_the_same_outputs(dhw: tuple[int, int, int], bias: bool, seed: int) -> None:
    """One set of weights written to every layout: five implementations, one function
    (four where the heads are not d_model / h wide, which torch's module cannot hold)."""
    d, h, hd = dhw
    w = random_weights(d, bias, seed, heads_width=hd)
    x = torch.randn(2, 4, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours, _ = MultiHeadAttention.from_projections(w, h)(x, x, x, mask=causal(4))
        others = []
        if hd == d:
            torch_mha = write_torch_mha(w, h, batch_first=True)
            others.append(torch_mha(x, x, x, attn_mask=~causal(4), need_weights=False)[0])
        sep = write_separate_linear(w)
        q, k, v = (split_heads(sep[r](x), h) for r in "qkv")  # (B, h, n, d_k)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal(4))  # (B, h, n, d_k)
        others.append(sep["o"](y.transpose(1, 2).reshape(2, 4, hd)))
        lin = write_packed_linear(w)
        others.append(packed_forward(lin["c_attn"], lin["c_proj"], x, h))
        t = write_conv1d(w)
        others.append(packed_forward(Conv1DLike(*t["c_attn"]), Conv1DLike(*t["c_proj"]), x, h))
    for other in others:
        torch.testing.assert_close(other, ours)
    # reading each layout back gives identical weights
    pairs = {r: (sep[r].weight, sep[r].bias) for r in "qkvo"}
    assert_same_weights(read_separate_linear(**pairs), w)  # type: ignore[arg-type]


# ---- errors ----------------------------------------------------------------------

d = 4
good_linear = (torch.randn(3 * d, d), torch.randn(3 * d))
good_conv = (torch.randn(d, 3 * d), torch.randn(3 * d))
good_proj = (torch.randn(d, d), torch.randn(d))


@pytest.mark.parametrize(
    ("read", "c_attn", "c_proj", "message"),
    [
        (read_packed_linear, (torch.randn(d, 3 * d), None), (torch.randn(d, d), None),
         r"c_attn weight must have shape \(3\*h\*d_k, d_model\), nn.Linear \(out, in\), got \(4, 12\)"),
        (read_packed_linear, (torch.randn(3 * d), None), good_proj, r"c_attn weight .* got \(12,\)"),
        (read_packed_linear, (torch.randn(0, 0), None), (torch.randn(0, 0), None), r"c_attn weight .* got \(0, 0\)"),
        (read_packed_linear, good_linear, (torch.randn(d, d + 1), torch.randn(d)),
         r"c_proj weight must have shape \(d_model, h\*d_v\) = \(4, 4\), nn.Linear.*got \(4, 5\)"),
        (read_packed_linear, (good_linear[0], torch.randn(d)), good_proj,
         r"c_attn bias must have shape \(3\*h\*d_k,\) = \(12,\), got \(4,\)"),
        (read_packed_linear, good_linear, (good_proj[0], torch.randn(3 * d)),
         r"c_proj bias must have shape \(d_model,\) = \(4,\), got \(12,\)"),
        (read_conv1d, good_linear, good_proj, r"c_attn weight must have shape \(d_model, 3\*h\*d_k\), Conv1D.*got \(12, 4\)"),
        (read_conv1d, good_conv, (torch.randn(2 * d, d), torch.randn(d)), r"c_proj weight .* = \(4, 4\).*got \(8, 4\)"),
        (read_conv1d, (good_conv[0], torch.randn(3 * d, 1)), good_proj, r"c_attn bias .* got \(12, 1\)"),
    ],
)
def test_error_wrong_shapes(read, c_attn, c_proj, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        read(c_attn, c_proj)


@pytest.mark.parametrize("read", [read_packed_linear, read_conv1d])
def test_error_not_a_pair(read) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TypeError, match="c_attn must be a \\(weight, bias\\) pair"):
        read(torch.randn(12, 4), good_proj)
    with pytest.raises(TypeError, match="c_proj must be a \\(weight, bias\\) pair"):
        read(good_linear if read is read_packed_linear else good_conv, (None, None))
