"""How fast is each way of writing multi-head attention? (chapter 5)

Every variant is built from **the same weights** (one ``attnlib.MultiHeadAttention``,
converted with ``attnlib.interop``), every variant's output (and attention weights,
and input gradient when timing the backward pass) is checked against attnlib's
**before** anything is timed, and times are **medians of interleaved rounds**: each
round runs every variant once, in turn, so a slow spell on a shared machine hits all
variants alike. Each of those runs is one call timed by ``benchmarks/harness.py`` (the
harness ``bench_blockwise.py`` uses too), after two untimed calls, with the requested number
of torch threads. Ratios are also given as the median of per-round ratios against
``torch.nn.MultiheadAttention`` returning the same thing (weights or not). The variants that
call ``scaled_dot_product_attention`` (``per_head_loop_sdpa``, ``attnlib_noweights``, ``sdpa``)
are checked under ``torch.nn.attention.sdpa_kernel`` with the fused kernels only (on a CPU,
FlashAttention's), so none of them can fall back to the math path, which writes out the
``n x n`` weights, and be timed under a fused name.

Variants (self-attention, ``query is key is value``):

=======================  ===================================================================
``per_head_loop``        ``attnlib.SeparateHeadsAttention``: h small projections per role, a loop,
                         explicit softmax per head (``attnlib.attention``)
``per_head_loop_sdpa``   the same loop and small projections, ``F.scaled_dot_product_attention``
                         per head, on ``(B, 1, n, d_k)`` (4-D: its fused kernel; on 3-D inputs
                         torch runs the math path)
``attnlib``              ``attnlib.MultiHeadAttention``, attention weights returned
``attnlib_noweights``    ``attnlib.MultiHeadAttention(..., need_weights=False)`` (SDPA inside)
``packed_qkv``           one ``nn.Linear(d, 3d)`` as nanoGPT's ``c_attn``, explicit softmax
                         (the fused partner of ``per_head_loop``)
``sdpa``                 the same packed projection + ``F.scaled_dot_product_attention``
                         (the fused partner of ``per_head_loop_sdpa``)
``torch_mha``            ``torch.nn.MultiheadAttention``, weights returned (per head)
``torch_mha_noweights``  ``torch.nn.MultiheadAttention(..., need_weights=False)``
``merged_qk``            scores from one ``d x d`` matrix per head, ``W_i^Q W_i^K^T``
=======================  ===================================================================

Modes: ``forward`` (eval mode, ``torch.no_grad()``: PyTorch may take its inference
fast path) and ``train`` (train mode, forward plus backward of ``out.sum()`` into the
parameters and the input).

The "GEMM floor" column is the time the matrix products alone would take at the
rate this machine reaches on one big ``torch.matmul``, ``(2048, 512) @ (512, 1536)``
(the packed projection of the reference layer B=8, n=256, d_model=512), timed in every
round beside the variants:
forward FLOPs ``8 B n d^2 + 4 B n^2 d`` (four projections, scores, weighted sum of
values); ``train`` counts three times that (the backward pass of a product costs two
products).

Usage (from the repository root)::

    python benchmarks/bench_attention.py --out my_sweep.csv    # sweep on CPU, default threads
    python benchmarks/bench_attention.py --threads 1 --clock cpu --out benchmarks/results/cpu_sweep.csv
    python benchmarks/bench_attention.py --target --out benchmarks/results/cpu_target.csv
    python benchmarks/bench_attention.py --device cuda --out benchmarks/results/cuda_sweep.csv
    python benchmarks/bench_attention.py --device cuda --target --out benchmarks/results/cuda_target.csv
    python benchmarks/bench_attention.py --quick                # a few seconds: smoke test, into a temporary folder
    python benchmarks/bench_attention.py --decoding --threads 1 --clock cpu --rounds 5 --out benchmarks/results/cpu_decoding.csv

``--target`` measures only the book's reference layer (B=8, n=256, d_model=512,
h=8) with attnlib against ``torch.nn.MultiheadAttention``, with more rounds.
``--clock cpu`` times with the process's CPU time instead of the wall clock (CPU
only, and with ``--threads 1``: the process's CPU time is summed over its threads;
with one thread it ignores the time other programs take the core away).
On CUDA the clock is the wall clock around ``torch.cuda.synchronize()``.
A plot is written next to the CSV (same name, ``.png``) unless ``--no-plot``.

Where the CSV goes: ``--out``; without it, ``benchmarks/results/<device>_<kind>.csv``
unless that file exists (the committed results are replaced only by naming them in
``--out``). ``--quick`` writes to a fresh temporary folder (or ``--out``) and never
into ``benchmarks/results/``: its tiny sizes are a smoke test, not results.

The committed results in ``benchmarks/results/`` come from the book's build machine,
2 shared CPU cores, PyTorch 2.13 CPU build, float32:

- ``cpu_sweep.csv`` / ``.png``: ``--threads 1 --clock cpu --rounds 7 --heads 1 4 16``
  (other jobs shared the cores, so one thread and CPU time; 9.5 minutes, load average 4 to 7);
- ``cpu_target.csv``: ``--target --threads 1 --clock cpu --rounds 60``;
- ``cpu_decoding.csv``: ``--decoding --threads 1 --clock cpu --rounds 5`` (one decoding step and a prefill
  for MHA, GQA, MQA and MLA, with cache bytes per token). The caches append with ``torch.cat``, so each
  timed step also copies the whole cache, in proportion to its bytes; a preallocated cache would not.

These three files were measured before the harness above replaced ``torch.utils.benchmark.Timer``
and before ``per_head_loop_sdpa`` passed 4-D inputs: in ``cpu_sweep.csv`` its SDPA calls got
``(B, n, d_k)`` and ran the math path, so its rows measure a loop over the math path, not over
the fused kernel that the ``sdpa`` variant runs.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import sdpa_kernel

try:
    import attnlib  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnlib import MultiHeadAttention, SeparateHeadsAttention
from attnlib.interop import write_packed_linear

if str(Path(__file__).resolve().parent) not in sys.path:  # imported by path (the book, the tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Sample, fused_backends, interleaved, measure  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # the committed results

VARIANTS = [
    "per_head_loop",
    "per_head_loop_sdpa",
    "attnlib",
    "attnlib_noweights",
    "packed_qkv",
    "sdpa",
    "torch_mha",
    "torch_mha_noweights",
    "merged_qk",
]
RETURNS_WEIGHTS = {"attnlib", "torch_mha", "merged_qk"}
CALLS_SDPA = {"per_head_loop_sdpa", "attnlib_noweights", "sdpa"}  # checked under the fused kernels only
TARGET_VARIANTS = ["attnlib", "torch_mha", "attnlib_noweights", "torch_mha_noweights"]
FIELDS = [
    "device", "device_name", "threads", "clock", "dtype", "torch", "mode", "B", "n", "d_model", "h", "d_k",
    "variant", "returns_weights", "median_ms", "q1_ms", "q3_ms", "rounds", "ratio_vs_torch",
    "gflop", "floor_ms", "matmul_gflops", "date",
]


@dataclass
class Variant:
    """A callable ``x -> (out, weights or None)`` and the tensors it learns."""

    fn: Callable[[Tensor], tuple[Tensor, Tensor | None]]
    params: list[Tensor]
    modules: list[nn.Module]


def _split_heads(t: Tensor, h: int) -> Tensor:
    B, n, d = t.shape
    return t.view(B, n, h, d // h).transpose(1, 2)  # (B, h, n, d_k)


def _merge_heads(t: Tensor) -> Tensor:
    B, h, n, d_k = t.shape
    return t.transpose(1, 2).reshape(B, n, h * d_k)  # (B, n, h*d_k)


def build_variants(mha: MultiHeadAttention) -> dict[str, Variant]:
    """Every variant, each holding copies of ``mha``'s weights in its own layout."""
    h, d, d_k = mha.num_heads, mha.d_model, mha.d_k
    weights = mha.projections()
    sep = SeparateHeadsAttention.from_fused(mha)
    tmha = mha.to_torch()  # nn.MultiheadAttention(batch_first=True)
    lin = write_packed_linear(weights)  # {"c_attn": Linear(d, 3d), "c_proj": Linear(d, d)}
    c_attn, c_proj = lin["c_attn"], lin["c_proj"]
    for m in (sep, tmha, c_attn, c_proj):
        m.to(device=weights.w_q.device, dtype=weights.w_q.dtype)

    def loop_sdpa(x: Tensor) -> tuple[Tensor, Tensor | None]:
        heads = []
        for i in range(h):  # SeparateHeadsAttention's loop, with SDPA in place of attnlib.attention
            q_i, k_i, v_i = x @ sep.w_q[i], x @ sep.w_k[i], x @ sep.w_v[i]  # (B, n, d_k)
            if sep.b_q is not None:
                q_i, k_i, v_i = q_i + sep.b_q[i], k_i + sep.b_k[i], v_i + sep.b_v[i]  # type: ignore[index]
            # 4-D (B, 1, n, d_k): on (B, n, d_k) torch would run its math path, not the fused kernel
            heads.append(F.scaled_dot_product_attention(q_i[:, None], k_i[:, None], v_i[:, None])[:, 0])
        out = torch.cat(heads, dim=-1) @ sep.w_o  # (B, n, d)
        return (out if sep.b_o is None else out + sep.b_o), None

    def packed(x: Tensor) -> tuple[Tensor, Tensor | None]:
        q, k, v = (_split_heads(t, h) for t in c_attn(x).split(d, dim=2))  # (B, h, n, d_k)
        att = torch.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d_k)), dim=-1)  # (B, h, n, n)
        return c_proj(_merge_heads(att @ v)), None  # (B, n, d)

    def sdpa(x: Tensor) -> tuple[Tensor, Tensor | None]:
        q, k, v = (_split_heads(t, h) for t in c_attn(x).split(d, dim=2))  # (B, h, n, d_k)
        return c_proj(_merge_heads(F.scaled_dot_product_attention(q, k, v))), None  # (B, n, d)

    # Merged scores: q_i . k_j = x_i W^QK x_j^T + (b^Q W^K^T) x_j^T + (terms constant in j,
    # which softmax ignores). One (d, d) matrix per head, stored side by side: (d, h*d).
    with torch.no_grad():
        w_qk = torch.einsum("hak,hbk->ahb", mha.w_q_heads, mha.w_k_heads).reshape(d, h * d)  # (d, h*d)
        u = torch.zeros(h * d, dtype=w_qk.dtype, device=w_qk.device)
        if mha.b_q is not None:
            u = torch.einsum("hk,hbk->hb", mha.b_q.view(h, d_k), mha.w_k_heads).reshape(h * d)  # (h*d,)
    w_qk, u = nn.Parameter(w_qk), nn.Parameter(u)
    zeros = torch.zeros_like(weights.w_v[0])  # (d,): a missing bias
    w_v = nn.Parameter(weights.w_v.clone())  # (d, d)
    b_v = nn.Parameter(zeros.clone() if weights.b_v is None else weights.b_v.clone())  # (d,)
    w_o = nn.Parameter(weights.w_o.clone())  # (d, d)
    b_o = nn.Parameter(zeros.clone() if weights.b_o is None else weights.b_o.clone())  # (d,)

    def merged(x: Tensor) -> tuple[Tensor, Tensor | None]:
        B, n, _ = x.shape
        xq = torch.addmm(u, x.reshape(B * n, d), w_qk).view(B, n, h, d).transpose(1, 2)  # (B, h, n, d)
        scores = (xq @ x.unsqueeze(1).transpose(-2, -1)) * (1.0 / math.sqrt(d_k))  # (B, h, n, n)
        att = torch.softmax(scores, dim=-1)  # (B, h, n, n)
        v = _split_heads(torch.addmm(b_v, x.reshape(B * n, d), w_v).view(B, n, d), h)  # (B, h, n, d_k)
        return torch.addmm(b_o, _merge_heads(att @ v).reshape(B * n, d), w_o).view(B, n, d), att

    return {
        "per_head_loop": Variant(lambda x: sep(x, x, x, need_weights=False), list(sep.parameters()), [sep]),
        "per_head_loop_sdpa": Variant(loop_sdpa, list(sep.parameters()), [sep]),
        "attnlib": Variant(lambda x: mha(x, x, x, need_weights=True), list(mha.parameters()), [mha]),
        "attnlib_noweights": Variant(lambda x: mha(x, x, x, need_weights=False), list(mha.parameters()), [mha]),
        "packed_qkv": Variant(packed, [*c_attn.parameters(), *c_proj.parameters()], [c_attn, c_proj]),
        "sdpa": Variant(sdpa, [*c_attn.parameters(), *c_proj.parameters()], [c_attn, c_proj]),
        "torch_mha": Variant(
            lambda x: tmha(x, x, x, need_weights=True, average_attn_weights=False), list(tmha.parameters()), [tmha]
        ),
        "torch_mha_noweights": Variant(lambda x: tmha(x, x, x, need_weights=False), list(tmha.parameters()), [tmha]),
        "merged_qk": Variant(merged, [w_qk, u, w_v, b_v, w_o, b_o], []),
    }


