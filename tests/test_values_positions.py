"""attnlib.decoding.positions on hand-sized cases with exact expected numbers: ALiBi's
slopes for a power of two and for other head counts (BLOOM's rule), and its bias behind a
cache. Written to kill what mutation testing (``make mutants``) and planted bugs found
unchecked."""

from __future__ import annotations

import pytest
import torch

from attnlib import AttentionWeights
from attnlib.decoding import alibi_bias, alibi_slopes
from attnlib.decoding.positions import AlibiAttention, AlibiWeights, score_terms, score_terms_bound


def test_alibi_slopes_exact() -> None:
    assert alibi_slopes(1).tolist() == [2.0**-8]
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    # h = 6: the 4 slopes of 4 heads, then every other slope of 8 heads: 2^-1, 2^-3
    assert alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    # h = 3: 2 slopes of 2 heads (2^-4, 2^-8), then 2^-2 from 4 heads
    assert alibi_slopes(3).tolist() == [2.0**-4, 2.0**-8, 2.0**-2]
    assert alibi_slopes(5, dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError):
        alibi_slopes(0)


def test_alibi_bias_behind_a_cache() -> None:
    """Two queries at positions 2 and 3 of four, head slopes 1/16 and 1/256."""
    b = alibi_bias(2, 2, 4)
    dist = torch.tensor([[2.0, 1.0, 0.0, -1.0], [3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)  # p - j
    assert torch.equal(b, torch.stack([-dist / 16, -dist / 256]))
    assert torch.equal(alibi_bias(1, 3), -torch.tensor([[[0.0, -1, -2], [1, 0, -1], [2, 1, 0]]], dtype=torch.float64) / 256)
    with pytest.raises(ValueError, match=r"n_k \(2\) must be >= n_q \(3\)"):
        alibi_bias(2, 3, 2)


def test_score_terms_bound_is_its_formula() -> None:
    """gamma_{4 d_model + 2 d_k + 5} (|x_p| + |e_p|)|W^Q| ((|x_j| + |e_j|)|W^K|)^T + eta (3 d_model
    (|A_p|_1 + |A_j|_1) + 6 d_k + 3), eta = eps x smallest normal; d_model = 2, d_k = 1:
    A_p = 1.5 + 2 = 3.5, A_j = 7 and 4, gamma_15."""
    w_q = torch.tensor([[1.0], [-2.0]], dtype=torch.float64)
    w_k = torch.tensor([[3.0], [1.0]], dtype=torch.float64)
    x_q, e_q = torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.tensor([[0.5, 0.0]], dtype=torch.float64)
    x_k = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    e_k = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)
    u = 2.0**-53
    gamma = 15 * u / (1 - 15 * u)
    got = score_terms_bound(x_q, e_q, x_k, e_k, w_q, w_k)
    assert got.shape == (1, 2)
    assert got[0].tolist() == pytest.approx([gamma * 3.5 * 7, gamma * 3.5 * 4], rel=1e-15, abs=0)
    # queries of zero: only the underflow term, whole multiples of eta (exact subnormals)
    eta = 2.0**-52 * 2.0**-1022
    zero = torch.zeros(1, 2, dtype=torch.float64)
    assert score_terms_bound(zero, zero, x_k, e_k, w_q, w_k)[0].tolist() == [eta * (6 * 7 + 9), eta * (6 * 4 + 9)]
    f32 = [t.float() for t in (zero, zero, x_k, e_k, w_q, w_k)]
    assert score_terms_bound(*f32)[0].tolist() == [2.0**-149 * 51, 2.0**-149 * 33]
    # behind a batch axis: the sums stay per key
    batched = score_terms_bound(zero[None], zero[None], x_k[None], e_k[None], w_q, w_k)
    assert batched.shape == (1, 1, 2) and batched[0, 0].tolist() == [eta * 51, eta * 33]
    # d_k = 2: A_j = (7, 1) and (4, 1), eta (6 |A_j|_1 + 12 + 3)
    w2 = torch.tensor([[3.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    assert score_terms_bound(zero, zero, x_k, e_k, w2, w2)[0].tolist() == [eta * (6 * 8 + 15), eta * (6 * 5 + 15)]


@pytest.mark.parametrize("i", range(6))
def test_score_terms_names_the_argument_that_is_not_a_tensor(i: int) -> None:
    names = ["x_q", "e_q", "x_k", "e_k", "w_q", "w_k"]
    args: list = [torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3),
                  torch.zeros(3, 2), torch.zeros(3, 2)]
    args[i] = [0.0]
    with pytest.raises(TypeError, match=f"^{names[i]} must be a torch.Tensor, got list$"):
        score_terms(*args)
    if i in (1, 3):  # e_q, e_k: of another shape than x_q, x_k
        args[i] = torch.zeros(1, 3)
        with pytest.raises(ValueError, match=rf"^{names[i - 1]} and {names[i]} must have one shape, got \(2, 3\) and \(1, 3\)$"):
            score_terms(*args)


def _alibi(dtype: torch.dtype = torch.float64, device: str | None = None) -> AlibiAttention:
    torch.manual_seed(0)
    return AlibiAttention(4, 2, dtype=dtype, device=device)


def test_alibi_attention_keeps_the_dtype_and_device_of_its_inputs() -> None:
    m = _alibi(torch.float32)
    x = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, w = m(x, x, x)
        fused, _ = m(x, x, x, need_weights=False)
    assert out.dtype == w.dtype == fused.dtype == torch.float32
    assert torch.allclose(fused, out, rtol=0, atol=1e-6)
    meta = _alibi(device="meta")
    y = torch.empty(1, 3, 4, device="meta")
    for need in (True, False):
        assert meta(y, y, y, need_weights=need)[0].device.type == "meta"


def test_alibi_attention_cross_attention_offsets() -> None:
    """Two queries after five keys: the queries sit at positions 3 and 4 (the last n_q of n_k),
    so head 0 (slope 1/16) adds -(p - j)/16 to each scaled score."""
    m = _alibi()
    g = torch.Generator().manual_seed(2)
    q, kv = torch.randn(1, 2, 4, generator=g, dtype=torch.float64), torch.randn(1, 5, 4, generator=g, dtype=torch.float64)
    with torch.no_grad():
        _, w = m(q, kv, kv)
        qh = (q @ m.w_q + m.b_q).view(1, 2, 2, 2).transpose(1, 2)
        kh = (kv @ m.w_k + m.b_k).view(1, 5, 2, 2).transpose(1, 2)
    scores = qh @ kh.mT / 2**0.5 + alibi_bias(2, 2, 5)
    assert torch.allclose(w, torch.softmax(scores, -1), rtol=0, atol=1e-14)


def test_alibi_records_and_repr() -> None:
    m = _alibi()
    assert repr(m) == "AlibiAttention(d_model=4, num_heads=2, d_k=2, bias=True, alibi=True)"
    assert {p.dtype for p in m.parameters()} == {torch.float64}
    plain_layer = AlibiAttention(4, 2, bias=False)
    assert not plain_layer.bias and plain_layer.b_q is None and len(list(plain_layer.parameters())) == 4
    rec = m.projections()
    assert isinstance(rec, AlibiWeights)
    plain = rec.without_alibi()
    assert type(plain) is AttentionWeights and torch.equal(plain.w_q, m.w_q)
    for weights in (rec, plain):
        again = AlibiAttention.from_projections(weights, 2)
        for p, q in zip(m.parameters(), again.parameters()):
            assert torch.equal(p, q)
