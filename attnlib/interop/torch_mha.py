"""``torch.nn.MultiheadAttention``'s packed layout, read into and written from attnlib's
(chapter 3, where :meth:`attnlib.MultiHeadAttention.from_torch` and ``.to_torch`` use it).

``in_proj_weight`` is ``[W^Q | W^K | W^V]ᵀ``: ``(3E, E)`` in ``nn.Linear`` orientation
``(out, in)``; ``out_proj.weight`` is ``(W^O)ᵀ``: ``(E, E)``. This module imports only the
shared records and checks, so that chapter 3's layer can use it without loading the
rest of :mod:`attnlib.interop`.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlib.checks import warn_dropout
from attnlib.records import AttentionWeights, pack_qkv, plain_record, split_qkv

__all__ = ["read_torch_mha", "write_torch_mha"]


def read_torch_mha(m: nn.MultiheadAttention) -> AttentionWeights:
    """Read a ``torch.nn.MultiheadAttention`` into paper orientation (copies).

    ``in_proj_weight`` is ``(3E, E)`` in ``nn.Linear`` orientation ``(out, in)``:
    rows ``0:E`` are ``(W^Q)ᵀ``, ``E:2E`` are ``(W^K)ᵀ``, ``2E:3E`` are ``(W^V)ᵀ``,
    so its transpose is the packed ``[W^Q | W^K | W^V]``.

    Raises:
        TypeError: ``m`` is not a ``torch.nn.MultiheadAttention``.
        ValueError: for features attnlib does not have (``kdim``/``vdim`` other than
            ``embed_dim``, ``add_bias_kv``, ``add_zero_attn``), naming the feature.

    Warns (``UserWarning``) when ``m`` is in training mode with ``dropout > 0``: attnlib
    has no dropout, so the weights read compute ``m``'s function in eval mode only
    (:func:`attnlib.checks.warn_dropout`, the rule of every reader).
    """
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(m).__name__}")
    if m.kdim != m.embed_dim or m.vdim != m.embed_dim:
        raise ValueError(
            f"kdim={m.kdim} and vdim={m.vdim} must equal embed_dim={m.embed_dim}: "
            "attnlib.MultiHeadAttention takes keys and values of width d_model"
        )
    if m.bias_k is not None:
        raise ValueError("add_bias_kv=True is not supported by attnlib.MultiHeadAttention")
    if m.add_zero_attn:
        raise ValueError("add_zero_attn=True is not supported by attnlib.MultiHeadAttention")
    warn_dropout("dropout", m.dropout, m.training)
    b_qkv = None if m.in_proj_bias is None else m.in_proj_bias.detach()  # (3E,)
    b_o = None if m.out_proj.bias is None else m.out_proj.bias.detach()  # (E,)
    if (b_qkv is None) != (b_o is None):
        raise ValueError("in_proj_bias and out_proj.bias must both exist or both be absent")
    w_qkv = m.in_proj_weight.detach().T  # (E, 3E) = [W^Q | W^K | W^V]
    return split_qkv(w_qkv, b_qkv, m.out_proj.weight.detach().T, b_o)


def write_torch_mha(weights: AttentionWeights, num_heads: int, batch_first: bool = True) -> nn.MultiheadAttention:
    """Build a ``torch.nn.MultiheadAttention`` holding ``weights`` (the inverse of
    :func:`read_torch_mha`): ``in_proj_weight = [W^Q | W^K | W^V]ᵀ``, ``(3E, E)``.

    Raises:
        TypeError: ``weights`` not an :class:`~attnlib.AttentionWeights`, or the record of
            a layer torch's module cannot compute (ALiBi), named by ``weights.as_plain()``.
        ValueError: heads of another width than ``d_model / num_heads`` (``h*d_k != d_model``).
    """
    weights = plain_record(weights)
    if weights.heads_width != weights.d_model:
        raise ValueError(
            f"torch.nn.MultiheadAttention's heads are embed_dim / num_heads wide, so h*d_k must equal "
            f"d_model: these weights have h*d_k = {weights.heads_width}, d_model = {weights.d_model}"
        )
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