def seconds(sample: Sample, clock: str) -> float:
    """The time of one harness sample on ``clock``: ``"cpu"`` (user + system) or ``"wall"``."""
    return sample.cpu if clock == "cpu" else sample.wall


def _sync(device: torch.device) -> Callable[[], object] | None:
    return torch.cuda.synchronize if device.type == "cuda" else None


def make_step(v: Variant, x: Tensor, mode: str) -> Callable[[], tuple[Tensor, Tensor | None]]:
    """One timed call: forward only (no_grad) or forward + backward of ``out.sum()``."""
    if mode == "forward":

        def step() -> tuple[Tensor, Tensor | None]:
            with torch.no_grad():
                return v.fn(x)

        return step

    def train_step() -> tuple[Tensor, Tensor | None]:
        for p in v.params:
            p.grad = None
        x.grad = None
        out, w = v.fn(x)
        out.sum().backward()
        return out, w

    return train_step


def check_agreement(variants: dict[str, Variant], x: Tensor, mode: str, names: list[str]) -> None:
    """Every variant's output (and weights, and d out.sum()/dx in train mode) must match attnlib's."""
    tol = {  # float64: assert_close's defaults
        torch.float32: {"rtol": 1e-4, "atol": 1e-4},
        torch.float16: {"rtol": 3e-2, "atol": 3e-2},
        torch.bfloat16: {"rtol": 5e-2, "atol": 5e-2},
    }.get(x.dtype, {})
    ref_out, ref_w = make_step(variants["attnlib"], x, mode)()
    ref_dx = None if x.grad is None else x.grad.clone()
    for name in names:
        if name in CALLS_SDPA:  # its SDPA calls may only run a fused kernel: a math-path fallback fails here
            with sdpa_kernel(fused_backends(x.device)):
                out, w = make_step(variants[name], x, mode)()
        else:
            out, w = make_step(variants[name], x, mode)()
        torch.testing.assert_close(out, ref_out, **tol, msg=lambda m: f"{name} ({mode}): output differs: {m}")
        if w is not None:
            assert ref_w is not None
            torch.testing.assert_close(w, ref_w, **tol, msg=lambda m: f"{name}: weights differ: {m}")
        if ref_dx is not None:
            assert x.grad is not None
            torch.testing.assert_close(x.grad, ref_dx, **tol, msg=lambda m: f"{name}: d/dx differs: {m}")


