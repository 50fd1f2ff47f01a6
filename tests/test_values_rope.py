"""attnlib.decoding.rope on hand-sized cases with exact expected numbers: the direction of
the rotation (Llama's rotate-half: dimension l is turned towards l + d_k/2), the angles in
float64 at a large position, and the rotation matrix. Written to kill what mutation testing
(``make mutants``) and planted bugs found unchecked."""

from __future__ import annotations

import math

import pytest
import torch

from attnlib.decoding import apply_rope, rope_angles, rope_inv_freq, rope_rotation, rotate_half
from attnlib.decoding.rope import rope_angle_error, rope_frequency_error, rope_merged_bound

F64 = torch.float64


def test_rotate_half_exact() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rotate_half(x).tolist() == [-3.0, -4.0, 1.0, 2.0]


def test_apply_rope_turns_each_pair_the_right_way() -> None:
    """e_0 at position p: (cos p, 0, sin p, 0); e_2: (-sin p, 0, cos p, 0); pair 1 turns by p/100."""
    x = torch.eye(4, dtype=F64)  # rows e_0 .. e_3, at positions 0 .. 3 by default
    out = apply_rope(x, torch.tensor([1, 1, 1, 1]))
    c, s, c1, s1 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
    expected = torch.tensor([[c, 0, s, 0], [0, c1, 0, s1], [-s, 0, c, 0], [0, -s1, 0, c1]], dtype=F64)
    assert torch.allclose(out, expected, rtol=0, atol=1e-15)
    assert torch.equal(apply_rope(x[:1]), x[:1])  # position 0: unchanged
    assert torch.allclose(out, x @ rope_rotation(1, 4), rtol=0, atol=1e-15)


def test_angles_are_float64_at_large_positions() -> None:
    p = 12345
    angles = rope_angles(torch.tensor([p]), 8)
    assert angles.dtype == F64
    expected = torch.tensor([[p * 1.0 / (10000.0 ** (2 * l / 8)) for l in range(4)]], dtype=F64)
    assert torch.allclose(angles, expected, rtol=4e-16, atol=0)
    assert torch.allclose(rope_inv_freq(8, 12345.0), torch.tensor([12345.0 ** (-2 * l / 8) for l in range(4)],
                                                                   dtype=F64), rtol=4e-16, atol=0)


def test_rope_rotation_exact() -> None:
    c, s = math.cos(2), math.sin(2)
    c1, s1 = math.cos(2 / 100), math.sin(2 / 100)
    expected = torch.tensor([[c, 0, s, 0], [0, c1, 0, s1], [-s, 0, c, 0], [0, -s1, 0, c1]], dtype=F64)
    assert torch.allclose(rope_rotation(2, 4), expected, rtol=0, atol=1e-15)
    assert torch.equal(rope_rotation(0, 4), torch.eye(4, dtype=F64))
    assert rope_rotation(1, 4, dtype=torch.float32).dtype == torch.float32


def test_rope_frequency_error_is_its_formula() -> None:
    """gamma_k, k = t_l ln(base) + 3, t_l = 2l/d_k, u = eps/2: d_k = 4 has t = 0 and 1/2."""
    for dtype in (torch.float32, F64):
        u = torch.finfo(dtype).eps / 2
        ks = [3.0, 0.5 * math.log(500.0) + 3]
        got = rope_frequency_error(4, 500.0, dtype)
        assert got.dtype == F64 and got.tolist() == pytest.approx([k * u / (1 - k * u) for k in ks], rel=1e-14, abs=0)
    assert rope_frequency_error(2).tolist() == [3 * 2.0**-53 / (1 - 3 * 2.0**-53)]
    with pytest.raises(ValueError, match="d_k must be even, got 3"):
        rope_frequency_error(3)


