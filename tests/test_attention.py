"""Tests of attnlib.attention: masked softmax and scaled dot-product attention.

Reference everywhere: ``torch.nn.functional.scaled_dot_product_attention`` for the
output, and a plain float64 softmax of the masked scores for the weights.
"""

from __future__ import annotations

import math
import re

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis.extra.numpy import mutually_broadcastable_shapes

from attnlib.attention import attention, masked_softmax
from strategies import examples

FAST = examples(40)

# float32 against a float64 reference, and float64 against float64 (same maths, other kernel)
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


# ---------------------------------------------------------------- helpers ---------------
def reference_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """softmax(q k^T * scale) over the allowed keys, in float64, the textbook way."""
    q64, k64 = q.to(torch.float64), k.to(torch.float64)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q64 @ k64.transpose(-2, -1)) * s  # (..., n_q, n_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def reference_output(q, k, v, mask, scale):
    """PyTorch's fused attention in float64, batch dimensions expanded first."""
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q64 = q.to(torch.float64).expand(*batch, *q.shape[-2:])
    k64 = k.to(torch.float64).expand(*batch, *k.shape[-2:])
    v64 = v.to(torch.float64).expand(*batch, *v.shape[-2:])
    return F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, scale=scale)


@st.composite
def attention_problems(draw, with_mask: bool = True):
    """Random shapes (batch dims of q, k and v that broadcast, each with 0 to 2 dims),
    data from a seeded generator, a mask with at least one True per query, and
    sometimes a custom scale."""
    batch = draw(mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=2, max_side=3))
    (batch_q, batch_k, batch_v), full = batch.input_shapes, list(batch.result_shape)
    n_q, n_k = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    d_k, d_v = draw(st.integers(1, 8)), draw(st.integers(1, 8))

    def some_ones(dims: list[int]) -> list[int]:  # a version of dims that broadcasts to it
        flags = draw(st.lists(st.booleans(), min_size=len(dims), max_size=len(dims)))
        return [1 if f else d for d, f in zip(dims, flags)]

    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(*batch_q, n_q, d_k, generator=gen, dtype=torch.float64)
    k = torch.randn(*batch_k, n_k, d_k, generator=gen, dtype=torch.float64)
    v = torch.randn(*batch_v, n_k, d_v, generator=gen, dtype=torch.float64)
    mask = None
    if with_mask and draw(st.booleans()):
        rows = n_q if draw(st.booleans()) else 1
        shape = (*some_ones(full)[len(full) - draw(st.integers(0, len(full))):], rows, n_k)
        mask = torch.rand(shape, generator=gen) < 0.5
        keep = torch.randint(n_k, (*shape[:-1], 1), generator=gen)
        mask.scatter_(-1, keep, True)  # at least one True per row
    scale = draw(st.one_of(st.none(), st.floats(0.05, 3.0)))
    return q, k, v, mask, scale


# ------------------------------------------------------- agreement with PyTorch ---------
@FAST
@given(attention_problems(), st.sampled_from([torch.float64, torch.float32]))
def test_agrees_with_torch_sdpa(problem, dtype):
    q, k, v, mask, scale = problem
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, w = attention(q, k, v, mask=mask, scale=scale)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    assert out.shape == (*batch, q.shape[-2], v.shape[-1]) and out.dtype == dtype
    assert w.shape == (*batch, q.shape[-2], k.shape[-2]) and w.dtype == dtype
    torch.testing.assert_close(out.double(), reference_output(q, k, v, mask, scale), **TOL[dtype])
    ref_w = reference_weights(q, k, mask, scale).expand(w.shape)
    torch.testing.assert_close(w.double(), ref_w, **TOL[dtype])


@FAST
@given(attention_problems())
def test_weights_are_a_distribution_over_allowed_keys(problem):
    q, k, v, mask, scale = problem
    out, w = attention(q, k, v, mask=mask, scale=scale)
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1], dtype=w.dtype))
    if mask is not None:
        assert (w[~mask.expand(w.shape)] == 0).all()  # exactly zero, not merely small
    # the output is the weighted sum of the values: sum_j w_ij v_j
    torch.testing.assert_close(out, (w.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2))


