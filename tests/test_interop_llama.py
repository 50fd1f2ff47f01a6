"""attnlib.interop's Llama layout, checked against the REAL Hugging Face ``LlamaAttention``.

``LlamaAttention`` is built offline from a small ``LlamaConfig`` with random weights,
grouped-query attention and RoPE, eager attention. attnlib reads its ``q_proj``,
``k_proj``, ``v_proj``, ``o_proj`` and reproduces its outputs and attention weights
under a causal mask, in one pass and by cached decoding.
"""

from __future__ import annotations

import warnings

from types import ModuleType

import pytest
import torch
from torch import nn

from attnlib import DecoderAttention, KVCache
from attnlib.decoding import causal_mask
from attnlib.interop import GroupedAttentionWeights, read_llama, write_llama


def _hf_llama() -> ModuleType:
    """transformers' Llama modelling module, imported on first use: importing it takes
    seconds, which every pytest worker would pay while collecting if it were done here."""
    return pytest.importorskip("transformers.models.llama.modeling_llama")

TOL32 = {"atol": 1e-5, "rtol": 1e-5}


def _config(**kw: object) -> "LlamaConfig":
    """A small Llama config; RoPE's theta is 12345, a base no code would hard-code (a base
    fixed at 10000, Llama's default, or at any round number fails the comparisons)."""
    base: dict[str, object] = {
        "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 12345.0, "intermediate_size": 64, "num_hidden_layers": 1,
    }
    base.update(kw)
    config = _hf_llama().LlamaConfig(**base)
    config._attn_implementation = "eager"
    return config


