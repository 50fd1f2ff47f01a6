"""attnlib.multihead: separate heads == fused == torch.nn.MultiheadAttention.

Every equivalence is a hypothesis property over random sizes, bias on/off,
self- and cross-attention and the three kinds of mask (padding ``(B, 1, 1, n_k)``,
causal ``(n_q, n_k)``, per head ``(B, h, n_q, n_k)``); forward outputs, attention
maps and gradients (inputs and weights) are compared. Every error path has a test.

Comparisons with torch never give a query an all-masked row: torch returns NaN
there, attnlib returns zero (tested separately, attnlib against attnlib).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

from attnlib import MultiHeadAttention, SeparateHeadsAttention
from strategies import DTYPE, SETTINGS, TOL, Case, cases


# ---- helpers --------------------------------------------------------------------


def _leaves(case: Case) -> tuple[Tensor, Tensor, Tensor]:
    """Fresh leaf copies of the inputs (shared when self-attention) for gradients."""
    q = case.query.detach().clone().requires_grad_(True)
    if case.key is case.query:
        return q, q, q
    k = case.key.detach().clone().requires_grad_(True)
    v = case.value.detach().clone().requires_grad_(True)
    return q, k, v


def _torch_call(m: nn.MultiheadAttention, case: Case, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Call torch's module with the case's mask in torch's convention (True = blocked).

    Padding masks go through ``key_padding_mask``, causal masks through a 2-D
    ``attn_mask``, per-head masks through a ``(B*h, n_q, n_k)`` ``attn_mask``.
    """
    B, n_q, _ = q.shape
    n_k, h = k.shape[1], m.num_heads
    kw: dict[str, Tensor] = {}
    mask = case.mask
    if case.mask_kind == "padding":
        kw["key_padding_mask"] = ~mask[:, 0, 0, :]  # type: ignore[index]  # (B, n_k)
    elif case.mask_kind == "causal":
        kw["attn_mask"] = ~mask  # type: ignore[operator]  # (n_q, n_k)
    elif mask is not None:
        full = mask.expand(B, h, n_q, n_k).reshape(B * h, n_q, n_k)  # (B*h, n_q, n_k)
        kw["attn_mask"] = ~full
    if not m.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (n, B, d_model)
    out, weights = m(q, k, v, need_weights=True, average_attn_weights=False, **kw)
    if not m.batch_first:
        out = out.transpose(0, 1)
    return out, weights  # (B, n_q, d_model), (B, h, n_q, n_k)


def _grads_fused(mha: MultiHeadAttention) -> dict[str, Tensor]:
    return {n: p.grad for n, p in mha.named_parameters()}  # type: ignore[misc]


def _grads_separate_as_fused(sep: SeparateHeadsAttention) -> dict[str, Tensor]:
    """The separate heads' weight gradients placed side by side, as the fused layout."""
    g = {
        "w_q": torch.cat([p.grad for p in sep.w_q], dim=1),  # type: ignore[misc]
        "w_k": torch.cat([p.grad for p in sep.w_k], dim=1),  # type: ignore[misc]
        "w_v": torch.cat([p.grad for p in sep.w_v], dim=1),  # type: ignore[misc]
        "w_o": sep.w_o.grad,
    }
    if sep.bias:
        g["b_q"] = torch.cat([p.grad for p in sep.b_q])  # type: ignore[misc,union-attr]
        g["b_k"] = torch.cat([p.grad for p in sep.b_k])  # type: ignore[misc,union-attr]
        g["b_v"] = torch.cat([p.grad for p in sep.b_v])  # type: ignore[misc,union-attr]
        g["b_o"] = sep.b_o.grad
    return g  # type: ignore[return-value]