@FAST
@given(attention_problems())
def test_single_query_is_a_row_of_the_batched_case(problem):
    _, k, v, mask, scale = problem
    k, v = k[(0,) * (k.dim() - 2)], v[(0,) * (v.dim() - 2)]  # (n_k, d_k), (n_k, d_v)
    gen = torch.Generator().manual_seed(1)
    q_all = torch.randn(3, k.shape[-1], generator=gen, dtype=k.dtype)  # (3, d_k)
    row_mask = None if mask is None else mask.reshape(-1, mask.shape[-1])[0]  # (n_k,)
    full_mask = None if row_mask is None else row_mask.expand(3, -1)  # (3, n_k)
    out_all, w_all = attention(q_all, k, v, mask=full_mask, scale=scale)
    for i in range(3):
        out_i, w_i = attention(q_all[i], k, v, mask=row_mask, scale=scale)
        assert out_i.shape == (v.shape[-1],) and w_i.shape == (k.shape[-2],)
        torch.testing.assert_close(out_i, out_all[i], **TOL[torch.float64])
        torch.testing.assert_close(w_i, w_all[i], **TOL[torch.float64])


def test_single_query_against_batched_keys():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, generator=gen)  # (d_k,)
    k, v = torch.randn(2, 5, 4, generator=gen), torch.randn(2, 5, 3, generator=gen)
    mask = torch.tensor([True, False, True, True, False])  # (n_k,), shared by the batch
    out, w = attention(q, k, v, mask=mask)
    assert out.shape == (2, 3) and w.shape == (2, 5)
    out_b, w_b = attention(q.expand(2, 1, 4), k, v, mask=mask)
    torch.testing.assert_close(out, out_b[:, 0])
    torch.testing.assert_close(w, w_b[:, 0])


def test_loop_over_queries_equals_matrix_form():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(6, 4, generator=gen), torch.randn(5, 4, generator=gen),
               torch.randn(5, 3, generator=gen))
    out, w = attention(q, k, v)
    rows = [attention(q[i], k, v) for i in range(6)]
    torch.testing.assert_close(out, torch.stack([o for o, _ in rows]))
    torch.testing.assert_close(w, torch.stack([a for _, a in rows]))


def test_default_scale_is_inverse_sqrt_dk():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 9, generator=gen), torch.randn(4, 9, generator=gen),
               torch.randn(4, 2, generator=gen))
    out_default, _ = attention(q, k, v)
    out_explicit, _ = attention(q, k, v, scale=1 / 3)
    torch.testing.assert_close(out_default, out_explicit)
    _, w_unscaled = attention(q, k, v, scale=1.0)
    torch.testing.assert_close(w_unscaled, torch.softmax(q @ k.T, -1))


