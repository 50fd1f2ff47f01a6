r"""Attention in a decoder today: rotary positions, the KV cache and latent attention (chapter 8).

Three pieces that a modern decoder adds to the attention of chapters 1-5:

- **RoPE** (rotary position embedding, Su et al. 2021): queries and keys are rotated by
  an angle proportional to their position, so that the score of query ``i`` and key ``j``
  depends on ``j - i`` only. attnlib uses the "rotate-half" layout of Llama in Hugging Face
  ``transformers``: dimension ``j`` is paired with dimension ``j + d_k/2`` and turned by
  the angle :math:`p\,\omega_j`, :math:`\omega_j = \text{base}^{-2j/d_k}`.
- **The KV cache** (:class:`KVCache`): when a decoder generates token ``n``, the keys and
  values of tokens ``0..n-1`` have not changed, so they are kept instead of recomputed.
  :class:`attnlib.MultiHeadAttention` fills and reads it (``mha(x, x, x, cache=cache)``).
- **Multi-head latent attention** (:class:`LatentAttention`, DeepSeek-AI 2024,
  "DeepSeek-V2", section 2.1): the cache holds one latent vector
  :math:`c_j = x_j W^{DKV}` per token instead of ``h`` keys and ``h`` values; with
  :math:`W^{UK}` folded into the queries and :math:`W^{UV}` into :math:`W^O`, attention
  reads the latents directly and never forms the keys.

Orientation as everywhere in attnlib: row vectors, ``x @ W``, masks boolean with
``True`` = may attend.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlib._core import check_head_mask, check_positive_int, check_tensor, format_shape
from attnlib.attention import masked_softmax

__all__ = [
    "rope_inv_freq",
    "rope_angles",
    "rotate_half",
    "apply_rope",
    "rope_rotation",
    "causal_mask",
    "KVCache",
    "LatentCache",
    "LatentAttention",
    "kv_cache_bytes_per_token",
    "latent_cache_bytes_per_token",
    "GroupedAttentionWeights",
]


# ---- RoPE -----------------------------------------------------------------------------------


def _check_width(value: object, name: str, *, even: bool = False, zero_ok: bool = False) -> int:
    """``value`` if it is an int >= 1 (>= 0 with ``zero_ok``; even with ``even``):
    ``TypeError`` for a non-int (``True`` included), ``ValueError`` for a wrong value."""
    if zero_ok and type(value) is int and value == 0:
        return 0
    if zero_ok and type(value) is int and value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    value = check_positive_int(name, value)
    if even and value % 2:
        raise ValueError(
            f"{name} must be even for RoPE (dimension j is paired with j + {name}/2), got {value}"
        )
    return value


def _check_base(base: object, name: str = "base") -> float:
    """RoPE's theta as a float: ``TypeError`` for a non-number, ``ValueError`` unless > 1."""
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise TypeError(f"{name} (RoPE's theta) must be a number, got {type(base).__name__} {base!r}")
    if not base > 1:
        raise ValueError(f"{name} (RoPE's theta) must be > 1, got {base!r}")
    return float(base)


def _angle_dtype(device: torch.device) -> torch.dtype:
    """float64 for the angles where the device has it (MPS does not)."""
    return torch.float32 if device.type == "mps" else torch.float64