def _grads_torch_as_fused(m: nn.MultiheadAttention) -> dict[str, Tensor]:
    """torch's gradients in attnlib's layout: ``in_proj_weight.grad`` is ``(3E, E)``."""
    e = m.embed_dim
    gw = m.in_proj_weight.grad  # (3E, E), nn.Linear orientation
    assert gw is not None
    g = {"w_q": gw[:e].T, "w_k": gw[e : 2 * e].T, "w_v": gw[2 * e :].T, "w_o": m.out_proj.weight.grad.T}  # type: ignore[union-attr]
    if m.in_proj_bias is not None:
        gb = m.in_proj_bias.grad
        g |= {"b_q": gb[:e], "b_k": gb[e : 2 * e], "b_v": gb[2 * e :], "b_o": m.out_proj.bias.grad}  # type: ignore[index]
    return g  # type: ignore[return-value]


def _input_grads(q: Tensor, k: Tensor, v: Tensor) -> list[Tensor]:
    return [t.grad for t in ({id(t): t for t in (q, k, v)}).values()]  # type: ignore[misc]


def _backward(out: Tensor, seed: int = 0) -> None:
    """Backpropagate a fixed random linear functional of ``out`` (not just sum)."""
    g = torch.Generator().manual_seed(seed)
    out.backward(torch.randn(out.shape, generator=g, dtype=out.dtype))


# ---- forward equivalences -------------------------------------------------------


@SETTINGS
@given(cases(any_width=True))
def test_separate_equals_fused_forward(case: Case) -> None:
    sep = SeparateHeadsAttention.from_fused(case.mha)
    out_f, w_f = case.mha(*case.inputs, mask=case.mask)
    out_s, w_s = sep(*case.inputs, mask=case.mask)
    B, n_q, n_k = case.query.shape[0], case.query.shape[1], case.key.shape[1]
    assert out_f.shape == (B, n_q, case.mha.d_model)
    assert w_f is not None and w_f.shape == (B, case.mha.num_heads, n_q, n_k)
    torch.testing.assert_close(out_s, out_f, **TOL)
    torch.testing.assert_close(w_s, w_f, **TOL)
    torch.testing.assert_close(w_f.sum(-1), torch.ones_like(w_f.sum(-1)), **TOL)  # every row reads something


@SETTINGS
@given(cases(), st.booleans())
def test_fused_equals_torch_forward(case: Case, batch_first: bool) -> None:
    m = case.mha.to_torch() if batch_first else _to_torch_seq_first(case.mha)
    m.eval()
    out_t, w_t = _torch_call(m, case, *case.inputs)
    out_f, w_f = case.mha(*case.inputs, mask=case.mask)
    torch.testing.assert_close(out_f, out_t, **TOL)
    torch.testing.assert_close(w_f, w_t, **TOL)


@SETTINGS
@given(cases(masks=("none", "padding", "causal", "padding+causal", "per_head", "random"), any_width=True))
def test_need_weights_false_gives_same_output(case: Case) -> None:
    """The fast path (SDPA) gives the same output; also with all-masked rows ("random")."""
    mask = case.mask
    for module in (case.mha, SeparateHeadsAttention.from_fused(case.mha)):
        out_w, weights = module(*case.inputs, mask=mask, need_weights=True)
        out_n, none = module(*case.inputs, mask=mask, need_weights=False)
        assert none is None and weights is not None
        assert torch.isfinite(out_n).all()
        torch.testing.assert_close(out_n, out_w, **TOL)
    grads = []  # the fused fast path (SDPA) also has the same, finite, gradients
    for need_weights in (True, False):
        case.mha.zero_grad()
        q, k, v = _leaves(case)
        out, _ = case.mha(q, k, v, mask=mask, need_weights=need_weights)
        _backward(out)
        grads.append(_input_grads(q, k, v) + [p.grad for p in case.mha.parameters()])
        assert all(g is not None and torch.isfinite(g).all() for g in grads[-1])
    for g_fast, g_ref in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g_fast, g_ref, **TOL)