# ------------------------------------------------------------- large logits --------------
@FAST
@given(st.integers(0, 2**31 - 1), st.sampled_from([torch.float32, torch.float64]))
def test_logits_of_magnitude_1e4(seed, dtype):
    """Integer entries make every score exact in float32 (|score| <= 2e4 < 2**24), so
    float32 must match the float64 reference to rounding of exp, not of the scores."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-100, 101, (3, 4), generator=gen).to(dtype)  # (n_q, d_k=4): scale 1/2
    k = torch.randint(-100, 101, (6, 4), generator=gen).to(dtype)  # scores up to 2e4
    k[1] = k[0] + torch.tensor([1, 0, 0, 0], dtype=dtype)  # two keys whose scores differ by q_0/2
    v = torch.randn(6, 5, generator=gen, dtype=torch.float64).to(dtype)
    mask = torch.rand(3, 6, generator=gen) < 0.7
    mask[:, 0] = True
    scores = (q.double() @ k.double().T) / 2
    assert scores.abs().max() >= 1e3  # the test really exercises large logits
    for m in (None, mask):
        out, w = attention(q, k, v, mask=m)
        assert torch.isfinite(out).all() and torch.isfinite(w).all()
        torch.testing.assert_close(w.double(), reference_weights(q, k, m, None), **TOL[dtype])
        torch.testing.assert_close(out.double(), reference_output(q, k, v, m, None), **TOL[dtype])


def test_masked_softmax_huge_scores_exact_values():
    scores = torch.tensor([1e4, 1e4 - 1.0, -1e4, 5e3])  # float32
    naive = torch.exp(scores) / torch.exp(scores).sum()
    assert torch.isnan(naive).any()  # why the shift by the maximum is needed
    mask = torch.tensor([True, True, True, False])
    w = masked_softmax(scores, mask)
    e = math.exp(-1.0)
    expected = torch.tensor([1 / (1 + e), e / (1 + e), 0.0, 0.0])
    torch.testing.assert_close(w, expected)
    assert w[3] == 0 and w[2] == 0
    torch.testing.assert_close(masked_softmax(-scores), torch.tensor([0.0, 0.0, 1.0, 0.0]))


@FAST
@given(st.integers(0, 2**31 - 1), st.integers(0, 2))
def test_masked_softmax_matches_softmax_over_kept_entries(seed, dim):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64) * 10
    mask = torch.rand(3, 4, 5, generator=gen) < 0.6
    w = masked_softmax(scores, mask, dim=dim)
    ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=dim)
    ref = torch.nan_to_num(ref, nan=0.0)  # rows with nothing kept: 0 by definition
    torch.testing.assert_close(w, ref, rtol=1e-12, atol=1e-12)
    assert (w[~mask] == 0).all()
    sums = w.sum(dim)
    any_kept = mask.any(dim)
    torch.testing.assert_close(sums[any_kept], torch.ones_like(sums[any_kept]))
    assert (sums[~any_kept] == 0).all()
    torch.testing.assert_close(masked_softmax(scores, None, dim=dim), torch.softmax(scores, dim=dim))


def test_masked_softmax_broadcasts_mask():
    scores = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([True, False, True, True])  # (4,) -> (2, 3, 4)
    w = masked_softmax(scores, mask)
    torch.testing.assert_close(w, masked_softmax(scores, mask.expand(2, 3, 4)))
    assert (w[..., 1] == 0).all()


# ---------------------------------------------------------- all-masked query -------------
def test_all_masked_query_reads_nothing():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(5, 2, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False  # query 1 may attend to nothing
    mask[2, :2] = False
    out, w = attention(q, k, v, mask=mask)
    assert (w[1] == 0).all() and (out[1] == 0).all()  # documented: zero weights, zero output
    # the other queries are untouched
    for i in (0, 2):
        out_i, w_i = attention(q[i], k, v, mask=mask[i])
        torch.testing.assert_close(out[i], out_i)
        torch.testing.assert_close(w[i], w_i)
    # a textbook softmax gives NaN there; PyTorch's fused attention (torch >= 2.5) gives 0 too
    assert torch.isnan(reference_weights(q.detach(), k.detach(), mask, None)[1]).all()
    torch.testing.assert_close(out.detach(), reference_output(q.detach(), k.detach(), v, mask, None))
    # and gradients stay finite
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert (q.grad[1] == 0).all()


def test_torch_sdpa_reads_zero_for_an_all_masked_query_with_zero_gradients():
    """Why pyproject.toml asks for torch >= 2.5 and MultiHeadAttention calls SDPA
    without a repair: SDPA itself gives a query with no allowed key a zero output
    and zero gradients, agreeing with attnlib's rule (both dtypes, with and
    without autograd)."""
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.float64):
        q = torch.randn(2, 3, 4, generator=gen, dtype=dtype, requires_grad=True)
        k = torch.randn(2, 5, 4, generator=gen, dtype=dtype, requires_grad=True)
        v = torch.randn(2, 5, 3, generator=gen, dtype=dtype, requires_grad=True)
        mask = torch.rand(2, 3, 5, generator=gen) < 0.5
        mask[:, 1] = False  # query 1 may attend to nothing
        mask[:, [0, 2], 0] = True
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert (out[:, 1] == 0).all()
        out_a, _ = attention(q, k, v, mask=mask)
        torch.testing.assert_close(out, out_a, **TOL[dtype])
        g = torch.randn(out.shape, generator=gen, dtype=dtype)
        grads = torch.autograd.grad(out, (q, k, v), g)
        grads_a = torch.autograd.grad(out_a, (q, k, v), g)
        assert (grads[0][:, 1] == 0).all()
        for mine, theirs in zip(grads_a, grads, strict=True):
            assert torch.isfinite(theirs).all()
            torch.testing.assert_close(mine, theirs, **TOL[dtype])
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert (major, minor) >= (2, 5)


def test_weights_batch_entries_do_not_alias_when_only_v_has_the_batch():
    q, k = torch.randn(3, 4), torch.randn(5, 4)
    v = torch.randn(2, 5, 6)  # a batch dimension that q and k do not have
    out, w = attention(q, k, v)
    assert w.shape == (2, 3, 5) and out.shape == (2, 3, 6)
    assert w[0].data_ptr() != w[1].data_ptr()
    w[0].zero_()  # writing one batch entry leaves the other alone
    assert (w[1] != 0).any()


def test_single_query_all_masked():
    out, w = attention(torch.ones(3), torch.ones(4, 3), torch.ones(4, 2), mask=torch.zeros(4, dtype=torch.bool))
    assert out.tolist() == [0.0, 0.0] and w.tolist() == [0.0] * 4


# ------------------------------------------------------------- errors --------------------
def shapes(*dims: int) -> str:
    """The regex for a shape as attnlib prints it, e.g. ``\\(2, 3\\)``."""
    return re.escape("(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")")


def _t(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        # q / k width mismatch
        ((_t(2, 3), _t(4, 5), _t(4, 6)), {}, rf"q and k.*same width.*q has shape {shapes(2, 3)}.*k has shape {shapes(4, 5)}"),
        ((_t(3), _t(4, 5), _t(4, 6)), {}, rf"q and k.*q has shape {shapes(3)}.*k has shape {shapes(4, 5)}"),
        # k / v length mismatch
        ((_t(2, 3), _t(4, 3), _t(5, 6)), {}, rf"k and v.*n_k.*k has shape {shapes(4, 3)}, v has shape {shapes(5, 6)}"),
        # no keys
        ((_t(2, 3), _t(0, 3), _t(0, 6)), {}, rf"at least one key: k has shape {shapes(0, 3)}"),
        # width 0
        ((_t(2, 0), _t(4, 0), _t(4, 6)), {}, rf"width d_k >= 1: k has shape {shapes(4, 0)}"),
        # batch dimensions that do not broadcast
        ((_t(2, 1, 3), _t(3, 4, 3), _t(3, 4, 6)), {},
         rf"batch dimensions.*q {shapes(2, 1, 3)}, k {shapes(3, 4, 3)}, v {shapes(3, 4, 6)}"),
        # wrong rank
        ((_t(), _t(4, 3), _t(4, 6)), {}, r"q must have shape \(d_k,\) or \(\.\.\., n_q, d_k\), got \(\)"),
        ((_t(3), _t(3), _t(4, 6)), {}, rf"k must have shape \(\.\.\., n_k, d_k\), got {shapes(3)}"),
        ((_t(3), _t(4, 3), _t(6)), {}, rf"v must have shape \(\.\.\., n_k, d_v\), got {shapes(6)}"),
        # dtypes of q, k, v
        ((_t(2, 3, dtype=torch.float64), _t(4, 3), _t(4, 6)), {},
         rf"q, k and v.*floating-point dtype.*q has shape {shapes(2, 3)} and dtype torch.float64"),
        ((_t(2, 3, dtype=torch.int64), _t(4, 3, dtype=torch.int64), _t(4, 6, dtype=torch.int64)), {},
         r"q, k and v must share one floating-point dtype.*torch.int64"),
        # mask of the wrong dtype
        ((_t(2, 3), _t(4, 3), _t(4, 6)), {"mask": _t(2, 4)},
         rf"mask must have dtype torch.bool.*mask of shape {shapes(2, 4)} and dtype torch.float32"),
        ((_t(3), _t(4, 3), _t(4, 6)), {"mask": _t(4, dtype=torch.int64)},
         rf"mask must have dtype torch.bool.*mask of shape {shapes(4)} and dtype torch.int64"),
        # mask not broadcastable
        ((_t(2, 3), _t(4, 3), _t(4, 6)), {"mask": _t(2, 5, dtype=torch.bool)},
         rf"mask of shape {shapes(2, 5)} does not broadcast to the scores' shape {shapes(2, 4)}"),
        ((_t(3), _t(4, 3), _t(4, 6)), {"mask": _t(5, dtype=torch.bool)},
         rf"mask of shape {shapes(5)} does not broadcast to the scores' shape {shapes(4)}"),
        # mask that would enlarge the scores
        ((_t(2, 3), _t(4, 3), _t(4, 6)), {"mask": _t(7, 2, 4, dtype=torch.bool)},
         rf"mask of shape {shapes(7, 2, 4)} does not broadcast to the scores' shape {shapes(2, 4)}"),
        ((_t(1, 3), _t(4, 3), _t(4, 6)), {"mask": _t(3, 4, dtype=torch.bool)},
         rf"mask of shape {shapes(3, 4)} does not broadcast to the scores' shape {shapes(1, 4)}"),
        ((_t(3), _t(4, 3), _t(4, 6)), {"mask": _t(2, 4, dtype=torch.bool)},
         rf"mask of shape {shapes(2, 4)} does not broadcast to the scores' shape {shapes(4)}"),
    ],
)
def test_value_errors_name_argument_and_shapes(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        attention(*args, **kwargs)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_type_error_for_non_tensor_inputs(name):
    args = {"q": _t(2, 3), "k": _t(4, 3), "v": _t(4, 6)}
    args[name] = [[0.0] * 3] * 4
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got list"):
        attention(**args)


@pytest.mark.parametrize(
    ("scale", "error", "match"),
    [
        ("0.5", TypeError, "scale must be a real number or None, got str '0.5'"),
        (True, TypeError, "scale must be a real number or None, got bool True"),
        (torch.tensor(0.5), TypeError, "scale must be a real number or None, got Tensor"),
        (float("nan"), ValueError, r"scale must be a finite number >= 0, or None for 1/sqrt\(d_k\); got nan"),
        (float("inf"), ValueError, "scale must be a finite number >= 0.*got inf"),
        (-0.5, ValueError, "scale must be a finite number >= 0.*got -0.5"),
    ],
)
def test_scale_must_be_a_finite_number_or_none(scale, error, match):
    with pytest.raises(error, match=match):
        attention(_t(2, 3), _t(4, 3), _t(4, 6), scale=scale)


def test_scale_zero_gives_uniform_weights():
    _, w = attention(torch.randn(2, 3), torch.randn(4, 3), torch.randn(4, 6), scale=0)
    torch.testing.assert_close(w, torch.full((2, 4), 0.25))


def test_type_error_for_non_tensor_mask():
    with pytest.raises(TypeError, match=r"mask must be a torch.Tensor of dtype torch.bool, got list"):
        attention(_t(2, 3), _t(4, 3), _t(4, 6), mask=[[True] * 4] * 2)


def test_masked_softmax_errors():
    with pytest.raises(ValueError, match=r"scores must be a floating-point tensor, got torch.int64"):
        masked_softmax(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=rf"mask of shape {shapes(2, 4)} does not broadcast to the scores' shape {shapes(2, 3)}"):
        masked_softmax(_t(2, 3), _t(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"mask of shape {shapes(5, 2, 3)} does not broadcast to the scores' shape {shapes(2, 3)}"):
        masked_softmax(_t(2, 3), _t(5, 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must have dtype torch.bool"):
        masked_softmax(_t(2, 3), _t(2, 3))
    with pytest.raises(TypeError, match=r"mask must be a torch.Tensor"):
        masked_softmax(_t(2, 3), [True, False, True])
