"""attnlib.decoding.rope on hand-sized cases with exact expected numbers: the direction of
the rotation (Llama's rotate-half: dimension l is turned towards l + d_k/2), the angles in
float64 at a large position, and the rotation matrix. Written to kill what mutation testing
(``make mutants``) and planted bugs found unchecked."""

from __future__ import annotations

import math

import pytest
import torch

from attnlib.decoding import apply_rope, rope_angles, rope_inv_freq, rope_rotation, rotate_half
from attnlib.decoding.rope import angle_dtype, rope_angle_error, rope_frequency_error, rope_merged_bound

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


def test_rope_defaults_are_llamas_base_10000() -> None:
    """Called without a base, the frequencies and the error bounds are base 10000's (Llama's):
    d_k = 4 has omega = (1, 1/100) and t = (0, 1/2)."""
    assert torch.allclose(rope_inv_freq(4), torch.tensor([1.0, 0.01], dtype=F64), rtol=4e-16, atol=0)
    u = 2.0**-53
    ks = [3.0, 0.5 * math.log(10000.0) + 3]
    assert rope_frequency_error(4).tolist() == pytest.approx([k * u / (1 - k * u) for k in ks], rel=1e-14, abs=0)
    pos = torch.tensor([3, 1000])
    assert torch.equal(rope_angle_error(pos, 4), rope_angle_error(pos, 4, 10000.0))
    assert not torch.equal(rope_angle_error(pos, 4), rope_angle_error(pos, 4, 10001.0))


def test_rope_base_just_above_one_is_accepted_and_one_is_refused() -> None:
    """Any base > 1 is a RoPE (d_k = 4: omega = (1, base^(-1/2))); 1 and below are refused,
    the message naming ``base``."""
    for base in (2, 1.5):
        assert torch.allclose(rope_inv_freq(4, base), torch.tensor([1.0, base**-0.5], dtype=F64), rtol=4e-16, atol=0)
    for bad in (1, 0.5):
        with pytest.raises(ValueError, match=rf"^base \(RoPE's theta\) must be > 1, got {bad}$"):
            rope_inv_freq(4, bad)


def test_angle_dtype_is_float32_on_mps_only() -> None:
    """MPS has no float64, so RoPE's angles are float32 there; float64 everywhere else
    (device objects only: no MPS or CUDA is needed to build them)."""
    assert angle_dtype(torch.device("mps")) == torch.float32
    assert angle_dtype(torch.device("mps", 0)) == torch.float32
    for name in ("cpu", "cuda", "meta"):
        assert angle_dtype(torch.device(name)) == F64


def test_rope_rotation_with_another_base_and_on_its_device() -> None:
    """Base 100: pair 1 turns by p/10. The matrix is built on the device asked for, even
    under another default device (``with torch.device(...)``; meta stands in for a GPU),
    and on the default device when none is asked for."""
    c, s, c1, s1 = math.cos(2), math.sin(2), math.cos(0.2), math.sin(0.2)
    expected = torch.tensor([[c, 0, s, 0], [0, c1, 0, s1], [-s, 0, c, 0], [0, -s1, 0, c1]], dtype=F64)
    assert torch.allclose(rope_rotation(2, 4, 100.0), expected, rtol=0, atol=1e-15)
    for device in ("meta", torch.device("meta")):
        on_meta = rope_rotation(2, 4, 100.0, device=device)
        assert on_meta.device.type == "meta" and on_meta.shape == (4, 4) and on_meta.dtype == F64
    with torch.device("meta"):
        on_cpu = rope_rotation(2, 4, 100.0, device="cpu")
        assert rope_rotation(2, 4, 100.0).device.type == "meta"
    assert on_cpu.device.type == "cpu"
    assert torch.allclose(on_cpu, expected, rtol=0, atol=1e-15)


def test_rope_angle_error_counts_integer_positions_that_float32_rounds() -> None:
    """2^24 + 1 is an integer position that float32 cannot hold (it rounds to 2^24): its
    angle's bound in float32 counts that rounding, as for 2^25 + 2."""
    u = 2.0**-24
    rel = rope_frequency_error(4, 100.0, torch.float32).tolist()
    got = rope_angle_error(torch.tensor([2**24 - 1, 2**24 + 1, 2**25 + 2]), 4, 100.0, torch.float32)
    for row, (p, extra) in zip(got.tolist(), ((2**24 - 1, 1), (2**24 + 1, 2), (2**25 + 2, 2))):
        assert row == pytest.approx([p * w * (r + extra * u * (1 + r)) for w, r in zip((1.0, 0.1), rel)], rel=1e-14, abs=0)


