r"""Rotary position embedding, RoPE (Su et al. 2021), in Llama's rotate-half layout (chapter 8).

Queries and keys are rotated by an angle proportional to their position, so that the
score of query ``i`` and key ``j`` depends on ``j - i`` only. Dimension ``l`` is paired
with dimension ``l + d_k/2`` and turned by the angle :math:`p\,\omega_\ell`,
:math:`\omega_\ell = \text{base}^{-2\ell/d_k}` (Hugging Face ``transformers``' Llama layout).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlib.checks import check_tensor, check_width, format_shape

__all__ = ["rope_inv_freq", "rope_angles", "rotate_half", "apply_rope", "rope_rotation",
           "check_rope_base", "angle_dtype"]


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

