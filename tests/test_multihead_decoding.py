"""attnlib.MultiHeadAttention as a decoder layer: grouped keys/values (GQA/MQA), RoPE, KVCache.

The references are independent of the fused forward: a loop over heads with
:func:`attnlib.attention` on the :meth:`head` views (RoPE applied with
:func:`attnlib.decoding.apply_rope`), and plain multi-head attention whose K/V
weights are repeated per group with ``repeat_interleave``. Every error path has a test.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

from attnlib import KVCache, LatentCache, MultiHeadAttention, SeparateHeadsAttention, attention
from attnlib.decoding import DecoderAttention
from attnlib.decoding import apply_rope, causal_mask
from strategies import DTYPE, SETTINGS, TOL, Case, decoder_cases


def _reference(mha: MultiHeadAttention, query: Tensor, key: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Head by head with attnlib.attention on the head(i) views, RoPE by apply_rope."""
    outs, maps = [], []
    for i in range(mha.num_heads):
        hw = mha.head(i)
        q, k, v = query @ hw.w_q, key @ hw.w_k, key @ hw.w_v  # (B, n, d_k)
        if hw.b_q is not None:
            q, k, v = q + hw.b_q, k + hw.b_k, v + hw.b_v
        if mha.rope_base is not None:
            q, k = apply_rope(q, base=mha.rope_base), apply_rope(k, base=mha.rope_base)
        m = None
        if mask is not None:
            m4 = mask.expand(query.shape[0], mha.num_heads, query.shape[1], key.shape[1])
            m = m4[:, i]
        o, w = attention(q, k, v, mask=m)
        outs.append(o @ hw.w_o)
        maps.append(w)
    out = torch.stack(outs).sum(0)
    if mha.b_o is not None:
        out = out + mha.b_o
    return out, torch.stack(maps, dim=1)