@SETTINGS
@given(cases(any_width=True), st.booleans())
def test_no_grad_forward_equals_autograd_forward(case: Case, need_weights: bool) -> None:
    """Under torch.no_grad (no graph kept) the result is the same."""
    for module in (case.mha, SeparateHeadsAttention.from_fused(case.mha)):
        out, weights = module(*case.inputs, mask=case.mask, need_weights=need_weights)
        with torch.no_grad():
            out_ng, weights_ng = module(*case.inputs, mask=case.mask, need_weights=need_weights)
        torch.testing.assert_close(out_ng, out, **TOL)
        if need_weights:
            torch.testing.assert_close(weights_ng, weights, **TOL)
        else:
            assert weights is None and weights_ng is None


def test_all_masked_query_reads_nothing() -> None:
    """A query with no allowed key gets zero weights; its heads output zero."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2, bias=False, dtype=DTYPE)
    x = torch.randn(1, 3, 8, dtype=DTYPE)
    mask = torch.ones(1, 2, 3, 3, dtype=torch.bool)
    mask[0, 1, 2] = False  # head 1, query 2: nothing allowed
    out, w = mha(x, x, x, mask=mask)
    assert w is not None
    assert (w[0, 1, 2] == 0).all()
    # the zero head contributes nothing: out = head 0's part only
    sep = SeparateHeadsAttention.from_fused(mha)
    out_s, _ = sep(x, x, x, mask=mask)
    torch.testing.assert_close(out, out_s, **TOL)
    for need_weights in (True, False):
        q = x.clone().requires_grad_(True)
        out, _ = mha(q, q, q, mask=mask, need_weights=need_weights)
        out.sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all(), f"need_weights={need_weights}"


# ---- gradients ---------------------------------------------------------------------


@SETTINGS
@given(cases(any_width=True))
def test_gradients_separate_fused_torch(case: Case) -> None:
    """d(out)/d(inputs) and d(out)/d(weights) agree; separate head i's w_q[i].grad is
    the matching column block of the fused w_q.grad (likewise every role). torch's module
    joins where its heads are d_model / h wide."""
    mha = case.mha
    sep = SeparateHeadsAttention.from_fused(mha)
    square = mha.num_heads * mha.d_k == mha.d_model
    m = mha.to_torch() if square else None
    grads = {}
    for name, module in (("fused", mha), ("separate", sep), ("torch", m)):
        if module is None:
            continue
        module.zero_grad()
        q, k, v = _leaves(case)
        if name == "torch":
            out, _ = _torch_call(m, case, q, k, v)
        else:
            out, _ = module(q, k, v, mask=case.mask)
        _backward(out)
        grads[name] = (_input_grads(q, k, v), module)
    ref_inputs = grads["fused"][0]
    for name in grads:
        for g, g_ref in zip(grads[name][0], ref_inputs, strict=True):
            torch.testing.assert_close(g, g_ref, **TOL)
    ref = _grads_fused(mha)
    assert set(ref) == ({"w_q", "w_k", "w_v", "w_o"} | ({"b_q", "b_k", "b_v", "b_o"} if mha.bias else set()))
    for other in [_grads_separate_as_fused(sep)] + ([_grads_torch_as_fused(m)] if m is not None else []):
        assert set(other) == set(ref)
        for n in ref:
            torch.testing.assert_close(other[n], ref[n], **TOL, msg=lambda s, n=n: f"{n}: {s}")
    d_k = mha.d_k
    for i in range(mha.num_heads):  # the block statement, spelled out for w_q
        torch.testing.assert_close(sep.w_q[i].grad, mha.w_q.grad[:, i * d_k : (i + 1) * d_k], **TOL)  # type: ignore[index]


# ---- conversions ---------------------------------------------------------------------


def _to_torch_seq_first(mha: MultiHeadAttention) -> nn.MultiheadAttention:
    from attnlib.interop import write_torch_mha

    return write_torch_mha(mha.projections(), mha.num_heads, batch_first=False)


@SETTINGS
@given(
    h=st.integers(1, 4),
    d_k=st.integers(1, 4),
    bias=st.booleans(),
    batch_first=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_from_torch_round_trip(h: int, d_k: int, bias: bool, batch_first: bool, seed: int) -> None:
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(h * d_k, h, bias=bias, batch_first=batch_first, dtype=DTYPE).eval()
    if bias:
        with torch.no_grad():
            m.in_proj_bias.normal_()  # type: ignore[union-attr]
            m.out_proj.bias.normal_()
    mha = MultiHeadAttention.from_torch(m)
    assert (mha.num_heads, mha.d_model, mha.bias) == (h, h * d_k, bias)
    x = torch.randn(2, 3, h * d_k, dtype=DTYPE)
    y = torch.randn(2, 4, h * d_k, dtype=DTYPE)
    x_t, y_t = (x, y) if batch_first else (x.transpose(0, 1), y.transpose(0, 1))
    out_t, _ = m(x_t, y_t, y_t)
    if not batch_first:
        out_t = out_t.transpose(0, 1)
    torch.testing.assert_close(mha(x, y, y)[0], out_t, **TOL)
    back = mha.to_torch()
    assert back.batch_first and back.num_heads == h and (back.in_proj_bias is not None) == bias
    torch.testing.assert_close(back.in_proj_weight, m.in_proj_weight, atol=0, rtol=0)
    torch.testing.assert_close(back.out_proj.weight, m.out_proj.weight, atol=0, rtol=0)
    if bias:
        torch.testing.assert_close(back.in_proj_bias, m.in_proj_bias, atol=0, rtol=0)
        torch.testing.assert_close(back.out_proj.bias, m.out_proj.bias, atol=0, rtol=0)
    again = MultiHeadAttention.from_torch(back)
    for n, p in mha.named_parameters():
        torch.testing.assert_close(getattr(again, n), p, atol=0, rtol=0)


@SETTINGS
@given(cases(masks=("none",), any_width=True))
def test_separate_fused_and_weights_round_trips(case: Case) -> None:
    mha = case.mha
    back = SeparateHeadsAttention.from_fused(mha).to_fused()
    again = MultiHeadAttention.from_projections(mha.projections(), mha.num_heads)
    for n, p in mha.named_parameters():
        torch.testing.assert_close(getattr(back, n), p, atol=0, rtol=0)
        torch.testing.assert_close(getattr(again, n), p, atol=0, rtol=0)
    assert back.num_heads == again.num_heads == mha.num_heads


def test_converted_modules_hold_copies() -> None:
    mha = MultiHeadAttention(6, 2, dtype=DTYPE)
    sep = SeparateHeadsAttention.from_fused(mha)
    copy = MultiHeadAttention.from_projections(mha.projections(), 2)
    before = mha.w_q.detach().clone()
    with torch.no_grad():
        sep.w_q[0].add_(1.0)
        copy.w_q.add_(1.0)
    torch.testing.assert_close(mha.w_q, before, atol=0, rtol=0)


def test_separate_heads_default_constructor() -> None:
    torch.manual_seed(0)
    sep = SeparateHeadsAttention(12, 3, bias=True)
    assert len(sep.w_q) == 3 and sep.w_q[0].shape == (12, 4) and sep.w_o.shape == (12, 12)
    assert sum(p.numel() for p in sep.parameters()) == 4 * 12 * 12 + 4 * 12
    x = torch.randn(2, 5, 12)
    out, w = sep(x, x, x)
    assert out.shape == (2, 5, 12) and w is not None and w.shape == (2, 3, 5, 5)
    assert not SeparateHeadsAttention(12, 3, bias=False).bias


def test_separate_heads_device_and_dtype() -> None:
    sep = SeparateHeadsAttention(8, 2, device="cpu", dtype=torch.float64)
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in sep.parameters())
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    assert sep(x, x, x)[0].dtype == torch.float64


def test_from_fused_goes_through_init_and_draws_no_random_numbers() -> None:
    mha = MultiHeadAttention(8, 2, dtype=torch.float64)
    state = torch.get_rng_state()
    sep = SeparateHeadsAttention.from_fused(mha)
    assert torch.equal(torch.get_rng_state(), state)
    assert (sep.d_model, sep.num_heads, sep.d_k, sep.bias) == (8, 2, 4, True)
    assert all(p.device.type == "cpu" and p.dtype == torch.float64 for p in sep.parameters())
    assert [n for n, _ in sep.named_parameters()] == [n for n, _ in SeparateHeadsAttention(8, 2).named_parameters()]


# ---- per-head views ------------------------------------------------------------------


@SETTINGS
@given(h=st.integers(1, 4), d_k=st.integers(1, 4), bias=st.booleans(), i=st.integers(0, 3))
def test_head_views_share_storage(h: int, d_k: int, bias: bool, i: int) -> None:
    i = i % h
    mha = MultiHeadAttention(h * d_k, h, bias=bias, dtype=DTYPE)
    cols = slice(i * d_k, (i + 1) * d_k)
    head = mha.head(i)
    views = {
        "w_q": (mha.w_q_heads[i], head.w_q, mha.w_q[:, cols]),
        "w_k": (mha.w_k_heads[i], head.w_k, mha.w_k[:, cols]),
        "w_v": (mha.w_v_heads[i], head.w_v, mha.w_v[:, cols]),
        "w_o": (mha.w_o_heads[i], head.w_o, mha.w_o[cols, :]),
    }
    assert mha.w_q_heads.shape == (h, h * d_k, d_k) and mha.w_o_heads.shape == (h, d_k, h * d_k)
    for name, (a, b, block) in views.items():
        fused = getattr(mha, name)
        assert a.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        torch.testing.assert_close(a, block, atol=0, rtol=0)
        torch.testing.assert_close(b, block, atol=0, rtol=0)
        with torch.no_grad():
            fused.mul_(2.0).add_(1.0)  # in place, on the fused matrix
        torch.testing.assert_close(a, fused[:, cols] if name != "w_o" else fused[cols, :], atol=0, rtol=0)
        torch.testing.assert_close(b, a, atol=0, rtol=0)
        with torch.no_grad():
            b.zero_()  # in place, on the view: seen by the fused matrix
        assert (fused[:, cols] if name != "w_o" else fused[cols, :]).abs().sum() == 0
    if bias:
        with torch.no_grad():
            mha.b_q.fill_(3.0)  # type: ignore[union-attr]
        assert head.b_q is not None and (head.b_q == 3.0).all() and head.b_q.shape == (d_k,)
    else:
        assert head.b_q is head.b_k is head.b_v is None


def test_head_index_out_of_range() -> None:
    mha = MultiHeadAttention(8, 2)
    for i in (-1, 2):
        with pytest.raises(IndexError, match=rf"head must be an int in \[0, 2\) for num_heads=2, got {i}"):
            mha.head(i)
    for bad in (True, 1.0, "0"):  # bool is an int to Python, not to attnlib
        with pytest.raises(TypeError, match=r"head must be an int in \[0, 2\), got"):
            mha.head(bad)  # type: ignore[arg-type]


def test_parameter_count_independent_of_heads() -> None:
    for h in (1, 2, 4, 8, 16):
        for bias, extra in ((True, 4 * 64), (False, 0)):
            n = sum(p.numel() for p in MultiHeadAttention(64, h, bias=bias).parameters())
            assert n == 4 * 64 * 64 + extra


def test_extra_repr_and_init() -> None:
    mha = MultiHeadAttention(8, 2, bias=True)
    assert "d_model=8, num_heads=2, d_k=4, bias=True" in repr(mha)
    assert all((b == 0).all() for b in (mha.b_q, mha.b_k, mha.b_v, mha.b_o))  # type: ignore[union-attr]
    bound = (6 / (8 + 8)) ** 0.5
    assert all(w.abs().max() <= bound for w in (mha.w_q, mha.w_k, mha.w_v, mha.w_o))


# ---- error paths -------------------------------------------------------------------


@pytest.mark.parametrize("cls", [MultiHeadAttention, SeparateHeadsAttention])
def test_error_d_model_not_divisible(cls: type[nn.Module]) -> None:
    with pytest.raises(ValueError, match=r"d_model \(10\) must be divisible by num_heads \(3\)"):
        cls(10, 3)


@pytest.mark.parametrize("cls", [MultiHeadAttention, SeparateHeadsAttention])
@pytest.mark.parametrize(
    ("d_model", "num_heads", "error", "message"),
    [
        (0, 1, ValueError, "d_model must be a positive int, got 0"),
        (8.0, 2, TypeError, "d_model must be a positive int, got float 8.0"),
        (True, True, TypeError, "d_model must be a positive int, got bool True"),
        (8, True, TypeError, "num_heads must be a positive int, got bool True"),
        (8, 0, ValueError, "num_heads must be a positive int, got 0"),
        (8, -2, ValueError, "num_heads must be a positive int, got -2"),
    ],
)
def test_error_bad_dims(
    cls: type[nn.Module], d_model: object, num_heads: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        cls(d_model, num_heads)


def _modules() -> list[nn.Module]:
    mha = MultiHeadAttention(8, 2)
    return [mha, SeparateHeadsAttention.from_fused(mha)]


@pytest.mark.parametrize("module", _modules(), ids=["fused", "separate"])
class TestInputErrors:
    x = torch.randn(2, 3, 8)
    y = torch.randn(2, 4, 8)

    def test_wrong_rank(self, module: nn.Module) -> None:
        with pytest.raises(ValueError, match=r"query must have shape \(B, n_q, d_model=8\), got \(3, 8\)"):
            module(self.x[0], self.y, self.y)
        with pytest.raises(ValueError, match=r"key must have shape \(B, n_k, d_model=8\), got \(1, 2, 4, 8\)"):
            module(self.x, self.y[None], self.y)

    def test_wrong_width(self, module: nn.Module) -> None:
        with pytest.raises(ValueError, match=r"value must have shape \(B, n_k, d_model=8\), got \(2, 4, 6\)"):
            module(self.x, self.y, self.y[..., :6])
        with pytest.raises(ValueError, match=r"query must have shape \(B, n_q, d_model=8\), got \(2, 3, 9\)"):
            module(torch.randn(2, 3, 9), self.y, self.y)

    def test_not_a_tensor(self, module: nn.Module) -> None:
        with pytest.raises(TypeError, match="key must be a torch.Tensor, got list"):
            module(self.x, [[0.0] * 8], self.y)

    def test_key_value_length_mismatch(self, module: nn.Module) -> None:
        with pytest.raises(ValueError, match=r"key has shape \(2, 4, 8\), value has shape \(2, 3, 8\)"):
            module(self.x, self.y, self.x)

    def test_key_value_batch_mismatch(self, module: nn.Module) -> None:
        with pytest.raises(ValueError, match=r"key and value must have the same batch size"):
            module(self.x, self.y, self.y[:1])

    def test_query_key_batch_mismatch(self, module: nn.Module) -> None:
        with pytest.raises(ValueError, match=r"same batch size B: query \(2, 3, 8\), key \(1, 4, 8\)"):
            module(self.x, self.y[:1], self.y[:1])

    def test_no_keys(self, module: nn.Module) -> None:
        with pytest.raises(ValueError, match=r"key must hold at least one position, got \(2, 0, 8\)"):
            module(self.x, self.y[:, :0], self.y[:, :0])

    def test_mask_dtype(self, module: nn.Module) -> None:
        for bad in (torch.ones(3, 4), torch.ones(3, 4, dtype=torch.int64)):
            with pytest.raises(ValueError, match=r"mask must have dtype torch.bool \(True = may attend\)"):
                module(self.x, self.y, self.y, mask=bad)

    def test_mask_shape(self, module: nn.Module) -> None:
        bad_shapes = [(3, 5), (4, 3), (3, 2, 3, 4), (2, 3, 3, 4), (1, 2, 2, 3, 4)]
        for shape in bad_shapes:
            with pytest.raises(ValueError, match=r"does not broadcast to the scores' shape \(2, 2, 3, 4\)"):
                module(self.x, self.y, self.y, mask=torch.ones(shape, dtype=torch.bool))

    def test_mask_not_a_tensor(self, module: nn.Module) -> None:
        with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
            module(self.x, self.y, self.y, mask=[[True] * 4] * 3)

    def test_three_d_mask_is_refused(self, module: nn.Module) -> None:
        """(B, n_q, n_k) with B = h = 2 would broadcast per head: sequence 0's mask on head 0."""
        per_sequence = torch.ones(2, 3, 4, dtype=torch.bool)
        per_sequence[0, :, -1] = False  # sequence 0 pads its last key
        with pytest.raises(ValueError, match=r"mask of shape \(2, 3, 4\) is 3-D, which is ambiguous for the scores' "
                                             r"shape \(B, h, n_q, n_k\) = \(2, 2, 3, 4\): write a per-sequence mask "
                                             r"\(B, n_q, n_k\) as mask\[:, None\] and a per-head mask \(h, n_q, n_k\) as mask\[None\]"):
            module(self.x, self.y, self.y, mask=per_sequence)
        _, w = module(self.x, self.y, self.y, mask=per_sequence[:, None])  # as the message says
        assert w is not None and (w[0, :, :, -1] == 0).all() and (w[1, :, :, -1] > 0).all()

    def test_good_mask_shapes_accepted(self, module: nn.Module) -> None:
        for shape in [(4,), (3, 4), (1, 4), (2, 1, 1, 4), (1, 2, 3, 4), (2, 2, 3, 4), (1, 1, 3, 1)]:
            mask = torch.ones(shape, dtype=torch.bool)
            out, w = module(self.x, self.y, self.y, mask=mask)
            assert out.shape == (2, 3, 8) and w is not None and w.shape == (2, 2, 3, 4)
            fast, _ = module(self.x, self.y, self.y, mask=mask, need_weights=False)
            torch.testing.assert_close(fast, out)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kdim": 4}, r"kdim=4 and vdim=8 must equal embed_dim=8"),
        ({"vdim": 6}, r"kdim=8 and vdim=6 must equal embed_dim=8"),
        ({"add_bias_kv": True}, r"add_bias_kv=True is not supported"),
        ({"add_zero_attn": True}, r"add_zero_attn=True is not supported"),
    ],
)
def test_from_torch_unsupported_features(kwargs: dict[str, object], message: str) -> None:
    m = nn.MultiheadAttention(8, 2, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention.from_torch(m)


def test_from_torch_wrong_type() -> None:
    with pytest.raises(TypeError, match="expected torch.nn.MultiheadAttention, got Linear"):
        MultiHeadAttention.from_torch(nn.Linear(4, 4))  # type: ignore[arg-type]


def test_the_plain_layer_has_no_decoder_options_and_no_aliases() -> None:
    """Chapter 3's class is the plain layer alone: no constructor that returns a subclass, no
    decoder options, and no deprecated names (attnlib has had no release)."""
    import warnings

    import attnlib.multihead

    for options in ({"num_kv_heads": 2}, {"num_kv_heads": 4}, {"rope_base": 100.0}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(options))}'"):
            MultiHeadAttention(8, 4, **options)  # type: ignore[arg-type]
    assert type(MultiHeadAttention(8, 4)) is MultiHeadAttention
    assert not hasattr(MultiHeadAttention, "attention_weights") and "__new__" not in vars(MultiHeadAttention)
    with pytest.raises(AttributeError, match="has no attribute 'SeparateHeadsAttention'"):
        attnlib.multihead.SeparateHeadsAttention  # type: ignore[attr-defined]  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from attnlib.multihead import *", {})  # fires no deprecation


