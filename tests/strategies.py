"""What several test files share: tolerances, hypothesis settings, random problems.

Imported as ``from strategies import ...``: pytest puts ``tests/`` on ``sys.path``
(``pythonpath`` in pyproject.toml), whichever test file or folder it is given.

Example counts come from the hypothesis profile (registered in the root
``conftest.py``): :func:`examples` gives a test ``n`` examples under the ``ci``
profile and the same share of another profile's ``max_examples`` under that one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch import Tensor

from attnlib import AttentionWeights, MultiHeadAttention, attention
from attnlib.blockwise import gradient_rounding_bound, rounding_bound
from attnlib.decoding import DecoderAttention, causal_mask

DTYPE = torch.float64
# float64 against a float64 reference computed another way
TOL = {"atol": 1e-10, "rtol": 1e-8}
EXACT = {"atol": 0.0, "rtol": 0.0}
WEIGHT_NAMES = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


# ---- hypothesis settings ---------------------------------------------------------------


def examples(n: int) -> settings:
    """No deadline; ``n`` examples under the ``ci`` profile, ``n x max_examples / ci's``
    (rounded up, at least 1) under the profile loaded now (``dev``: a tenth)."""
    share = settings.default.max_examples / settings.get_profile("ci").max_examples
    return settings(deadline=None, max_examples=max(1, math.ceil(n * share)))


SETTINGS = examples(25)  # the multi-head and decoding properties

HUNT_THOROUGH = 2000  # examples of each bound hunt under the thorough profile


def hunt(n: int) -> settings:
    """A bound hunt (``tests/test_bounds_search.py``, ``tests/test_blockwise_bounds.py``): ``n`` examples under ``ci`` (kept
    small: ``make test`` has a time budget), at least :data:`HUNT_THOROUGH` under the
    ``thorough`` profile that ``.ci/run`` runs after ``make test``, a tenth under ``dev``.
    No deadline, and no health check against filtering: a hunt steers towards inputs most
    draws would not reach, and discards those whose result overflows."""
    thorough = settings.default.max_examples >= settings.get_profile("thorough").max_examples
    count = max(HUNT_THOROUGH, n) if thorough else examples(n).max_examples
    return settings(deadline=None, max_examples=count,
                    suppress_health_check=list(HealthCheck))


# ---- multi-head problems -----------------------------------------------------------------


@dataclass
class Case:
    """One random problem: a seeded module, inputs and a mask (attnlib convention)."""

    mha: MultiHeadAttention
    query: Tensor  # (B, n_q, d_model)
    key: Tensor  # (B, n_k, d_model); the query itself for self-attention
    value: Tensor  # (B, n_k, d_model); the key itself unless the problem draws values apart
    mask: Tensor | None  # bool, True = may attend
    mask_kind: str  # "none" | "padding" | "causal" | "padding+causal" | "per_head" | "random"

    @property
    def inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.query, self.key, self.value


def make_mask(kind: str, B: int, h: int, n_q: int, n_k: int, g: torch.Generator) -> Tensor | None:
    """A mask of the given kind; all but "random" let every query attend to some key."""
    if kind == "none":
        return None
    lengths = torch.randint(1, n_k + 1, (B,), generator=g)  # real keys per sequence, >= 1
    padding = (torch.arange(n_k) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, n_k)
    causal = torch.ones(n_q, n_k, dtype=torch.bool).tril()  # (n_q, n_k), key 0 always allowed
    if kind == "padding":
        return padding
    if kind == "causal":
        return causal
    if kind == "padding+causal":
        return padding & causal  # (B, 1, n_q, n_k)
    if kind == "random":  # may leave a query with no allowed key
        return torch.rand(B, h, n_q, n_k, generator=g) < 0.4
    assert kind == "per_head"
    m = torch.rand(B, h, n_q, n_k, generator=g) < 0.5  # (B, h, n_q, n_k)
    keep = torch.randint(0, n_k, (B, h, n_q, 1), generator=g)  # one allowed key per row
    return m.scatter(-1, keep, True)


def _random_biases(mha: MultiHeadAttention, g: torch.Generator) -> None:
    """Zero-initialised biases would hide bias bugs."""
    with torch.no_grad():
        for b in (mha.b_q, mha.b_k, mha.b_v, mha.b_o):
            b.copy_(torch.randn(b.shape, generator=g, dtype=DTYPE))


def _d_model(draw: st.DrawFn, h: int, d_k: int, any_width: bool) -> int:
    """``h * d_k`` (the paper's layer), or with ``any_width`` as often any ``d_model`` in 1..8."""
    return draw(st.one_of(st.just(h * d_k), st.integers(1, 8))) if any_width else h * d_k


@st.composite
def cases(
    draw: st.DrawFn, masks: tuple[str, ...] = ("none", "padding", "causal", "padding+causal", "per_head"),
    any_width: bool = False,
) -> Case:
    """Plain multi-head attention (chapters 3 and 5): h in 1..4, d_k in 1..5, bias on/off,
    self- or cross-attention (keys and values drawn apart), one of ``masks``. ``d_model = h d_k``,
    or with ``any_width`` heads of any width (``d_model`` drawn apart half the time)."""
    h = draw(st.integers(1, 4))
    d_k = draw(st.integers(1, 5))
    d_model = _d_model(draw, h, d_k, any_width)
    B = draw(st.integers(1, 3))
    n_q = draw(st.integers(1, 5))
    cross = draw(st.booleans())
    n_k = draw(st.integers(1, 5)) if cross else n_q
    bias = draw(st.booleans())
    kind = draw(st.sampled_from(masks))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_model, h, bias=bias, d_k=d_k, dtype=DTYPE)
    if bias:
        _random_biases(mha, g)
    query = torch.randn(B, n_q, d_model, generator=g, dtype=DTYPE)
    if cross:
        key = torch.randn(B, n_k, d_model, generator=g, dtype=DTYPE)
        value = torch.randn(B, n_k, d_model, generator=g, dtype=DTYPE)
    else:
        key = value = query  # self-attention: one sequence plays all three roles
    return Case(mha, query, key, value, make_mask(kind, B, h, n_q, n_k, g), kind)


