"""attnlib.audit on real attention code, run the way a user runs it: a regression set.

Two kinds of module:

- **real classes**, Hugging Face transformers' own (``GPT2Attention`` eager and SDPA, with a
  ``DynamicCache``; ``LlamaAttention`` and ``Qwen2Attention`` with their real rotary embedding;
  ``BertAttention``; ``ViTAttention``; ``OPTAttention``; ``CLIPAttention``; ``BloomAttention``)
  and ``torch.nn.MultiheadAttention``, built offline from tiny configs: the right ones must pass,
  in float32 and in float64 (those that take their softmax in float32 once that is declared,
  ``compute_dtype=torch.float32``: undeclared, a float64 audit does not pass them);
- **historical bugs** of public repositories, planted in their original form in modules written
  in each repository's idiom (our code; the wrong line is the repository's): each must get the
  right name.

=========================================  ===========================================
repository, change                          the bug, as named
=========================================  ===========================================
karpathy/ng-video-lecture, PR 6             ``C**-0.5`` (C = n_embd): ``scale_by_d_model``
lucidrains/vit-pytorch, issue 65            ``dim ** -0.5`` (``dim_head = 64``): ``scale_by_d_model``
  (fixed in 85314cf)                        (``takes_mask=False``: no mask bug named)
lucidrains/vit-pytorch at 3f2cbc6           masks padded keys *and* queries: right; its
                                            padded rows are a convention
jsbaan/transformer-from-scratch, PR 6       a reshape without the permute:
                                            ``merge_without_transpose``
hyunwoongko/transformer, PR 40              decoder mask ``(B, 1, n, 1)`` & tril, filled
                                            with -10000: ``mask_fill_finite`` +
                                            ``padding_on_queries``
=========================================  ===========================================

Configs are the smallest that keep every feature (2 to 4 heads, width 16 to 32), so the whole
file runs in a few seconds.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlib import MultiHeadAttention
from attnlib.audit import assert_attention_matches, assert_cache_matches, diagnose, diagnose_cache
from attnlib.decoding import AlibiAttention, DecoderAttention
from attnlib.interop import (
    read_bert, read_bloom, read_conv1d, read_linear_heads, read_llama, read_packed_linear, read_separate_linear,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers import (
        BertConfig, BloomConfig, CLIPTextConfig, DynamicCache, GPT2Config, LlamaConfig, OPTConfig, Qwen2Config,
        ViTConfig,
    )
    from transformers.models.bert.modeling_bert import BertAttention
    from transformers.models.bloom.modeling_bloom import BloomAttention, build_alibi_tensor
    from transformers.models.clip.modeling_clip import CLIPAttention
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    from transformers.models.opt.modeling_opt import OPTAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2RotaryEmbedding
    from transformers.models.vit.modeling_vit import ViTAttention

D, H = 32, 4


def pair(lin: nn.Module) -> tuple[Tensor, Tensor | None]:
    return lin.weight, lin.bias  # type: ignore[return-value]


def randomize_biases(module: nn.Module) -> None:
    """Non-zero biases, so that an adapter that drops one is seen."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.2)


def additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """bool ``(n_q, n_k)`` or ``(B, n_q, n_k)``, True = may attend -> Hugging Face's additive 4-D mask."""
    if mask is None:
        return None
    out = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    return out[None, None] if mask.dim() == 2 else out[:, None]


def causal(n_q: int, n_k: int) -> Tensor:
    """bool ``(n_q, n_k)``: the queries are the last ``n_q`` of ``n_k`` positions."""
    return torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]


# ---- Hugging Face GPT-2: Conv1D layout; the model, not the layer, builds the causal mask ---------


def gpt2(impl: str) -> tuple[GPT2Attention, MultiHeadAttention]:
    config = GPT2Config(n_embd=D, n_head=H, n_layer=1, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0)
    config._attn_implementation = impl
    torch.manual_seed(0)
    layer = GPT2Attention(config, layer_idx=0).eval()
    randomize_biases(layer)
    with torch.no_grad():
        for conv in (layer.c_attn, layer.c_proj):
            conv.bias.normal_(0, 0.2)
    return layer, MultiHeadAttention.from_weights(read_conv1d(pair(layer.c_attn), pair(layer.c_proj)), H)