GEMM = "reference_gemm"
GEMM_SHAPE = (2048, 512, 1536)  # (B n, d_model) @ (d_model, 3 d_model) of the reference layer


def reference_gemm(device: torch.device, dtype: torch.dtype) -> Callable[[], Tensor]:
    """One big ``torch.matmul`` ``(2048, 512) @ (512, 1536)``, timed in every round beside
    the variants, so the machine's matrix-product rate is measured in the same conditions."""
    m, k, n = GEMM_SHAPE
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return lambda: a @ b


def forward_gflop(B: int, n: int, d: int) -> float:
    """Projections ``4 * 2 B n d^2`` plus scores and values ``2 * 2 B n^2 d`` (all heads)."""
    return (8 * B * n * d * d + 4 * B * n * n * d) / 1e9


def time_config(
    B: int, n: int, d: int, h: int, mode: str, names: list[str], rounds: int,
    device: torch.device, dtype: torch.dtype, clock: str, threads: int, seed: int = 0,
) -> dict[str, list[float]]:
    """Per-round times (seconds on ``clock``) of each variant, interleaved, after checking
    agreement; each one call after two warm-up calls, with ``threads`` torch threads."""
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d, h, device=device, dtype=dtype)
    variants = build_variants(mha)
    for v in variants.values():
        for m in v.modules:
            m.train(mode == "train")
    x = torch.randn(B, n, d, device=device, dtype=dtype, requires_grad=(mode == "train"))
    check_agreement(variants, x, mode, names)
    steps: dict[str, Callable[[], object]] = {name: make_step(variants[name], x, mode) for name in names}
    steps[GEMM] = reference_gemm(device, dtype)
    samples = interleaved(steps, rounds, threads=threads, warmup=2, sync=_sync(device))  # rotating who goes first
    return {name: [seconds(t, clock) for t in ts] for name, ts in samples.items()}