def _repeat_kv_weights(mha: DecoderAttention) -> DecoderAttention:
    """Plain MHA with each K/V column block repeated for its group (repeat_interleave)."""
    h, g, d_k = mha.num_heads, mha.num_kv_heads, mha.d_k
    plain = DecoderAttention(mha.d_model, h, mha.bias, rope_base=mha.rope_base, d_k=d_k, dtype=DTYPE)
    idx = torch.arange(g).repeat_interleave(h // g)  # group of each query head
    cols = (idx[:, None] * d_k + torch.arange(d_k)).flatten()  # (h*d_k,)
    with torch.no_grad():
        plain.w_q.copy_(mha.w_q)
        plain.w_o.copy_(mha.w_o)
        plain.w_k.copy_(mha.w_k[:, cols])
        plain.w_v.copy_(mha.w_v[:, cols])
        if mha.bias:
            plain.b_q.copy_(mha.b_q)
            plain.b_o.copy_(mha.b_o)
            plain.b_k.copy_(mha.b_k[cols])  # type: ignore[index]
            plain.b_v.copy_(mha.b_v[cols])  # type: ignore[index]
    return plain


# ---- GQA / MQA / RoPE ---------------------------------------------------------------------------


@SETTINGS
@given(decoder_cases(), st.booleans())
def test_grouped_attention_equals_the_head_by_head_reference(case: Case, need_weights: bool) -> None:
    mha = case.mha
    out, w = mha(case.query, case.key, case.key, mask=case.mask, need_weights=need_weights)
    ref_out, ref_w = _reference(mha, case.query, case.key, case.mask)
    torch.testing.assert_close(out, ref_out, **TOL)
    if need_weights:
        torch.testing.assert_close(w, ref_w, **TOL)
    else:
        assert w is None


@SETTINGS
@given(decoder_cases())
def test_gqa_equals_mha_with_kv_weights_repeated_per_group(case: Case) -> None:
    mha = case.mha
    plain = _repeat_kv_weights(mha)
    out, w = mha(case.query, case.key, case.key, mask=case.mask)
    out_p, w_p = plain(case.query, case.key, case.key, mask=case.mask)
    torch.testing.assert_close(out, out_p, **TOL)
    torch.testing.assert_close(w, w_p, **TOL)
    expanded = mha.expand_kv_heads()
    assert expanded.num_kv_heads == mha.num_heads and expanded.rope_base == mha.rope_base
    for name, p in plain.named_parameters():
        torch.testing.assert_close(getattr(expanded, name), p, atol=0, rtol=0)


def test_mqa_one_key_value_head_serves_all() -> None:
    torch.manual_seed(0)
    mqa = DecoderAttention(12, 4, num_kv_heads=1, dtype=DTYPE)
    assert mqa.w_k.shape == (12, 3) and mqa.w_v.shape == (12, 3) and mqa.b_k.shape == (3,)
    assert mqa.group_size == 4 and mqa.w_k_heads.shape == (1, 12, 3)
    x = torch.randn(2, 5, 12, dtype=DTYPE)
    out, w = mqa(x, x, x)
    ref, ref_w = _reference(mqa, x, x, None)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(w, ref_w, **TOL)


def test_head_views_follow_the_groups() -> None:
    mha = DecoderAttention(12, 6, num_kv_heads=2)  # d_k = 2, groups of 3 heads
    assert mha.w_k.shape == (12, 4) and mha.w_q_heads.shape == (6, 12, 2)
    assert mha.w_k_heads.shape == (2, 12, 2) and mha.w_v_heads.shape == (2, 12, 2)
    for i in range(6):
        j = i // 3
        hw = mha.head(i)
        assert hw.w_k.data_ptr() == mha.w_k_heads[j].data_ptr()  # a view, shared by the group
        torch.testing.assert_close(hw.w_v, mha.w_v[:, 2 * j : 2 * j + 2], atol=0, rtol=0)
        torch.testing.assert_close(hw.b_k, mha.b_k[2 * j : 2 * j + 2], atol=0, rtol=0)
        torch.testing.assert_close(hw.w_q, mha.w_q[:, 2 * i : 2 * i + 2], atol=0, rtol=0)
    assert "num_kv_heads=2" in repr(mha)
    assert "rope_base=500" in repr(DecoderAttention(4, 2, rope_base=500))


def test_shared_block_gradient_is_the_sum_of_its_heads_gradients() -> None:
    torch.manual_seed(0)
    gqa = DecoderAttention(8, 4, num_kv_heads=2, rope_base=10000.0, dtype=DTYPE)
    plain = gqa.expand_kv_heads()
    x = torch.randn(2, 5, 8, dtype=DTYPE)
    seed = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    for m in (gqa, plain):
        out, _ = m(x, x, x, mask=causal_mask(5))
        (out * seed).sum().backward()
    d_k = 2
    for name in ("w_k", "w_v", "b_k", "b_v"):
        g_plain = getattr(plain, name).grad  # (.., h*d_k)
        summed = g_plain.unflatten(-1, (2, 2, d_k)).sum(-2).flatten(-2)  # heads of one group added
        torch.testing.assert_close(getattr(gqa, name).grad, summed, **TOL)
    torch.testing.assert_close(gqa.w_q.grad, plain.w_q.grad, **TOL)


def test_rope_scores_depend_on_offsets_not_positions() -> None:
    """With RoPE, a token's score with another depends on their distance: the scores of a
    sequence read after a cache of 3 unrelated tokens equal those of a fresh pass."""
    torch.manual_seed(0)
    mha = DecoderAttention(8, 2, rope_base=50.0, dtype=DTYPE)
    x = torch.randn(1, 4, 8, dtype=DTYPE)
    _, w_fresh = mha(x, x, x, mask=causal_mask(4))
    cache = KVCache()
    mha(p := torch.randn(1, 3, 8, dtype=DTYPE), p, p, cache=cache)
    _, w_late = mha(x, x, x, cache=cache)  # positions 3..6
    assert w_late is not None and w_fresh is not None
    w_new = w_late[..., 3:] / w_late[..., 3:].sum(-1, keepdim=True)  # drop the earlier 3 tokens
    torch.testing.assert_close(w_new, w_fresh, **TOL)
    # Without RoPE the scores ignore order: reversing the sequence reverses the map's rows
    # and columns. With RoPE it does not.
    full = torch.ones(4, 4, dtype=torch.bool)
    xf = x.flip(1)
    for m, order_blind in ((DecoderAttention(8, 2, dtype=DTYPE), True), (mha, False)):
        _, w = m(x, x, x, mask=full)
        _, w_f = m(xf, xf, xf, mask=full)
        assert w is not None and w_f is not None
        assert torch.allclose(w_f.flip(-1).flip(-2), w) == order_blind


# ---- the KV cache -------------------------------------------------------------------------------


@SETTINGS
@given(decoder_cases(cross_ok=False), st.integers(1, 5), st.booleans())
def test_cached_decoding_equals_the_full_causal_pass(case: Case, prefill: int, need_weights: bool) -> None:
    mha, x = case.mha, case.query
    B, n, _ = x.shape
    prefill = min(prefill, n)
    full, w_full = mha(x, x, x, mask=causal_mask(n))
    cache = KVCache()
    first = x[:, :prefill]
    outs = [mha(first, first, first, need_weights=need_weights, cache=cache)[0]]
    for t in range(prefill, n):
        step = x[:, t : t + 1]  # (B, 1, d_model)
        out, w = mha(step, step, step, need_weights=need_weights, cache=cache)
        if need_weights:
            assert w is not None and w.shape == (B, mha.num_heads, 1, t + 1)
            torch.testing.assert_close(w, w_full[:, :, t : t + 1, : t + 1], **TOL)  # type: ignore[index]
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL)
    g, d_k = mha.num_kv_heads, mha.d_k
    assert len(cache) == n
    assert cache.keys is not None and cache.keys.shape == (B, g, n, d_k)
    assert cache.values is not None and cache.values.shape == (B, g, n, d_k)
    assert cache.nbytes == 2 * B * n * g * d_k * 8


