"""attnlib.decoding.DecoderAttention against the formula written as a loop over heads: head
i reads key/value group i // (h/g), queries and keys turned by RoPE at their positions, on
every path (explicit weights, SDPA with need_weights=False, a per-head mask, the KV cache
one token at a time) and after expand_kv_heads. Written to kill what mutation testing
(``make mutants``) and planted bugs found unchecked."""

from __future__ import annotations

import pytest
import torch

from attnlib.attention import attention, causal_mask
from attnlib.decoding import DecoderAttention, KVCache, apply_rope

F64 = torch.float64


def _layer(rope: bool) -> DecoderAttention:
    torch.manual_seed(0)
    m = DecoderAttention(8, 4, num_kv_heads=2, rope_base=100.0 if rope else None, dtype=F64)
    with torch.no_grad():
        for b in (m.b_q, m.b_k, m.b_v, m.b_o):
            b.normal_()
    return m


def _loop(m: DecoderAttention, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    h, g, d_k = m.num_heads, m.num_kv_heads, m.d_k
    n = x.shape[1]
    heads = []
    for i in range(h):
        j = i // (h // g)  # the group head i reads
        cq, ck = slice(i * d_k, (i + 1) * d_k), slice(j * d_k, (j + 1) * d_k)
        q, k, v = x @ m.w_q[:, cq] + m.b_q[cq], x @ m.w_k[:, ck] + m.b_k[ck], x @ m.w_v[:, ck] + m.b_v[ck]
        if m.rope_base is not None:
            q, k = apply_rope(q, torch.arange(n), m.rope_base), apply_rope(k, torch.arange(n), m.rope_base)
        heads.append(attention(q, k, v, mask=None if mask is None else mask[:, i])[0])
    return torch.cat(heads, -1) @ m.w_o + m.b_o


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
def test_grouped_heads_read_their_group(rope: bool, need_weights: bool) -> None:
    m = _layer(rope)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, generator=g, dtype=F64)
    mask = (torch.rand(2, 4, 3, 3, generator=g) < 0.5) | (torch.arange(3) == 0)  # per head, key 0 always
    with torch.no_grad():
        for mk in (None, mask, causal_mask(3).expand(2, 4, 3, 3)):
            ref = _loop(m, x, mk)
            out, w = m(x, x, x, mask=mk, need_weights=need_weights)
            assert torch.allclose(out, ref, rtol=0, atol=1e-13)
            assert (w is None) == (not need_weights)
            if not rope:
                wide = m.expand_kv_heads()
                assert wide.num_kv_heads == 4
                assert torch.allclose(wide(x, x, x, mask=mk)[0], ref, rtol=0, atol=1e-13)
                assert torch.allclose(m.as_plain()(x, x, x, mask=mk)[0], ref, rtol=0, atol=1e-13)


@pytest.mark.parametrize("rope", [False, True])
def test_cached_decoding_is_the_causal_pass(rope: bool) -> None:
    m = _layer(rope)
    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(2), dtype=F64)
    with torch.no_grad():
        ref = _loop(m, x, causal_mask(5)[None, None].expand(1, 4, 5, 5))
        cache = KVCache()
        steps = [m(x[:, :2], x[:, :2], x[:, :2], cache=cache)[0]]
        for t in range(2, 5):
            xt = x[:, t:t + 1]
            steps.append(m(xt, xt, xt, cache=cache)[0])
    assert torch.allclose(torch.cat(steps, 1), ref, rtol=0, atol=1e-13)
    assert len(cache) == 5 and cache.keys.shape == (1, 2, 5, 2)


def test_repr_names_the_groups_and_rope() -> None:
    assert repr(DecoderAttention(8, 4, dtype=F64)) == "DecoderAttention(d_model=8, num_heads=4, d_k=2, bias=True)"
    assert repr(_layer(True)) == ("DecoderAttention(d_model=8, num_heads=4, d_k=2, bias=True, num_kv_heads=2, "
                                  "rope_base=100)")
    assert repr(DecoderAttention(8, 4, rope_base=10000.0)).endswith("bias=True, rope_base=10000)")


def test_rebuilt_from_its_grouped_projections_on_their_device() -> None:
    m = _layer(True)
    for rebuild in (DecoderAttention.from_grouped_projections, DecoderAttention.from_grouped_weights):
        again = rebuild(m.grouped_projections())
        assert (again.num_kv_heads, again.rope_base) == (2, 100.0)
        for (name, p), q in zip(m.named_parameters(), again.parameters()):
            assert torch.equal(p, q), name
    meta = DecoderAttention(8, 4, num_kv_heads=2, device="meta")
    again = DecoderAttention.from_grouped_projections(meta.grouped_projections())
    assert {p.device.type for p in again.parameters()} == {"meta"}
