r"""The two circuits of a head, :math:`W_i^{QK}` and :math:`W_i^{OV}`, as factored matrices (chapter 4).

.. math::
    W_i^{QK} = W_i^Q {W_i^K}^\top, \qquad W_i^{OV} = W_i^V W_i^O \qquad (\text{Elhage et al., 2021})
"""

from __future__ import annotations

from attnlib._core import check_index, check_plain
from attnlib.lowrank.factored import FactoredMatrix
from attnlib.multihead import MultiHeadAttention

__all__ = ["qk_circuit", "ov_circuit", "QK_NEEDS_NO_ROPE"]


# Why qk_circuit and explorers.head_explorer refuse a module with RoPE.
QK_NEEDS_NO_ROPE = (
    "the W^QK lens is only defined without RoPE's position-dependent rotation (with it, query i "
    "and key j score x_i W^Q R_(i-j) W^K^T x_j^T); use a module without rope_base"
)


def _check_circuit_args(mha: object, head: object, user: str, rope_reason: str | None) -> int | None:
    if not isinstance(mha, MultiHeadAttention):
        raise TypeError(f"mha must be an attnlib.MultiHeadAttention, got {type(mha).__name__}")
    check_plain(mha, user, rope_reason)
    if head is None:
        return None
    return check_index("head", head, mha.num_heads, f"num_heads={mha.num_heads}")


def qk_circuit(
    mha: MultiHeadAttention, head: int | None = None
) -> FactoredMatrix:
    r"""Head ``head``'s :math:`W_i^{QK} = W_i^Q {W_i^K}^\top`, kept factored.

    ``(d_model, d_model)``, rank <= ``d_k``: ``left`` = :math:`W_i^Q`
    ``(d_model, d_k)``, ``right`` = :math:`{W_i^K}^\top` ``(d_k, d_model)``.
    With ``head=None``, all heads at once: batch ``(h,)``. The factors are
    detached views of ``mha``'s weights. Biases are not part of the bilinear
    form (they add terms linear in the query or key token).

    Raises ``ValueError`` for a module with RoPE (its scores are not
    :math:`x_i W_i^{QK} x_j^\top`) or with grouped keys/values (use
    :meth:`~attnlib.decoding.DecoderAttention.expand_kv_heads`).
    """
    i = _check_circuit_args(mha, head, "qk_circuit", QK_NEEDS_NO_ROPE)
    w_q = mha.w_q_heads.detach()  # (h, d_model, d_k)
    w_k = mha.w_k_heads.detach()  # (h, d_model, d_k)
    fm = FactoredMatrix(w_q, w_k.mT)  # (h, d_model, d_k) @ (h, d_k, d_model)
    return fm if i is None else fm[i]


def ov_circuit(
    mha: MultiHeadAttention, head: int | None = None
) -> FactoredMatrix:
    r"""Head ``head``'s :math:`W_i^{OV} = W_i^V W_i^O`, kept factored.

    ``(d_model, d_model)``, rank <= ``d_v``: ``left`` = :math:`W_i^V`
    ``(d_model, d_v)``, ``right`` = :math:`W_i^O` ``(d_v, d_model)``: a token's
    contribution to the layer's output, per unit of attention paid to it.
    With ``head=None``, all heads at once: batch ``(h,)``. Detached views of ``mha``'s
    weights; biases are not included. RoPE rotates queries and keys only, so with
    RoPE this is still the head's circuit; grouped keys/values raise ``ValueError``
    (use :meth:`~attnlib.decoding.DecoderAttention.expand_kv_heads`).
    """
    i = _check_circuit_args(mha, head, "ov_circuit", None)
    w_v = mha.w_v_heads.detach()  # (h, d_model, d_v)
    w_o = mha.w_o_heads.detach()  # (h, d_v, d_model)
    fm = FactoredMatrix(w_v, w_o)
    return fm if i is None else fm[i]