def test_cache_holds_only_keys_and_values() -> None:
    """nbytes counts what the cache keeps alive: its tensors are not views of a bigger one."""
    mha = DecoderAttention(16, 4, num_kv_heads=2)
    x = torch.randn(3, 7, 16)
    cache = KVCache()
    mha(x, x, x, cache=cache)
    keys, values = cache.keys, cache.values
    assert keys is not None and values is not None
    for t in (keys, values):
        assert t.untyped_storage().nbytes() == t.numel() * 4
    assert cache.nbytes == 2 * 3 * 7 * 2 * 4 * 4 == 1344
    assert repr(cache) == "KVCache(len=7, keys=(3, 2, 7, 4), values=(3, 2, 7, 4), dtype=torch.float32)"


def test_cache_keys_are_stored_after_rope() -> None:
    mha = DecoderAttention(8, 2, num_kv_heads=1, rope_base=10.0, bias=False, dtype=DTYPE)
    x = torch.randn(1, 3, 8, dtype=DTYPE)
    cache = KVCache()
    mha(x, x, x, cache=cache)
    k = (x @ mha.w_k).view(1, 3, 1, 4).transpose(1, 2)  # (1, 1, 3, 4)
    torch.testing.assert_close(cache.keys, apply_rope(k, base=10.0), **TOL)


def _filled(mha: MultiHeadAttention, B: int = 2, dtype: torch.dtype = torch.float32) -> KVCache:
    cache = KVCache()
    x = torch.randn(B, 2, mha.d_model, dtype=dtype)
    mha(x, x, x, cache=cache)
    return cache


def test_cache_misuse_errors() -> None:
    mha = DecoderAttention(8, 2, num_kv_heads=1)
    x = torch.randn(2, 1, 8)
    y = torch.randn(2, 1, 8)
    with pytest.raises(TypeError, match="cache must be an attnlib.KVCache"):
        mha(x, x, x, cache=LatentCache())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mask cannot be combined with cache"):
        mha(x, x, x, mask=causal_mask(1), cache=KVCache())
    with pytest.raises(ValueError, match="self-attention over the new tokens"):
        mha(x, y, y, cache=KVCache())
    with pytest.raises(ValueError, match="self-attention over the new tokens"):
        mha(x, x, x.clone(), cache=KVCache())
    cache = _filled(mha)
    with pytest.raises(ValueError, match="batch size 3 does not match the KVCache's batch size 2"):
        z = torch.randn(3, 1, 8)
        mha(z, z, z, cache=cache)
    other = DecoderAttention(8, 2, num_kv_heads=1)
    with pytest.raises(ValueError, match="another module"):
        other(x, x, x, cache=cache)
    mha64 = DecoderAttention(8, 2, num_kv_heads=1, dtype=DTYPE)
    cache64 = _filled(mha64, dtype=DTYPE)
    mha64.float()
    with pytest.raises(ValueError, match="dtype torch.float32 does not match the KVCache's dtype torch.float64"):
        mha64(x, x, x, cache=cache64)
    assert len(cache) == 2  # the failed calls appended nothing
    cache.clear()
    other(x, x, x, cache=cache)
    assert len(cache) == 1


@pytest.mark.parametrize("need_weights", [True, False])
def test_cached_decoding_under_autocast(need_weights: bool) -> None:
    """Under autocast the keys are bfloat16 while the inputs stay float32: the cache holds
    what the projections produced, and every later call under the same autocast reads it."""
    torch.manual_seed(0)
    mha = DecoderAttention(16, 4, num_kv_heads=2, rope_base=100.0)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        ref, _ = mha(x, x, x, mask=causal_mask(6))  # float32, one causal pass
        cache = KVCache()
        with torch.autocast("cpu", torch.bfloat16):
            outs = [mha(t, t, t, need_weights=need_weights, cache=cache)[0] for t in (x[:, :4], x[:, 4:5], x[:, 5:])]
    assert cache.dtype == torch.bfloat16 and len(cache) == 6
    torch.testing.assert_close(torch.cat(outs, dim=1).float(), ref, atol=0.05, rtol=0.05)
    t = x[:, 5:]
    with pytest.raises(ValueError, match=r"dtype torch.float32 does not match the KVCache's dtype torch.bfloat16: .* same autocast"):
        mha(t, t, t, cache=cache)  # the same cache outside autocast


