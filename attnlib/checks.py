"""The argument checks every attnlib module shares, and the one rule they follow.

``TypeError``
    an argument of the wrong type: not a tensor, not an int (a ``bool`` is not
    accepted as an int), not a number;
``ValueError``
    the right type with a wrong value: a shape, dtype or size that does not fit,
    a count below 1;
``IndexError``
    an index (a head, a layer) outside its range.

Each message names the argument, what was expected and what was received; shapes are
written ``(2, 3, 4)`` (:func:`format_shape`). This module imports nothing else from
attnlib.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "format_shape",
    "check_tensor",
    "check_dtype",
    "check_int",
    "check_positive_int",
    "check_width",
    "check_index",
    "check_heads",
    "broadcast_shape",
    "check_mask",
    "check_head_mask",
    "check_attention_inputs",
    "warn_dropout",
]


def format_shape(t: Tensor | torch.Size | tuple[int, ...]) -> str:
    """A shape as Python writes a tuple, ``(2, 3, 4)`` (``(5,)`` for one dimension), for error
    messages: ``torch.Size`` itself prints as ``torch.Size([2, 3, 4])``."""
    return str(tuple(t.shape if isinstance(t, Tensor) else t))


def check_tensor(name: str, t: object) -> Tensor:
    """``t`` itself if it is a tensor; ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_dtype(name: str, value: object) -> torch.dtype:
    """``value`` itself if it is a ``torch.dtype``; ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(value).__name__} {value!r}")
    return value


def check_int(name: str, value: object, expected: str = "an int") -> int:
    """``value`` if it is an int (``True`` is not); ``TypeError`` saying ``expected`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1: ``TypeError`` for a non-int (``True`` included),
    ``ValueError`` for an int below 1."""
    n = check_int(name, value, "a positive int")
    if n < 1:
        raise ValueError(f"{name} must be a positive int, got {n}")
    return n


def check_width(name: str, value: object, *, even: bool = False, zero_ok: bool = False, why: str = "") -> int:
    """``value`` if it is an int >= 1 (>= 0 with ``zero_ok``; even with ``even``, ``why`` saying
    why in the message): ``TypeError`` for a non-int (``True`` included), ``ValueError`` for a
    wrong value. The argument order of :func:`check_positive_int`: the name, then the value."""
    if zero_ok and type(value) is int and value == 0:
        return 0
    if zero_ok and type(value) is int and value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    value = check_positive_int(name, value)
    if even and value % 2:
        raise ValueError(f"{name} must be even, got {value}" + (f": {why}" if why else ""))
    return value


def check_index(name: str, value: object, size: int, what: str) -> int:
    """``value`` if it is an int in ``[0, size)``: ``TypeError`` for a non-int
    (``True`` included), ``IndexError`` outside the range; ``what`` says what
    ``size`` counts, e.g. ``"num_heads=4"``."""
    i = check_int(name, value, f"an int in [0, {size})")
    if not 0 <= i < size:
        raise IndexError(f"{name} must be an int in [0, {size}) for {what}, got {i}")
    return i


def check_heads(d_model: object, num_heads: object, d_k: object = None) -> int:
    """Validate a layer's sizes and return its head width ``d_k``: ``d_model / num_heads`` by
    default (which must then be whole), or the ``d_k`` given, any positive int (heads of any
    width: ``h * d_k`` need not be ``d_model``, as in Llama with its own ``head_dim``)."""
    d = check_positive_int("d_model", d_model)
    h = check_positive_int("num_heads", num_heads)
    if d_k is not None:
        return check_positive_int("d_k", d_k)
    if d % h:
        raise ValueError(
            f"d_model ({d}) must be divisible by num_heads ({h}): "
            f"each head gets d_k = d_model / num_heads columns (or give the head width d_k)"
        )
    return d // h


def broadcast_shape(*shapes: Sequence[int]) -> torch.Size:
    """The shape that ``shapes`` broadcast to, by torch's rules; ``RuntimeError`` if they do not.

    The answer of ``torch.broadcast_shapes``, computed by broadcasting empty tensors on the
    ``meta`` device (no memory, no arithmetic). ``torch.broadcast_shapes`` itself imports
    sympy on its first call, about 2.5 s of every process and notebook kernel that checks a
    mask; this does not.
    """
    return torch.broadcast_tensors(*(torch.empty(tuple(s), device="meta") for s in shapes))[0].shape


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
        broadcast = broadcast_shape(mask.shape, target)
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


def warn_dropout(name: str, p: float, training: bool) -> None:
    """The readers' one rule for a layer's dropout, which attnlib does not have: the weights
    read compute the layer's eval-mode function. A layer in training mode with ``p > 0``
    computes a random one now, so a ``UserWarning`` (naming ``name=p``) says so; in eval mode
    its dropout is off and nothing is lost, so nothing is said."""
    if training and p > 0:
        warnings.warn(
            f"{name}={p} is not read: attnlib has no dropout, so the weights compute this layer's "
            f"function in eval mode only (call .eval() on the layer to compare the two)",
            UserWarning,
            stacklevel=3,
        )
