r"""Multi-head attention written literally: h separate heads, concatenated (chapters 3 and 5).

.. math::
    \mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{h-1})\, W^O,
    \qquad \mathrm{head}_i = \mathrm{Attention}(Q W_i^Q,\; K W_i^K,\; V W_i^V)

with one small ``(d_model, d_k)`` matrix per head and role, as the paper writes it
(Vaswani et al., 2017, section 3.2.2). Chapter 3 reads the formula off this form;
chapter 5 compares it with the fused :class:`~attnlib.multihead.MultiHeadAttention`
it converts to and from: built from the same weights, the two compute the same function.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlib.checks import check_attention_inputs
from attnlib.records import AttentionWeights
from attnlib.attention import attention
from attnlib.multihead import Device, DType, MultiHeadAttention, plain_view

__all__ = ["SeparateHeadsAttention"]


class SeparateHeadsAttention(nn.Module):
    r"""Multi-head attention written literally: h independent heads, concatenated.

    ``SeparateHeadsAttention(d_model, num_heads, bias=True, *, d_k=None)``, ``d_k`` as in
    :class:`MultiHeadAttention` (``d_model / num_heads`` by default). Head ``i`` has its own
    small parameters ``w_q[i], w_k[i]``: ``(d_model, d_k)``,
    ``w_v[i]``: ``(d_model, d_v)`` (``nn.ParameterList`` entries) and computes
    :math:`\mathrm{head}_i = \mathrm{Attention}(Q W_i^Q + b_i^Q, K W_i^K + b_i^K, V W_i^V + b_i^V)`
    with :func:`attnlib.attention`. The heads' outputs ``(B, n_q, d_v)`` are
    concatenated to ``(B, n_q, h d_v)`` and multiplied by ``w_o``: ``(h d_v, d_model)``.

    It exists to be compared with :class:`MultiHeadAttention`: build it with
    :meth:`from_fused` and both compute the same function. Call signature and
    shapes are those of :class:`MultiHeadAttention`.
    """

    # Per-head biases: a ParameterList of h vectors, or None when bias=False.
    b_q: nn.ParameterList | None
    b_k: nn.ParameterList | None
    b_v: nn.ParameterList | None

    def __init__(
        self, d_model: int, num_heads: int, bias: bool = True, *, d_k: int | None = None, device: Device = None,
        dtype: DType = None,
    ) -> None:
        super().__init__()
        fused = MultiHeadAttention(d_model, num_heads, bias=bias, d_k=d_k, device=device, dtype=dtype)  # checks
        self.d_k, self.d_model, self.num_heads = fused.d_k, d_model, num_heads
        self._load(fused)  # MultiHeadAttention's initialisation, cut into heads

    def _load(self, fused: MultiHeadAttention) -> None:
        def heads(t: Tensor) -> nn.ParameterList:
            return nn.ParameterList([nn.Parameter(t[i].detach().clone()) for i in range(t.shape[0])])

        h, d_k = fused.num_heads, fused.d_k
        self.w_q = heads(fused.w_q_heads)  # h x (d_model, d_k)
        self.w_k = heads(fused.w_k_heads)  # h x (d_model, d_k)
        self.w_v = heads(fused.w_v_heads)  # h x (d_model, d_v)
        self.w_o = nn.Parameter(fused.w_o.detach().clone())  # (h*d_v, d_model)
        if fused.bias:
            assert fused.b_q is not None and fused.b_k is not None and fused.b_v is not None
            self.b_q = heads(fused.b_q.view(h, d_k))  # h x (d_k,)
            self.b_k = heads(fused.b_k.view(h, d_k))  # h x (d_k,)
            self.b_v = heads(fused.b_v.view(h, d_k))  # h x (d_v,)
            self.b_o = nn.Parameter(fused.b_o.detach().clone())
        else:
            self.b_q = None
            self.b_k = None
            self.b_v = None
            self.register_parameter("b_o", None)

    @property
    def bias(self) -> bool:
        return self.b_o is not None

    @classmethod
    def from_fused(cls, mha: MultiHeadAttention) -> "SeparateHeadsAttention":
        """h small heads holding copies of ``mha``'s per-head blocks.

        ``mha`` is read through its plain view (:func:`attnlib.multihead.plain_view`): a
        layer with grouped keys/values gives its heads with the groups written out; one
        that computes more than the plain layer (RoPE, ALiBi) is refused, naming it.

        Raises:
            TypeError: ``mha`` is not an attention layer of attnlib, or its type has no
                plain view (ALiBi, latent attention).
            ValueError: ``mha`` has RoPE.
        """
        plain = plain_view(mha, "mha", "SeparateHeadsAttention.from_fused")
        # built on the meta device (no memory, no random numbers drawn), then filled
        sep = cls(plain.d_model, plain.num_heads, bias=plain.bias, d_k=plain.d_k, device="meta", dtype=plain.w_q.dtype)
        sep._load(plain)
        return sep

    def as_plain(self) -> MultiHeadAttention:
        """The plain view (see :func:`attnlib.multihead.plain_view`): :meth:`to_fused`, the
        same function as one fused :class:`MultiHeadAttention` (a copy)."""
        return self.to_fused()

    def to_fused(self) -> MultiHeadAttention:
        """The per-head blocks placed side by side again, as a :class:`MultiHeadAttention`."""

        def cat(ps: nn.ParameterList) -> Tensor:
            return torch.cat([p.detach() for p in ps], dim=-1)  # side by side again

        weights = AttentionWeights(
            w_q=cat(self.w_q),  # (d_model, h*d_k)
            w_k=cat(self.w_k),  # (d_model, h*d_k)
            w_v=cat(self.w_v),  # (d_model, h*d_v)
            w_o=self.w_o.detach(),  # (h*d_v, d_model)
            b_q=None if self.b_q is None else cat(self.b_q),
            b_k=None if self.b_k is None else cat(self.b_k),
            b_v=None if self.b_v is None else cat(self.b_v),
            b_o=None if self.b_o is None else self.b_o.detach(),
        )
        return MultiHeadAttention.from_projections(weights, self.num_heads)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        check_attention_inputs(query, key, value, mask, self.d_model, self.num_heads)
        outputs, maps = [], []
        for i in range(self.num_heads):
            q_i = query @ self.w_q[i]  # (B, n_q, d_k)
            k_i = key @ self.w_k[i]  # (B, n_k, d_k)
            v_i = value @ self.w_v[i]  # (B, n_k, d_v)
            if self.b_q is not None and self.b_k is not None and self.b_v is not None:  # bias=True
                q_i, k_i, v_i = q_i + self.b_q[i], k_i + self.b_k[i], v_i + self.b_v[i]
            mask_i = None if mask is None else _head_mask(mask, i)  # broadcastable to (B, n_q, n_k)
            head_i, weights_i = attention(q_i, k_i, v_i, mask=mask_i)  # (B, n_q, d_v), (B, n_q, n_k)
            outputs.append(head_i)
            maps.append(weights_i)
        concat = torch.cat(outputs, dim=-1)  # (B, n_q, h*d_v)
        out = concat @ self.w_o  # (B, n_q, d_model)
        if self.b_o is not None:
            out = out + self.b_o
        if not need_weights:
            return out, None
        weights = torch.stack([m.expand(query.shape[0], query.shape[1], key.shape[1]) for m in maps], dim=1)
        return out, weights  # (B, h, n_q, n_k)


def _head_mask(mask: Tensor, i: int) -> Tensor:
    """Head i's slice of a mask broadcastable to (B, h, n_q, n_k)."""
    m = mask
    while m.dim() < 4:
        m = m.unsqueeze(0)  # (1.., n_q, n_k) -> 4-D
    return m[:, i if m.shape[1] > 1 else 0]  # (B or 1, n_q or 1, n_k)