def _llama(config: LlamaConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    attn = _hf_llama().LlamaAttention(config, layer_idx=0).eval()
    with torch.no_grad():  # nn.Linear's default init is small; make the weights matter
        for p in attn.parameters():
            p.normal_(0.0, 0.3)
    return attn


def _llama_causal(attn: nn.Module, config: LlamaConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's own call: RoPE tables from LlamaRotaryEmbedding, additive causal mask."""
    B, n, _ = x.shape
    rotary = _hf_llama().LlamaRotaryEmbedding(config)
    positions = torch.arange(n)[None].expand(B, n)
    cos, sin = rotary(x, positions)
    additive = torch.zeros(n, n).masked_fill(~causal_mask(n), float("-inf"))[None, None]  # (1, 1, n, n)
    with torch.no_grad():
        return attn(x, position_embeddings=(cos, sin), attention_mask=additive)


@pytest.mark.parametrize("kw", [{}, {"num_key_value_heads": 1}, {"num_key_value_heads": 4}, {"attention_bias": True},
                                {"head_dim": 16}, {"head_dim": 4, "num_key_value_heads": 1}])  # h*d_k = 64, 16 != 32
def test_llama_attention_outputs_and_weights_reproduced(kw: dict[str, object]) -> None:
    config = _config(**kw)
    attn = _llama(config)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    out_hf, w_hf = _llama_causal(attn, config, x)
    ours = DecoderAttention.from_grouped_projections(read_llama(attn))
    assert ours.num_kv_heads == config.num_key_value_heads and ours.rope_base == 12345.0
    with torch.no_grad():
        out, w = ours(x, x, x, mask=causal_mask(7))
    torch.testing.assert_close(out, out_hf, **TOL32)
    torch.testing.assert_close(w, w_hf, **TOL32)
    assert (out - out_hf).abs().max() <= 1e-5 and (w - w_hf).abs().max() <= 1e-5  # type: ignore[operator]


def test_llama_attention_reproduced_by_cached_decoding() -> None:
    config = _config()
    attn = _llama(config, seed=3)
    x = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(2))
    out_hf, _ = _llama_causal(attn, config, x)
    ours = DecoderAttention.from_grouped_projections(read_llama(attn))
    cache = KVCache()
    with torch.no_grad():
        outs = [ours(x[:, :3], x[:, :3], x[:, :3], cache=cache)[0]]
        for t in range(3, 6):
            step = x[:, t : t + 1]
            outs.append(ours(step, step, step, cache=cache)[0])
    torch.testing.assert_close(torch.cat(outs, dim=1), out_hf, **TOL32)
    assert cache.nbytes == 2 * 1 * 6 * 2 * 8 * 4  # 2 B n g d_k itemsize


def _random_grouped(bias: bool, seed: int = 0, d_k: int = 2) -> GroupedAttentionWeights:
    """d_model = 12, h = 6 heads of width d_k (2: h*d_k = d_model), g = 2 key/value heads."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    hd, gd = 6 * d_k, 2 * d_k
    b = (r(hd), r(gd), r(gd), r(12)) if bias else (None, None, None, None)
    return GroupedAttentionWeights(r(12, hd), r(12, gd), r(12, gd), r(hd, 12), 6, 2, *b, rope_base=500.0)


@pytest.mark.parametrize(("bias", "d_k"), [(False, 2), (True, 2), (True, 4)])
def test_write_then_read_gives_the_weights_back(bias: bool, d_k: int) -> None:
    w = _random_grouped(bias, d_k=d_k)
    layers = write_llama(w)
    assert layers["q_proj"].weight.shape == (6 * d_k, 12) and layers["k_proj"].weight.shape == (2 * d_k, 12)
    again = read_llama(layers, num_heads=6, rope_base=500.0)
    assert again.num_kv_heads == 2 and again.rope_base == 500.0
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
        a, b = getattr(w, name), getattr(again, name)
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=0, rtol=0)
    assert read_llama(layers, num_heads=6).rope_base is None  # no config, no RoPE unless told


def test_written_layers_load_into_a_real_llama_attention() -> None:
    config = _config()
    attn = _llama(config)
    w = read_llama(attn)
    fresh = _hf_llama().LlamaAttention(config, layer_idx=0)
    fresh.load_state_dict(write_llama(w).state_dict())
    for name, p in attn.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], p, atol=0, rtol=0)


def test_missing_bias_is_read_as_zero() -> None:
    """Qwen2-style: q, k, v with bias, o_proj without; the zero bias computes the same."""
    layers = write_llama(_random_grouped(True))
    layers["o_proj"] = nn.Linear(12, 12, bias=False, dtype=torch.float64)
    w = read_llama(layers, num_heads=6)
    assert w.b_o is not None and not w.b_o.any()


def test_read_llama_errors() -> None:
    layers = write_llama(_random_grouped(False))
    with pytest.raises(ValueError, match="num_heads must be given when attn has no config"):
        read_llama(layers)
    broken = nn.ModuleDict(dict(layers.items()))
    broken["v_proj"] = nn.Identity()
    with pytest.raises(TypeError, match="attn.v_proj must be an nn.Linear, got Identity"):
        read_llama(broken, num_heads=6)
    attn = _llama(_config())
    with pytest.raises(ValueError, match="num_heads=2 disagrees with attn.config.num_attention_heads=4"):
        read_llama(attn, num_heads=2)
    with pytest.raises(ValueError, match="rope_base=10.0 disagrees with the config's rope_theta=12345.0"):
        read_llama(attn, rope_base=10.0)
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        read_llama(_llama(_config(rope_parameters={"rope_type": "linear", "rope_theta": 12345.0, "factor": 2.0})))
    dropping = _llama(_config(attention_dropout=0.1))  # in eval mode: its dropout is off
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_llama(dropping)
    with pytest.warns(UserWarning, match=r"attention_dropout=0.1 is not read: attnlib has no dropout"):
        read_llama(dropping.train())
    attn = _llama(_config())
    attn.config.num_key_value_heads = 1
    with pytest.raises(ValueError, match="config.num_key_value_heads = 1"):
        read_llama(attn)
    with pytest.raises(TypeError, match="num_heads must be a positive int, got bool True"):
        read_llama(layers, num_heads=True)
    with pytest.raises(ValueError, match="q_proj has 12 outputs, not a multiple of num_heads=5"):
        read_llama(layers, num_heads=5)
    with pytest.raises(ValueError, match=r"w_k must have shape \(12, 3\)"):
        read_llama(layers, num_heads=4)  # d_k = 3: k_proj's 4 outputs are no whole number of heads
    with pytest.raises(TypeError, match="weights must be a GroupedAttentionWeights"):
        write_llama(object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_kv_heads": 4}, r"num_kv_heads \(4\) must divide num_heads \(6\)"),
        ({"num_heads": 0}, "num_heads must be a positive int, got 0"),
        ({"num_heads": 8, "num_kv_heads": 4}, r"w_q must have shape \(d_model, h\*d_k\) with num_heads=8 heads, got \(12, 12\)"),
        ({"w_q": torch.zeros(12, 7)}, r"w_q must have shape \(d_model, h\*d_k\) with num_heads=6 heads, got \(12, 7\)"),
        ({"w_k": torch.zeros(12, 12)}, r"w_k must have shape \(12, 4\) for d_model=12, num_heads=6, num_kv_heads=2, d_k=2, got \(12, 12\)"),
        ({"b_q": torch.zeros(12)}, "all four projections or for none"),
        ({"b_q": torch.zeros(4)}, r"b_q must have shape \(12,\)"),
        ({"rope_base": 1}, r"rope_base \(RoPE's theta\) must be > 1"),
    ],
)
def test_grouped_weights_validation(change: dict[str, object], match: str) -> None:
    w = _random_grouped(False)
    fields = {n: getattr(w, n) for n in ("w_q", "w_k", "w_v", "w_o", "num_heads", "num_kv_heads", "b_q", "b_k", "b_v", "b_o", "rope_base")}
    fields.update(change)
    with pytest.raises(ValueError, match=match):
        GroupedAttentionWeights(**fields)  # type: ignore[arg-type]


def test_read_llama_refuses_what_it_cannot_map() -> None:
    """Qwen3 normalises queries and keys per head (q_norm, k_norm) between the projection
    and RoPE; reading its four projections alone would compute another function."""
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    config = qwen3.Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, intermediate_size=64, num_hidden_layers=1)
    attn = qwen3.Qwen3Attention(config, layer_idx=0)
    with pytest.raises(ValueError, match="has k_norm, q_norm besides q_proj"):
        read_llama(attn)
    layers = write_llama(_random_grouped(False))
    layers["extra"] = nn.Identity()  # any submodule it does not map
    with pytest.raises(ValueError, match=r"\(ModuleDict\) has extra besides"):
        read_llama(layers, num_heads=6)
    layers = write_llama(_random_grouped(False))
    layers.register_parameter("scale", nn.Parameter(torch.ones(())))
    with pytest.raises(ValueError, match="has scale besides"):
        read_llama(layers, num_heads=6)


def test_read_llama_accepts_default_rope_frequencies_and_refuses_others() -> None:
    """An inv_freq buffer (older Llama code keeps one in the attention module) is read
    when it holds rope_base's frequencies, and refused when it holds scaled ones."""
    from attnlib.decoding import rope_inv_freq

    d, h = 16, 2
    attn = nn.Module()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(attn, name, nn.Linear(d, d, bias=False))
    attn.register_buffer("inv_freq", rope_inv_freq(d // h, 100.0, dtype=torch.float32))
    weights = read_llama(attn, num_heads=h, rope_base=100.0)
    assert weights.rope_base == 100.0
    with pytest.raises(ValueError, match="no rope_base: pass rope_base="):
        read_llama(attn, num_heads=h)
    attn.inv_freq = attn.inv_freq / 4  # linearly scaled positions
    with pytest.raises(ValueError, match="RoPE frequencies other than rope_base=100"):
        read_llama(attn, num_heads=h, rope_base=100.0)


def test_float32_widths_hold_for_near_tied_huge_scores() -> None:
    """The first-order count of float32_attention_widths, eps32 (n + 4 + 4S), broke where
    float32 resolves scores of 1e8 only to 8: two scores 20 apart round to 16 apart, and the
    smaller weight, e^-20 exactly, comes out e^-16: 54 times too large, where the first-order
    count allowed 48. Counted as e^y - 1, the bound holds; for moderate scores the widths are
    the first-order ones (chapter 8's 61 for BLOOM's largest score, 15.25)."""
    from attnlib import assert_rounding_close
    from attnlib.decoding import float32_attention_widths

    eps32 = torch.finfo(torch.float32).eps
    scores = torch.tensor([[1e8, 1e8 - 20]], dtype=torch.float64)
    exact = torch.softmax(scores, -1)
    hf = torch.softmax(scores, -1, dtype=torch.float32).to(torch.float64)  # as eager Llama does
    relative = ((hf - exact).abs() / exact).max().item()
    assert 53 < relative < 54
    assert relative > eps32 * (2 + 4 + 4e8)  # the first-order count is broken
    widths = float32_attention_widths(scores)
    assert widths[:2] == (2, 4) and widths[2] > 10**22
    assert_rounding_close(hf, exact, *widths, dtype=torch.float32, size=exact)
    assert float32_attention_widths(torch.tensor([[15.25, -3.0]], dtype=torch.float64)) == (2, 4, 61)
    assert float32_attention_widths(torch.tensor([[0.0, float("-inf")]], dtype=torch.float64)) == (2, 4, 1)
    with pytest.raises(ValueError, match="overflows"):
        float32_attention_widths(torch.tensor([[3e9, 0.0]], dtype=torch.float64))