def test_rope_angle_error_ignores_the_default_dtype() -> None:
    """The bound is float64 and the same when half precision is torch's default dtype (as
    Meta's reference Llama code sets it)."""
    pos = torch.tensor([3, 1000, 2**53 + 2**12])
    expected = rope_angle_error(pos, 4, 100.0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        got = rope_angle_error(pos, 4, 100.0)
    finally:
        torch.set_default_dtype(old)
    assert got.dtype == F64 and torch.equal(got, expected)


def _merged_bound_by_hand(wq: list[float], wk: list[float], p: int, j: int, base: float) -> float:
    """d_model = 1: sum_ab |wq_a| core_ab |wk_b| + the underflow term, core = gamma_{d_k+4}
    |R_p||R_j|^T + E_p |R_j|^T + |R_p| E_j^T + E_p E_j^T, built entry by entry."""
    d_k, half = len(wq), len(wq) // 2
    u, eps, eta = 2.0**-53, 2.0**-52, 2.0**-52 * 2.0**-1022
    omega = [base ** (-2 * l / d_k) for l in range(half)]

    def rot_and_err(pos: int) -> tuple[list[list[float]], list[list[float]]]:
        rho = [float(x) + eps for x in rope_angle_error(torch.tensor([pos]), d_k, base)[0]]
        r, e = [[0.0] * d_k for _ in range(d_k)], [[0.0] * d_k for _ in range(d_k)]
        for l in range(half):
            c, s = abs(math.cos(pos * omega[l])), abs(math.sin(pos * omega[l]))
            for a, b, v in ((l, l, c), (l + half, l + half, c), (l, l + half, s), (l + half, l, s)):
                r[a][b], e[a][b] = v, rho[l]
        return r, e

    (r_p, e_p), (r_j, e_j) = rot_and_err(p), rot_and_err(j)
    g = (d_k + 4) * u / (1 - (d_k + 4) * u)

    def dot(x: list[list[float]], y: list[list[float]], a: int, b: int) -> float:  # (x y^T)_ab
        return sum(x[a][c] * y[b][c] for c in range(d_k))

    total = 0.0
    for a in range(d_k):
        for b in range(d_k):
            core = g * dot(r_p, r_j, a, b) + dot(e_p, r_j, a, b) + dot(r_p, e_j, a, b) + dot(e_p, e_j, a, b)
            total += abs(wq[a]) * core * abs(wk[b])
    col = [sum(r_j[b][c] for c in range(d_k)) for b in range(d_k)]  # (1 |R_j|^T)_b
    return total + eta * (2 * sum(col[b] * abs(wk[b]) for b in range(d_k)) + 2 * sum(map(abs, wk)) + 2 * d_k)


def test_rope_merged_bound_far_positions_another_base() -> None:
    """d_k = 4, base 100 (pair 1 turns by p/10), a query at 10^6 and a key at 999 000: the
    rotations' errors (about 4e-10) dominate, and their product E_p E_j^T counts. A query at
    2^24 + 1, which float32 (torch's default dtype) cannot hold, is counted at 2^24 + 1."""
    wq, wk = [1.0, -2.0, 0.5, 3.0], [0.25, 1.5, -1.0, 2.0]
    for p, j in ((10**6, 999_000), (0, 3), (2**24 + 1, 0)):
        got = rope_merged_bound(torch.tensor([wq], dtype=F64), torch.tensor([wk], dtype=F64), p, j, 100.0)
        assert got.shape == (1, 1) and float(got) == pytest.approx(_merged_bound_by_hand(wq, wk, p, j, 100.0), rel=1e-13, abs=0)


def test_rope_merged_bound_at_position_zero_is_gamma_and_an_ulp() -> None:
    """Both positions 0: the rotations are the identity, exact, so entry (0, 0) of e_0 ... e_0^T
    is gamma_{d_k+4} = (d_k+4) u / (1 - (d_k+4) u) plus the cosine's ulp on each side (2 eps
    + 2 eps^2) and the underflow term; at d_k = 64 gamma dominates."""
    d_k, u, eps, eta = 64, 2.0**-53, 2.0**-52, 2.0**-52 * 2.0**-1022
    e0 = torch.zeros(1, d_k, dtype=F64)
    e0[0, 0] = 1.0
    k = d_k + 4
    expected = k * u / (1 - k * u) + 2 * eps + 2 * eps**2 + eta * (4 + 2 * d_k)
    assert float(rope_merged_bound(e0, e0, 0, 0)) == pytest.approx(expected, rel=1e-15, abs=0)
