"""The pieces every attnlib module shares; it imports nothing else from attnlib.

- :func:`format_shape`: shapes in error messages, written ``(2, 3, 4)``;
- the validators, one rule for every module:

  ``TypeError``
      an argument of the wrong type: not a tensor, not an int (a ``bool`` is
      not accepted as an int), not a number;
  ``ValueError``
      the right type with a wrong value: a shape, dtype or size that does not
      fit, a count below 1;
  ``IndexError``
      an index (a head, a layer) outside its range.

- :class:`AttentionWeights`, the four projections of a layer in paper
  orientation, with :class:`Biases` (all four or none) and the packing of
  ``[W^Q | W^K | W^V]`` (:func:`pack_qkv`, :func:`split_qkv`).

Every other module imports from here, and the imports form layers with no cycle:
``attention`` uses ``_core``; ``decoding`` (RoPE, the caches, grouped weights) uses
``attention``; ``multihead`` uses ``attention`` and ``decoding``; ``interop`` uses
``_core`` and ``decoding``; ``lowrank``, ``recall`` and ``audit`` use ``multihead``;
``pretrained`` uses ``interop`` and ``multihead``; ``blockwise`` uses ``attention``;
``explorers`` uses ``lowrank`` and ``blockwise``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import warnings

import torch
from torch import Tensor, nn

__all__ = [
    "rounding_tolerance",
    "assert_rounding_close",
    "format_shape",
    "check_tensor",
    "check_positive_int",
    "check_width",
    "check_index",
    "check_mask",
    "check_head_mask",
    "check_heads",
    "check_attention_inputs",
    "check_plain",
    "Biases",
    "AttentionWeights",
    "pack_qkv",
    "split_qkv",
    "read_torch_mha",
    "write_torch_mha",
]


# ---- rounding ---------------------------------------------------------------------
def rounding_tolerance(dtype: torch.dtype, *widths: int) -> float:
    r"""How far two evaluations of the same computation may drift apart by rounding.

    An inner product of length :math:`n` computed in floating point, in any order, is
    off by at most :math:`\gamma_n = n u / (1 - n u) \approx n u` relative to
    :math:`\sum_i |x_i y_i|` (:math:`u` = unit roundoff = ``eps / 2``; Higham,
    *Accuracy and Stability of Numerical Algorithms*, 2002, section 3.1). A chain of
    such products, one after another (a projection of width ``d_model``, then scores
    of width ``d_k``, ...), adds their lengths to first order. Two implementations
    that sum in different orders (another CPU, BLAS or thread count) are each that
    close to the exact result, so they differ by at most

    .. math::  2u \sum_j n_j = \varepsilon \sum_j n_j \quad (\varepsilon = \texttt{eps}),

    relative to the size of the terms. This is a worst case, not a typical error:
    measured gaps are usually far smaller, and a tolerance derived this way does not
    depend on the machine it was written on.

    Args:
        dtype: a floating dtype, e.g. ``torch.float32``.
        widths: the lengths of the inner products along the computation's path, one
            per step (at least one, each at least 1).

    Returns ``eps(dtype) * sum(widths)``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not widths:
        raise ValueError("widths must name at least one inner-product length, got none")
    for i, w in enumerate(widths):
        _check_int(f"widths[{i}]", w, "a positive int")
        if w < 1:
            raise ValueError(f"widths[{i}] must be at least 1, got {w}")
    return torch.finfo(dtype).eps * sum(widths)


def assert_rounding_close(
    actual: Tensor, expected: Tensor, *widths: int, dtype: torch.dtype | None = None
) -> float:
    r"""Assert that two evaluations of one computation agree to rounding; the bound used.

    The bound is :func:`rounding_tolerance` of ``dtype`` (by default the coarser of the
    two tensors' dtypes; pass ``torch.float32`` where a float64 tensor went through a
    float32 step, as Hugging Face's softmax does) and ``widths``, times
    the size of the numbers, :math:`\max |\text{expected}|` (at least 1e-30):
    ``|actual - expected| <= eps * sum(widths) * max|expected|`` elementwise. Use it
    where two implementations (another library, another order of the same sums) are
    compared in float32: the tolerance follows from the computation, not from the
    machine it was first run on. It is a first-order tolerance relative to the size of
    the result: where the terms are much larger than the result (cancellation, or a
    softmax over large scores), a worst-case bound must use the size of the terms
    instead, as chapter 6 does.

    Shapes: ``actual`` and ``expected`` of one shape. Returns the bound, so that a
    page can print it.
    """
    actual, expected = check_tensor("actual", actual), check_tensor("expected", expected)
    if actual.shape != expected.shape:
        raise ValueError(f"actual and expected must have one shape, got "
                         f"{format_shape(actual)} and {format_shape(expected)}")
    coarser = dtype if dtype is not None else min(
        (actual.dtype, expected.dtype), key=lambda d: torch.finfo(d).bits)
    size = max(expected.detach().abs().max().item(), 1e-30) if expected.numel() else 1.0
    bound = rounding_tolerance(coarser, *widths) * size
    gap = (actual.detach().to(expected.dtype) - expected.detach()).abs().max().item() \
        if expected.numel() else 0.0
    if not gap <= bound:  # also catches NaN
        raise AssertionError(
            f"actual and expected differ by {gap:.3g}, more than rounding allows: "
            f"eps({coarser}) x {sum(widths)} x max|expected| = {bound:.3g}")
    return bound


