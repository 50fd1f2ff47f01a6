r"""The two circuits of a head, :math:`W_i^{QK}` and :math:`W_i^{OV}`, as factored matrices (chapter 4).

.. math::
    W_i^{QK} = W_i^Q {W_i^K}^\top, \qquad W_i^{OV} = W_i^V W_i^O \qquad (\text{Elhage et al., 2021})
"""

from __future__ import annotations

from attnlib.checks import check_index
from attnlib.lowrank.factored import FactoredMatrix
from attnlib.multihead import MultiHeadAttention, plain_view

__all__ = ["qk_circuit", "ov_circuit"]


def _plain_and_head(mha: object, head: object, user: str) -> tuple[MultiHeadAttention, int | None]:
    plain = plain_view(mha, "mha", user)
    if head is None:
        return plain, None
    return plain, check_index("head", head, plain.num_heads, f"num_heads={plain.num_heads}")


def qk_circuit(
    mha: MultiHeadAttention, head: int | None = None
) -> FactoredMatrix:
    r"""Head ``head``'s :math:`W_i^{QK} = W_i^Q {W_i^K}^\top`, kept factored.

    ``(d_model, d_model)``, rank <= ``d_k``: ``left`` = :math:`W_i^Q`
    ``(d_model, d_k)``, ``right`` = :math:`{W_i^K}^\top` ``(d_k, d_model)``.
    With ``head=None``, all heads at once: batch ``(h,)``. The factors are
    detached views of ``mha``'s weights. Biases are not part of the bilinear
    form (they add terms linear in the query or key token).

    ``mha`` is read through its plain view (:func:`attnlib.multihead.plain_view`): a
    layer with grouped keys/values gives its heads with the groups written out (copies);
    a layer whose scores are not :math:`x_i W_i^{QK} x_j^\top` (RoPE, ALiBi, latent
    attention) is refused, naming the feature.
    """
    plain, i = _plain_and_head(mha, head, "qk_circuit")
    w_q = plain.w_q_heads.detach()  # (h, d_model, d_k)
    w_k = plain.w_k_heads.detach()  # (h, d_model, d_k)
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
    weights; biases are not included. ``mha`` is read through its plain view, as in
    :func:`qk_circuit`: a layer that is not the plain layer is refused, naming what it adds.
    """
    plain, i = _plain_and_head(mha, head, "ov_circuit")
    w_v = plain.w_v_heads.detach()  # (h, d_model, d_v)
    w_o = plain.w_o_heads.detach()  # (h, d_v, d_model)
    fm = FactoredMatrix(w_v, w_o)
    return fm if i is None else fm[i]