def test_kv_cache_update_refuses_other_head_shapes() -> None:
    cache = KVCache()
    m = nn.Identity()
    cache.update(m, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"new keys of shape \(1, 1, 1, 4\) do not fit the cached keys of shape \(1, 2, 3, 4\)"):
        cache.update(m, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    with pytest.raises(ValueError, match="device"):
        cache.update(m, torch.zeros(1, 2, 1, 4, device="meta"), torch.zeros(1, 2, 1, 4, device="meta"))


def test_kv_cache_update_refuses_keys_and_values_that_do_not_pair_up() -> None:
    cache, m = KVCache(), nn.Identity()
    with pytest.raises(ValueError, match=r"keys of shape \(1, 2, 3, 4\) and values of shape \(1, 2, 5, 4\) must have the same \(B, g, t\)"):
        cache.update(m, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4))
    with pytest.raises(ValueError, match=r"values must have shape \(B, g, t, d_v\), got \(2, 3, 4\)"):
        cache.update(m, torch.zeros(1, 2, 3, 4), torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match="keys must be a torch.Tensor, got list"):
        cache.update(m, [0.0], torch.zeros(1, 2, 3, 4))  # type: ignore[arg-type]
    assert len(cache) == 0


def test_cache_of_a_garbage_collected_module() -> None:
    import gc

    mha = DecoderAttention(8, 2)
    cache = _filled(mha)
    del mha
    gc.collect()
    other = DecoderAttention(8, 2)
    x = torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match=r"filled by a module that no longer exists \(it was garbage-collected\); call cache.clear\(\)"):
        other(x, x, x, cache=cache)
    cache.clear()
    other(x, x, x, cache=cache)
    assert len(cache) == 1


