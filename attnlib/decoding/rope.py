r"""Rotary position embedding, RoPE (Su et al. 2021), in Llama's rotate-half layout (chapter 8).

Queries and keys are rotated by an angle proportional to their position, so that the
score of query ``i`` and key ``j`` depends on ``j - i`` only. Dimension ``l`` is paired
with dimension ``l + d_k/2`` and turned by the angle :math:`p\,\omega_\ell`,
:math:`\omega_\ell = \text{base}^{-2\ell/d_k}` (Hugging Face ``transformers``' Llama layout).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlib.checks import check_tensor, check_width, format_shape

__all__ = ["rope_inv_freq", "rope_angles", "rotate_half", "apply_rope", "rope_rotation",
           "check_rope_base", "angle_dtype", "rope_frequency_error", "rope_angle_error", "rope_merged_bound"]


def check_rope_base(base: object, name: str = "base") -> float:
    """RoPE's theta as a float: ``TypeError`` for a non-number, ``ValueError`` unless > 1."""
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise TypeError(f"{name} (RoPE's theta) must be a number, got {type(base).__name__} {base!r}")
    if not base > 1:
        raise ValueError(f"{name} (RoPE's theta) must be > 1, got {base!r}")
    return float(base)


def angle_dtype(device: torch.device) -> torch.dtype:
    """float64 for the angles where the device has it (MPS does not)."""
    return torch.float32 if device.type == "mps" else torch.float64


def rope_inv_freq(
    d_k: int,
    base: float = 10000.0,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    r"""RoPE's angular frequencies :math:`\omega_\ell = \text{base}^{-2\ell/d_k}`, ``l = 0..d_k/2-1``.

    Pair ``l`` (dimensions ``l`` and ``l + d_k/2``) turns by :math:`p\,\omega_\ell` at
    position ``p``: the first pair once per position (:math:`\omega_0 = 1` radian), the
    last pair slowest. Hugging Face's ``LlamaRotaryEmbedding`` calls this ``inv_freq``.

    Returns:
        ``(d_k/2,)``.

    Raises:
        ValueError: ``d_k`` not a positive even int; ``base`` not a number > 1.
    """
    check_width("d_k", d_k, even=True, why="RoPE pairs dimension l with l + d_k/2")
    base = check_rope_base(base)
    two_l = torch.arange(0, d_k, 2, device=device, dtype=dtype)  # (d_k/2,): 2l
    return 1.0 / (base ** (two_l / d_k))  # (d_k/2,)


def rope_angles(positions: Tensor, d_k: int, base: float = 10000.0) -> Tensor:
    r"""The rotation angles :math:`\theta_{p,\ell} = p\,\omega_\ell` of RoPE.

    Args:
        positions: ``(..., n)``, integer or real positions.
        d_k: the (even) head width.
        base: RoPE's :math:`\theta` (``rope_theta`` in Hugging Face configs).

    Returns:
        ``(..., n, d_k/2)`` in float64 (float32 on MPS).
    """
    check_tensor("positions", positions)
    if positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"positions must be integer or real, got dtype {positions.dtype}")
    dtype = angle_dtype(positions.device)
    inv_freq = rope_inv_freq(d_k, base, device=positions.device, dtype=dtype)  # (d_k/2,)
    return positions.to(dtype)[..., None] * inv_freq  # (..., n, d_k/2)


def rotate_half(x: Tensor) -> Tensor:
    """``(x_1, x_2) -> (-x_2, x_1)`` on the two halves of the last dimension, ``(..., d)``.

    This is Hugging Face's ``rotate_half``: with it, RoPE is
    ``x * cos + rotate_half(x) * sin``, a rotation of each pair ``(x_l, x_{l + d/2})``.
    """
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (..., d)


