r"""Hugging Face's BLOOM attention layout (``BloomAttention``), read into and written from
attnlib's :class:`~attnlib.AttentionWeights` (chapter 8, where :class:`AlibiAttention` is
built from it; also importable from :mod:`attnlib.interop`, with the other layouts).

BLOOM fuses the three projections into one ``nn.Linear`` ``query_key_value`` of weight
``(3d, d)``, whose ``3d`` outputs are grouped **by head**: head ``i`` owns outputs
``3 i d_k .. 3 (i+1) d_k``, in the order query, key, value (``view(B, n, h, 3, d_k)``).
That is not the ``[W^Q | W^K | W^V]`` packing of ``nn.MultiheadAttention`` or nanoGPT,
so reading it as one would mix queries, keys and values of different heads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlib.checks import check_positive_int, format_shape, warn_dropout
from attnlib.records import AttentionWeights

__all__ = ["read_bloom", "write_bloom"]


def read_bloom(attn: nn.Module, *, num_heads: int | None = None) -> AttentionWeights:
    r"""Read Hugging Face BLOOM attention into paper orientation (copies).

    ``query_key_value.weight`` ``(3d, d)`` viewed as ``(h, 3, d_k, d)``: block ``[i, 0]``
    is :math:`(W^Q_i)^\top`, ``[i, 1]`` :math:`(W^K_i)^\top`, ``[i, 2]``
    :math:`(W^V_i)^\top`; its bias ``(3d,)`` is viewed as ``(h, 3, d_k)`` the same way;
    ``dense.weight`` ``(d, d)`` is :math:`(W^O)^\top`. (BLOOM's heads are ``d / h`` wide;
    heads of another width ``d_k`` read the same way, from ``(3 h d_k, d)`` and ``(d, h d_k)``.) The positions (ALiBi) are not
    weights: :class:`attnlib.decoding.AlibiAttention` adds them.

    Args:
        attn: a module with ``query_key_value`` and ``dense`` (``nn.Linear``, with or without
            bias: layers without one read as ``None`` biases, one without beside one with as
            zeros), e.g. ``BloomAttention``, the per-head packed projections of a GPT-NeoX-style
            layer, or the ``nn.ModuleDict`` of :func:`write_bloom`.
        num_heads: ``h``; default ``attn.num_heads`` (``BloomAttention`` has it).

    Raises:
        TypeError: a projection missing or not an ``nn.Linear``.
        ValueError: ``num_heads`` missing or disagreeing with ``attn.num_heads``; shapes
            that do not fit ``(3 h d_k, d)`` and ``(d, h d_k)``.

    Warns (``UserWarning``) when ``attn`` is in training mode with ``attention_dropout``
    ``p > 0``, as every reader does (:func:`attnlib.checks.warn_dropout`).
    """
    layers: dict[str, nn.Linear] = {}
    for name in ("query_key_value", "dense"):
        layer = getattr(attn, name, None)
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"attn.{name} must be an nn.Linear, got {type(layer).__name__}")
        layers[name] = layer
    own = getattr(attn, "num_heads", None)
    if num_heads is None:
        if own is None:
            raise ValueError("num_heads must be given when attn has no num_heads attribute")
        num_heads = int(own)
    h = check_positive_int("num_heads", num_heads)
    if own is not None and int(own) != h:
        raise ValueError(f"num_heads={h} disagrees with attn.num_heads={own}")
    dropout = getattr(attn, "attention_dropout", None)
    if isinstance(dropout, nn.Dropout):
        warn_dropout("attention_dropout", dropout.p, attn.training)
    w = layers["query_key_value"].weight.detach()  # (3*h*d_k, d)
    three_hd, d = w.shape
    d_k = three_hd // (3 * h)
    if d_k == 0 or three_hd != 3 * h * d_k or layers["dense"].weight.shape != (d, h * d_k):
        raise ValueError(
            f"query_key_value.weight must be (3*h*d_k, d) and dense.weight (d, h*d_k) with num_heads={h}, "
            f"got {format_shape(w)} and {format_shape(layers['dense'].weight)}"
        )
    blocks = w.view(h, 3, d_k, d)  # (h, q/k/v, d_k, d): head i's three (d_k, d) blocks
    dense = layers["dense"]
    qkv_bias, dense_bias = layers["query_key_value"].bias, dense.bias
    if qkv_bias is None and dense_bias is None:  # bias-free layers (GPT-NeoX-style with use_bias off)
        b3: Tensor | None = None
        b_o: Tensor | None = None
    else:  # a missing bias reads as zeros, which computes the same function
        b3 = torch.zeros(three_hd, dtype=w.dtype, device=w.device) if qkv_bias is None else qkv_bias.detach()
        b_o = torch.zeros(d, dtype=w.dtype, device=w.device) if dense_bias is None else dense_bias.detach().clone()
    biases = None if b3 is None else b3.view(h, 3, d_k)  # (h, q/k/v, d_k)

    def paper(t: int) -> tuple[Tensor, Tensor | None]:  # projection t of every head: (d, h*d_k), (h*d_k,)
        bias = None if biases is None else biases[:, t].reshape(h * d_k).clone()
        return blocks[:, t].reshape(h * d_k, d).T.clone(), bias

    (w_q, b_q), (w_k, b_k), (w_v, b_v) = paper(0), paper(1), paper(2)
    return AttentionWeights(w_q=w_q, w_k=w_k, w_v=w_v, w_o=dense.weight.detach().T.clone(),
                            b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o)


def write_bloom(weights: AttentionWeights, num_heads: int) -> nn.ModuleDict:
    """``query_key_value`` and ``dense`` (``nn.Linear`` with bias) holding ``weights`` in
    BLOOM's per-head fused layout: the inverse of :func:`read_bloom`. Its ``state_dict()``
    loads into a ``BloomAttention`` of the same shape. Like ``BloomAttention`` it carries
    ``num_heads``: the layout's rows are grouped by head, and read with another number of
    heads they would be scrambled without any shape going wrong, so :func:`read_bloom`
    refuses another one. A record without biases gets zero
    biases (BLOOM's layers always have one), which computes the same function.

    Raises:
        TypeError: ``weights`` not an :class:`~attnlib.AttentionWeights`.
        ValueError: ``num_heads`` not a positive int dividing ``h*d_k`` (``d_model`` in BLOOM).
    """
    if not isinstance(weights, AttentionWeights):
        raise TypeError(f"weights must be an AttentionWeights, got {type(weights).__name__}")
    h, d, hd = check_positive_int("num_heads", num_heads), weights.d_model, weights.heads_width
    if hd % h:
        raise ValueError(f"num_heads ({h}) must divide h*d_k ({hd})")
    d_k, w0 = hd // h, weights.w_q

    def bias(t: Tensor | None, width: int) -> Tensor:
        return torch.zeros(width, device=w0.device, dtype=w0.dtype) if t is None else t

    per_head = [w.T.reshape(h, d_k, d) for w in (weights.w_q, weights.w_k, weights.w_v)]  # (h, d_k, d) each
    fused_w = torch.stack(per_head, dim=1).reshape(3 * hd, d)  # (h, 3, d_k, d) -> (3D, d)
    fused_b = torch.stack([bias(t, hd).reshape(h, d_k) for t in (weights.b_q, weights.b_k, weights.b_v)], 1)  # (h, 3, d_k)
    qkv = nn.Linear(d, 3 * hd, device=w0.device, dtype=w0.dtype)
    dense = nn.Linear(hd, d, device=w0.device, dtype=w0.dtype)
    with torch.no_grad():
        qkv.weight.copy_(fused_w)
        qkv.bias.copy_(fused_b.reshape(3 * hd))
        dense.weight.copy_(weights.w_o.T)  # (d_out, d_in)
        dense.bias.copy_(bias(weights.b_o, d))
    layers = nn.ModuleDict({"query_key_value": qkv, "dense": dense})
    setattr(layers, "num_heads", h)  # as BloomAttention has it: read_bloom refuses another num_heads
    return layers