@st.composite
def decoder_cases(draw: st.DrawFn, cross_ok: bool = True) -> Case:
    """Multi-head attention as a decoder layer (chapter 8): h query heads sharing
    g | h key/value heads (GQA, MQA at g = 1), RoPE or none, bias on/off, heads of any
    width (``d_model = h d_k`` half the time); the keys are also the values; no mask, a
    causal one (when n_q <= n_k) or one per head."""
    h = draw(st.sampled_from([1, 2, 3, 4, 6]))
    g = draw(st.sampled_from([d for d in range(1, h + 1) if h % d == 0]))
    rope = draw(st.booleans())
    d_k = 2 * draw(st.integers(1, 2)) if rope else draw(st.integers(1, 3))
    d_model = _d_model(draw, h, d_k, any_width=True)
    B, n_q = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    cross = cross_ok and draw(st.booleans())
    n_k = draw(st.integers(1, 5)) if cross else n_q
    bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mha = DecoderAttention(d_model, h, bias, num_kv_heads=g, rope_base=100.0 if rope else None, d_k=d_k, dtype=DTYPE)
    if bias:
        _random_biases(mha, gen)
    query = torch.randn(B, n_q, d_model, generator=gen, dtype=DTYPE)
    key = torch.randn(B, n_k, d_model, generator=gen, dtype=DTYPE) if cross else query
    kind = draw(st.sampled_from(["none", "causal", "per_head"]))
    mask = None
    if kind == "causal" and n_q <= n_k:
        mask = causal_mask(n_q, n_k)
    elif kind == "per_head":
        mask = torch.rand(B, h, n_q, n_k, generator=gen) < 0.6
        mask[..., 0] = True
    return Case(mha, query, key, key, mask, kind if mask is not None else "none")


# ---- weights in attnlib's layout (the interop round trips) --------------------------------


def random_weights(d_model: int, bias: bool, seed: int, heads_width: int | None = None) -> AttentionWeights:
    """W^Q, W^K, W^V (d_model, D), W^O (D, d_model) and, with ``bias``, biases (D,) and
    (d_model,); ``D = heads_width`` (h*d_k), ``d_model`` by default."""
    g = torch.Generator().manual_seed(seed)
    D = d_model if heads_width is None else heads_width
    w = [torch.randn(d_model, D, generator=g, dtype=DTYPE) for _ in range(3)] + [
        torch.randn(D, d_model, generator=g, dtype=DTYPE)]
    b = [torch.randn(n, generator=g, dtype=DTYPE) if bias else None for n in (D, D, D, d_model)]
    return AttentionWeights(*w, *b)


def assert_same_weights(a: AttentionWeights, b: AttentionWeights) -> None:
    """The same tensors bit for bit (values, dtype, shape), and the same missing biases."""
    for name in WEIGHT_NAMES:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            torch.testing.assert_close(x, y, **EXACT, msg=lambda s, name=name: f"{name}: {s}")