def test_gpt2_eager_passes_with_the_model_s_causal_mask_and_not_without() -> None:
    layer, ref = gpt2("eager")

    def forward(x: Tensor, mask: Tensor | None) -> Tensor:  # causal=True: mask is None
        n = x.shape[1]
        return layer(x, attention_mask=additive(causal(n, n), x.dtype))[0]

    assert_attention_matches(forward, ref, causal=True)
    alone = diagnose(lambda x, m: layer(x)[0], ref, causal=True)  # the layer masks nothing itself
    assert alone.bugs == ("mask_ignored",)
    assert "Hugging Face's attention layers" in " ".join(str(alone).split())


def test_gpt2_sdpa_passes_and_its_cache_is_named_for_chunks() -> None:
    layer, ref = gpt2("sdpa")
    assert_attention_matches(lambda x, m: layer(x)[0], ref, causal=True)  # SDPA's is_causal

    def step(x: Tensor, cache: DynamicCache | None) -> tuple[Tensor, DynamicCache]:
        cache = DynamicCache() if cache is None else cache
        return layer(x, past_key_values=cache)[0], cache  # no mask: is_causal for T > 1

    report = diagnose_cache(step, ref)
    assert report.bugs == ("chunk_causal_upper_left",), str(report)
    assert report.errors["steps"] <= report.rtol < report.errors["chunks"]

    def step_with_mask(x: Tensor, cache: DynamicCache | None) -> tuple[Tensor, DynamicCache]:
        cache = DynamicCache() if cache is None else cache
        past, n = cache.get_seq_length(), x.shape[1]
        mask = causal(n, past + n)[None, None]  # bool, True = may attend, aligned to the lower right
        return layer(x, past_key_values=cache, attention_mask=mask)[0], cache

    assert_cache_matches(step_with_mask, ref)


# ---- Llama and Qwen2: grouped keys and values, the real rotary embedding, the model's mask ------