def apply_rope(x: Tensor, positions: Tensor | None = None, base: float = 10000.0) -> Tensor:
    r"""Rotary position embedding of the rows of ``x`` (rotate-half layout, as Llama).

    Row ``p`` (at position ``p``) has each pair :math:`(x_\ell, x_{\ell+d_k/2})` turned by the
    angle :math:`p\,\omega_\ell`, :math:`\omega_\ell = \text{base}^{-2\ell/d_k}`:

    .. math::
        \mathrm{RoPE}(x, p)_\ell = x_\ell \cos p\omega_\ell - x_{\ell+d_k/2} \sin p\omega_\ell, \qquad
        \mathrm{RoPE}(x, p)_{\ell+d_k/2} = x_{\ell+d_k/2} \cos p\omega_\ell + x_\ell \sin p\omega_\ell .

    Each pair is a 2-D rotation, so ``RoPE(x, p) = x @ R_p`` with ``R_p`` orthogonal
    (:func:`rope_rotation`) and :math:`R_p R_s^\top = R_{p-s}`: the score of a rotated
    query at ``i`` and a rotated key at ``j`` is :math:`q R_{i-j} k^\top`, a function of the
    offset only (Su et al. 2021).

    Args:
        x: ``(..., n, d_k)``, ``d_k`` even, floating point.
        positions: ``(n,)`` or broadcastable to ``(..., n)``; default ``0..n-1``.
        base: RoPE's :math:`\theta`; Llama uses 10000 (Llama 3: 500000).

    Returns:
        ``(..., n, d_k)``, the dtype of ``x``. The angles are computed in float64 and
        rounded once to ``x``'s dtype.

    Raises:
        TypeError: ``x`` or ``positions`` not a tensor.
        ValueError: ``x`` of rank < 2, not floating point or of odd width; positions that
            do not broadcast to ``(..., n)``; ``base`` not > 1.
    """
    check_tensor("x", x)
    if x.dim() < 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor of shape (..., n, d_k), got {format_shape(x)} of dtype {x.dtype}")
    n, d_k = x.shape[-2], x.shape[-1]
    check_width("d_k (the last dimension of x)", d_k, even=True, why="RoPE pairs dimension l with l + d_k/2")
    if positions is None:
        positions = torch.arange(n, device=x.device)  # (n,)
    elif not isinstance(positions, Tensor):
        raise TypeError(f"positions must be a torch.Tensor or None, got {type(positions).__name__}")
    else:
        try:
            ok = torch.broadcast_shapes(positions.shape, x.shape[:-1]) == x.shape[:-1]
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"positions of shape {format_shape(positions)} must broadcast to x's (..., n) = {format_shape(x.shape[:-1])}"
            )
    angles = rope_angles(positions.to(x.device), d_k, base)  # (..., n, d_k/2)
    angles = torch.cat((angles, angles), dim=-1)  # (..., n, d_k): dims l, l + d_k/2 share an angle
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # (..., n, d_k)
    return x * cos + rotate_half(x) * sin  # (..., n, d_k)


