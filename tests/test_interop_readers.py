"""Readers for the layouts readers meet when auditing their attention (chapter 9).

Partial biases (Raschka's ``qkv_bias=False`` with a biased ``out_proj``, timm's ``qkv_bias=False``
with a biased ``proj``) read as zeros; a list of heads (Raschka's wrapper); BERT's W^O in
another module. Each round-trips exactly and computes the layout's own function.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlib import AttentionWeights, MultiHeadAttention
from attnlib.interop import (
    read_bert,
    read_conv1d,
    read_linear_heads,
    read_packed_linear,
    read_separate_linear,
    write_bert,
    write_linear_heads,
)


def weights(d: int = 8, seed: int = 0) -> AttentionWeights:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return AttentionWeights(r(d, d), r(d, d), r(d, d), r(d, d), r(d), r(d), r(d), r(d))


def same(a: AttentionWeights, b: AttentionWeights) -> None:
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_partial_biases_read_as_zeros_in_separate_linear() -> None:
    torch.manual_seed(0)
    q, k, v = (nn.Linear(8, 8, bias=False) for _ in range(3))  # Raschka's default qkv_bias=False
    o = nn.Linear(8, 8)
    w = read_separate_linear((q.weight, None), (k.weight, None), (v.weight, None), (o.weight, o.bias))
    assert w.b_q is not None and not w.b_q.any() and not w.b_k.any() and not w.b_v.any()  # type: ignore[union-attr]
    assert torch.equal(w.b_o, o.bias.detach())  # type: ignore[arg-type]
    x = torch.randn(2, 5, 8)
    mha = MultiHeadAttention.from_projections(w, 2)
    heads = lambda t: t.view(2, 5, 2, 4).transpose(1, 2)  # noqa: E731
    expected = o(F.scaled_dot_product_attention(heads(q(x)), heads(k(x)), heads(v(x))).transpose(1, 2).reshape(2, 5, 8))
    torch.testing.assert_close(mha(x, x, x)[0], expected)


def test_partial_biases_read_as_zeros_in_packed_layouts() -> None:
    w = weights()
    w_qkv = torch.cat([w.w_q, w.w_k, w.w_v], dim=1)  # (d, 3d)
    timm = read_packed_linear((w_qkv.T, None), (w.w_o.T, w.b_o))  # qkv_bias=False, proj with bias
    assert not timm.b_q.any() and torch.equal(timm.b_o, w.b_o)  # type: ignore[union-attr,arg-type]
    conv = read_conv1d((w_qkv, torch.cat([w.b_q, w.b_k, w.b_v])), (w.w_o, None))  # type: ignore[list-item]
    assert torch.equal(conv.b_k, w.b_k) and not conv.b_o.any()  # type: ignore[arg-type,union-attr]


def test_linear_heads_round_trip_and_compute_the_wrapper() -> None:
    w = weights()
    heads, o = write_linear_heads(w, 2)
    assert len(heads) == 2 and heads[0]["q"].weight.shape == (4, 8)
    pair = lambda lin: (lin.weight, lin.bias)  # noqa: E731
    back = read_linear_heads([(pair(h["q"]), pair(h["k"]), pair(h["v"])) for h in heads], pair(o))
    same(back, w)
    # a wrapper of single heads, concatenated, then W^O: the attnlib module computes it
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    outs = []
    for h in heads:
        q, k, v = h["q"](x), h["k"](x), h["v"](x)
        outs.append(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(4), dim=-1) @ v)
    torch.testing.assert_close(MultiHeadAttention.from_projections(back, 2)(x, x, x)[0], o(torch.cat(outs, dim=-1)))


def test_linear_heads_without_output_projection_and_without_bias() -> None:
    torch.manual_seed(0)
    heads = [tuple((nn.Linear(6, 3, bias=False).weight, None) for _ in range(3)) for _ in range(2)]
    w = read_linear_heads(heads)  # type: ignore[arg-type]
    assert torch.equal(w.w_o, torch.eye(6)) and w.b_q is None
    assert torch.equal(w.w_q[:, 3:], heads[1][0][0].detach().T)


def test_linear_heads_errors() -> None:
    good = (torch.randn(4, 8), None)
    with pytest.raises(ValueError, match="heads must be a non-empty list"):
        read_linear_heads([])
    with pytest.raises(TypeError, match=r"heads\[0\] must be a \(q, k, v\) triple"):
        read_linear_heads([(good, good)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"heads\[1\].v must be a \(weight, bias\) pair"):
        read_linear_heads([(good, good, good), (good, good, torch.randn(4, 8))])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"heads\[1\].k weight must have shape \(d_k, d_model\) = \(4, 8\).*got \(3, 8\)"):
        read_linear_heads([(good, good, good), (good, (torch.randn(3, 8), None), good)])
    with pytest.raises(ValueError, match="3 heads of width d_k = 4 make 12 columns, not d_model = 8"):
        read_linear_heads([(good, good, good)] * 3)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must divide h\*d_k \(8\)"):
        write_linear_heads(weights(), 3)


def test_bert_round_trip_and_transformers_layer() -> None:
    w = weights()
    self_attention, self_output = write_bert(w)
    same(read_bert(self_attention, self_output), w)
    bert = pytest.importorskip("transformers.models.bert.modeling_bert")
    from transformers import BertConfig

    config = BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=16, num_hidden_layers=1)
    config._attn_implementation = "eager"
    layer = bert.BertAttention(config).eval().double()
    layer.self.load_state_dict(self_attention.state_dict(), strict=False)
    layer.output.dense.load_state_dict(self_output["dense"].state_dict())
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = layer.output.dense(layer.self(x)[0])
    torch.testing.assert_close(MultiHeadAttention.from_projections(read_bert(layer.self, layer.output), 2)(x, x, x)[0], expected)


def test_bert_reader_errors() -> None:
    self_attention, self_output = write_bert(weights())
    with pytest.raises(TypeError, match="self_output.dense must be an nn.Linear, got NoneType"):
        read_bert(self_attention, nn.Module())
    with pytest.raises(TypeError, match="self_attention.query must be an nn.Linear, got Identity"):
        read_bert(nn.ModuleDict({"query": nn.Identity()}), self_output)