def summarise(times: dict[str, list[float]], meta: dict[str, object], gflop: float) -> list[dict[str, object]]:
    """One row per variant: medians, quartiles, the median paired ratio against torch MHA
    returning the same thing, and the GEMM floor at the rate of this config's rounds."""
    rows = []
    m, k, n = GEMM_SHAPE
    rate = 2 * m * k * n / statistics.median(times.pop(GEMM)) / 1e9  # GFLOP/s
    for name, ts in times.items():
        ref = "torch_mha" if name in RETURNS_WEIGHTS else "torch_mha_noweights"
        ratio = (
            statistics.median(a / b for a, b in zip(ts, times[ref], strict=True)) if ref in times else float("nan")
        )
        q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (ts[0], ts[0], ts[0])
        rows.append({
            **meta, "variant": name, "returns_weights": name in RETURNS_WEIGHTS,
            "median_ms": round(statistics.median(ts) * 1e3, 4), "q1_ms": round(q1 * 1e3, 4),
            "q3_ms": round(q3 * 1e3, 4), "rounds": len(ts), "ratio_vs_torch": round(ratio, 4),
            "gflop": round(gflop, 4), "floor_ms": round(gflop / rate * 1e3, 4), "matmul_gflops": round(rate, 2),
        })
    return rows