# ---- messages and validators ------------------------------------------------------
def format_shape(t: Tensor | torch.Size | tuple[int, ...]) -> str:
    """Format a shape as ``(2, 3, 4)`` (``(5,)`` for one dimension) for error messages."""
    dims = tuple(t.shape) if isinstance(t, Tensor) else tuple(t)
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def check_tensor(name: str, t: object) -> Tensor:
    """``t`` itself if it is a tensor; ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_int(name: str, value: object, expected: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1: ``TypeError`` for a non-int (``True`` included),
    ``ValueError`` for an int below 1."""
    n = _check_int(name, value, "a positive int")
    if n < 1:
        raise ValueError(f"{name} must be a positive int, got {n}")
    return n


def check_width(value: object, name: str, *, even: bool = False, zero_ok: bool = False) -> int:
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



def check_index(name: str, value: object, size: int, what: str) -> int:
    """``value`` if it is an int in ``[0, size)``: ``TypeError`` for a non-int
    (``True`` included), ``IndexError`` outside the range; ``what`` says what
    ``size`` counts, e.g. ``"num_heads=4"``."""
    i = _check_int(name, value, f"an int in [0, {size})")
    if not 0 <= i < size:
        raise IndexError(f"{name} must be an int in [0, {size}) for {what}, got {i}")
    return i


def check_heads(d_model: object, num_heads: object) -> int:
    """Validate a layer's sizes and return the head width ``d_k = d_model / num_heads``."""
    d = check_positive_int("d_model", d_model)
    h = check_positive_int("num_heads", num_heads)
    if d % h:
        raise ValueError(
            f"d_model ({d}) must be divisible by num_heads ({h}): "
            f"each head gets d_k = d_model / num_heads columns"
        )
    return d // h


def check_mask(mask: object, target: torch.Size, name: str = "mask") -> Tensor:
    """Return ``mask`` if it is boolean and broadcasts to ``target``; raise otherwise.

    Broadcasting may add or stretch size-1 dimensions of ``mask`` but must not
    change ``target``: a mask that would enlarge the score tensor is an error,
    not a silent broadcast.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of dtype torch.bool, "
            f"got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} must have dtype torch.bool (True = may attend), got {name} "
            f"of shape {format_shape(mask)} and dtype {mask.dtype}; convert an additive "
            f"float mask with `{name} == 0` or a 0/1 mask with `{name}.bool()`"
        )
    try:
        broadcast = torch.broadcast_shapes(mask.shape, target)
    except RuntimeError:
        broadcast = None
    if broadcast != target:
        raise ValueError(
            f"{name} of shape {format_shape(mask)} does not broadcast to the scores' "
            f"shape {format_shape(target)}"
        )
    return mask


def check_head_mask(mask: object, target: torch.Size, name: str = "mask") -> Tensor:
    """:func:`check_mask` for the scores ``(B, h, n_q, n_k)`` of a multi-head layer:
    ``(n_k,)``, ``(n_q, n_k)`` or ``(B or 1, h or 1, n_q, n_k)``, never 3-D.

    A 3-D mask ``(X, n_q, n_k)`` would broadcast as ``(1, X, n_q, n_k)``: per head. Meant per
    sequence (``X = B``), it would hand sequence ``b``'s mask to head ``b`` of every sequence,
    silently when ``B = h``. So it is refused, with the two ways to write what was meant.
    """
    if isinstance(mask, Tensor) and mask.dim() == 3:
        raise ValueError(
            f"{name} of shape {format_shape(mask)} is 3-D, which is ambiguous for the scores' shape "
            f"(B, h, n_q, n_k) = {format_shape(target)}: write a per-sequence mask (B, n_q, n_k) as "
            f"{name}[:, None] and a per-head mask (h, n_q, n_k) as {name}[None]"
        )
    return check_mask(mask, target, name)


def check_plain(mha: object, user: str, rope_reason: str | None) -> None:
    """Raise ``ValueError`` if the layer ``mha`` has grouped keys/values, or RoPE (unless
    ``rope_reason`` is ``None``): ``user`` is defined for the plain layer of chapters
    2-5 only. Reads the attributes every attnlib layer has (``num_heads``,
    ``num_kv_heads``, ``rope_base``), so that a chapter-2 tool need not import
    chapter 8's class to refuse it."""
    rope_base = getattr(mha, "rope_base", None)
    if rope_reason is not None and rope_base is not None:
        raise ValueError(f"{user} is defined without RoPE, but this module has rope_base={rope_base:g}: {rope_reason}")
    h, g = getattr(mha, "num_heads", None), getattr(mha, "num_kv_heads", None)
    if g != h:
        raise ValueError(
            f"{user} is defined for one key/value head per query head, but this module has "
            f"num_kv_heads={g} < num_heads={h}: pass mha.expand_kv_heads(), "
            f"the same function with each group's keys and values repeated for its heads"
        )