# ---- inputs built to break a rounding bound ------------------------------------------------

HOSTILE_KINDS = ("gauss", "sparse", "ones", "rank1", "cancel", "powers", "gemm_order")


@st.composite
def hostile(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype = DTYPE, exponents: int = 40) -> Tensor:
    """A tensor steered to where rounding bounds break, its last axis the one summed over.

    Kinds: ``gauss`` (random), ``sparse`` (mostly zeros: a size that pairs the wrong
    entries reads 0), ``ones`` and ``rank1`` (aligned: every term of a sum the same size,
    errors add up), ``cancel`` (pairs ``a, -(1 - c) a`` along the last axis: a result far
    below its terms), ``powers`` (signed powers of two: exact products, the error all in the
    sums), ``gemm_order`` (``1, t, t, ..`` with ``t`` just below half an ulp of 1: a
    left-to-right sum drops every ``t``, other orders keep them). The whole tensor is
    scaled by ``2^k``, ``|k| <= exponents`` (tiny and huge entries)."""
    kind = draw(st.sampled_from(HOSTILE_KINDS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    f64 = torch.float64
    if kind == "gauss":
        t = torch.randn(shape, generator=g, dtype=f64)
    elif kind == "sparse":
        keep = torch.rand(shape, generator=g) < draw(st.sampled_from([0.05, 0.2, 0.5]))
        t = torch.randn(shape, generator=g, dtype=f64) * keep
    elif kind == "ones":
        t = torch.ones(shape, dtype=f64) * draw(st.sampled_from([1.0, -1.0, 0.5]))
    elif kind == "rank1":
        t = torch.randn(*shape[:-1], 1, generator=g, dtype=f64) * torch.randn(shape[-1], generator=g, dtype=f64)
    elif kind == "cancel":
        t = torch.randn(shape, generator=g, dtype=f64)
        c = draw(st.sampled_from([0.0, 2.0**-40, 2.0**-20, 1e-3]))
        t[..., 1::2] = -(1 - c) * t[..., 0::2][..., : t[..., 1::2].shape[-1]]
    elif kind == "powers":
        t = 2.0 ** torch.randint(-6, 7, shape, generator=g).to(f64)
        t = t * (torch.randint(0, 2, shape, generator=g).to(f64) * 2 - 1)
    else:  # gemm_order
        u = torch.finfo(dtype).eps / 2
        t = torch.full(shape, u * (1 - 2.0**-10), dtype=f64)
        t[..., 0] = 1.0
    k = draw(st.integers(-exponents, exponents)) if draw(st.booleans()) else 0
    return (t * 2.0**k).to(dtype)


# ---- half precision: the tiles' derived bounds against float64 ----------------------------------
def half_tile_bounds(q: Tensor, k: Tensor, v: Tensor, do: Tensor, out: Tensor) -> tuple[Tensor, list[Tensor]]:
    """How far the float16 / bfloat16 tiles' output ``out`` ``(n_q, d_v)`` and gradients of
    ``sum(out * do)`` may be from exact (float64) attention, entry by entry: one float32
    evaluation (half of ``rounding_bound``'s and ``gradient_rounding_bound``'s two, float32 and
    float64), D = rowsum(dO * O) read from the output rounded to the half type (off by
    u sum_c |dO_ic O_ic| + tau u sum_c |dO_ic|: an output below the smallest normal tau errs by up
    to half the subnormals' spacing) carried through dS into dQ and dK, and the final rounding
    (u |exact| + tau u, applied by the caller to each). Returns the output's bound and
    ``[dQ, dK, dV]``'s, before that final rounding."""
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    out_b = rounding_bound(q.float(), k.float(), v.float())[0] / 2 + rounding_bound(q64, k64, v64)[0] / 2
    b32 = gradient_rounding_bound(q.float(), k.float(), v.float(), do.float())
    b64 = gradient_rounding_bound(q64, k64, v64, do64)
    u, tiny = torch.finfo(q.dtype).eps / 2, torch.finfo(q.dtype).tiny * torch.finfo(q.dtype).eps / 2
    p, sc = attention(q64, k64, v64)[1], 1 / math.sqrt(q.shape[-1])
    d_err = (u * (do64.abs() * out.double().abs()).sum(-1, keepdim=True)
             + tiny * do64.abs().sum(-1, keepdim=True))  # (n_q, 1)
    from_d = (d_err * sc * (p @ k64.abs()), (p * d_err).T @ q64.abs() * sc, torch.zeros_like(v64))
    return out_b, [x / 2 + y / 2 + z for x, y, z in zip(b32, b64, from_d)]