def read_results(path: str | Path) -> list[dict[str, object]]:
    """Rows of a results CSV with numbers as numbers."""
    ints = {"threads", "B", "n", "d_model", "h", "d_k", "rounds"}
    floats = {"median_ms", "q1_ms", "q3_ms", "ratio_vs_torch", "gflop", "floor_ms", "matmul_gflops"}
    with open(path, newline="") as f:
        rows: list[dict[str, object]] = []
        for row in csv.DictReader(f):
            rows.append({k: int(v) if k in ints else float(v) if k in floats else
                         (v == "True") if k == "returns_weights" else v for k, v in row.items()})
    return rows


def plot(rows: list[dict[str, object]], path: Path, h_fixed: int, n_fixed: int) -> None:
    """Time against n (h fixed) and against h (n fixed), one row of panels per mode."""
    from attnlib import plots

    fig = plots.benchmark_panels(rows, h_fixed=h_fixed, n_fixed=n_fixed)
    fig.savefig(path, dpi=110)


# ---- decoding: GQA, MQA and MLA (chapter 8) -----------------------------------------------
# One decoding step (a new token reading a cache of n_ctx positions) and the prefill of a
# whole prompt, for plain MHA, GQA, MQA and multi-head latent attention, naive and absorbed.
# Every variant's step output is checked (GQA/MQA against plain MHA with K/V repeated per
# group; MLA absorbed against MLA naive) before anything is timed. All take the
# need_weights=False (SDPA) path; MHA/GQA/MQA use RoPE, MLA its decoupled RoPE key.
# KVCache and LatentCache append with torch.cat (a copy of the cache per step), as a simple cache
# does, so the timed step includes that copy; chapter 8 says so where it cites this benchmark.
#
#   python benchmarks/bench_attention.py --decoding --threads 1 --clock cpu --rounds 5 --out benchmarks/results/cpu_decoding.csv
#
# writes benchmarks/results/cpu_decoding.csv (committed: B=8, n_ctx=1024, d_model=512, h=8,
# GQA g=2, MQA g=1, MLA d_c=128, d_r=32; 2 shared cores, one thread, CPU time).