def rope_rotation(
    position: int | float,
    d_k: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> Tensor:
    r"""The orthogonal ``(d_k, d_k)`` matrix :math:`R_p` with ``apply_rope(x, p) == x @ R_p``.

    .. math::
        (R_p)_{\ell,\ell} = (R_p)_{\ell+d_k/2,\,\ell+d_k/2} = \cos p\omega_\ell, \quad
        (R_p)_{\ell,\,\ell+d_k/2} = \sin p\omega_\ell, \quad (R_p)_{\ell+d_k/2,\,\ell} = -\sin p\omega_\ell .

    :math:`R_p R_s^\top = R_{p-s}` and :math:`R_0 = I`.
    """
    if isinstance(position, bool) or not isinstance(position, (int, float)):
        raise TypeError(f"position must be an int or float, got {type(position).__name__} {position!r}")
    a_dtype = angle_dtype(torch.device(device) if device is not None else torch.device("cpu"))
    theta = position * rope_inv_freq(d_k, base, device=device, dtype=a_dtype)  # (d_k/2,)
    cos, sin = theta.cos(), theta.sin()  # (d_k/2,)
    half = d_k // 2
    r = torch.zeros(d_k, d_k, device=device, dtype=a_dtype)  # (d_k, d_k)
    idx = torch.arange(half, device=device)
    r[idx, idx] = cos
    r[idx + half, idx + half] = cos
    r[idx, idx + half] = sin
    r[idx + half, idx] = -sin
    return r.to(dtype)



# ---- how far the rounded rotations may be off -------------------------------------------
def _gamma(k: float, dtype: torch.dtype) -> float:
    """Higham's gamma_k = k u / (1 - k u), u = eps(dtype) / 2: k roundings, compounded."""
    u = torch.finfo(dtype).eps / 2
    return k * u / (1 - k * u)


def rope_frequency_error(d_k: int, base: float = 10000.0, dtype: torch.dtype = torch.float64) -> Tensor:
    r"""How far RoPE's frequencies, computed in ``dtype``, may be from :math:`\omega_\ell`, relative.

    :func:`rope_inv_freq` (and Hugging Face's ``inv_freq``, in float32) computes
    :math:`\omega_\ell = 1 / \text{base}^{t_\ell}` with :math:`t_\ell = 2\ell/d_k`. The
    quotient :math:`t_\ell` is rounded once, :math:`\hat t = t(1 + \delta)` with
    :math:`|\delta| \le u` (exact when :math:`d_k` is a power of two), and a relative
    error :math:`\delta` in an exponent becomes :math:`t_\ell \ln(\text{base})\,\delta` in
    the power, :math:`\text{base}^{t(1+\delta)} = \text{base}^t e^{t \delta \ln \text{base}}`:
    the rounding of :math:`t_\ell` is amplified by :math:`\ln \text{base}` (9.2 for 10000,
    13.1 for Llama 3's 500000). The power (one ulp, :math:`2u`) and the reciprocal
    (:math:`u`) add three roundings:

    .. math::  |\hat\omega_\ell - \omega_\ell| \le \gamma_{t_\ell \ln(\text{base}) + 3}\; \omega_\ell,
        \qquad \gamma_k = \frac{k u}{1 - k u},\; u = \texttt{eps(dtype)} / 2 .

    Returns:
        ``(d_k/2,)`` float64, the bound on :math:`|\hat\omega_\ell - \omega_\ell| / \omega_\ell`.
    """
    check_width("d_k", d_k, even=True)
    log_base = math.log(check_rope_base(base))
    t = torch.arange(0, d_k, 2, dtype=torch.float64) / d_k  # (d_k/2,): t_l = 2l/d_k
    u = torch.finfo(dtype).eps / 2
    k = t * log_base + 3  # (d_k/2,): roundings, the exponent's amplified
    return k * u / (1 - k * u)


def rope_angle_error(
    positions: Tensor, d_k: int, base: float = 10000.0, dtype: torch.dtype = torch.float64
) -> Tensor:
    r"""A bound on how far RoPE's angles, computed in ``dtype``, are from :math:`p\,\omega_\ell`.

    The angle is :math:`\hat\theta = \mathrm{fl}(p\,\hat\omega_\ell)`: the frequency's error
    (:func:`rope_frequency_error`) and one rounding of the product,

    .. math::  |\hat\theta_{p,\ell} - p\,\omega_\ell| \le
        |p|\,\omega_\ell\,\gamma_{t_\ell \ln(\text{base}) + 4} ,

    and one rounding more where the position itself is not exact in ``dtype`` (beyond
    :math:`2^{24}` in float32, where Hugging Face casts its positions).

    Per radian of angle that is :math:`(t_\ell \ln \text{base} + 4)\,u`, up to about
    :math:`6.6\,\varepsilon` for base 10000, more than one :math:`\varepsilon` wherever
    :math:`2\ell/d_k` is rounded; per unit of position it is at most
    :math:`\omega_\ell (t_\ell \ln \text{base} + 4)\,u \le (1/e + 4)\,u`, whatever the base
    (:math:`t \ln(b)\, b^{-t} \le 1/e`). The angles are exact at position 0.

    Args:
        positions: ``(..., n)``, integer or real.
        d_k, base: as for :func:`rope_angles`.
        dtype: the dtype the frequencies and angles are computed in (float64 for attnlib
            on CPU, float32 for Hugging Face's ``LlamaRotaryEmbedding``).

    Returns:
        ``(..., n, d_k/2)`` float64.
    """
    check_tensor("positions", positions)
    rel = rope_frequency_error(d_k, base, dtype)  # (d_k/2,)
    omega = rope_inv_freq(d_k, base, dtype=torch.float64)  # (d_k/2,)
    u = torch.finfo(dtype).eps / 2
    p = positions.to(torch.float64).abs()[..., None]  # (..., n, 1)
    inexact = (p > 1 / u).to(torch.float64)  # (..., n, 1): the position rounds too
    return p * omega * (rel + (1 + inexact) * u * (1 + rel))  # (..., n, d_k/2)


def rope_merged_bound(w_q: Tensor, w_k: Tensor, p: int, j: int, base: float = 10000.0) -> Tensor:
    r"""Elementwise bound on the rounding of ``w_q @ rope_rotation(p) @ rope_rotation(j).T @ w_k.T``.

    In exact arithmetic that product is :math:`W^Q R_p R_j^\top {W^K}^\top = W^Q R_{p-j} {W^K}^\top`,
    the merged matrix between a query at ``p`` and a key at ``j``. Computed in float64, it
    is off by two kinds of error, each counted through the rotations (not through
    :math:`|W^Q|\,|W^K|^\top`, which pairs coordinate :math:`\ell` of the query with
    coordinate :math:`\ell` of the key only, while a rotation mixes :math:`\ell` with
    :math:`\ell + d_k/2`):

    - the rotations' entries: each of pair :math:`\ell`'s four entries is off by at most
      :math:`\rho_\ell =` :func:`rope_angle_error` :math:`+ 2u` (the angle, then one ulp
      of the cosine or sine); :math:`E_p` puts :math:`\rho_\ell` on those four entries;
    - the three products: columns of :math:`R` hold two non-zeros, so the first two products
      are sums of two terms (:math:`\gamma_2` each), the last one of :math:`d_k`.

    .. math::
        |\hat M - W^Q R_{p-j} {W^K}^\top| \le |W^Q| \big(\gamma_{d_k + 4}\, |\hat R_p|\, |\hat R_j|^\top
        + E_p |\hat R_j|^\top + |\hat R_p|\, E_j^\top + E_p E_j^\top\big) |W^K|^\top ,

    to first order in :math:`u` (:math:`\hat R` the rotations as computed), plus, for
    entries in the subnormal range (gradual underflow), :math:`\eta`, the subnormals'
    spacing, per rounding. Two such products
    at a common offset (``p + s, j + s`` and ``p, j``) differ by at most the sum of their
    bounds.

    Args:
        w_q, w_k: ``(d_model, d_k)`` float64, one head's :math:`W^Q, W^K`.
        p, j: the query's and the key's positions (ints).

    Returns:
        ``(d_model, d_model)`` float64.
    """
    for name, w in (("w_q", w_q), ("w_k", w_k)):
        check_tensor(name, w)
        if w.dim() != 2 or w.dtype != torch.float64:
            raise ValueError(f"{name} must be a float64 matrix (d_model, d_k), got {format_shape(w)} of {w.dtype}")
    d_k = w_q.shape[1]
    if w_k.shape[1] != d_k:
        raise ValueError(f"w_q and w_k must have the same d_k, got {format_shape(w_q)} and {format_shape(w_k)}")
    f64 = torch.float64
    half = d_k // 2
    idx = torch.arange(half)
    pair = torch.zeros(d_k, d_k, dtype=f64)  # (d_k, d_k): pair l's four entries
    pair[idx, idx] = pair[idx + half, idx + half] = pair[idx, idx + half] = pair[idx + half, idx] = 1.0

    def entry_error(position: int) -> Tensor:  # (d_k, d_k): E_position
        rho = rope_angle_error(torch.tensor([float(position)], dtype=f64), d_k, base)[0] + torch.finfo(f64).eps  # (d_k/2,)
        return pair * torch.cat([rho, rho])[:, None]

    r_p, r_j = rope_rotation(p, d_k, base).abs(), rope_rotation(j, d_k, base).abs()  # (d_k, d_k)
    e_p, e_j = entry_error(p), entry_error(j)
    core = _gamma(d_k + 4, f64) * r_p @ r_j.T + e_p @ r_j.T + r_p @ e_j.T + e_p @ e_j.T  # (d_k, d_k)
    info = torch.finfo(f64)
    eta = info.eps * info.smallest_normal  # the subnormals' spacing: underflow, per rounding
    ones = torch.ones(1, d_k, dtype=f64)
    underflow = eta * (2 * ones @ r_j.T @ w_k.abs().T + 2 * ones @ w_k.abs().T + 2 * d_k)  # (1, d_model)
    return w_q.abs() @ core @ w_k.abs().T + underflow  # (d_model, d_model)
