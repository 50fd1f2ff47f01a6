"""attnlib.audit on the modules readers actually write: causal, padded, cross, grouped, rotary.

Each module below is our own code written in the idiom of well-known implementations (nanoGPT's
``CausalSelfAttention``, the ``MultiHeadAttention`` of Raschka's LLMs-from-scratch chapter 3,
Hugging Face's BERT and Llama attention); none uses attnlib. A bug is a keyword of the
constructor that swaps one line for its wrong form. Every right module passes; every bug is named.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from attnlib import DecoderAttention, MultiHeadAttention
from attnlib.audit import BUGS, BUGS_BY_NAME, diagnose, planted
from attnlib.interop import read_llama, read_packed_linear, read_separate_linear

SETTINGS = settings(max_examples=12, deadline=None)


def pair(lin: nn.Linear) -> tuple[Tensor, Tensor | None]:
    return lin.weight, lin.bias


def randomize_biases(module: nn.Module) -> None:
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.2)


# ---- nanoGPT style: one packed projection, a tril buffer or is_causal ----------------------


class NanoCausal(nn.Module):
    """Causal self-attention, nanoGPT's way: ``c_attn`` packs q, k, v; ``bias`` is a tril buffer."""

    def __init__(self, n_embd: int, n_head: int, block_size: int = 16, bug: str = "", flash: bool = False) -> None:
        super().__init__()
        self.n_head, self.n_embd, self.bug, self.flash = n_head, n_embd, bug, flash
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        diagonal = {"causal_blocks_diagonal": -1, "causal_sees_next": 1}.get(bug, 0)
        tril = torch.tril(torch.ones(block_size, block_size), diagonal=diagonal)
        self.register_buffer("bias", tril.view(1, 1, block_size, block_size))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.bug == "double_scale":
            q = q * (1.0 / math.sqrt(k.size(-1)))  # and SDPA scales once more
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            if self.bug == "mask_ignored":
                att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))  # not assigned
            else:
                att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)

    def reference(self) -> MultiHeadAttention:
        return MultiHeadAttention.from_weights(read_packed_linear(pair(self.c_attn), pair(self.c_proj)), self.n_head)


# ---- Raschka ch03 style: W_query/W_key/W_value without bias, out_proj with bias, triu buffer ---


class RaschkaMHA(nn.Module):
    """Causal multi-head attention in the LLMs-from-scratch chapter 3 idiom."""

    def __init__(self, d_in: int, d_out: int, context_length: int, num_heads: int, qkv_bias: bool = False,
                 bug: str = "") -> None:
        super().__init__()
        self.d_out, self.num_heads, self.head_dim, self.bug = d_out, num_heads, d_out // num_heads, bug
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        ones = torch.ones(context_length, context_length)
        blocked = torch.tril(ones, diagonal=-1) if bug == "causal_reversed" else torch.triu(ones, diagonal=1)
        self.register_buffer("mask", blocked)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, num_tokens, _ = x.shape
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)  # (b, heads, T, T)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        if self.bug == "mask_inverted":
            attn_scores.masked_fill_(~mask_bool, -torch.inf)
        else:
            attn_scores.masked_fill_(mask_bool, -torch.inf)
        width = self.d_out if self.bug == "scale_by_d_model" else keys.shape[-1]
        attn_weights = torch.softmax(attn_scores / width**0.5, dim=-1)
        context_vec = (attn_weights @ values).transpose(1, 2)  # (b, T, heads, head_dim)
        return self.out_proj(context_vec.contiguous().view(b, num_tokens, self.d_out))

    def reference(self) -> MultiHeadAttention:
        layers = (self.W_query, self.W_key, self.W_value, self.out_proj)
        return MultiHeadAttention.from_weights(read_separate_linear(*(pair(lin) for lin in layers)), self.num_heads)


# ---- Hugging Face BERT style: additive extended mask, W^O in another module --------------------


class BertishSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, bug: str = "") -> None:
        super().__init__()
        self.heads, self.head_size, self.bug = heads, hidden // heads, bug
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))

    def transpose_for_scores(self, x: Tensor) -> Tensor:
        return x.view(*x.shape[:-1], self.heads, self.head_size).permute(0, 2, 1, 3)  # (B, h, n, d_k)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                encoder_hidden_states: Tensor | None = None) -> Tensor:
        source = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        k_in = hidden_states if self.bug == "keys_from_query" else source
        v_in = hidden_states if self.bug == "values_from_query" else source
        q = self.transpose_for_scores(self.query(hidden_states))
        k, v = self.transpose_for_scores(self.key(k_in)), self.transpose_for_scores(self.value(v_in))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_size)  # (B, h, n_q, n_k)
        if attention_mask is not None:
            scores = scores + attention_mask  # additive: 0 or a large negative number
        context = scores.softmax(dim=-1) @ v  # (B, h, n_q, d_k)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:2], self.heads * self.head_size)


class BertishSelfOutput(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)


class Bertish(nn.Module):
    """BERT's attention block: ``self`` (no W^O) and ``output.dense`` (W^O), padded batches."""

    def __init__(self, hidden: int, heads: int, bug: str = "", fill: float | None = None) -> None:
        super().__init__()
        self.self = BertishSelfAttention(hidden, heads, bug)
        self.output = BertishSelfOutput(hidden)
        self.bug, self.fill = bug, fill

    def extended(self, mask: Tensor, dtype: torch.dtype) -> Tensor:
        """(B, n) 1 = real -> additive (B, 1, 1, n): 0 for real tokens."""
        fill = torch.finfo(dtype).min if self.fill is None else self.fill
        if self.bug == "padding_on_queries":
            return (1.0 - mask[:, None, :, None].to(dtype)) * fill
        if self.bug == "mask_inverted":
            return mask[:, None, None, :].to(dtype) * fill
        return (1.0 - mask[:, None, None, :].to(dtype)) * fill

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        additive = None if mask is None else self.extended(mask, x.dtype)
        return self.output.dense(self.self(x, additive))

    def cross(self, x: Tensor, context: Tensor, mask: Tensor | None) -> Tensor:
        """Cross-attention (an encoder-decoder block): ``mask`` (n_q, n_k) bool or (B, n_k)."""
        additive = None
        if mask is not None:
            m = mask[:, None, None, :] if mask.dim() == 2 and mask.shape[0] == x.shape[0] and mask.shape[0] != x.shape[1] \
                else mask
            additive = (~m.bool()).to(x.dtype) * (torch.finfo(x.dtype).min if self.fill is None else self.fill)
        return self.output.dense(self.self(x, additive, encoder_hidden_states=context))

    def reference(self) -> MultiHeadAttention:
        s = self.self
        w = read_separate_linear(pair(s.query), pair(s.key), pair(s.value), pair(self.output.dense))
        return MultiHeadAttention.from_weights(w, s.heads)


# ---- heads folded into the batch, as torch's MultiheadAttention does internally ---------------