def check_attention_inputs(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, d_model: int, num_heads: int
) -> None:
    """Shape checks of a multi-head layer's call: ``query`` ``(B, n_q, d_model)``, ``key``,
    ``value`` ``(B, n_k, d_model)``, ``mask`` for scores ``(B, h, n_q, n_k)``; errors name the argument."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if check_tensor(name, t).dim() != 3 or t.shape[-1] != d_model:
            n = "n_q" if name == "query" else "n_k"
            raise ValueError(f"{name} must have shape (B, {n}, d_model={d_model}), got {format_shape(t)}")
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must have the same batch size and length (B, n_k): "
            f"key has shape {format_shape(key)}, value has shape {format_shape(value)}"
        )
    if query.shape[0] != key.shape[0]:
        raise ValueError(
            f"query and key must have the same batch size B: query {format_shape(query)}, key {format_shape(key)}"
        )
    if key.shape[1] == 0:
        raise ValueError(f"key must hold at least one position, got {format_shape(key)}")
    if mask is not None:
        b, n_q, n_k = query.shape[0], query.shape[1], key.shape[1]
        check_head_mask(mask, torch.Size([b, num_heads, n_q, n_k]))


# ---- the weights of one layer -------------------------------------------------------
class Biases(NamedTuple):
    """The four biases of a layer, all present: ``q, k, v, o``: ``(d_model,)`` each."""

    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor


@dataclass(frozen=True)
class AttentionWeights:
    """The four projections of one multi-head attention layer, paper orientation.

    ``w_q, w_k, w_v``: ``(d_model, d_model)``, ``w_o``: ``(d_model, d_model)``, each
    used as ``x @ w``; biases ``(d_model,)`` or all ``None``. Head ``i`` owns columns
    ``i*d_k:(i+1)*d_k`` of ``w_q, w_k, w_v`` and rows ``i*d_v:(i+1)*d_v`` of ``w_o``.
    :attr:`biases` gives the four biases together (or ``None``).
    """

    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    w_o: Tensor
    b_q: Tensor | None = None
    b_k: Tensor | None = None
    b_v: Tensor | None = None
    b_o: Tensor | None = None

    def __post_init__(self) -> None:
        weights = {"w_q": self.w_q, "w_k": self.w_k, "w_v": self.w_v, "w_o": self.w_o}
        biases = {"b_q": self.b_q, "b_k": self.b_k, "b_v": self.b_v, "b_o": self.b_o}
        for name, t in weights.items():
            check_tensor(name, t)
        for name, b in biases.items():
            if b is not None:
                check_tensor(name, b)
        d_model = self.w_q.shape[0] if self.w_q.dim() == 2 else -1
        for name, t in weights.items():
            if t.shape != (d_model, d_model):
                raise ValueError(
                    f"{name} must have shape (d_model, d_model) = ({d_model}, {d_model}), "
                    f"got {format_shape(t)}"
                )
        for name, b in biases.items():
            if b is not None and b.shape != (d_model,):
                raise ValueError(f"{name} must have shape (d_model,) = ({d_model},), got {format_shape(b)}")
        present = [b is not None for b in biases.values()]
        if any(present) and not all(present):
            raise ValueError("biases must be given for all four projections or for none")

    @property
    def d_model(self) -> int:
        return int(self.w_q.shape[0])

    @property
    def bias(self) -> bool:
        return self.b_q is not None

    @property
    def biases(self) -> Biases | None:
        """The four biases together, or ``None`` when the layer has none."""
        if self.b_q is None or self.b_k is None or self.b_v is None or self.b_o is None:
            return None  # __post_init__ made it all or none
        return Biases(self.b_q, self.b_k, self.b_v, self.b_o)


def pack_qkv(weights: AttentionWeights) -> tuple[Tensor, Tensor | None]:
    """``[W^Q | W^K | W^V]``: ``(d, 3d)`` and ``[b^Q, b^K, b^V]``: ``(3d,)`` (or ``None``)."""
    w_qkv = torch.cat([weights.w_q, weights.w_k, weights.w_v], dim=1)  # (d, 3d)
    b = weights.biases
    return w_qkv, None if b is None else torch.cat([b.q, b.k, b.v])  # (3d,)


def split_qkv(w_qkv: Tensor, b_qkv: Tensor | None, w_o: Tensor, b_o: Tensor | None) -> AttentionWeights:
    """``w_qkv``: ``(d, 3d)`` = ``[W^Q | W^K | W^V]`` in paper orientation -> copies."""
    d = w_qkv.shape[0]
    return AttentionWeights(
        w_q=w_qkv[:, :d].clone(),
        w_k=w_qkv[:, d : 2 * d].clone(),
        w_v=w_qkv[:, 2 * d :].clone(),
        w_o=w_o.clone(),
        b_q=None if b_qkv is None else b_qkv[:d].clone(),
        b_k=None if b_qkv is None else b_qkv[d : 2 * d].clone(),
        b_v=None if b_qkv is None else b_qkv[2 * d :].clone(),
        b_o=None if b_o is None else b_o.clone(),
    )


# ---- torch.nn.MultiheadAttention's packed layout ------------------------------------
# Here rather than in attnlib.interop because MultiHeadAttention.from_torch and
# .to_torch need it too; attnlib.interop re-exports both names.
def read_torch_mha(m: nn.MultiheadAttention) -> AttentionWeights:
    """Read a ``torch.nn.MultiheadAttention`` into paper orientation (copies).

    ``in_proj_weight`` is ``(3E, E)`` in ``nn.Linear`` orientation ``(out, in)``:
    rows ``0:E`` are ``(W^Q)ᵀ``, ``E:2E`` are ``(W^K)ᵀ``, ``2E:3E`` are ``(W^V)ᵀ``,
    so its transpose is the packed ``[W^Q | W^K | W^V]``.

    Raises:
        TypeError: ``m`` is not a ``torch.nn.MultiheadAttention``.
        ValueError: for features attnlib does not have (``kdim``/``vdim`` other than
            ``embed_dim``, ``add_bias_kv``, ``add_zero_attn``), naming the feature.

    Warns (``UserWarning``) when ``m.dropout > 0``: attnlib has no dropout, so the
    weights read compute ``m``'s function in eval mode only.
    """
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(m).__name__}")
    if not m._qkv_same_embed_dim:
        raise ValueError(
            f"kdim={m.kdim} and vdim={m.vdim} must equal embed_dim={m.embed_dim}: "
            "attnlib.MultiHeadAttention takes keys and values of width d_model"
        )
    if m.bias_k is not None:
        raise ValueError("add_bias_kv=True is not supported by attnlib.MultiHeadAttention")
    if m.add_zero_attn:
        raise ValueError("add_zero_attn=True is not supported by attnlib.MultiHeadAttention")
    if m.dropout > 0:
        warnings.warn(
            f"dropout={m.dropout} is not read: attnlib has no dropout, so the weights "
            "compute this layer's function in eval mode only",
            UserWarning,
            stacklevel=2,
        )
    b_qkv = None if m.in_proj_bias is None else m.in_proj_bias.detach()  # (3E,)
    b_o = None if m.out_proj.bias is None else m.out_proj.bias.detach()  # (E,)
    if (b_qkv is None) != (b_o is None):
        raise ValueError("in_proj_bias and out_proj.bias must both exist or both be absent")
    w_qkv = m.in_proj_weight.detach().T  # (E, 3E) = [W^Q | W^K | W^V]
    return split_qkv(w_qkv, b_qkv, m.out_proj.weight.detach().T, b_o)


def write_torch_mha(weights: AttentionWeights, num_heads: int, batch_first: bool = True) -> nn.MultiheadAttention:
    """Build a ``torch.nn.MultiheadAttention`` holding ``weights`` (the inverse of
    :func:`read_torch_mha`): ``in_proj_weight = [W^Q | W^K | W^V]ᵀ``, ``(3E, E)``."""
    w_qkv, b_qkv = pack_qkv(weights)  # (E, 3E), (3E,) or None
    m = nn.MultiheadAttention(
        weights.d_model, num_heads, bias=weights.bias, batch_first=batch_first,
        device=w_qkv.device, dtype=w_qkv.dtype,
    )
    with torch.no_grad():
        m.in_proj_weight.copy_(w_qkv.T)  # (3E, E)
        m.out_proj.weight.copy_(weights.w_o.T)  # (E, E)
        if b_qkv is not None and m.in_proj_bias is not None and weights.b_o is not None:
            m.in_proj_bias.copy_(b_qkv)  # (3E,)
            m.out_proj.bias.copy_(weights.b_o)  # (E,)
    return m