def rope_inv_freq(
    d_k: int,
    base: float = 10000.0,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    r"""RoPE's angular frequencies :math:`\omega_j = \text{base}^{-2j/d_k}`, ``j = 0..d_k/2-1``.

    Pair ``j`` (dimensions ``j`` and ``j + d_k/2``) turns by :math:`p\,\omega_j` at
    position ``p``: the first pair once per position (:math:`\omega_0 = 1` radian), the
    last pair slowest. Hugging Face's ``LlamaRotaryEmbedding`` calls this ``inv_freq``.

    Returns:
        ``(d_k/2,)``.

    Raises:
        ValueError: ``d_k`` not a positive even int; ``base`` not a number > 1.
    """
    _check_width(d_k, "d_k", even=True)
    base = _check_base(base)
    j = torch.arange(0, d_k, 2, device=device, dtype=dtype)  # (d_k/2,): 2j
    return 1.0 / (base ** (j / d_k))  # (d_k/2,)


def rope_angles(positions: Tensor, d_k: int, base: float = 10000.0) -> Tensor:
    r"""The rotation angles :math:`\theta_{p,j} = p\,\omega_j` of RoPE.

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
    dtype = _angle_dtype(positions.device)
    inv_freq = rope_inv_freq(d_k, base, device=positions.device, dtype=dtype)  # (d_k/2,)
    return positions.to(dtype)[..., None] * inv_freq  # (..., n, d_k/2)


def rotate_half(x: Tensor) -> Tensor:
    """``(x_1, x_2) -> (-x_2, x_1)`` on the two halves of the last dimension, ``(..., d)``.

    This is Hugging Face's ``rotate_half``: with it, RoPE is
    ``x * cos + rotate_half(x) * sin``, a rotation of each pair ``(x_j, x_{j + d/2})``.
    """
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (..., d)


def apply_rope(x: Tensor, positions: Tensor | None = None, base: float = 10000.0) -> Tensor:
    r"""Rotary position embedding of the rows of ``x`` (rotate-half layout, as Llama).

    Row ``p`` (at position ``p``) has each pair :math:`(x_j, x_{j+d_k/2})` turned by the
    angle :math:`p\,\omega_j`, :math:`\omega_j = \text{base}^{-2j/d_k}`:

    .. math::
        \mathrm{RoPE}(x, p)_j = x_j \cos p\omega_j - x_{j+d_k/2} \sin p\omega_j, \qquad
        \mathrm{RoPE}(x, p)_{j+d_k/2} = x_{j+d_k/2} \cos p\omega_j + x_j \sin p\omega_j .

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
    _check_width(d_k, "d_k (the last dimension of x)", even=True)
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
    angles = torch.cat((angles, angles), dim=-1)  # (..., n, d_k): pair j and j + d_k/2 share an angle
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
        (R_p)_{j,j} = (R_p)_{j+d_k/2,\,j+d_k/2} = \cos p\omega_j, \quad
        (R_p)_{j,\,j+d_k/2} = \sin p\omega_j, \quad (R_p)_{j+d_k/2,\,j} = -\sin p\omega_j .

    :math:`R_p R_s^\top = R_{p-s}` and :math:`R_0 = I`.
    """
    if isinstance(position, bool) or not isinstance(position, (int, float)):
        raise TypeError(f"position must be an int or float, got {type(position).__name__} {position!r}")
    angle_dtype = _angle_dtype(torch.device(device) if device is not None else torch.device("cpu"))
    theta = position * rope_inv_freq(d_k, base, device=device, dtype=angle_dtype)  # (d_k/2,)
    cos, sin = theta.cos(), theta.sin()  # (d_k/2,)
    half = d_k // 2
    r = torch.zeros(d_k, d_k, device=device, dtype=angle_dtype)  # (d_k, d_k)
    idx = torch.arange(half, device=device)
    r[idx, idx] = cos
    r[idx + half, idx + half] = cos
    r[idx, idx + half] = sin
    r[idx + half, idx] = -sin
    return r.to(dtype)


def causal_mask(n_q: int, n_k: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """The causal mask for ``n_q`` new queries that follow ``n_k - n_q`` cached positions.

    Query ``i`` sits at absolute position ``n_k - n_q + i`` and may attend to keys
    ``j <= n_k - n_q + i``: row ``i`` allows the first ``n_k - n_q + i + 1`` keys. With
    ``n_k = n_q`` (the default) this is the lower triangle, ``tril``.

    Returns:
        bool ``(n_q, n_k)``, ``True`` = may attend.

    Raises:
        ValueError: ``n_q`` not a positive int, or ``n_k`` not an int ``>= n_q``.
    """
    _check_width(n_q, "n_q")
    if n_k is None:
        n_k = n_q
    _check_width(n_k, "n_k")
    if n_k < n_q:
        raise ValueError(f"n_k ({n_k}) must be >= n_q ({n_q}): the queries are the last n_q of the n_k positions")
    q_pos = torch.arange(n_k - n_q, n_k, device=device)  # (n_q,) absolute positions
    return torch.arange(n_k, device=device)[None, :] <= q_pos[:, None]  # (n_q, n_k)


def kv_cache_bytes_per_token(
    num_kv_heads: int, d_k: int, d_v: int | None = None, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes a KV cache holds per token, per layer and sequence: ``g * (d_k + d_v) * itemsize``.

    With ``g = num_kv_heads = h`` (MHA), ``d_k = d_v = d_model / h`` this is
    ``2 * d_model * itemsize``; GQA divides it by ``h / g``; MQA is ``g = 1``.
    """
    _check_width(num_kv_heads, "num_kv_heads")
    _check_width(d_k, "d_k")
    d_v = d_k if d_v is None else _check_width(d_v, "d_v")
    return num_kv_heads * (d_k + d_v) * _itemsize(dtype)


def latent_cache_bytes_per_token(d_c: int, d_r: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes an MLA cache holds per token, per layer and sequence: ``(d_c + d_r) * itemsize``
    (one latent of width ``d_c`` and one shared RoPE key of width ``d_r``)."""
    _check_width(d_c, "d_c")
    _check_width(d_r, "d_r", zero_ok=True)
    return (d_c + d_r) * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


# ---- grouped weights ----------------------------------------------------------------------


@dataclass(frozen=True)
class GroupedAttentionWeights:
    """Multi-head attention with grouped keys and values (GQA/MQA) and optional RoPE,
    paper orientation (each weight used as ``x @ w``).

    ``w_q``: ``(d_model, h*d_k)``, ``w_k``, ``w_v``: ``(d_model, g*d_k)``,
    ``w_o``: ``(h*d_k, d_model)`` with ``h*d_k = d_model``, ``h = num_heads``,
    ``g = num_kv_heads`` dividing ``h``; biases ``(h*d_k,)`` / ``(g*d_k,)`` / ``(d_model,)``,
    all four or none. Query head ``i`` reads key/value group ``i // (h/g)``.
    ``rope_base``: RoPE's theta, or ``None`` for no RoPE.
    """

    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    w_o: Tensor
    num_heads: int
    num_kv_heads: int
    b_q: Tensor | None = None
    b_k: Tensor | None = None
    b_v: Tensor | None = None
    b_o: Tensor | None = None
    rope_base: float | None = None

    def __post_init__(self) -> None:
        h = check_positive_int("num_heads", self.num_heads)
        g = check_positive_int("num_kv_heads", self.num_kv_heads)
        if h % g:
            raise ValueError(f"num_kv_heads ({g}) must divide num_heads ({h})")
        for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
            if not (name.startswith("b_") and getattr(self, name) is None):
                check_tensor(name, getattr(self, name))
        if self.w_q.dim() != 2 or self.w_q.shape[0] != self.w_q.shape[1]:
            raise ValueError(f"w_q must have shape (d_model, d_model) (h*d_k = d_model), got {format_shape(self.w_q)}")
        d = int(self.w_q.shape[0])
        if d % h:
            raise ValueError(f"d_model ({d}) must be divisible by num_heads ({h})")
        d_kv = g * (d // h)
        expected = {
            "w_k": (d, d_kv), "w_v": (d, d_kv), "w_o": (d, d),
            "b_q": (d,), "b_k": (d_kv,), "b_v": (d_kv,), "b_o": (d,),
        }
        for name, shape in expected.items():
            t = getattr(self, name)
            if name.startswith("b_") and t is None:
                continue
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} must have shape {format_shape(shape)} for d_model={d}, num_heads={h}, "
                    f"num_kv_heads={g}, got {format_shape(t)}"
                )
        has_bias = [getattr(self, n) is not None for n in ("b_q", "b_k", "b_v", "b_o")]
        if any(has_bias) and not all(has_bias):
            raise ValueError("biases must be given for all four projections or for none")
        if self.rope_base is not None:
            _check_base(self.rope_base, "rope_base")

    @property
    def d_model(self) -> int:
        return int(self.w_q.shape[0])

    @property
    def bias(self) -> bool:
        return self.b_q is not None


# ---- caches ---------------------------------------------------------------------------------


class _Cache:
    """Per-layer store of tensors that grow along a sequence dimension (base class).

    Subclasses name their tensors (``_names``) and where the sequence axis sits
    (``_seq_dim``). The cache remembers the module that first filled it and refuses any
    other, and refuses a batch size, dtype or device other than the one it holds.
    """

    _names: tuple[str, ...] = ()
    _seq_dim: int = 0
    _kind: str = "cache"
    _shapes: dict[str, str] = {}  # name -> its shape, for messages
    _lead: str = ""  # the dimensions up to the sequence axis, shared by all tensors

    def __init__(self) -> None:
        self._tensors: dict[str, Tensor] = {}
        self._owner: weakref.ReferenceType[nn.Module] | None = None

    def __len__(self) -> int:
        """The number of cached positions ``n``."""
        if not self._tensors:
            return 0
        return int(self._tensors[self._names[0]].shape[self._seq_dim])

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached tensors (nothing else counted)."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def batch_size(self) -> int | None:
        """``B`` of the cached tensors; ``None`` while empty."""
        return None if not self._tensors else int(self._tensors[self._names[0]].shape[0])

    @property
    def dtype(self) -> torch.dtype | None:
        """The cached tensors' dtype; ``None`` while empty."""
        return None if not self._tensors else self._tensors[self._names[0]].dtype

    @property
    def device(self) -> torch.device | None:
        """The cached tensors' device; ``None`` while empty."""
        return None if not self._tensors else self._tensors[self._names[0]].device

    def clear(self) -> None:
        """Empty the cache and release it from its module (it may then serve another)."""
        self._tensors = {}
        self._owner = None

    def _get(self, name: str) -> Tensor | None:
        return self._tensors.get(name)

    def _check(self, module: nn.Module, batch_size: int, dtype: torch.dtype | None, device: torch.device) -> None:
        """Raise unless a call of ``module`` with this batch, dtype and device may use the cache.

        ``dtype=None`` skips the dtype: a module checking before it projects passes it, because
        under ``torch.autocast`` float32 inputs give bfloat16 (or float16) keys; ``update``
        then checks the dtype of what is actually stored."""
        if self._owner is not None:
            owner = self._owner()
            if owner is None:
                raise ValueError(
                    f"this {self._kind} was filled by a module that no longer exists (it was "
                    f"garbage-collected); call cache.clear() to use the cache with another module"
                )
            if owner is not module:
                raise ValueError(
                    f"this {self._kind} holds the keys of another module ({type(owner).__name__}); "
                    f"use one cache per attention layer, or call cache.clear() first"
                )
        if self._tensors:
            if batch_size != self.batch_size:
                raise ValueError(
                    f"batch size {batch_size} does not match the {self._kind}'s batch size {self.batch_size}"
                )
            if dtype is not None and dtype != self.dtype:
                raise ValueError(
                    f"dtype {dtype} does not match the {self._kind}'s dtype {self.dtype}: make every call "
                    f"with one cache in one dtype (under torch.autocast: every call under the same autocast)"
                )
            if device != self.device:
                raise ValueError(f"device {device} does not match the {self._kind}'s device {self.device}")

    def _check_new(self, **new: Tensor) -> None:
        """Raise unless the new tensors have their rank and agree up to the sequence axis."""
        for name, t in new.items():
            if check_tensor(name, t).dim() != self._seq_dim + 2:
                raise ValueError(f"{name} must have shape {self._shapes[name]}, got {format_shape(t)}")
        (a, ta), (b, tb) = new.items()
        lead = self._seq_dim + 1
        if ta.shape[:lead] != tb.shape[:lead]:
            raise ValueError(
                f"{a} of shape {format_shape(ta)} and {b} of shape {format_shape(tb)} must have the "
                f"same {self._lead}: one entry of each per position"
            )

    def _append(self, module: nn.Module, **new: Tensor) -> dict[str, Tensor]:
        """Append ``new`` (checked by the caller) along the sequence axis; return the totals."""
        if self._tensors:
            self._tensors = {k: torch.cat([self._tensors[k], new[k]], dim=self._seq_dim) for k in self._names}
        else:
            # copies: a view (say of a packed q|k|v projection) would keep its whole base alive
            self._tensors = {k: new[k].clone(memory_format=torch.contiguous_format) for k in self._names}
            self._owner = weakref.ref(module)
        return dict(self._tensors)

    def __repr__(self) -> str:
        if not self._tensors:
            return f"{type(self).__name__}(empty)"
        shapes = ", ".join(f"{k}={format_shape(t)}" for k, t in self._tensors.items())
        return f"{type(self).__name__}(len={len(self)}, {shapes}, dtype={self.dtype})"


class KVCache(_Cache):
    r"""The keys and values of the positions seen so far, for one attention layer.

    Use one empty cache per layer and pass it to every call of that layer::

        cache = KVCache()
        out, w = mha(prompt, prompt, prompt, cache=cache)  # prefill: (B, t, d_model)
        out, w = mha(x_t, x_t, x_t, cache=cache)           # one step: (B, 1, d_model)

    Each call appends the new tokens' keys (after RoPE) and values, and the new queries
    attend causally to everything cached, so a prefill followed by one-token steps gives
    the same outputs as one causal pass over the whole sequence.

    Attributes:
        keys: ``(B, g, n, d_k)`` or ``None`` while empty (``g`` = the layer's ``num_kv_heads``).
        values: ``(B, g, n, d_v)`` or ``None``.

    ``len(cache)`` is ``n``; ``cache.nbytes`` is ``2 B n g d_k`` times the item size
    (``d_v = d_k``): the keys and values, nothing else. The cache holds the dtype the
    projections produce: under ``torch.autocast(..., torch.bfloat16)`` bfloat16, for
    float32 inputs; every call with one cache must then run under that autocast.
    """

    _names = ("keys", "values")
    _seq_dim = 2
    _kind = "KVCache"
    _shapes = {"keys": "(B, g, t, d_k)", "values": "(B, g, t, d_v)"}
    _lead = "(B, g, t)"

    @property
    def keys(self) -> Tensor | None:
        """``(B, g, n, d_k)``, after RoPE; ``None`` while empty."""
        return self._get("keys")

    @property
    def values(self) -> Tensor | None:
        """``(B, g, n, d_v)``; ``None`` while empty."""
        return self._get("values")

    def update(self, module: nn.Module, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``keys`` ``(B, g, t, d_k)`` and ``values`` ``(B, g, t, d_v)`` for ``module``;
        return all cached keys and values ``(B, g, n + t, .)``.

        Raises:
            ValueError: keys and values of other ranks or of different ``(B, g, t)``;
                another module filled the cache (or it was garbage-collected); batch size,
                dtype, device or head shape differ from what the cache holds.
        """
        self._check_new(keys=keys, values=values)
        self._check(module, keys.shape[0], keys.dtype, keys.device)
        if self._tensors:
            for name, t in (("keys", keys), ("values", values)):
                old = self._tensors[name]
                if t.shape[1] != old.shape[1] or t.shape[3] != old.shape[3]:
                    raise ValueError(
                        f"new {name} of shape {format_shape(t)} do not fit the cached {name} of shape {format_shape(old)}"
                    )
        total = self._append(module, keys=keys, values=values)
        return total["keys"], total["values"]


class LatentCache(_Cache):
    r"""What multi-head latent attention caches per token: a latent and a RoPE key.

    Attributes:
        latents: ``(B, n, d_c)``, :math:`c_j = x_j W^{DKV}`; ``None`` while empty.
        rope_keys: ``(B, n, d_r)``, :math:`k^R_j = \mathrm{RoPE}(x_j W^{KR}, j)`, shared
            by all heads; ``None`` while empty.

    ``cache.nbytes`` is ``B n (d_c + d_r)`` times the item size. Used by
    :class:`LatentAttention` as :class:`KVCache` is used by ``MultiHeadAttention``, with
    the same rules.
    """

    _names = ("latents", "rope_keys")
    _seq_dim = 1
    _kind = "LatentCache"
    _shapes = {"latents": "(B, t, d_c)", "rope_keys": "(B, t, d_r)"}
    _lead = "(B, t)"

    @property
    def latents(self) -> Tensor | None:
        """``(B, n, d_c)``; ``None`` while empty."""
        return self._get("latents")

    @property
    def rope_keys(self) -> Tensor | None:
        """``(B, n, d_r)``, after RoPE; ``None`` while empty."""
        return self._get("rope_keys")

    def update(self, module: nn.Module, latents: Tensor, rope_keys: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``latents`` ``(B, t, d_c)`` and ``rope_keys`` ``(B, t, d_r)``; return all."""
        self._check_new(latents=latents, rope_keys=rope_keys)
        self._check(module, latents.shape[0], latents.dtype, latents.device)
        total = self._append(module, latents=latents, rope_keys=rope_keys)
        return total["latents"], total["rope_keys"]


def _check_cache_call(cache: object, cls: type[_Cache], mask: Tensor | None) -> None:
    """Raise unless ``cache`` is a ``cls`` and no mask came with it."""
    if not isinstance(cache, cls):
        raise TypeError(f"cache must be an attnlib.{cls.__name__} (or None), got {type(cache).__name__}")
    if mask is not None:
        raise ValueError(
            "mask cannot be combined with cache: a call with a cache is causal over the cached "
            "and new positions, and takes no other mask"
        )


# ---- multi-head latent attention ------------------------------------------------------------


class LatentAttention(nn.Module):
    r"""Multi-head latent attention (MLA) of DeepSeek-V2 (DeepSeek-AI 2024, section 2.1).

    Every token ``j`` is compressed to one latent :math:`c_j = x_j W^{DKV}` of width
    :math:`d_c`, from which all heads' keys and values are up-projected:

    .. math::
        k^C_{j,i} = c_j W^{UK}_i, \qquad v_{j,i} = c_j W^{UV}_i, \qquad
        k^R_j = \mathrm{RoPE}(x_j W^{KR}, j),

    and head ``i`` of query ``t`` has a content part :math:`q^C_{t,i} = x_t W^Q_i` and a
    rotary part :math:`q^R_{t,i} = \mathrm{RoPE}(x_t W^{QR}_i, t)`. The score is

    .. math::
        s_{t,j,i} = \frac{q^C_{t,i} \cdot k^C_{j,i} + q^R_{t,i} \cdot k^R_j}{\sqrt{d_k + d_r}},

    and the output :math:`\sum_i (\mathrm{softmax}_j s_{t,j,i})\, v_{j,i}\, W^O_i`. The cache
    (:class:`LatentCache`) holds :math:`c_j` and the shared :math:`k^R_j` only:
    :math:`d_c + d_r` numbers per token instead of :math:`2 h d_k`.

    **Absorption.** :math:`q^C_{t,i} \cdot k^C_{j,i} = (q^C_{t,i} W^{UK\top}_i) \cdot c_j`, so
    with :math:`W^{UK}_i` folded into the query side the scores read the latents directly;
    and :math:`\sum_j a_j v_{j,i} W^O_i = (\sum_j a_j c_j)(W^{UV}_i W^O_i)`, so :math:`W^{UV}_i`
    folds into :math:`W^O_i`. ``absorb=True`` computes that way and never forms a key or
    value of a cached token; ``absorb=False`` up-projects the cache to K and V. Both give the
    same function. All heads then read the same latents and the same rotary key, which
    makes the absorbed form multi-query attention in latent space.
    The rotary part cannot be absorbed (its rotation depends on the position), which is
    why DeepSeek-V2 keeps it as a separate, shared key of width :math:`d_r`.

    Left out from DeepSeek-V2: the low-rank compression of the queries (it saves training
    activations, not cache) and the RMSNorm the released code applies to the latent.

    Parameters (each used as ``x @ W``; no biases):

    - ``w_q``: ``(d_model, h*d_k)``, :math:`W^Q`; ``w_qr``: ``(d_model, h*d_r)``, :math:`W^{QR}`
    - ``w_dkv``: ``(d_model, d_c)``, :math:`W^{DKV}`; ``w_kr``: ``(d_model, d_r)``, :math:`W^{KR}`
    - ``w_uk``: ``(d_c, h*d_k)``, :math:`W^{UK}`; ``w_uv``: ``(d_c, h*d_v)``, :math:`W^{UV}`
    - ``w_o``: ``(h*d_v, d_model)``, :math:`W^O`

    Head ``i`` owns columns ``i*d_k:(i+1)*d_k`` (``i*d_r:..``, ``i*d_v:..``) of the
    per-head matrices and rows ``i*d_v:(i+1)*d_v`` of ``w_o``.

    Args:
        d_model: model width.
        num_heads: ``h``.
        d_c: latent width (DeepSeek-V2: 512 for ``d_model`` = 5120, ``h`` = 128).
        d_r: width of the rotary query/key parts (DeepSeek-V2: 64); even; 0 = no RoPE.
        d_k: content width of a query/key head; default ``d_model // num_heads``.
        d_v: value width of a head; default ``d_k``.
        rope_base: RoPE's :math:`\theta`.

    Call: ``out, weights = mla(x, mask=None, need_weights=True, *, cache=None, absorb=False)``

    - ``x``: ``(B, t, d_model)`` (self-attention only)
    - ``mask``: bool, ``(t,)``, ``(t, t)`` or ``(B or 1, h or 1, t, t)`` (3-D refused, as
      for :class:`attnlib.MultiHeadAttention`); not allowed with ``cache``
    - ``cache``: a :class:`LatentCache`; the call appends the ``t`` new tokens and attends
      causally over all cached positions (positions continue from ``len(cache)``)
    - ``out``: ``(B, t, d_model)``; ``weights``: ``(B, h, t, n_k)``, or ``None`` when
      ``need_weights=False``, which takes PyTorch's fused ``scaled_dot_product_attention``
      (absorbed: one shared key ``[c_j | k^R_j]`` and value ``c_j`` for all heads)

    Initialisation: each matrix Xavier-uniform.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_c: int,
        d_r: int,
        *,
        d_k: int | None = None,
        d_v: int | None = None,
        rope_base: float = 10000.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("num_heads", num_heads)
        _check_width(d_c, "d_c")
        _check_width(d_r, "d_r", even=True, zero_ok=True)
        if d_k is None:
            if d_model % num_heads:
                raise ValueError(
                    f"d_model ({d_model}) must be divisible by num_heads ({num_heads}) when d_k is not given"
                )
            d_k = d_model // num_heads
        _check_width(d_k, "d_k")
        d_v = d_k if d_v is None else _check_width(d_v, "d_v")
        self.rope_base = _check_base(rope_base, "rope_base")
        self.d_model, self.num_heads, self.d_c, self.d_r, self.d_k, self.d_v = d_model, num_heads, d_c, d_r, d_k, d_v
        h = num_heads
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.w_q = nn.Parameter(torch.empty(d_model, h * d_k, **kw))  # (d_model, h*d_k)
        self.w_qr = nn.Parameter(torch.empty(d_model, h * d_r, **kw))  # (d_model, h*d_r)
        self.w_dkv = nn.Parameter(torch.empty(d_model, d_c, **kw))  # (d_model, d_c)
        self.w_kr = nn.Parameter(torch.empty(d_model, d_r, **kw))  # (d_model, d_r)
        self.w_uk = nn.Parameter(torch.empty(d_c, h * d_k, **kw))  # (d_c, h*d_k)
        self.w_uv = nn.Parameter(torch.empty(d_c, h * d_v, **kw))  # (d_c, h*d_v)
        self.w_o = nn.Parameter(torch.empty(h * d_v, d_model, **kw))  # (h*d_v, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights (empty ``d_r = 0`` matrices are left as they are)."""
        for w in (self.w_q, self.w_qr, self.w_dkv, self.w_kr, self.w_uk, self.w_uv, self.w_o):
            if w.numel():
                nn.init.xavier_uniform_(w)

    @property
    def w_q_absorbed(self) -> Tensor:
        r"""``(h, d_model, d_c)``: :math:`W^Q_i (W^{UK}_i)^\top`, head ``i``'s query map into
        latent space (a computed product, not a parameter)."""
        h = self.num_heads
        w_q = self.w_q.view(self.d_model, h, self.d_k).transpose(0, 1)  # (h, d_model, d_k)
        w_uk = self.w_uk.view(self.d_c, h, self.d_k).transpose(0, 1)  # (h, d_c, d_k)
        return w_q @ w_uk.transpose(1, 2)  # (h, d_model, d_c)

    @property
    def w_o_absorbed(self) -> Tensor:
        r"""``(h, d_c, d_model)``: :math:`W^{UV}_i W^O_i`, head ``i``'s map from a mixture of
        latents to the output (a computed product, not a parameter)."""
        h = self.num_heads
        w_uv = self.w_uv.view(self.d_c, h, self.d_v).transpose(0, 1)  # (h, d_c, d_v)
        w_o = self.w_o.view(h, self.d_v, self.d_model)  # (h, d_v, d_model)
        return w_uv @ w_o  # (h, d_c, d_model)

    def cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """``(d_c + d_r) * itemsize``: what :class:`LatentCache` holds per token and sequence."""
        return latent_cache_bytes_per_token(self.d_c, self.d_r, dtype or self.w_q.dtype)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = True,
        *,
        cache: LatentCache | None = None,
        absorb: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        check_tensor("x", x)
        if x.dim() != 3 or x.shape[-1] != self.d_model or x.shape[1] == 0:
            raise ValueError(f"x must have shape (B, t, d_model={self.d_model}) with t >= 1, got {format_shape(x)}")
        if x.dtype != self.w_q.dtype:
            raise ValueError(f"x has dtype {x.dtype} but the module's weights have dtype {self.w_q.dtype}")
        B, t, _ = x.shape
        h, d_k, d_r, d_v, d_c = self.num_heads, self.d_k, self.d_r, self.d_v, self.d_c
        past = 0
        if cache is not None:
            _check_cache_call(cache, LatentCache, mask)
            cache._check(self, B, None, x.device)  # dtype: in update, after autocast
            past = len(cache)
        elif mask is not None:
            check_head_mask(mask, torch.Size([B, h, t, t]))
        positions = torch.arange(past, past + t, device=x.device)  # (t,)
        c = x @ self.w_dkv  # (B, t, d_c): the latents
        k_r = x @ self.w_kr  # (B, t, d_r)
        q_c = (x @ self.w_q).view(B, t, h, d_k).transpose(1, 2)  # (B, h, t, d_k)
        q_r = (x @ self.w_qr).view(B, t, h, d_r).transpose(1, 2)  # (B, h, t, d_r)
        if d_r:
            k_r = apply_rope(k_r, positions, self.rope_base)  # (B, t, d_r)
            q_r = apply_rope(q_r, positions, self.rope_base)  # (B, h, t, d_r)
        if cache is not None:
            c, k_r = cache.update(self, c, k_r)  # (B, n, d_c), (B, n, d_r)
            mask = causal_mask(t, past + t, device=x.device)  # (t, n)
        n = c.shape[1]
        scale = 1.0 / math.sqrt(d_k + d_r)
        weights: Tensor | None = None
        if not need_weights:
            heads = self._fused(q_c, q_r, c, k_r, mask, absorb, scale)  # (B, h, t, d_v)
        else:
            # The rotary key and (absorbed) the latent are shared by all heads, so the heads'
            # queries are stacked as rows of one (B, h*t, .) matrix, as in multi-query attention.
            rope_scores = (q_r.reshape(B, h * t, d_r) @ k_r.transpose(1, 2)).view(B, h, t, n)  # (B, h, t, n)
            if absorb:
                q_lat = torch.einsum("bhtd,chd->bhtc", q_c, self.w_uk.view(d_c, h, d_k))  # q^C_i W^UK_i^T
                scores = (q_lat.reshape(B, h * t, d_c) @ c.transpose(1, 2)).view(B, h, t, n)  # latents read directly
            else:
                k_c = (c @ self.w_uk).view(B, n, h, d_k).transpose(1, 2)  # (B, h, n, d_k)
                scores = q_c @ k_c.transpose(-2, -1)  # (B, h, t, n)
            scores = (scores + rope_scores) * scale  # (B, h, t, n)
            weights = masked_softmax(scores, mask)  # (B, h, t, n); plain softmax when mask is None
            if absorb:
                mixed = (weights.reshape(B, h * t, n) @ c).view(B, h, t, d_c)  # a mixture of latents per head
                # through W^UV_i W^O_i = w_o_absorbed[i], applied as two small products (cheaper
                # than forming the (d_c, d_model) products when t is small)
                heads = torch.einsum("bhtc,chv->bhtv", mixed, self.w_uv.view(d_c, h, d_v))  # (B, h, t, d_v)
            else:
                v = (c @ self.w_uv).view(B, n, h, d_v).transpose(1, 2)  # (B, h, n, d_v)
                heads = weights @ v  # (B, h, t, d_v)
        out = heads.transpose(1, 2).reshape(B, t, h * d_v) @ self.w_o  # (B, t, d_model)
        return out, weights

    def _fused(
        self, q_c: Tensor, q_r: Tensor, c: Tensor, k_r: Tensor, mask: Tensor | None, absorb: bool, scale: float
    ) -> Tensor:
        """The ``need_weights=False`` path: PyTorch's ``scaled_dot_product_attention`` on
        queries ``[q^C | q^R]`` and keys ``[k^C | k^R]`` (width ``d_k + d_r``), or, absorbed,
        ``[q^C W^UK^T | q^R]`` against the shared ``[c | k^R]`` (width ``d_c + d_r``) with the
        latents as values: one key/value head for all query heads, whose ``h*t`` queries are
        stacked as rows. Returns ``(B, h, t, d_v)``."""
        B, h, t, _ = q_c.shape
        n, d_c, d_k, d_v = c.shape[1], self.d_c, self.d_k, self.d_v
        if mask is not None and mask.dim() == 1:
            mask = mask.unsqueeze(0)  # (n,) -> (1, n): SDPA rejects a 1-D mask
        if absorb:
            q_lat = torch.einsum("bhtd,chd->bhtc", q_c, self.w_uk.view(d_c, h, d_k))  # (B, h, t, d_c)
            # one key/value head: the h heads' queries become h*t rows against the shared keys
            q = torch.cat([q_lat, q_r], dim=-1).reshape(B, 1, h * t, d_c + self.d_r)  # (B, 1, h*t, d_c + d_r)
            k = torch.cat([c, k_r], dim=-1)[:, None]  # (B, 1, n, d_c + d_r)
            v = c[:, None]  # (B, 1, n, d_c): the latents themselves
            if mask is not None:
                while mask.dim() < 4:
                    mask = mask.unsqueeze(0)  # -> (B or 1, h or 1, t or 1, n)
                mask = mask.expand(mask.shape[0], h, t, n).reshape(mask.shape[0], 1, h * t, n)
            mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (B, 1, h*t, d_c)
            mixed = mixed.view(B, h, t, d_c)  # (B, h, t, d_c)
            return torch.einsum("bhtc,chv->bhtv", mixed, self.w_uv.view(d_c, h, d_v))  # (B, h, t, d_v)
        k_c = (c @ self.w_uk).view(B, n, h, d_k).transpose(1, 2)  # (B, h, n, d_k)
        q = torch.cat([q_c, q_r], dim=-1)  # (B, h, t, d_k + d_r)
        k = torch.cat([k_c, k_r[:, None].expand(B, h, n, self.d_r)], dim=-1)  # (B, h, n, d_k + d_r)
        v = (c @ self.w_uv).view(B, n, h, d_v).transpose(1, 2)  # (B, h, n, d_v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (B, h, t, d_v)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, d_c={self.d_c}, d_r={self.d_r}, "
            f"d_k={self.d_k}, d_v={self.d_v}, rope_base={self.rope_base:g}"
        )
