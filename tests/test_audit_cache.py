"""attnlib.audit.diagnose_cache: incremental decoding must equal the full causal pass.

The decoder below is our own code in the idiom of Hugging Face's Llama (``past_key_value``
holding keys after RoPE, ``repeat_kv``, positions continuing after the cache) and uses nothing
from attnlib. A bug is a constructor keyword that swaps one line for its wrong form.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from attnlib import KVCache, MultiHeadAttention
from attnlib.audit import CACHE_BUGS, diagnose_cache
from attnlib.decoding import DecoderAttention
from attnlib.interop import read_llama


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CachedDecoder(nn.Module):
    """Grouped-query causal attention with RoPE and a (keys, values) cache passed in and out."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, theta: float | None = 100.0, bug: str = "") -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta, self.bug = heads, kv_heads, hidden // heads, theta, bug
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def rope(self, t: Tensor, positions: Tensor) -> Tensor:
        assert self.theta is not None
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = positions.float()[:, None] * inv_freq  # (t, d/2), float32 as in transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        return t * emb.cos().to(t.dtype) + rotate_half(t) * emb.sin().to(t.dtype)

    def forward(self, x: Tensor, past: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        B, t, _ = x.shape
        q = self.q_proj(x).view(B, t, -1, self.head_dim).transpose(1, 2)  # (B, h, t, d)
        k = self.k_proj(x).view(B, t, -1, self.head_dim).transpose(1, 2)  # (B, g, t, d)
        v = self.v_proj(x).view(B, t, -1, self.head_dim).transpose(1, 2)
        past_len = 0 if past is None else past[0].shape[2]
        if self.theta is not None:
            start = 0 if self.bug == "rope_positions_restart" else past_len
            pos = torch.arange(start, start + t)
            q, k = self.rope(q, pos), self.rope(k, pos)
        if past is None:
            cache_k, cache_v = k, v
            k_all, v_all = k, v
        else:
            cache_k, cache_v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            if self.bug == "keys_appended_twice":
                cache_k, cache_v = torch.cat([cache_k, k], dim=2), torch.cat([cache_v, v], dim=2)
            k_all, v_all = (past if self.bug == "cache_read_before_update" else (cache_k, cache_v))
        rep = self.heads // self.kv_heads
        if self.bug == "kv_head_order":
            k_all, v_all = k_all.repeat(1, rep, 1, 1), v_all.repeat(1, rep, 1, 1)
        else:
            k_all, v_all = (a.repeat_interleave(rep, dim=1) for a in (k_all, v_all))
        off = 1.0001 if self.bug == "scale off by 1e-4" else 1.0  # a real error, tiny
        scores = q @ k_all.transpose(2, 3) / (off * math.sqrt(self.head_dim))  # (B, h, t, n_k)
        n_k = k_all.shape[2]
        if t > 1 and self.bug != "prefill_not_causal":  # a prompt (or a chunk) masks its own future
            q_pos = torch.arange(n_k - t, n_k)[:, None]
            if self.bug == "chunk_causal_upper_left" and past is not None:
                q_pos = torch.arange(t)[:, None]  # SDPA's is_causal=True: aligned to the upper left
            scores = scores.masked_fill(torch.arange(n_k)[None, :] > q_pos, float("-inf"))
        out = (scores.softmax(dim=-1) @ v_all).transpose(1, 2).reshape(B, t, -1)
        return self.o_proj(out), (cache_k, cache_v)

    def reference(self) -> MultiHeadAttention:
        return DecoderAttention.from_grouped_weights(read_llama(self, num_heads=self.heads, rope_base=self.theta))


def build(bug: str = "", seed: int = 0, **kw: object) -> tuple[CachedDecoder, MultiHeadAttention]:
    torch.manual_seed(seed)
    m = CachedDecoder(24, 4, 2, bug=bug, **kw).eval()  # type: ignore[arg-type]
    return m, m.reference()


def test_right_decoder_passes() -> None:
    module, ref = build()
    report = diagnose_cache(module, ref)
    assert report.ok and report.bugs == () and set(report.errors) == {"prefill", "steps", "chunks"}, str(report)


def test_a_small_real_error_in_float64_passes_undeclared_and_the_report_says_so() -> None:
    torch.manual_seed(0)
    module = CachedDecoder(24, 4, 2, theta=None, bug="scale off by 1e-4").eval().double()
    ref = module.reference()
    report = diagnose_cache(module, ref, pairs=False)  # undeclared: passed at float32's tolerance, and said
    assert report.ok and report.bugs == () and report.suspected_dtype == report.compute_dtype == "float32"
    text = " ".join(str(report).split())
    assert "passed at float32's tolerance" in text and "would pass the same way" in text
    assert "compute_dtype=torch.float64" in text
    strict = diagnose_cache(module, ref, compute_dtype=torch.float64, pairs=False)
    assert not strict.ok and strict.suspected_dtype == "" and strict.compute_dtype == "float64"
    assert "float32" not in str(strict)
    assert str(strict).startswith("WRONG") and strict.rtol < report.rtol
    declared = diagnose_cache(module, ref, compute_dtype=torch.float32, pairs=False)
    assert declared.ok and declared.suspected_dtype == ""
    assert "would pass the same way" not in " ".join(str(declared).split())  # the text wraps lines


def test_attnlib_kv_cache_passes() -> None:
    torch.manual_seed(0)
    mha = DecoderAttention(24, 4, num_kv_heads=2, rope_base=100.0)

    def step(x: Tensor, cache: KVCache | None) -> tuple[Tensor, KVCache]:
        cache = KVCache() if cache is None else cache
        return mha(x, x, x, need_weights=False, cache=cache)[0], cache

    assert diagnose_cache(step, mha).ok


@pytest.mark.parametrize("bug", list(CACHE_BUGS))
def test_each_cache_bug_is_named(bug: str) -> None:
    module, ref = build(bug)
    report = diagnose_cache(module, ref)
    assert not report.ok and report.explanations == ((bug,),), (bug, str(report))
    assert f"bug {bug}:" in str(report)


def test_a_step_only_bug_is_wrong_on_the_steps_only() -> None:
    module, ref = build("cache_read_before_update")
    report = diagnose_cache(module, ref)
    assert report.errors["prefill"] <= report.rtol < report.errors["steps"]


def test_two_cache_bugs_are_named_as_a_pair() -> None:
    class Both(CachedDecoder):
        def forward(self, x, past=None):  # type: ignore[no-untyped-def]
            self.bug = "prefill_not_causal" if past is None else "rope_positions_restart"
            return super().forward(x, past)

    torch.manual_seed(0)
    module = Both(24, 4, 2)
    assert diagnose_cache(module, module.reference()).bugs == ("rope_positions_restart", "prefill_not_causal")


def test_without_rope_or_groups_their_bugs_are_not_tried() -> None:
    torch.manual_seed(0)
    plain = CachedDecoder(24, 4, 4, theta=None, bug="keys_appended_twice")
    report = diagnose_cache(plain, plain.reference())
    assert report.bugs == ("keys_appended_twice",)


def test_cache_errors_are_clear() -> None:
    module, ref = build()
    with pytest.raises(TypeError, match="step must be a callable"):
        diagnose_cache(3, ref)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must return \(out, state\)"):
        diagnose_cache(lambda x, s: module(x, s)[0], ref)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match=r"out of shape \(2, 3, 24\), got \(2, 3, 12\)"):
        diagnose_cache(lambda x, s: (module(x, s)[0][..., :12], module(x, s)[1]), ref)
    with pytest.raises(ValueError, match=r"after 3 tokens raised TypeError in your adapter"):
        diagnose_cache(lambda x, s: (module(x, s)[0], module(x, s)[1] if s is None else s + 1), ref)
    with pytest.raises(ValueError, match="different outputs for the same input"):
        diagnose_cache(lambda x, s: (module(x, s)[0] + torch.rand(()), module(x, s)[1]), ref)
    with pytest.raises(ValueError, match="rtol must be a positive number"):
        diagnose_cache(module, ref, rtol=-1.0)
    with pytest.raises(TypeError, match="reference must be an attnlib.MultiHeadAttention"):
        diagnose_cache(module, module)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed must be an int"):
        diagnose_cache(module, ref, seed="0")  # type: ignore[arg-type]


def test_a_reference_with_another_forward_is_refused_by_the_cache_check() -> None:
    class Shifted(DecoderAttention):  # grouped heads and RoPE: chapter 8's subclass
        def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            out, w = super().forward(*args, **kwargs)
            return out + 1.0, w

    module, ref = build()
    shifted = Shifted(24, 4, bias=False, num_kv_heads=2, rope_base=100.0)
    shifted.load_state_dict(ref.state_dict())
    with pytest.raises(RuntimeError, match="model of decoding disagrees with reference.forward"):
        diagnose_cache(module, shifted)
