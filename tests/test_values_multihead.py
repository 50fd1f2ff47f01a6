"""attnlib.MultiHeadAttention against the paper's formula written as a loop over heads, on a
hand-sized layer with random biases: every path of the forward (the in-place softmax under
no_grad without a mask, the masked one, autograd, SDPA with need_weights=False) and the
head views. Written to kill what mutation testing (``make mutants``) and planted bugs found
unchecked."""

from __future__ import annotations

import math

import pytest
import torch

from attnlib import MultiHeadAttention
from attnlib.multihead import plain_view
from attnlib.attention import attention

F64 = torch.float64


def _layer(d_model: int = 6, h: int = 3) -> MultiHeadAttention:
    torch.manual_seed(0)
    m = MultiHeadAttention(d_model, h, dtype=F64)
    with torch.no_grad():
        for b in (m.b_q, m.b_k, m.b_v, m.b_o):
            b.normal_()
    return m


def _loop(m: MultiHeadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Concat(head_0, ..., head_{h-1}) W^O + b^O, head_i = Attention(q W_i^Q + b_i^Q, ...)."""
    d_k = m.d_model // m.num_heads
    heads, weights = [], []
    for i in range(m.num_heads):
        c = slice(i * d_k, (i + 1) * d_k)
        out, w = attention(q @ m.w_q[:, c] + m.b_q[c], k @ m.w_k[:, c] + m.b_k[c], v @ m.w_v[:, c] + m.b_v[c],
                           mask=None if mask is None else mask[:, i] if mask.dim() == 4 else mask)
        heads.append(out)
        weights.append(w)
    return torch.cat(heads, -1) @ m.w_o + m.b_o, torch.stack(weights, 1)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_forward_is_the_loop_over_heads(grad: bool, masked: bool) -> None:
    m = _layer()
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(2, 3, 6, generator=g, dtype=F64), torch.randn(2, 4, 6, generator=g, dtype=F64)
    mask = (torch.rand(2, 3, 3, 4, generator=g) < 0.6) | (torch.arange(4) == 0) if masked else None
    with torch.no_grad():
        ref_out, ref_w = _loop(m, q, kv, kv, mask)
    with torch.set_grad_enabled(grad):
        out, w = m(q, kv, kv, mask=mask)
        fused, none = m(q, kv, kv, mask=mask, need_weights=False)
    assert none is None
    assert torch.allclose(w, ref_w, rtol=0, atol=1e-14)
    assert torch.allclose(w.sum(-1), torch.ones(2, 3, 3, dtype=F64), rtol=0, atol=1e-14)
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-13)
    assert torch.allclose(fused, ref_out, rtol=0, atol=1e-13)


def test_a_one_head_layer_by_hand() -> None:
    """d_model = 2, one head: identity projections, no bias; scores x_i . x_j / sqrt 2."""
    m = MultiHeadAttention(2, 1, bias=False, dtype=F64)
    with torch.no_grad():
        for w in (m.w_q, m.w_k, m.w_v, m.w_o):
            w.copy_(torch.eye(2, dtype=F64))
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=F64)
    a = 1 / (1 + math.exp(-1 / math.sqrt(2)))
    with torch.no_grad():
        out, w = m(x, x, x)
    assert torch.allclose(w, torch.tensor([[[[a, 1 - a], [1 - a, a]]]], dtype=F64), rtol=0, atol=1e-15)
    assert torch.allclose(out, torch.tensor([[[a, 1 - a], [1 - a, a]]], dtype=F64), rtol=0, atol=1e-15)


def test_head_views_are_the_columns_of_each_head() -> None:
    m = _layer()
    for i in range(3):
        hw = m.head(i)
        c = slice(2 * i, 2 * i + 2)
        for got, full in ((hw.w_q, m.w_q[:, c]), (hw.w_k, m.w_k[:, c]), (hw.w_v, m.w_v[:, c]),
                          (hw.w_o, m.w_o[c, :]), (hw.b_q, m.b_q[c]), (hw.b_k, m.b_k[c]), (hw.b_v, m.b_v[c])):
            assert torch.equal(got, full)
        assert torch.equal(m.w_q_heads[i], m.w_q[:, c]) and torch.equal(m.w_k_heads[i], m.w_k[:, c])
        assert torch.equal(m.w_v_heads[i], m.w_v[:, c]) and torch.equal(m.w_o_heads[i], m.w_o[c, :])
    assert m.d_v == m.d_k == 2 and m.bias
    assert repr(m) == "MultiHeadAttention(d_model=6, num_heads=3, d_k=2, bias=True)"
    plain = MultiHeadAttention(4, 2, bias=False)
    assert plain.head(1).b_q is None and not plain.bias and plain.b_o is None


def test_initialisation_bounds() -> None:
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 2)
    bound = math.sqrt(6 / 16)
    for w in (m.w_q, m.w_k, m.w_v, m.w_o):
        assert w.abs().max() <= bound and w.abs().max() > bound / 2
    for b in (m.b_q, m.b_k, m.b_v, m.b_o):
        assert torch.equal(b, torch.zeros(8))


def test_every_parameter_is_made_on_the_device_asked_for() -> None:
    """The meta device (no memory, no numbers) shows where each parameter was made; so does a
    layer rebuilt from the projections of one there."""
    m = MultiHeadAttention(4, 2, device="meta")
    assert {p.device.type for p in m.parameters()} == {"meta"} and len(list(m.parameters())) == 8
    again = MultiHeadAttention.from_projections(m.projections(), 2)
    assert {p.device.type for p in again.parameters()} == {"meta"}


def test_a_key_mask_of_one_axis_on_the_fused_path() -> None:
    """need_weights=False hands SDPA the (n_k,) mask as (1, n_k): key 1 is never read."""
    m = _layer()
    g = torch.Generator().manual_seed(2)
    q, kv = torch.randn(1, 2, 6, generator=g, dtype=F64), torch.randn(1, 3, 6, generator=g, dtype=F64)
    keep = torch.tensor([True, False, True])
    with torch.no_grad():
        out, none = m(q, kv, kv, mask=keep, need_weights=False)
        ref, _ = _loop(m, q, kv, kv, keep)
    assert none is None
    assert torch.allclose(out, ref, rtol=0, atol=1e-13)


def test_to_torch_is_batch_first() -> None:
    m = _layer()
    t = m.to_torch()
    assert t.batch_first
    x = torch.randn(2, 3, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(t(x, x, x, need_weights=False)[0], m(x, x, x)[0], rtol=0, atol=1e-13)


class _RefusesByValue(MultiHeadAttention):
    def as_plain(self) -> MultiHeadAttention:
        raise ValueError("no plain view at this base")


def test_plain_view_refuses_what_has_no_as_plain_and_keeps_the_error_type() -> None:
    with pytest.raises(TypeError, match="^m must be an attnlib.MultiHeadAttention, got object$"):
        plain_view(object(), "m", "a tool")
    with pytest.raises(ValueError, match="^a tool: no plain view at this base$"):
        plain_view(_RefusesByValue(4, 2), "m", "a tool")