# ---- heads of any width: h * d_k need not be d_model -------------------------------------------


@SETTINGS
@given(h=st.integers(1, 4), d_k=st.integers(1, 5), d_model=st.integers(1, 8), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_heads_of_any_width_compute_the_papers_formula(h: int, d_k: int, d_model: int, bias: bool, seed: int) -> None:
    """W^Q (d_model, h d_k), W^O (h d_v, d_model): each head is torch's own scaled_dot_product_attention
    of its projections, and the concatenation goes through W^O, whatever h d_k is."""
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_model, h, bias=bias, d_k=d_k, dtype=DTYPE)
    assert (mha.w_q.shape, mha.w_o.shape, mha.w_q_heads.shape) == ((d_model, h * d_k), (h * d_k, d_model), (h, d_model, d_k))
    g = torch.Generator().manual_seed(seed)
    if bias:
        with torch.no_grad():
            for b in (mha.b_q, mha.b_k, mha.b_v, mha.b_o):
                b.copy_(torch.randn(b.shape, generator=g, dtype=DTYPE))  # type: ignore[union-attr]
    x = torch.randn(2, 4, d_model, generator=g, dtype=DTYPE)
    y = torch.randn(2, 3, d_model, generator=g, dtype=DTYPE)
    heads = []
    for i in range(h):
        hw = mha.head(i)
        q, k, v = (F.linear(t, w.T, b) for t, w, b in ((x, hw.w_q, hw.b_q), (y, hw.w_k, hw.b_k), (y, hw.w_v, hw.b_v)))
        heads.append(F.scaled_dot_product_attention(q, k, v))  # (B, n_q, d_k): torch's kernel, scale 1/sqrt(d_k)
    expected = F.linear(torch.cat(heads, dim=-1), mha.w_o.T, mha.b_o)  # (B, n_q, d_model)
    with torch.no_grad():
        for need_weights in (True, False):
            torch.testing.assert_close(mha(x, y, y, need_weights=need_weights)[0], expected, **TOL)