DECODING_FIELDS = [
    "device", "threads", "clock", "dtype", "torch", "mode", "B", "n_ctx", "d_model", "h", "variant",
    "num_kv_heads", "d_c", "d_r", "cache_bytes_per_token", "median_ms", "q1_ms", "q3_ms", "rounds",
    "ratio_vs_mha", "date",
]


def decoding_variants(
    d: int, h: int, device: torch.device, dtype: torch.dtype, d_c: int, d_r: int
) -> dict[str, tuple[nn.Module, dict[str, object]]]:
    """name -> (module, facts): MHA, GQA (g = h/4), MQA (g = 1), MLA naive and absorbed."""
    from attnlib import DecoderAttention, LatentAttention

    out: dict[str, tuple[nn.Module, dict[str, object]]] = {}
    for name, g in (("mha", h), ("gqa", max(1, h // 4)), ("mqa", 1)):
        m = DecoderAttention(d, h, bias=False, num_kv_heads=g, rope_base=10000.0, device=device, dtype=dtype)
        out[name] = (m.eval(), {"num_kv_heads": g, "d_c": "", "d_r": ""})
    mla = LatentAttention(d, h, d_c, d_r, device=device, dtype=dtype).eval()
    for name, absorb in (("mla_naive", False), ("mla_absorbed", True)):
        out[name] = (mla, {"num_kv_heads": "", "d_c": d_c, "d_r": d_r, "absorb": absorb})
    return out


def _decode_call(module: nn.Module, facts: dict[str, object], x: Tensor, cache: object) -> Tensor:
    from attnlib import LatentAttention

    if isinstance(module, LatentAttention):
        return module(x, need_weights=False, cache=cache, absorb=bool(facts["absorb"]))[0]
    return module(x, x, x, need_weights=False, cache=cache)[0]


def time_decoding(
    B: int, n_ctx: int, d: int, h: int, rounds: int, device: torch.device, dtype: torch.dtype,
    clock: str, threads: int, d_c: int, d_r: int, seed: int = 0,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, object]]]:
    """Per-round times (seconds on ``clock``) of a decoding step and of a prefill, for every
    variant, interleaved; each one call after two warm-up calls, with ``threads`` torch
    threads. A step reads a cache prefilled with ``n_ctx`` positions (untimed, afresh before
    every call), a prefill starts from an empty cache."""
    from attnlib import DecoderAttention, KVCache, LatentAttention, LatentCache

    torch.manual_seed(seed)
    variants = decoding_variants(d, h, device, dtype, d_c, d_r)
    prompt = torch.randn(B, n_ctx, d, device=device, dtype=dtype)
    step_x = torch.randn(B, 1, d, device=device, dtype=dtype)

    def fresh_cache(module: nn.Module) -> object:
        return LatentCache() if isinstance(module, LatentAttention) else KVCache()

    def prefilled(name: str) -> object:
        module, facts = variants[name]
        cache = fresh_cache(module)
        _decode_call(module, facts, prompt, cache)
        return cache

    facts_out: dict[str, dict[str, object]] = {}
    with torch.no_grad():
        # check: GQA/MQA equal plain MHA with K/V repeated; absorbed MLA equals naive MLA
        results = {name: _decode_call(m, f, step_x, prefilled(name)) for name, (m, f) in variants.items()}
        tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        for name in ("gqa", "mqa"):
            grouped = variants[name][0]
            assert isinstance(grouped, DecoderAttention)
            plain = grouped.expand_kv_heads()
            cache = KVCache()
            plain(prompt, prompt, prompt, need_weights=False, cache=cache)
            torch.testing.assert_close(results[name], plain(step_x, step_x, step_x, need_weights=False, cache=cache)[0], **tol)
        torch.testing.assert_close(results["mla_absorbed"], results["mla_naive"], **tol)
        for name in variants:
            c = prefilled(name)
            facts_out[name] = dict(variants[name][1])
            facts_out[name]["cache_bytes_per_token"] = c.nbytes // (B * n_ctx)  # type: ignore[attr-defined]
        times: dict[str, dict[str, list[float]]] = {"decode_step": {n: [] for n in variants}, "prefill": {n: [] for n in variants}}
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for r in range(rounds):
                names = list(variants)
                names = names[r % len(names):] + names[: r % len(names)]
                for name in names:
                    module, facts = variants[name]
                    box: list[object] = []  # the prefilled cache of the call to time, made by the untimed setup

                    def step(module: nn.Module = module, facts: dict[str, object] = facts, box: list[object] = box) -> Tensor:
                        return _decode_call(module, facts, step_x, box[0])

                    def prefill(module: nn.Module = module, facts: dict[str, object] = facts) -> Tensor:
                        return _decode_call(module, facts, prompt, fresh_cache(module))

                    def setup(box: list[object] = box, name: str = name) -> None:
                        box[:] = [prefilled(name)]

                    sync = _sync(device)
                    times["decode_step"][name].append(seconds(measure(step, warmup=2, setup=setup, sync=sync), clock))
                    times["prefill"][name].append(seconds(measure(prefill, warmup=2, sync=sync), clock))
        finally:
            torch.set_num_threads(before)
    return times, facts_out


def run_decoding(
    B: int, n_ctx: int, d: int, h: int, rounds: int, device: torch.device, dtype: torch.dtype,
    clock_name: str, threads: int, out: Path, d_c: int, d_r: int,
) -> list[dict[str, object]]:
    """Time the decoding variants, print a table and write ``out`` (CSV)."""
    times, facts = time_decoding(B, n_ctx, d, h, rounds, device, dtype, clock_name, threads, d_c, d_r)
    date = datetime.date.today().isoformat()
    rows: list[dict[str, object]] = []
    for mode, per_variant in times.items():
        ref = per_variant["mha"]
        for name, ts in per_variant.items():
            q1, med, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (ts[0], ts[0], ts[0])
            ratios = [a / b for a, b in zip(ts, ref)]
            row = {
                "device": device.type, "threads": threads, "clock": clock_name,
                "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "mode": mode,
                "B": B, "n_ctx": n_ctx, "d_model": d, "h": h, "variant": name,
                "num_kv_heads": facts[name]["num_kv_heads"], "d_c": facts[name]["d_c"], "d_r": facts[name]["d_r"],
                "cache_bytes_per_token": facts[name]["cache_bytes_per_token"],
                "median_ms": round(1e3 * statistics.median(ts), 4), "q1_ms": round(1e3 * q1, 4),
                "q3_ms": round(1e3 * q3, 4), "rounds": len(ts),
                "ratio_vs_mha": round(statistics.median(ratios), 3), "date": date,
            }
            rows.append(row)
            print(f"{mode:11s} {name:13s} cache {row['cache_bytes_per_token']:>6} B/token  "
                  f"{row['median_ms']:9.3f} ms  ({row['ratio_vs_mha']:.2f}x MHA)", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=DECODING_FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    return rows


# ---- end of the decoding section --------------------------------------------------------------


def output_path(p: argparse.ArgumentParser, a: argparse.Namespace, name: str) -> Path:
    """The CSV to write (see the module docstring): ``--out``; for ``--quick`` a fresh
    temporary folder, never ``RESULTS``; otherwise ``RESULTS / name`` if it does not exist."""
    if a.quick:
        if a.out is not None and RESULTS in Path(a.out).resolve().parents:
            p.error(f"--quick is a smoke test and must not write into {RESULTS}: "
                    "leave --out out (a temporary folder) or give one elsewhere")
        return Path(a.out) if a.out is not None else Path(tempfile.mkdtemp(prefix="attnlib-bench-")) / name
    if a.out is not None:
        return Path(a.out)
    out = RESULTS / name
    if out.exists():
        p.error(f"{out} exists (committed results): give --out elsewhere, or --out {out} to replace it on purpose")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--out", default=None, help="CSV to write (default: benchmarks/results/<device>_<kind>.csv "
                   "if it does not exist yet; a temporary folder with --quick)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512], help="n, with --heads-at-lengths' h")
    p.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="h, at n = --length-for-heads")
    p.add_argument("--heads-at-lengths", type=int, default=8)
    p.add_argument("--length-for-heads", type=int, default=256)
    p.add_argument("--modes", nargs="+", default=["forward", "train"], choices=["forward", "train"])
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per configuration")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads of the timed calls (CPU)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="cpu = process CPU time (CPU only)")
    p.add_argument("--target", action="store_true", help="only B=8, n=256, d=512, h=8: attnlib vs torch MHA")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds: a smoke test")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--decoding", action="store_true",
                   help="chapter 8: a decoding step and a prefill for MHA, GQA, MQA, MLA naive/absorbed")
    p.add_argument("--n-ctx", type=int, default=1024, help="--decoding: cached positions before the step")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    if a.clock == "cpu" and device.type != "cpu":
        p.error("--clock cpu measures the process's CPU time: use it with --device cpu only")
    if a.clock == "cpu" and a.threads != 1:
        p.error("--clock cpu sums the CPU time of all the process's threads: use it with --threads 1")
    kind = "decoding" if a.decoding else "target" if a.target else "sweep"
    out = output_path(p, a, f"{device.type}_{kind}.csv")
    # the timed calls run with this many threads (the harness sets and restores it)
    threads = a.threads or torch.get_num_threads()
    dtype = getattr(torch, a.dtype)
    if a.decoding:
        n_ctx, rounds = (32, 2) if a.quick else (a.n_ctx, a.rounds)
        d_model, h = (64, 4) if a.quick else (a.d_model, a.heads_at_lengths)
        run_decoding(a.batch, n_ctx, d_model, h, rounds, device, dtype, a.clock, threads, out,
                     d_c=d_model // 4, d_r=d_model // (2 * h))
        return 0
    names = list(a.variants)
    for needed in ("attnlib", "torch_mha", "torch_mha_noweights"):
        if needed not in names:
            names.append(needed)
    if a.target:
        a.batch, a.d_model, a.rounds = 8, 512, max(a.rounds, 25)
        configs = [(256, 8)]
        names = [v for v in TARGET_VARIANTS]
    elif a.quick:
        a.batch, a.d_model, a.rounds, a.heads_at_lengths, a.length_for_heads = 2, 64, 2, 4, 32
        configs = [(16, 4), (32, 4), (32, 2)]
    else:
        configs = [(n, a.heads_at_lengths) for n in a.lengths]
        configs += [(a.length_for_heads, h) for h in a.heads if (a.length_for_heads, h) not in configs]
    out.parent.mkdir(parents=True, exist_ok=True)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    if device.type == "cpu":
        name = f"{name}, {os.cpu_count()} logical CPUs"
    print(f"{name}; torch {torch.__version__}; {threads} threads; clock {a.clock}")
    rows: list[dict[str, object]] = []
    date = datetime.date.today().isoformat()
    for mode in a.modes:
        for n, h in configs:
            times = time_config(a.batch, n, a.d_model, h, mode, names, a.rounds, device, dtype, a.clock, threads)
            gflop = forward_gflop(a.batch, n, a.d_model) * (3 if mode == "train" else 1)
            meta = {"device": device.type, "device_name": name, "threads": threads, "clock": a.clock,
                    "dtype": a.dtype, "torch": torch.__version__, "mode": mode, "B": a.batch, "n": n,
                    "d_model": a.d_model, "h": h, "d_k": a.d_model // h, "date": date}
            new = summarise(times, meta, gflop)
            rows += new
            summary = ", ".join(f"{r['variant']} {r['median_ms']:.2f} ms ({r['ratio_vs_torch']:.2f}x)" for r in new)
            print(f"{mode:7s} n={n:4d} h={h:2d} matmul {new[0]['matmul_gflops']:.0f} GFLOP/s, "
                  f"floor {new[0]['floor_ms']:.2f} ms: {summary}", flush=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    if not a.no_plot and not a.target:
        plot(rows, out.with_suffix(".png"), a.heads_at_lengths, a.length_for_heads)
        print(f"wrote {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