def test_apply_rope_on_a_batch_and_on_the_device_of_x() -> None:
    """(B, n, d_k) rows, each turned by its own position (x @ R_p), the angles shared by the
    two halves; positions given on the CPU are moved to x's device (meta: shapes only)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 4, generator=g, dtype=F64)
    pos = torch.tensor([[0, 1, 2], [5, 7, 11]])
    out = apply_rope(x, pos)
    for b in range(2):
        for i in range(3):
            assert torch.allclose(out[b, i], x[b, i] @ rope_rotation(int(pos[b, i]), 4), rtol=0, atol=1e-15)
    assert torch.allclose(apply_rope(x), torch.stack([x[:, i] @ rope_rotation(i, 4) for i in range(3)], 1),
                          rtol=0, atol=1e-15)
    on_meta = apply_rope(torch.empty(2, 3, 4, device="meta"), torch.arange(3))
    assert on_meta.device.type == "meta" and on_meta.shape == (2, 3, 4)


def test_rope_angle_error_is_its_formula() -> None:
    """|p| omega_l (rel_l + (1 + [|p| > 1/u]) u (1 + rel_l)), rel = rope_frequency_error: d_k = 4,
    base 100 (omega = 1, 1/10), float32 (u = 2^-24); position 2^25 is past 1/u and rounds too."""
    u = 2.0**-24
    rel = rope_frequency_error(4, 100.0, torch.float32).tolist()
    got = rope_angle_error(torch.tensor([0, -3, 2**24, 2**25]), 4, 100.0, torch.float32)
    assert got.dtype == F64 and got.shape == (4, 2)
    # 2^24 = 1/u is still exact in float32; 2^25 is past it
    for row, (p, extra) in zip(got.tolist(), ((0, 1), (3, 1), (2**24, 1), (2**25, 2))):
        assert row == pytest.approx([p * w * (r + extra * u * (1 + r)) for w, r in zip((1.0, 0.1), rel)], rel=1e-14, abs=0)


def test_rope_merged_bound_is_its_formula() -> None:
    """d_model = 1, d_k = 2 (one pair), query at 0, key at 3: |W^Q| (gamma_6 |R_0||R_3|^T + E_0 |R_3|^T
    + |R_0| E_3^T + E_0 E_3^T) |W^K|^T, E_p = rho_p on the pair's four entries, rho_p the angle's
    error + eps; with W^Q = 0 only the underflow term is left, eta (2 1 |R_3|^T |W^K|^T + 2 1 |W^K|^T + 2 d_k)."""
    u, eps, eta = 2.0**-53, 2.0**-52, 2.0**-52 * 2.0**-1022
    c, s = abs(math.cos(3)), abs(math.sin(3))
    rho0 = eps
    rho3 = float(rope_angle_error(torch.tensor([3.0]), 2)[0, 0]) + eps
    g6 = 6 * u / (1 - 6 * u)
    r3 = [[c, s], [s, c]]  # |R_3|, symmetric
    core = [[g6 * r3[a][b] + rho0 * (c + s) + rho3 + rho0 * rho3 * 2 for b in range(2)] for a in range(2)]
    wq, wk = [1.0, -2.0], [0.5, 3.0]
    expected = sum(abs(wq[a]) * core[a][b] * abs(wk[b]) for a in range(2) for b in range(2))
    got = rope_merged_bound(torch.tensor([wq], dtype=F64), torch.tensor([wk], dtype=F64), 0, 3)
    assert got.shape == (1, 1) and float(got) == pytest.approx(expected, rel=1e-13, abs=0)
    under = eta * (2 * sum(r3[a][b] * abs(wk[b]) for a in range(2) for b in range(2)) + 2 * 3.5 + 4)
    zero = rope_merged_bound(torch.zeros(1, 2, dtype=F64), torch.tensor([wk], dtype=F64), 0, 3)
    assert float(zero) == pytest.approx(under, rel=0, abs=1.01 * eta)


def test_rope_merged_bound_default_base_and_refusals() -> None:
    w = torch.eye(4, dtype=F64)[:3]  # (d_model = 3, d_k = 4): the second pair turns by base^(-1/2)
    assert torch.equal(rope_merged_bound(w, w, 0, 3), rope_merged_bound(w, w, 0, 3, 10000.0))
    assert not torch.equal(rope_merged_bound(w, w, 0, 3), rope_merged_bound(w, w, 0, 3, 10001.0))
    with pytest.raises(TypeError, match="^w_q must be a torch.Tensor"):
        rope_merged_bound(None, w, 0, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^w_k must be a torch.Tensor"):
        rope_merged_bound(w, None, 0, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^w_q must be a float64 matrix \(d_model, d_k\), got \(3, 4\) of torch.float32$"):
        rope_merged_bound(w.float(), w, 0, 3)
    with pytest.raises(ValueError, match=r"^w_k must be a float64 matrix \(d_model, d_k\), got \(4,\) of torch.float64$"):
        rope_merged_bound(w, w[0], 0, 3)
    with pytest.raises(ValueError, match=r"^w_q and w_k must have the same d_k, got \(3, 4\) and \(3, 2\)$"):
        rope_merged_bound(w, w[:, :2], 0, 3)