def test_heads_of_any_width_errors_and_torch() -> None:
    """d_k given: no divisibility needed; torch's nn.MultiheadAttention has heads of width
    embed_dim / num_heads only, so to_torch refuses another width, naming it."""
    assert MultiHeadAttention(8, 4).d_k == 2 and MultiHeadAttention(6, 4, d_k=5).w_q.shape == (6, 20)
    assert "d_k=5" in repr(MultiHeadAttention(6, 4, d_k=5))
    with pytest.raises(ValueError, match=r"d_model \(6\) must be divisible by num_heads \(4\).*or give the head width d_k"):
        MultiHeadAttention(6, 4, bias=False, d_k=None)
    for bad, error in ((0, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="d_k must be a positive int"):
            MultiHeadAttention(8, 2, d_k=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"heads are embed_dim / num_heads wide.*h\*d_k = 12, d_model = 8"):
        MultiHeadAttention(8, 2, d_k=6).to_torch()
    w = MultiHeadAttention(8, 2, d_k=6).projections()
    with pytest.raises(ValueError, match=r"num_heads \(5\) must divide the weights' h\*d_k = 12"):
        MultiHeadAttention.from_projections(w, 5)
    assert MultiHeadAttention.from_projections(w, 3).d_k == 4  # the same columns, cut into 3 heads


def test_the_names_from_before_the_projections_rename_are_the_same_methods() -> None:
    """from_weights, grouped_weights and from_grouped_weights call the new names through the
    class, so that a subclass's override (ALiBi's) is the one that runs."""
    from attnlib.decoding import AlibiAttention, AlibiWeights, DecoderAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2, dtype=DTYPE)
    x = torch.randn(1, 3, 8, dtype=DTYPE)
    torch.testing.assert_close(MultiHeadAttention.from_weights(mha.projections(), 2)(x, x, x)[0], mha(x, x, x)[0],
                               atol=0, rtol=0)
    dec = DecoderAttention(8, 4, num_kv_heads=2, rope_base=100.0, dtype=DTYPE)
    again = DecoderAttention.from_grouped_weights(dec.grouped_weights())
    assert type(again) is DecoderAttention and all(torch.equal(getattr(again, n), p) for n, p in dec.named_parameters())
    al = AlibiAttention(8, 2, dtype=DTYPE)
    assert isinstance(al.projections(), AlibiWeights)
    torch.testing.assert_close(AlibiAttention.from_weights(al.projections(), 2)(x, x, x)[0], al(x, x, x)[0],
                               atol=0, rtol=0)
    with pytest.raises(TypeError, match="AlibiAttention has no grouped_projections"):
        al.grouped_weights()
