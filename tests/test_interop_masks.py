"""attnlib.interop's mask conversions, checked against the real library calls:
``F.scaled_dot_product_attention``, ``nn.MultiheadAttention`` (``attn_mask``,
``key_padding_mask``, 3-D per-head masks), Hugging Face's eager ``BertSelfAttention``
with its extended additive mask, and transformers' ``create_bidirectional_mask``. Masks are boolean, ``True`` = may attend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnlib import MultiHeadAttention, attention
from attnlib.interop import (
    additive_mask,
    from_torch_mha_masks,
    fully_masked_rows,
    hf_extended_mask,
    mask_from_additive,
    mask_from_padding,
    to_torch_mha_masks,
)
from strategies import DTYPE, TOL, examples

FAST = examples(20)


def _mask(g: torch.Generator, *shape: int, p: float = 0.6) -> torch.Tensor:
    """A random boolean mask in which every query may attend to at least one key."""
    m = torch.rand(*shape, generator=g) < p
    m[..., 0] = True  # key 0 always allowed: no fully masked rows
    return m


@FAST
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), seed=st.integers(0, 2**16),
       fill=st.sampled_from(["-inf", "min"]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_additive_round_trip(shape: list[int], seed: int, fill: str, dtype: torch.dtype) -> None:
    mask = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    add = additive_mask(mask, dtype=dtype, fill=fill)
    assert add.shape == mask.shape and add.dtype == dtype
    assert (add[mask] == 0).all()
    assert torch.equal(mask_from_additive(add), mask)


@FAST
@given(b=st.integers(1, 3), h=st.integers(1, 3), n_q=st.integers(1, 5), n_k=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_sdpa_bool_equals_additive(b: int, h: int, n_q: int, n_k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, 3, generator=g, dtype=DTYPE) for n in (n_q, n_k, n_k))
    mask = _mask(g, b, h, n_q, n_k)
    ref, _ = attention(q, k, v, mask=mask)
    got_bool = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # True = may attend
    for fill in ("-inf", "min"):
        got_add = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(mask, DTYPE, fill))
        torch.testing.assert_close(got_add, ref, **TOL)
    torch.testing.assert_close(got_bool, ref, **TOL)


def _torch_pair(d_model: int, h: int, seed: int) -> tuple[MultiHeadAttention, nn.MultiheadAttention]:
    torch.manual_seed(seed)
    ours = MultiHeadAttention(d_model, h, dtype=DTYPE)
    return ours, ours.to_torch().eval()


@FAST
@given(b=st.integers(1, 3), h=st.sampled_from([1, 2, 4]), n=st.integers(1, 5), seed=st.integers(0, 2**16),
       per=st.sampled_from(["shared", "sequence", "head", "both"]))
def test_to_torch_mha_masks_matches_real_layer(b: int, h: int, n: int, seed: int, per: str) -> None:
    ours, theirs = _torch_pair(8, h, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, 8, generator=g, dtype=DTYPE)
    shape = {"shared": (n, n), "sequence": (b, 1, n, n), "head": (1, h, n, n), "both": (b, h, n, n)}[per]
    mask = _mask(g, *shape)
    with torch.no_grad():
        ref, w_ref = ours(x, x, x, mask=mask)
        got, w_got = theirs(x, x, x, attn_mask=to_torch_mha_masks(mask, b, h), average_attn_weights=False)
    torch.testing.assert_close(got, ref, **TOL)
    torch.testing.assert_close(w_got, w_ref, **TOL)


def test_three_d_head_order_is_batch_major() -> None:
    """(B*h, n, n): row b*h + i is sequence b, head i; so repeat_interleave, not repeat."""
    b, h, n = 2, 2, 4
    ours, theirs = _torch_pair(8, h, 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, n, 8, generator=g, dtype=DTYPE)
    per_seq = _mask(g, b, n, n, p=0.4)  # (B, n, n): one mask per sequence
    assert not torch.equal(per_seq[0], per_seq[1])
    with torch.no_grad():
        ref, _ = ours(x, x, x, mask=per_seq[:, None])
        good, _ = theirs(x, x, x, attn_mask=(~per_seq).repeat_interleave(h, 0))
        bad, _ = theirs(x, x, x, attn_mask=(~per_seq).repeat(h, 1, 1))
    torch.testing.assert_close(good, ref, **TOL)
    assert torch.equal(to_torch_mha_masks(per_seq[:, None], b, h), (~per_seq).repeat_interleave(h, 0))
    assert not torch.allclose(bad, ref)


@FAST
@given(b=st.integers(1, 3), h=st.sampled_from([1, 2]), n=st.integers(2, 5), seed=st.integers(0, 2**16),
       additive=st.booleans())
def test_from_torch_mha_masks_combines_like_torch(b: int, h: int, n: int, seed: int, additive: bool) -> None:
    ours, theirs = _torch_pair(8, h, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, 8, generator=g, dtype=DTYPE)
    allowed = _mask(g, n, n)
    padding = torch.rand(b, n, generator=g) < 0.4
    padding[:, 0] = False  # key 0 stays: every query keeps a key
    attn_mask = additive_mask(allowed, DTYPE) if additive else ~allowed
    if additive:  # torch wants both masks of one kind
        kpm_arg = additive_mask(~padding, DTYPE)
    else:
        kpm_arg = padding
    combined = from_torch_mha_masks(attn_mask, padding, b, h)  # (B, h, n, n)
    torch.testing.assert_close(combined, (allowed & ~padding[:, None, :])[:, None].expand(b, h, n, n))
    with torch.no_grad():
        ref, _ = ours(x, x, x, mask=combined)
        got, _ = theirs(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm_arg)
    torch.testing.assert_close(got, ref, **TOL)


@FAST
@given(b=st.integers(1, 3), n=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_padding_masks(b: int, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    hf = (torch.rand(b, n, generator=g) < 0.6).long()
    m = mask_from_padding(hf)
    assert m.shape == (b, 1, 1, n) and torch.equal(m[:, 0, 0], hf.bool())
    assert torch.equal(mask_from_padding(hf == 0, padding_is_true=True), m)
    ext = hf_extended_mask(hf, torch.float32)
    assert torch.equal(ext, (1.0 - hf[:, None, None, :].float()) * torch.finfo(torch.float32).min)


def _bert_self_attention(d_model: int, h: int):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=d_model, num_attention_heads=h, intermediate_size=4 * d_model,
                                     num_hidden_layers=1, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    return transformers.models.bert.modeling_bert.BertSelfAttention(config).eval()


@examples(8)
@given(b=st.integers(1, 3), n=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_hf_extended_mask_matches_real_bert(b: int, n: int, seed: int) -> None:
    torch.manual_seed(seed)
    layer = _bert_self_attention(8, 2)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, 8, generator=g)
    hf = (torch.rand(b, n, generator=g) < 0.6).long()
    hf[:, 0] = 1
    with torch.no_grad():
        got, w_got = layer(x, attention_mask=hf_extended_mask(hf, x.dtype))
        q, k, v = (layer_(x).view(b, n, 2, 4).transpose(1, 2) for layer_ in (layer.query, layer.key, layer.value))
        ref, w_ref = attention(q, k, v, mask=mask_from_padding(hf))
    torch.testing.assert_close(w_got, w_ref)
    torch.testing.assert_close(got, ref.transpose(1, 2).reshape(b, n, 8))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_create_bidirectional_mask_is_hf_extended_or_padding_mask(impl: str) -> None:
    """transformers 5's create_bidirectional_mask (what BertModel hands its layers): with
    padding, eager gives hf_extended_mask broadcast to (B, 1, n, n), SDPA the boolean
    mask_from_padding broadcast; without padding, None for both."""
    transformers = pytest.importorskip("transformers")
    from transformers.masking_utils import create_bidirectional_mask

    config = transformers.BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=16, num_hidden_layers=1)
    config._attn_implementation = impl
    b, n = 2, 5
    x = torch.randn(b, n, 8)
    hf = torch.ones(b, n, dtype=torch.long)
    assert create_bidirectional_mask(config=config, inputs_embeds=x, attention_mask=hf) is None
    hf[1, -2:] = 0
    made = create_bidirectional_mask(config=config, inputs_embeds=x, attention_mask=hf)
    assert made is not None and made.shape == (b, 1, n, n)
    if impl == "eager":
        assert torch.equal(made, hf_extended_mask(hf, x.dtype).expand(b, 1, n, n))
    else:
        assert made.dtype == torch.bool and torch.equal(made, mask_from_padding(hf).expand(b, 1, n, n))


def test_fully_masked_rows_across_libraries() -> None:
    """attnlib and SDPA give 0; nn.MultiheadAttention's explicit softmax gives NaN;
    Hugging Face's finfo.min mask gives the plain mean of the values."""
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 1, 2, 3, 4
    mask = torch.ones(n, n, dtype=torch.bool)
    mask[1] = False  # query 1 may attend to nothing
    assert fully_masked_rows(mask).tolist() == [False, True, False]
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    out_ours, w_ours = attention(q, k, v, mask=mask)
    assert (out_ours[..., 1, :] == 0).all() and (w_ours[..., 1, :] == 0).all()
    assert (F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[..., 1, :] == 0).all()
    out_min = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(mask, q.dtype, "min"))
    torch.testing.assert_close(out_min[..., 1, :], v.mean(dim=-2))
    torch.manual_seed(0)
    tm = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(1, n, 8, generator=g)
    with torch.no_grad():
        out, w = tm(x, x, x, attn_mask=to_torch_mha_masks(mask, 1, 2))
    assert out[0, 1].isnan().all() and w is not None and w[0, 1].isnan().all()
    assert not out[0, 0].isnan().any()


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="mask must have dtype torch.bool"):
        additive_mask(torch.zeros(2, 2))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        additive_mask([[True]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype must be a floating dtype"):
        additive_mask(torch.ones(2, 2, dtype=torch.bool), dtype=torch.int64)
    with pytest.raises(ValueError, match="fill must be"):
        additive_mask(torch.ones(2, 2, dtype=torch.bool), fill="zero")
    with pytest.raises(ValueError, match="it is a bias, not a mask"):
        mask_from_additive(torch.tensor([[0.0, -1.0]]))
    with pytest.raises(TypeError, match="floating-point"):
        mask_from_additive(torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"2-D tensor \(B, n_k\), got \(3,\)"):
        mask_from_padding(torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="only 0 and 1"):
        mask_from_padding(torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="key_padding_mask must have dtype torch.bool"):
        mask_from_padding(torch.tensor([[0, 1]]), padding_is_true=True)
    with pytest.raises(ValueError, match="at most 4 dimensions"):
        to_torch_mha_masks(torch.ones(1, 1, 1, 2, 2, dtype=torch.bool), 1, 1)
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, h, n_q, n_k\) with B = 2, h = 4"):
        to_torch_mha_masks(torch.ones(3, 1, 2, 2, dtype=torch.bool), 2, 4)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 2, 3\) is 3-D, which is ambiguous .* "
                                         r"\(B, h, n_q, n_k\) = \(2, 2, 2, 3\): .* mask\[:, None\] .* mask\[None\]"):
        to_torch_mha_masks(torch.ones(2, 2, 3, dtype=torch.bool), 2, 2)
    with pytest.raises(ValueError, match="give attn_mask, key_padding_mask or both"):
        from_torch_mha_masks(None, None, 1, 1)
    with pytest.raises(ValueError, match=r"\(B \* h, n_q, n_k\) with B \* h = 4, got \(3, 2, 2\)"):
        from_torch_mha_masks(torch.ones(3, 2, 2, dtype=torch.bool), None, 2, 2)
    with pytest.raises(ValueError, match=r"attn_mask must be \(n_q, n_k\) or"):
        from_torch_mha_masks(torch.ones(2, dtype=torch.bool), None, 2, 2)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        from_torch_mha_masks(None, torch.ones(3, 2, dtype=torch.bool), 2, 2)
    with pytest.raises(ValueError, match="mask must have dtype torch.bool"):
        fully_masked_rows(torch.zeros(2, 2))