def rotary_layer(kind: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module, MultiHeadAttention]:
    cls, rot, cfg = {"llama": (LlamaAttention, LlamaRotaryEmbedding, LlamaConfig),
                     "qwen2": (Qwen2Attention, Qwen2RotaryEmbedding, Qwen2Config)}[kind]
    config = cfg(hidden_size=D, num_attention_heads=H, num_key_value_heads=2, intermediate_size=64,
                 num_hidden_layers=1, rope_theta=100.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = cls(config, layer_idx=0).eval().to(dtype)
    randomize_biases(layer)  # Qwen2's q, k, v have biases
    return layer, rot(config), DecoderAttention.from_grouped_weights(read_llama(layer))


def llama_forward(layer: nn.Module, rotary: nn.Module) -> Callable[[Tensor, Tensor | None], Tensor]:
    def forward(x: Tensor, mask: Tensor | None) -> Tensor:  # causal=True
        n = x.shape[1]
        cos, sin = rotary(x, torch.arange(n)[None])  # position_embeddings, as the model computes them
        return layer(x, position_embeddings=(cos, sin), attention_mask=additive(causal(n, n), x.dtype))[0]
    return forward


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_rotary_grouped_layers_pass_in_float32_and_float64(kind: str) -> None:
    for dtype in (torch.float32, torch.float64):
        layer, rotary, ref = rotary_layer(kind, dtype)
        report = assert_attention_matches(llama_forward(layer, rotary), ref, causal=True)
        assert dtype == torch.float32 or report.rtol < 1e-4  # float64: float32 RoPE angles allowed for


def test_llama_cache_with_the_model_s_mask_and_positions_passes() -> None:
    layer, rotary, ref = rotary_layer("llama")

    def step(x: Tensor, cache: DynamicCache | None) -> tuple[Tensor, DynamicCache]:
        cache = DynamicCache() if cache is None else cache
        past, n = cache.get_seq_length(), x.shape[1]
        position_embeddings = rotary(x, torch.arange(past, past + n)[None])
        mask = additive(causal(n, past + n), x.dtype)
        return layer(x, position_embeddings=position_embeddings, attention_mask=mask,
                     past_key_values=cache)[0], cache

    assert_cache_matches(step, ref)


# ---- encoders: BERT (padding), ViT (no mask), OPT and CLIP (softmax in float32) ------------------


def test_bert_attention_passes_with_padding() -> None:
    config = BertConfig(hidden_size=D, num_attention_heads=H, intermediate_size=64, num_hidden_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    bert = BertAttention(config).eval()
    ref = MultiHeadAttention.from_weights(read_bert(bert.self, bert.output), H)

    def forward(x: Tensor, pad: Tensor) -> Tensor:  # pad: (B, n), True = real token
        keys = pad[:, None, :].expand(-1, x.shape[1], -1)  # (B, n_q, n_k)
        return bert.output.dense(bert.self(x, attention_mask=additive(keys, x.dtype))[0])

    report = assert_attention_matches(forward, ref, padding=True)
    assert report.padded_rows == "the real keys"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vit_attention_takes_no_mask(dtype: torch.dtype) -> None:
    config = ViTConfig(hidden_size=D, num_attention_heads=H, intermediate_size=64, num_hidden_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    vit = ViTAttention(config).eval().to(dtype)
    randomize_biases(vit)
    ref = MultiHeadAttention.from_weights(
        read_separate_linear(*(pair(lin) for lin in (vit.q_proj, vit.k_proj, vit.v_proj, vit.o_proj))), H)
    report = assert_attention_matches(lambda x: vit(x)[0], ref, takes_mask=False)  # as a user calls it
    if dtype == torch.float64:  # its softmax runs in float32: passed at float32's tolerance, and said
        assert report.compute_dtype == report.suspected_dtype == "float32"
        assert "passed at float32's tolerance" in " ".join(str(report).split())
        declared = assert_attention_matches(lambda x: vit(x)[0], ref, takes_mask=False, compute_dtype=torch.float32)
        assert declared.rtol == report.rtol and declared.suspected_dtype == ""
    assert "mask_ignored" in report.untested and "could not be tested" in str(report)
    dropped = diagnose(lambda x, m: vit(x)[0], ref)  # the mask dropped in the adapter instead
    assert dropped.bugs == ("mask_ignored",)


@pytest.mark.parametrize("name", ["opt", "clip"])
def test_float32_softmax_in_a_float64_module_is_not_a_bug(name: str) -> None:
    torch.manual_seed(0)
    layer: nn.Module
    if name == "opt":
        opt = OPTConfig(hidden_size=D, num_attention_heads=H, ffn_dim=64, num_hidden_layers=1, dropout=0.0)
        opt._attn_implementation = "eager"
        layer = OPTAttention(opt, layer_idx=0).eval().double()
    else:
        clip = CLIPTextConfig(hidden_size=D, num_attention_heads=H, intermediate_size=64, num_hidden_layers=1)
        clip._attn_implementation = "eager"
        layer = CLIPAttention(clip).eval().double()
    randomize_biases(layer)
    ref = MultiHeadAttention.from_weights(read_separate_linear(
        *(pair(lin) for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj))), H)
    forward = lambda x, m: layer(x, attention_mask=additive(m, x.dtype))[0]  # noqa: E731
    report = diagnose(forward, ref)  # undeclared, as a user calls it: ok at float32's tolerance, and said
    assert report.ok and report.compute_dtype == report.suspected_dtype == "float32"
    text = " ".join(str(report).split())
    assert "seems to run in float32" in text and "passed at float32's tolerance" in text
    assert "would pass the same way" in text and "compute_dtype=torch.float64" in text
    assert report.rtol < 1e-4  # float32's rounding along this layer, not a blanket tolerance
    declared = diagnose(forward, ref, compute_dtype=torch.float32)
    assert declared.ok and declared.rtol == report.rtol and declared.compute_dtype == "float32"
    assert declared.suspected_dtype == ""
    assert "would pass the same way" not in " ".join(str(declared).split())  # the text wraps lines
    assert not diagnose(forward, ref, rtol=1e-12).ok  # a tolerance given is kept
    inverted = diagnose(lambda x, m: layer(x, attention_mask=additive(None if m is None else ~m, x.dtype))[0], ref)
    assert inverted.bugs == ("mask_inverted",) and inverted.compute_dtype == inverted.suspected_dtype == "float32"


def test_bloom_attention_against_an_alibi_reference() -> None:
    config = BloomConfig(hidden_size=D, n_head=H, n_layer=1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    bloom = BloomAttention(config, layer_idx=0).eval()
    ref = AlibiAttention.from_weights(read_bloom(bloom), H)

    def forward(x: Tensor, mask: Tensor | None) -> Tensor:  # causal=True
        B, n, _ = x.shape
        alibi = build_alibi_tensor(torch.ones(B, n), H, x.dtype)  # (B*h, 1, n), as the model builds it
        return bloom(x, torch.zeros_like(x), alibi, additive(causal(n, n), x.dtype))[0]  # residual 0

    assert_attention_matches(forward, ref, causal=True)


def test_torch_multihead_attention_passes() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    randomize_biases(mha)
    with torch.no_grad():
        mha.in_proj_bias.normal_(0, 0.2)
    forward = lambda x, m: mha(x, x, x, attn_mask=None if m is None else ~m, need_weights=False)[0]  # noqa: E731
    assert_attention_matches(forward, MultiHeadAttention.from_torch(mha))


# ---- historical bugs, planted in their original form ---------------------------------------------


class LectureHead(nn.Module):
    """ng-video-lecture's ``Head``: one head, a tril buffer, scaled by ``C**-0.5`` before PR 6."""

    tril: Tensor

    def __init__(self, n_embd: int, head_size: int, fixed: bool) -> None:
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(n_embd, head_size, bias=False) for _ in range(3))
        self.register_buffer("tril", torch.tril(torch.ones(16, 16)))
        self.fixed = fixed

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)
        scale = k.shape[-1] ** -0.5 if self.fixed else C**-0.5  # PR 6: head_size, not C
        wei = (q @ k.transpose(-2, -1) * scale).masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ self.value(x)


class LectureMHA(nn.Module):
    def __init__(self, n_embd: int, num_heads: int, fixed: bool) -> None:
        super().__init__()
        self.heads = nn.ModuleList(LectureHead(n_embd, n_embd // num_heads, fixed) for _ in range(num_heads))
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))

    def reference(self) -> MultiHeadAttention:
        heads = [(pair(h.query), pair(h.key), pair(h.value)) for h in self.heads if isinstance(h, LectureHead)]
        return MultiHeadAttention.from_weights(read_linear_heads(heads, pair(self.proj)), len(self.heads))


@pytest.mark.parametrize("fixed", [False, True])
def test_ng_video_lecture_pr6(fixed: bool) -> None:
    torch.manual_seed(0)
    module = LectureMHA(D, H, fixed).eval()
    report = diagnose(module, module.reference(), causal=True)
    assert report.ok if fixed else report.bugs == ("scale_by_d_model",), str(report)


class VitAttention2021(nn.Module):
    """vit-pytorch's ``Attention`` (early 2021), ``rearrange`` written as view/transpose; ``bug``:
    ``"dim"`` scales by ``dim ** -0.5`` (issue 65, before 85314cf)."""

    def __init__(self, dim: int, heads: int, dim_head: int, bug: str = "") -> None:
        super().__init__()
        self.heads, inner = heads, heads * dim_head
        self.scale = dim**-0.5 if bug == "dim" else dim_head**-0.5
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(0.0))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, n, _, h = *x.shape, self.heads
        q, k, v = (t.view(b, n, h, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        if mask is not None:  # 3f2cbc6: (b, n) patches, the class token prepended as real
            mask = F.pad(mask.flatten(1), (1, 0), value=True)
            mask = mask[:, None, :, None] * mask[:, None, None, :]  # padded keys *and* queries
            dots.masked_fill_(~mask, -torch.finfo(dots.dtype).max)
        out = torch.einsum("bhij,bhjd->bhid", dots.softmax(dim=-1), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))

    def reference(self) -> MultiHeadAttention:
        out = self.to_out[0]
        assert isinstance(out, nn.Linear)
        return MultiHeadAttention.from_weights(read_packed_linear(pair(self.to_qkv), pair(out)), self.heads)


def test_vit_pytorch_issue_65_is_named_without_a_mask_bug() -> None:
    torch.manual_seed(0)
    module = VitAttention2021(D, H, 64, bug="dim").eval()  # dim_head = 64, its default: h*d_k != dim
    report = diagnose(lambda x: module(x), module.reference(), takes_mask=False)
    assert report.bugs == ("scale_by_d_model",), str(report)


def test_vit_pytorch_3f2cbc6_padding_passes_with_padded_rows_a_convention() -> None:
    torch.manual_seed(0)
    module = VitAttention2021(D, H, 64).eval()
    # the module prepends a real class token; the probes' key 0 is always real (right padding)
    forward = lambda x, pad: module(x, pad[:, 1:])  # noqa: E731
    report = assert_attention_matches(forward, module.reference(), padding=True)
    assert report.padded_rows == "mean of values" and "padded query" in str(report)


class JsbaanMHA(nn.Module):
    """transformer-from-scratch's multi-head attention; before PR 6 the heads were merged by a
    reshape without the permute back."""

    def __init__(self, hidden: int, heads: int, fixed: bool) -> None:
        super().__init__()
        self.heads, self.qkv_dim, self.fixed = heads, hidden // heads, fixed
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, n, d = x.shape
        q, k, v = (p(x).reshape(b, n, self.heads, self.qkv_dim).permute(0, 2, 1, 3)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.qkv_dim)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        values = scores.softmax(dim=-1) @ v  # (b, heads, n, qkv_dim)
        if self.fixed:
            values = values.permute(0, 2, 1, 3)
        return self.o_proj(values.reshape(b, n, d))

    def reference(self) -> MultiHeadAttention:
        layers = (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        return MultiHeadAttention.from_weights(read_separate_linear(*(pair(lin) for lin in layers)), self.heads)


@pytest.mark.parametrize("fixed", [False, True])
def test_jsbaan_pr6(fixed: bool) -> None:
    torch.manual_seed(0)
    module = JsbaanMHA(D, H, fixed).eval()
    report = diagnose(module, module.reference())
    assert report.ok if fixed else report.bugs == ("merge_without_transpose",), str(report)


class HyunwoongkoMHA(nn.Module):
    """hyunwoongko/transformer's ``MultiHeadAttention`` with its ``ScaleDotProductAttention``:
    ``masked_fill(mask == 0, -10000)``."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.w_q, self.w_k, self.w_v, self.w_concat = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        q, k, v = (self.split(w(t)) for w, t in ((self.w_q, q), (self.w_k, k), (self.w_v, v)))
        score = q @ k.transpose(2, 3) / math.sqrt(k.shape[-1])
        if mask is not None:
            score = score.masked_fill(mask == 0, -10000)
        out = score.softmax(dim=-1) @ v
        b, h, n, d = out.shape
        return self.w_concat(out.transpose(1, 2).contiguous().view(b, n, h * d))

    def split(self, t: Tensor) -> Tensor:
        b, n, d = t.shape
        return t.view(b, n, self.n_head, d // self.n_head).transpose(1, 2)

    def reference(self) -> MultiHeadAttention:
        layers = (self.w_q, self.w_k, self.w_v, self.w_concat)
        return MultiHeadAttention.from_weights(read_separate_linear(*(pair(lin) for lin in layers)), self.n_head)


def test_hyunwoongko_pr40_decoder_mask_is_named() -> None:
    torch.manual_seed(0)
    module = HyunwoongkoMHA(D, H).eval()

    def make_trg_mask(pad: Tensor, fixed: bool) -> Tensor:  # pad: (B, n), True = real token
        pad_mask = pad[:, None, None, :] if fixed else pad.unsqueeze(1).unsqueeze(3)  # before PR 40: (B, 1, n, 1)
        n = pad.shape[1]
        return pad_mask & torch.tril(torch.ones(n, n, dtype=torch.bool))

    before = diagnose(lambda x, pad: module(x, x, x, make_trg_mask(pad, False)), module.reference(),
                      causal=True, padding=True)
    assert set(before.bugs) == {"padding_on_queries", "mask_fill_finite"}, str(before)
    assert len(before.explanations) == 1  # one pair
    assert before.errors["padding"] <= before.rtol < before.errors["left padding"]  # right padding hides it
    after = diagnose(lambda x, pad: module(x, x, x, make_trg_mask(pad, True)), module.reference(),
                     causal=True, padding=True)
    assert after.bugs == ("mask_fill_finite",), str(after)  # the -10000 fill stays


def test_assert_attention_matches_raises_with_the_report() -> None:
    torch.manual_seed(0)
    module = JsbaanMHA(D, H, fixed=False).eval()
    with pytest.raises(AssertionError, match="merge_without_transpose") as caught:
        assert_attention_matches(module, module.reference())
    assert "look for:" in str(caught.value)


def test_from_torch_names_the_readers_for_another_class() -> None:
    with pytest.raises(TypeError, match="expected torch.nn.MultiheadAttention, got JsbaanMHA: from_torch reads "
                                        "torch's module only.*read_separate_linear"):
        MultiHeadAttention.from_torch(JsbaanMHA(D, H, fixed=True))  # type: ignore[arg-type]


def test_read_bloom_reads_bias_free_layers() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleDict({"query_key_value": nn.Linear(D, 3 * D, bias=False), "dense": nn.Linear(D, D, bias=False)})
    weights = read_bloom(layers, num_heads=H)
    assert weights.b_q is None and weights.b_o is None
    layers["dense"] = nn.Linear(D, D)  # one with a bias, one without: zeros for the missing one
    mixed = read_bloom(layers, num_heads=H)
    assert mixed.b_q is not None and not mixed.b_q.any() and mixed.b_o is not None


def test_the_landing_page_quick_start_prints_what_the_page_shows(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    page = (Path(__file__).parents[1] / "intro.md").read_text()
    part = page[page.index("**Is my attention module right?**"):]
    code = part[part.index("```python\n") + 10:]
    code = code[: code.index("```")]
    shown = part[part.index("```text\n") + 8:]
    shown = shown[: shown.index("```")]
    torch.manual_seed(0)
    page_run: dict[str, object] = {}
    exec(compile(code, "intro.md", "exec"), page_run)
    assert capsys.readouterr().out == shown
    # the page's widths separate the two scaling bugs (h != d_k): the same module scaled by
    # sqrt(d_model) gets one name, not "scale_by_d_model or double_scale"
    reference = page_run["reference"]
    assert isinstance(reference, MultiHeadAttention) and reference.num_heads != reference.d_k
    scaled = "scores = q @ k.transpose(-2, -1) / (d // self.h) ** 0.5"
    assert scaled in code
    wrong: dict[str, object] = {}
    exec(compile(code.replace(scaled, "scores = q @ k.transpose(-2, -1) / d ** 0.5"), "intro.md", "exec"), wrong)
    capsys.readouterr()
    report = diagnose(wrong["mine"], wrong["reference"])  # type: ignore[arg-type]
    assert report.bugs == ("scale_by_d_model",), str(report)


def test_features_no_reference_computes_are_refused_by_name() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
    qwen3 = Qwen3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=2, intermediate_size=64,
                        num_hidden_layers=1, head_dim=D // H)
    with pytest.raises(ValueError, match="QK-norm"):
        read_llama(Qwen3Attention(qwen3, layer_idx=0))
    partial = LlamaConfig(hidden_size=D, num_attention_heads=H, intermediate_size=64, num_hidden_layers=1)
    partial.rope_parameters = {**(partial.rope_parameters or {}), "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial rotary"):
        read_llama(LlamaAttention(partial, layer_idx=0))


@pytest.mark.parametrize("head_dim", [16, 4])
def test_heads_of_any_width_are_referenced(head_dim: int) -> None:
    """Llama's own head_dim (h * head_dim != hidden) with its cache; ViT's head_dim likewise."""
    config = LlamaConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=2, intermediate_size=64,
                         num_hidden_layers=1, rope_theta=100.0, head_dim=head_dim)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer, rotary = LlamaAttention(config, layer_idx=0).eval(), LlamaRotaryEmbedding(config)
    ref = DecoderAttention.from_grouped_weights(read_llama(layer))
    assert ref.d_k == head_dim and ref.d_model == D
    forward = llama_forward(layer, rotary)
    assert_attention_matches(forward, ref, causal=True)

    def step(x: Tensor, cache: DynamicCache | None) -> tuple[Tensor, DynamicCache]:
        cache = DynamicCache() if cache is None else cache
        past, n = cache.get_seq_length(), x.shape[1]
        out = layer(x, position_embeddings=rotary(x, torch.arange(past, past + n)[None]),
                    attention_mask=additive(causal(n, past + n), x.dtype), past_key_values=cache)
        return out[0], cache

    assert_cache_matches(step, ref)
    vit_config = ViTConfig(hidden_size=D, num_attention_heads=H, intermediate_size=64, num_hidden_layers=1)
    vit_config.head_dim = head_dim
    vit_config._attn_implementation = "eager"
    vit = ViTAttention(vit_config).eval()
    vit_ref = MultiHeadAttention.from_weights(
        read_separate_linear(*(pair(lin) for lin in (vit.q_proj, vit.k_proj, vit.v_proj, vit.o_proj))), H)
    assert vit_ref.d_k == head_dim
    assert_attention_matches(lambda x: vit(x)[0], vit_ref, takes_mask=False)
    bug = diagnose(lambda x: _scaled_by_width(vit, x), vit_ref, takes_mask=False)
    assert bug.bugs == ("scale_by_d_model",), str(bug)


def _scaled_by_width(vit: nn.Module, x: Tensor) -> Tensor:
    """ViTAttention's computation with the scores divided by sqrt(hidden) (vit-pytorch's issue 65)."""
    b, n, _ = x.shape
    q, k, v = (lin(x).view(b, n, H, -1).transpose(1, 2) for lin in (vit.q_proj, vit.k_proj, vit.v_proj))
    weights = (q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])).softmax(dim=-1)
    return vit.o_proj((weights @ v).transpose(1, 2).reshape(b, n, -1))