class FoldedPadded(nn.Module):
    """Self-attention on ``(B*h, n, d_k)`` rows: ``b*h + i`` (``fold="bh"``) or ``i*B + b`` (``"hb"``)."""

    def __init__(self, d: int, h: int, fold: str = "bh", bug: str = "") -> None:
        super().__init__()
        self.h, self.fold, self.bug = h, fold, bug
        self.in_proj = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)

    def rows(self, t: Tensor) -> Tensor:
        B, n, d = t.shape
        heads = t.view(B, n, self.h, d // self.h)
        if self.fold == "bh":
            return heads.transpose(1, 2).reshape(B * self.h, n, d // self.h)  # row b*h + i
        return heads.permute(2, 0, 1, 3).reshape(self.h * B, n, d // self.h)  # row i*B + b

    def forward(self, x: Tensor, key_padding: Tensor) -> Tensor:
        B, n, d = x.shape
        q, k, v = (self.rows(t) for t in self.in_proj(x).chunk(3, dim=-1))  # (B*h, n, d_k)
        scores = q @ k.transpose(1, 2) / math.sqrt(d // self.h)  # (B*h, n, n)
        right = "repeat_interleave" if self.fold == "bh" else "repeat"
        use = right if self.bug != "padding_head_order" else {"repeat": "repeat_interleave"}.get(right, "repeat")
        if use == "repeat_interleave":
            keep = key_padding.repeat_interleave(self.h, dim=0)  # (B*h, n)
        else:
            keep = key_padding.repeat(self.h, 1)  # (h*B, n)
        scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
        out = scores.softmax(dim=-1) @ v  # (B*h, n, d_k)
        if self.fold == "bh":
            out = out.view(B, self.h, n, d // self.h).transpose(1, 2)
        else:
            out = out.view(self.h, B, n, d // self.h).permute(1, 2, 0, 3)
        return self.out_proj(out.reshape(B, n, d))

    def reference(self) -> MultiHeadAttention:
        return MultiHeadAttention.from_weights(read_packed_linear(pair(self.in_proj), pair(self.out_proj)), self.h)


# ---- Hugging Face Llama style: GQA (repeat_kv), RoPE with float32 angles, no bias -------------


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden: Tensor, n_rep: int) -> Tensor:
    b, g, n, d = hidden.shape
    return hidden[:, :, None].expand(b, g, n_rep, n, d).reshape(b, g * n_rep, n, d)  # head i: group i // n_rep


class Llamaish(nn.Module):
    """Grouped-query causal attention with rotary embeddings, as Hugging Face's Llama writes it."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, theta: float = 10000.0, bug: str = "") -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.bug = heads, kv_heads, hidden // heads, bug
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.theta = theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # float32, as in transformers

    def rope(self, t: Tensor, positions: Tensor) -> Tensor:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # (n, d/2), float32 as in HF
        if self.bug == "rope_pairing":  # GPT-J's adjacent pairs in a rotate-half model
            cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
            even, odd = t[..., 0::2], t[..., 1::2]
            return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (n, d)
        return t * emb.cos().to(t.dtype) + rotate_half(t) * emb.sin().to(t.dtype)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B, n, _ = x.shape
        shape = (B, n, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # (B, h, n, d)
        k = self.k_proj(x).view(shape).transpose(1, 2)  # (B, g, n, d)
        v = self.v_proj(x).view(shape).transpose(1, 2)  # (B, g, n, d)
        pos = torch.arange(n)
        q, k = self.rope(q, pos), self.rope(k, pos)
        if self.bug == "rope_on_values":
            v = self.rope(v, pos)
        rep = self.heads // self.kv_heads
        if self.bug == "kv_head_order":
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)  # tile order: head i reads group i % g
        else:
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        scores = q @ k.transpose(2, 3) * self.head_dim**-0.5  # (B, h, n, n)
        causal = torch.full((n, n), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)  # additive
        weights = (scores + causal).softmax(dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(B, n, -1)
        return self.o_proj(out)

    def reference(self) -> MultiHeadAttention:
        w = read_llama(self, num_heads=self.heads, rope_base=self.theta)
        return DecoderAttention.from_grouped_weights(w)


# ---- which module plants which bug ------------------------------------------------------------

FOREIGN_BUGS = {
    "causal_blocks_diagonal": "nanoGPT", "causal_sees_next": "nanoGPT", "causal_reversed": "Raschka",
    "padding_head_order": "folded", "padding_on_queries": "BERT", "keys_from_query": "BERT cross",
    "values_from_query": "BERT cross", "kv_head_order": "Llama", "rope_pairing": "Llama",
    "rope_on_values": "Llama", "double_scale": "nanoGPT flash",
}


def build(style: str, bug: str = "", seed: int = 0, dtype: torch.dtype = torch.float32,
          d: int = 24, h: int = 4) -> tuple[nn.Module, MultiHeadAttention, dict[str, bool]]:
    """A module of ``style`` with ``bug``, its reference, and the call form to diagnose it with."""
    torch.manual_seed(seed)
    module: nn.Module
    if style.startswith("nanoGPT"):
        module, form = NanoCausal(d, h, bug=bug, flash=style.endswith("flash")), {"causal": True}
    elif style == "Raschka":
        module, form = RaschkaMHA(d, d, 16, h, bug=bug), {"causal": True}
    elif style.startswith("BERT"):
        module, form = Bertish(d, h, bug=bug), {"padding": True}
        if style == "BERT cross":
            form = {"cross": True}
    elif style == "folded":
        module, form = FoldedPadded(d, h, bug=bug), {"padding": True}
    else:
        module, form = Llamaish(d, h, max(1, h // 2), theta=100.0, bug=bug), {"causal": True}
    randomize_biases(module)
    module = module.to(dtype).eval()
    return module, module.reference(), form  # type: ignore[operator]


def forward_of(module: nn.Module, form: dict[str, bool]):  # type: ignore[no-untyped-def]
    return module.cross if form.get("cross") else module  # type: ignore[union-attr]


STYLES = ["nanoGPT", "nanoGPT flash", "Raschka", "BERT", "BERT cross", "folded", "Llama"]


def test_every_bug_is_planted_in_a_foreign_module_or_the_scratch_one() -> None:
    assert set(FOREIGN_BUGS) | {b for b in BUGS if not BUGS_BY_NAME[b].needs} == set(BUGS)


@pytest.mark.parametrize("style", STYLES)
def test_right_foreign_modules_pass(style: str) -> None:
    module, ref, form = build(style)
    report = diagnose(forward_of(module, form), ref, **form)
    assert report.ok and report.bugs == (), (style, str(report))
    assert str(report).startswith("OK")


@pytest.mark.parametrize("bug", list(FOREIGN_BUGS) + ["mask_ignored", "mask_inverted", "scale_by_d_model"])
def test_foreign_bugs_are_named(bug: str) -> None:
    style = {"mask_ignored": "nanoGPT", "mask_inverted": "Raschka", "scale_by_d_model": "Raschka"}.get(
        bug, FOREIGN_BUGS.get(bug, ""))
    module, ref, form = build(style, bug)
    report = diagnose(forward_of(module, form), ref, **form)
    assert not report.ok and report.explanations == ((bug,),), (bug, str(report))
    assert report.bugs == (bug,) and f"bug {bug}:" in str(report) and "look for" in str(report)


def test_rope_pairing_either_way() -> None:
    class MixedLayouts(Llamaish):  # rotate_half, but GPT-J's interleaved angles
        def rope(self, t: Tensor, positions: Tensor) -> Tensor:
            freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
            emb = freqs.repeat_interleave(2, dim=-1)  # (n, d): angle j at dims 2j, 2j+1
            return t * emb.cos().to(t.dtype) + rotate_half(t) * emb.sin().to(t.dtype)

    torch.manual_seed(0)
    module = MixedLayouts(24, 4, 2, theta=100.0).eval()
    assert diagnose(module, module.reference(), causal=True).bugs == ("rope_pairing",)


def test_padding_head_order_either_way_and_padding_mask_inverted() -> None:
    for fold in ("bh", "hb"):
        torch.manual_seed(0)
        right, bad = FoldedPadded(24, 4, fold), FoldedPadded(24, 4, fold, bug="padding_head_order")
        bad.load_state_dict(right.state_dict())
        assert diagnose(right, right.reference(), padding=True).ok
        assert diagnose(bad, right.reference(), padding=True).bugs == ("padding_head_order",)
    module, ref, form = build("BERT", "mask_inverted")
    assert diagnose(module, ref, **form).bugs == ("mask_inverted",)


def test_causal_blocks_diagonal_is_named_whatever_row_0_returns() -> None:
    for style in ("nanoGPT", "nanoGPT flash"):  # NaN in row 0 with a -inf fill
        module, ref, form = build("nanoGPT", "causal_blocks_diagonal")
        with torch.no_grad():
            assert module(torch.randn(1, 3, 24))[0, 0].isnan().all()
        assert diagnose(module, ref, causal=True).bugs == ("causal_blocks_diagonal",)
    module, ref, _ = build("nanoGPT")
    zero_row = planted(ref, "causal_blocks_diagonal", causal=True)  # attnlib's zeros in row 0
    assert diagnose(zero_row, ref, causal=True).bugs == ("causal_blocks_diagonal",)


def test_fully_blocked_rows_are_a_convention_not_a_bug() -> None:
    module, ref, _ = build("BERT")
    conventions = {
        "zeros": planted(ref, blocked="zeros"),
        "NaN": planted(ref, blocked="NaN"),
        "mean of values": module.cross,  # finfo.min added to every score of the row
    }
    for name, fwd in conventions.items():
        report = diagnose((lambda x, m, f=fwd: f(x, x, m)) if name == "mean of values" else fwd, ref)
        assert report.ok and report.blocked_rows == name, (name, str(report))
        assert f"every key blocked gets, in your module: {name}" in str(report)
    # -1e4 added (older BERT code): a blocked row reads the unmasked softmax, fine; but large scores beat it
    weak, ref64, _ = build("BERT", dtype=torch.float64)
    weak.fill = -1e4
    report = diagnose(lambda x, m: weak.cross(x, x, m), ref64)
    assert not report.ok and report.errors["blocked row"] <= report.rtol < report.errors["large scores"]
    assert report.bugs == ("mask_fill_finite",)  # the additive form: an alternative of the same bug


def test_a_finite_mask_value_that_large_scores_overcome_is_caught() -> None:
    torch.manual_seed(0)
    weak, strong = Bertish(24, 4, fill=-1e5), Bertish(24, 4, fill=-1e9)
    strong.load_state_dict(weak.state_dict())
    ref = weak.reference()
    report = diagnose(weak, ref, padding=True)
    assert not report.ok and report.bugs == ("mask_fill_finite",)
    assert report.errors["large scores"] > report.rtol >= report.errors["padding"]
    assert "-1e4" in str(report) and "large-scores probe" in " ".join(str(report).split())
    assert diagnose(strong, ref, padding=True).ok



def test_cross_attention_probes_n_q_equal_n_k_and_treat_raising_as_evidence() -> None:
    module, ref, form = build("BERT cross", "keys_from_query")
    report = diagnose(module.cross, ref, cross=True)
    assert report.bugs == ("keys_from_query",) and report.raised  # it raised where n_q != n_k
    assert "raised on the" in str(report)
    torch.manual_seed(0)
    plain = Bertish(24, 4)  # a self-attention module audited as cross-attention: keys and values from x
    both = diagnose(lambda x, c, m: plain(x, None), plain.reference(), cross=True)
    assert not both.ok


def test_cross_padding_form() -> None:
    module, ref, _ = build("BERT cross")
    assert diagnose(module.cross, ref, cross=True, padding=True).ok
    bad, ref, _ = build("BERT cross", "values_from_query")
    assert diagnose(bad.cross, ref, cross=True, padding=True).bugs == ("values_from_query",)


def test_float32_module_against_float64_reference_is_not_wrong() -> None:
    module, ref32, form = build("Raschka")
    ref64 = ref32.to(torch.float64)
    report = diagnose(module, ref64, causal=True)
    assert report.ok and report.dtype == "float32" and report.reference_dtype == "float64"
    assert "float32" in str(report) and "float64" in str(report)
    assert report.rtol < 1e-4  # derived from float32's rounding, not sqrt(eps)
    bad, _, _ = build("Raschka", "scale_by_d_model")
    assert diagnose(bad, ref64, causal=True).bugs == ("scale_by_d_model",)


def test_rope_angles_in_float32_pass_a_float64_comparison() -> None:
    module, ref, form = build("Llama", dtype=torch.float64)
    assert ref.w_q.dtype == torch.float64  # and the module takes its angles in float32
    report = diagnose(module, ref, causal=True)
    assert report.ok, str(report)


def test_d_k_equal_h_ties_are_listed_with_the_reason() -> None:
    torch.manual_seed(0)
    module = RaschkaMHA(9, 9, 16, 3, bug="scale_by_d_model")  # h = d_k = 3: sqrt(d_model) = d_k
    report = diagnose(module, module.reference(), causal=True)
    assert report.explanations == (("scale_by_d_model",), ("double_scale",))
    assert report.bugs == ("scale_by_d_model", "double_scale")
    assert "h ≠ d_k" in report.tie and "h = 3, d_k = 3" in report.tie
    text = str(report)
    assert "cannot tell" in text and text.count("look for:") == 2


def test_errors_on_the_reference_side_and_in_the_adapter_are_named() -> None:
    module, ref, _ = build("BERT")

    class Broken(MultiHeadAttention):
        def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise RuntimeError("out of order")

    broken = Broken(24, 4)
    broken.load_state_dict(ref.state_dict())
    with pytest.raises(RuntimeError, match="reference raised RuntimeError.*reference's side"):
        diagnose(module, broken, padding=True)
    with pytest.raises(ValueError, match=r"in your adapter, <lambda> \(line \d+\), outside your module"):
        diagnose(lambda x, m: module(x, m[0].expand(x.shape[0], -1)), ref)  # m is None on some probes
    with pytest.raises(ValueError, match=r"inside your module, in BertishSelfAttention.forward"):
        diagnose(module, MultiHeadAttention(8, 2), padding=True)
    with pytest.raises(ValueError, match="causal=True and cross=True"):
        diagnose(module, ref, causal=True, cross=True)
    with pytest.raises(TypeError, match="padding must be a bool"):
        diagnose(module, ref, padding=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        diagnose(module, ref, dtype=torch.int32)
    with pytest.raises(ValueError, match="bug 'kv_head_order' needs grouped"):
        planted(ref, "kv_head_order")
    with pytest.raises(ValueError, match="blocked must be one of"):
        planted(ref, blocked="ones")


def test_grouped_and_rotary_references_do_not_crash_a_plain_module() -> None:
    module, ref, _ = build("Llama")
    report = diagnose(module, ref, causal=True)
    assert report.ok
    torch.manual_seed(0)
    book = DecoderAttention(24, 4, num_kv_heads=2, rope_base=100.0)  # the book's own layer
    assert diagnose(lambda x, m: book(x, x, x, mask=m)[0], book).ok
    assert diagnose(lambda x, c, m: book(x, c, c, mask=m)[0], book, cross=True).ok
    plain = MultiHeadAttention(24, 4)
    assert not diagnose(lambda x, m: plain(x, x, x, mask=m)[0], ref).ok  # another layer: WRONG, no crash


def test_causal_and_padded_together() -> None:
    module, ref, _ = build("BERT")
    right = planted(ref, causal=True, padding=True)
    assert diagnose(right, ref, causal=True, padding=True).ok
    for bug in ("padding_on_queries", "causal_reversed", "padding_head_order"):
        report = diagnose(planted(ref, bug, causal=True, padding=True), ref, causal=True, padding=True)
        assert report.bugs == (bug,), (bug, str(report))


def test_probe_inputs_of_the_other_call_forms() -> None:
    from attnlib.audit import probe_inputs

    padded = probe_inputs(8, padding=True)
    assert [k for k, _, _ in padded] == ["padding", "padding", "no padding", "large scores"]
    for _, x, mask in padded:
        assert mask is not None and mask.shape == x.shape[:2] and mask[:, 0].all()  # key 0 real
        assert torch.equal(mask, mask.cummin(dim=1).values)  # padded on the right
    assert all(m is None for _, _, m in probe_inputs(8, causal=True))
    for kind, (x, context), mask in probe_inputs(8, cross=True):  # type: ignore[misc]
        assert x.shape[0] == context.shape[0] and (kind != "same length" or x.shape == context.shape)
        assert mask is None or mask.shape == (x.shape[1], context.shape[1])


@SETTINGS
@given(st.sampled_from(list(FOREIGN_BUGS)), st.sampled_from([(8, 2), (12, 2), (16, 4), (12, 3), (16, 2)]),
       st.integers(0, 2**16))
def test_property_foreign_bugs_are_named_at_random_sizes(bug: str, dh: tuple[int, int], seed: int) -> None:
    d, h = dh
    if FOREIGN_BUGS[bug] == "Llama" and (d // h) % 2:
        return  # RoPE needs an even head width
    module, ref, form = build(FOREIGN_BUGS[bug], bug, seed=seed, d=d, h=h)
    right, _, _ = build(FOREIGN_BUGS[bug], seed=seed, d=d, h=h)
    assert diagnose(forward_of(right, form), ref, seed=seed, pairs=False, **form).ok
    report = diagnose(forward_of(module, form), ref, seed=seed, pairs=False, **form)
    if bug in report.undetectable:  # e.g. kv_head_order with h/g = 1 or g = 1
        assert report.ok
    else:
        assert (bug,) in report.explanations, (bug, d, h, seed, str(report))
