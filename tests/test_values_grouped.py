"""attnlib.decoding.DecoderAttention against the formula written as a loop over heads: head
i reads key/value group i // (h/g), queries and keys turned by RoPE at their positions, on
every path (explicit weights, SDPA with need_weights=False, a per-head mask, the KV cache
one token at a time) and after expand_kv_heads. Written to kill what mutation testing
(``make mutants``) and planted bugs found unchecked."""

from __future__ import annotations

import pytest
import torch

from attnlib.attention import attention, causal_mask
from attnlib.decoding import DecoderAttention, GroupedAttentionWeights, KVCache, apply_rope

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


def _grouped_args(**change: object) -> dict[str, object]:
    """A valid GroupedAttentionWeights: d_model 4, h 2, g 1, d_k 2, with biases; ``change`` replaces some."""
    z = torch.zeros
    args: dict[str, object] = dict(w_q=z(4, 4), w_k=z(4, 2), w_v=z(4, 2), w_o=z(4, 4), num_heads=2, num_kv_heads=1,
                      b_q=z(4), b_k=z(2), b_v=z(2), b_o=z(4))
    return args | change


GROUPED_REFUSALS: dict[str, tuple[dict[str, object], type[Exception], str]] = {
    "num_heads 0": ({"num_heads": 0}, ValueError, "^num_heads must be a positive int, got 0$"),
    "g not dividing h": ({"num_kv_heads": 3}, ValueError, r"^num_kv_heads \(3\) must divide num_heads \(2\)$"),
    "w_k None": ({"w_k": None}, TypeError, "^w_k must be a torch.Tensor, got NoneType$"),
    "b_q a str": ({"b_q": "x"}, TypeError, "^b_q must be a torch.Tensor, got str$"),
    "w_q 1-D": ({"w_q": torch.zeros(4)}, ValueError,
                r"^w_q must have shape \(d_model, h\*d_k\) with num_heads=2 heads, got \(4,\)$"),
    "w_q odd columns": ({"w_q": torch.zeros(4, 3)}, ValueError, r"with num_heads=2 heads, got \(4, 3\)$"),
    "w_q no columns": ({"w_q": torch.zeros(4, 0)}, ValueError, r"with num_heads=2 heads, got \(4, 0\)$"),
    "w_k wide": ({"w_k": torch.zeros(4, 4)}, ValueError,
                 r"^w_k must have shape \(4, 2\) for d_model=4, num_heads=2, num_kv_heads=1, d_k=2, got \(4, 4\)$"),
    "b_q short": ({"b_q": torch.zeros(2)}, ValueError, r"^b_q must have shape \(4,\) for d_model=4.*got \(2,\)$"),
    "b_k wrong, b_q none": ({"b_q": None, "b_k": torch.zeros(3)}, ValueError, r"^b_k must have shape \(2,\)"),
    "some biases": ({"b_q": None}, ValueError, "^biases must be given for all four projections or for none$"),
    "rope_base 1": ({"rope_base": 1.0}, ValueError, r"^rope_base \(RoPE's theta\) must be > 1, got 1.0$"),
}


@pytest.mark.parametrize("case", GROUPED_REFUSALS)
def test_grouped_weights_refusals(case: str) -> None:
    change, error, match = GROUPED_REFUSALS[case]
    with pytest.raises(error, match=match):
        GroupedAttentionWeights(**_grouped_args(**change))  # type: ignore[arg-type]
    w = GroupedAttentionWeights(**_grouped_args(rope_base=10.0))  # type: ignore[arg-type]
    assert (w.d_model, w.d_k, w.bias, w.rope_base) == (4, 2, True, 10.0)


def test_a_cache_call_needs_one_tensor_for_query_key_and_value() -> None:
    m = _layer(False)
    x = torch.zeros(1, 2, 8, dtype=F64)
    for args in ((x, x.tolist(), x), (x.tolist(), x.tolist(), x.tolist()), (x, x.clone(), x)):
        with pytest.raises(ValueError, match="^a call with a cache is self-attention over the new tokens"):
            m(*args, cache=KVCache())
    out, _ = m(x[:, :1], x[:, :1], x[:, :1], cache=KVCache())  # x[:, :1] taken three times: one tensor
    assert out.shape == (1, 1, 8)


def test_cached_decoding_on_the_meta_device() -> None:
    """Every tensor made inside the call (positions, the causal mask) is made on the inputs'
    device: on meta, a prefill and a step run through and give the shapes only."""
    m = DecoderAttention(8, 4, num_kv_heads=2, rope_base=100.0, device="meta")
    cache = KVCache()
    for n, n_k in ((3, 3), (1, 4)):
        x = torch.empty(1, n, 8, device="meta")
        out, w = m(x, x, x, cache=cache)
        assert out.device.type == "meta" and out.shape == (1, n, 8) and w is not None and w.shape == (1, 4, n, n_k)
    assert len(cache) == 4


def test_a_mask_is_checked_before_the_groups() -> None:
    m = _layer(True)
    x = torch.zeros(1, 3, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"^mask of shape \(1, 3, 3\) is 3-D, which is ambiguous"):
        m(x, x, x, mask=torch.ones(1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^mask of shape \(3, 2\) does not broadcast to the scores' shape \(1, 4, 3, 3\)$"):
        m(x, x, x, mask=torch.ones(3, 2, dtype=torch.bool))