# ---- constructor and conversion errors --------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"num_kv_heads": 3}, ValueError, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be a positive int, got 0"),
        ({"num_kv_heads": True}, TypeError, "num_kv_heads must be a positive int, got bool True"),
        ({"num_kv_heads": 2.0}, TypeError, "num_kv_heads must be a positive int, got float"),
        ({"rope_base": 1.0}, ValueError, r"rope_base \(RoPE's theta\) must be > 1"),
        ({"rope_base": "big"}, TypeError, r"rope_base \(RoPE's theta\) must be a number"),
    ],
)
def test_constructor_errors(kw: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        DecoderAttention(8, 4, **kw)  # type: ignore[arg-type]


def test_rope_needs_an_even_head_width() -> None:
    with pytest.raises(ValueError, match="rope_base needs an even head width d_k .* got d_k = 3"):
        DecoderAttention(6, 2, rope_base=10000.0)


def test_torch_conversions_read_the_plain_view() -> None:
    """to_torch writes a grouped layer out (its plain view); RoPE is refused by name. A grouped
    or rotary layer's projections() would drop what it adds: refused, pointing to grouped_projections()."""
    x = torch.randn(2, 5, 8, dtype=DTYPE)
    grouped = DecoderAttention(8, 4, num_kv_heads=2, dtype=DTYPE)
    torch.testing.assert_close(grouped.to_torch()(x, x, x, need_weights=False)[0], grouped(x, x, x)[0], **TOL)
    with pytest.raises(ValueError, match=r"to_torch: DecoderAttention with RoPE \(rope_base=10000\) has no plain view"):
        DecoderAttention(8, 4, rope_base=10000.0).to_torch()
    for layer in (grouped, DecoderAttention(8, 4, rope_base=10000.0)):
        with pytest.raises(ValueError, match="projections.. is the plain layer's record.*use grouped_projections"):
            layer.projections()
    m = nn.MultiheadAttention(8, 4, batch_first=True)
    assert type(DecoderAttention.from_torch(m)) is DecoderAttention
    with pytest.raises(TypeError, match="weights must be an attnlib.AttentionWeights, got GroupedAttentionWeights"):
        MultiHeadAttention.from_projections(grouped.grouped_projections(), 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GroupedAttentionWeights"):
        DecoderAttention.from_grouped_projections(DecoderAttention(8, 4).projections())  # type: ignore[arg-type]


def test_separate_heads_read_the_plain_view() -> None:
    """SeparateHeadsAttention has neither RoPE nor groups: RoPE is refused by name, and a
    grouped layer is copied with its groups written out (the same function)."""
    with pytest.raises(ValueError, match=r"SeparateHeadsAttention.from_fused: DecoderAttention with RoPE "
                                         r"\(rope_base=10000\) has no plain view"):
        SeparateHeadsAttention.from_fused(DecoderAttention(8, 2, rope_base=10000.0))
    with pytest.raises(TypeError, match="mha must be an attnlib.MultiHeadAttention, got Linear"):
        SeparateHeadsAttention.from_fused(nn.Linear(8, 8))  # type: ignore[arg-type]
    grouped = DecoderAttention(8, 4, num_kv_heads=2, dtype=DTYPE)
    x = torch.randn(2, 3, 8, dtype=DTYPE)
    sep = SeparateHeadsAttention.from_fused(grouped)
    torch.testing.assert_close(sep(x, x, x)[0], grouped(x, x, x)[0], **TOL)


def test_as_plain_of_a_grouped_layer_is_the_plain_class_with_the_groups_written_out() -> None:
    grouped = DecoderAttention(12, 6, num_kv_heads=2, dtype=DTYPE)
    plain = grouped.as_plain()
    assert type(plain) is MultiHeadAttention and plain.w_k.shape == (12, 12)
    x = torch.randn(2, 4, 12, dtype=DTYPE)
    mask = causal_mask(4)
    torch.testing.assert_close(plain(x, x, x, mask=mask)[0], grouped(x, x, x, mask=mask)[0], **TOL)
    expanded = grouped.expand_kv_heads()
    assert all(torch.equal(getattr(plain, n), getattr(expanded, n)) for n, _ in plain.named_parameters())


def test_grouped_projections_round_trip() -> None:
    mha = DecoderAttention(12, 6, num_kv_heads=3, rope_base=1000.0)
    again = DecoderAttention.from_grouped_projections(mha.grouped_projections())
    assert (again.num_heads, again.num_kv_heads, again.rope_base) == (6, 3, 1000.0)
    for name, p in mha.named_parameters():
        torch.testing.assert_close(getattr(again, name), p, atol=0, rtol=0)


def test_the_decoder_layer_is_built_as_itself() -> None:
    """DecoderAttention(...) is the decoder layer whatever its options; the plain class takes none
    (tests/test_multihead.py); a whole-number float is not a count of heads."""
    for kw in ({}, {"num_kv_heads": 4}, {"num_kv_heads": 2, "rope_base": 100.0}):
        assert type(DecoderAttention(8, 4, **kw)) is DecoderAttention  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_kv_heads must be a positive int, got float 4.0"):
        DecoderAttention(8, 4, num_kv_heads=4.0)  # type: ignore[arg-type]


def test_decoder_attention_without_options_equals_the_plain_layer() -> None:
    torch.manual_seed(0)
    plain = MultiHeadAttention(8, 2, dtype=DTYPE)
    dec = DecoderAttention.from_projections(plain.projections(), 2)
    x = torch.randn(2, 5, 8, dtype=DTYPE)
    mask = torch.rand(2, 1, 5, 5) > 0.3
    for need_weights in (True, False):
        out, w = dec(x, x, x, mask=mask, need_weights=need_weights)
        out_p, w_p = plain(x, x, x, mask=mask, need_weights=need_weights)
        torch.testing.assert_close(out, out_p, atol=0, rtol=0)
        assert (w is None) == (w_p is None) and (w is None or torch.equal(w, w_p))


def test_the_plain_layer_refuses_a_cache_and_says_where_one_goes() -> None:
    """A KV cache handed to chapter 3's layer is refused, naming chapter 8's layer; built the way
    the message says, that layer decodes with the cache to the plain layer's causal outputs."""
    torch.manual_seed(0)
    plain = MultiHeadAttention(8, 2, dtype=DTYPE)
    x = torch.randn(1, 4, 8, dtype=DTYPE)
    with pytest.raises(TypeError, match=r"MultiHeadAttention keeps no KV cache \(cache=KVCache\).*"
                                        r"DecoderAttention.from_projections\(layer.projections\(\), layer.num_heads\)"):
        plain(x, x, x, cache=KVCache())  # type: ignore[arg-type]
    decoder = DecoderAttention.from_projections(plain.projections(), plain.num_heads)
    cache = KVCache()
    steps = [decoder(x[:, :2], x[:, :2], x[:, :2], cache=cache)[0]]
    steps += [decoder(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache)[0] for t in (2, 3)]
    torch.testing.assert_close(torch.cat(steps, 1), plain(x, x, x, mask=causal_mask(4))[0], **TOL)
