r"""Multi-head attention, fused and as separate heads (chapters 2 and 3).

.. math::
    \mathrm{head}_i = \mathrm{Attention}(Q W_i^Q,\; K W_i^K,\; V W_i^V), \qquad
    \mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{h-1})\, W^O

with :math:`W_i^Q, W_i^K \in \mathbb{R}^{d_{model} \times d_k}`,
:math:`W_i^V \in \mathbb{R}^{d_{model} \times d_v}`,
:math:`W^O \in \mathbb{R}^{h d_v \times d_{model}}` and
:math:`d_k = d_v = d_{model} / h` (Vaswani et al., 2017, section 3.2.2).

:class:`MultiHeadAttention` stores the h per-head matrices of each role side by
side as one ``(d_model, d_model)`` matrix; :class:`SeparateHeadsAttention` stores
them as h independent small matrices. Built from the same weights, the two
compute the same function.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlib._core import (
    AttentionWeights,
    check_heads,
    check_index,
    check_head_mask,
    check_positive_int,
    check_tensor,
    format_shape,
    read_torch_mha,
    write_torch_mha,
)
from attnlib.attention import attention, masked_softmax
from attnlib.decoding import (
    GroupedAttentionWeights,
    KVCache,
    _check_base,
    _check_cache_call,
    apply_rope,
    causal_mask,
)

__all__ = ["MultiHeadAttention", "SeparateHeadsAttention", "HeadWeights"]

_Device = torch.device | str | None
_DType = torch.dtype | None


class HeadWeights(NamedTuple):
    """One head's weights: views into the fused matrices, not copies.

    ``w_q, w_k``: ``(d_model, d_k)``; ``w_v``: ``(d_model, d_v)``; ``w_o``: ``(d_v, d_model)``;
    biases ``(d_k,)``/``(d_v,)`` or ``None``. (The output bias belongs to no head.)
    """

    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    w_o: Tensor
    b_q: Tensor | None
    b_k: Tensor | None
    b_v: Tensor | None


def _check_inputs(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, d_model: int, num_heads: int
) -> None:
    """Shape checks shared by both implementations; errors name the argument."""
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


def _check_kv_heads(num_heads: int, num_kv_heads: object) -> int:
    """``num_kv_heads`` (default ``num_heads``), checked to divide ``num_heads``."""
    if num_kv_heads is None:
        return num_heads
    g = check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % g:
        raise ValueError(
            f"num_kv_heads ({g}) must divide num_heads ({num_heads}): each key/value head "
            f"serves a group of num_heads / num_kv_heads query heads"
        )
    return g


def _check_rope(rope_base: object, d_k: int) -> float | None:
    """``rope_base`` as a float (or ``None``: no RoPE); RoPE pairs dimensions, so d_k must be even."""
    if rope_base is None:
        return None
    base = _check_base(rope_base, "rope_base")
    if d_k % 2:
        raise ValueError(
            f"rope_base needs an even head width d_k (RoPE rotates pairs of dimensions), got d_k = {d_k}"
        )
    return base


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are one tensor: the same object, or views of the same memory with
    the same shape, strides and dtype (``x[:, :3]`` taken twice)."""
    if a is b:
        return True
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return False
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _group_mask(mask: Tensor, h: int, g: int, n_q: int, n_k: int) -> Tensor:
    """A mask broadcastable to ``(B, h, n_q, n_k)`` laid out for grouped queries,
    ``(B or 1, g, (h/g)*n_q, n_k)``: head ``i`` becomes rows ``(i % (h/g))*n_q ..`` of group ``i // (h/g)``."""
    m = mask
    while m.dim() < 4:
        m = m.unsqueeze(0)  # (.., n_q, n_k) -> 4-D
    b = m.shape[0]
    return m.expand(b, h, n_q, n_k).reshape(b, g, (h // g) * n_q, n_k)


def _require_plain(mha: "MultiHeadAttention", user: str, rope_reason: str | None) -> None:
    """Raise ``ValueError`` if ``mha`` has grouped keys/values, or RoPE (unless
    ``rope_reason`` is ``None``): ``user`` is defined for the plain layer only."""
    if rope_reason is not None and mha.rope_base is not None:
        raise ValueError(f"{user} is defined without RoPE, but this module has rope_base={mha.rope_base:g}: {rope_reason}")
    if mha.num_kv_heads != mha.num_heads:
        raise ValueError(
            f"{user} is defined for one key/value head per query head, but this module has "
            f"num_kv_heads={mha.num_kv_heads} < num_heads={mha.num_heads}: pass mha.expand_kv_heads(), "
            f"the same function with each group's keys and values repeated for its heads"
        )


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``x @ w + b`` in one fused call; ``w`` is ``(d_in, d_out)``."""
    return F.linear(x, w.T, b)


class MultiHeadAttention(nn.Module):
    r"""Multi-head attention with fused per-role weights, paper orientation.

    Parameters (each used as ``x @ W``): ``w_q, w_k, w_v, w_o``: ``(d_model, d_model)``;
    biases ``b_q, b_k, b_v, b_o``: ``(d_model,)`` when ``bias=True``. Head ``i`` owns
    columns ``i*d_k:(i+1)*d_k`` of ``w_q, w_k, w_v`` and rows ``i*d_v:(i+1)*d_v`` of
    ``w_o``; :meth:`head` and the ``*_heads`` properties return views of them.

    Call: ``out, weights = mha(query, key, value, mask=None, need_weights=True, *, cache=None)``

    - ``query``: ``(B, n_q, d_model)``; ``key``, ``value``: ``(B, n_k, d_model)``
    - ``mask``: bool, ``True`` = may attend: ``(n_k,)``, ``(n_q, n_k)`` or
      ``(B or 1, h or 1, n_q, n_k)``; a 3-D mask is refused as ambiguous (write a
      per-sequence mask as ``mask[:, None]``, a per-head one as ``mask[None]``)
    - ``out``: ``(B, n_q, d_model)``; ``weights``: ``(B, h, n_q, n_k)``, one map per
      head (not averaged), or ``None`` when ``need_weights=False`` (which takes
      PyTorch's fused ``scaled_dot_product_attention`` path).

    A query whose keys are all masked reads nothing: its heads output zero, with
    finite gradients, on both paths (:func:`attnlib.masked_softmax` on the explicit
    one; ``scaled_dot_product_attention`` gives zeros itself from torch 2.5 on).

    Decoder features (chapter 8), all off by default:

    - ``num_kv_heads=g`` (grouped-query attention, Ainslie et al. 2023; ``g = 1`` is
      multi-query attention, Shazeer 2019): ``g`` must divide ``h``; ``w_k, w_v`` are
      ``(d_model, g*d_k)``, ``b_k, b_v`` ``(g*d_k,)``, and query head ``i`` reads key/value
      group ``i // (h/g)`` (the order of ``repeat_interleave`` and of Hugging Face's
      ``repeat_kv``). ``w_k_heads``/``w_v_heads`` are then ``(g, d_model, d_k)``.
    - ``rope_base``: rotary position embedding (:func:`attnlib.decoding.apply_rope`,
      Llama's rotate-half layout, Su et al. 2021) on queries and keys after the
      projections, before the scores; positions ``0..n-1`` for queries and keys alike,
      or continuing from the cache. ``d_k`` must be even.
    - ``cache=KVCache()`` (keyword): self-attention over new tokens ``(B, t, d_model)``
      (one tensor as query, key and value); their keys (after RoPE) and values are
      appended to the cache, and the new queries attend causally to all cached
      positions. No ``mask`` with a cache. A prefill plus one-token steps equals the
      causal pass over the whole sequence.

    Initialisation: each weight matrix Xavier-uniform, biases zero.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        bias: bool = True,
        *,
        num_kv_heads: int | None = None,
        rope_base: float | None = None,
        device: _Device = None,
        dtype: _DType = None,
    ) -> None:
        super().__init__()
        self.d_k = check_heads(d_model, num_heads)
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = _check_kv_heads(num_heads, num_kv_heads)
        self.rope_base = _check_rope(rope_base, self.d_k)
        d_kv = self.num_kv_heads * self.d_k  # = d_model unless grouped
        self.w_q = nn.Parameter(torch.empty(d_model, d_model, device=device, dtype=dtype))  # (d_model, h*d_k)
        self.w_k = nn.Parameter(torch.empty(d_model, d_kv, device=device, dtype=dtype))  # (d_model, g*d_k)
        self.w_v = nn.Parameter(torch.empty(d_model, d_kv, device=device, dtype=dtype))  # (d_model, g*d_v)
        self.w_o = nn.Parameter(torch.empty(d_model, d_model, device=device, dtype=dtype))  # (h*d_v, d_model)
        if bias:
            self.b_q = nn.Parameter(torch.empty(d_model, device=device, dtype=dtype))
            self.b_k = nn.Parameter(torch.empty(d_kv, device=device, dtype=dtype))
            self.b_v = nn.Parameter(torch.empty(d_kv, device=device, dtype=dtype))
            self.b_o = nn.Parameter(torch.empty(d_model, device=device, dtype=dtype))
        else:
            self.register_parameter("b_q", None)
            self.register_parameter("b_k", None)
            self.register_parameter("b_v", None)
            self.register_parameter("b_o", None)
        self.reset_parameters()

    @property
    def d_v(self) -> int:
        return self.d_k

    @property
    def bias(self) -> bool:
        return self.b_q is not None

    @property
    def group_size(self) -> int:
        """``h / g``: how many query heads share one key/value head (1 = plain MHA)."""
        return self.num_heads // self.num_kv_heads

    def reset_parameters(self) -> None:
        """Xavier-uniform weights (bound ``sqrt(6 / (2 d_model))``), zero biases."""
        for w in (self.w_q, self.w_k, self.w_v, self.w_o):
            nn.init.xavier_uniform_(w)
        for b in (self.b_q, self.b_k, self.b_v, self.b_o):
            if b is not None:
                nn.init.zeros_(b)

    # ---- per-head views -------------------------------------------------------
    def _split_heads(self, x: Tensor, heads: int | None = None) -> Tensor:
        """``(B, n, h*d_k)`` -> ``(B, h, n, d_k)``: head ``i`` gets columns ``i*d_k:(i+1)*d_k`` (a view).
        ``heads`` (default ``h``): ``g`` for keys and values."""
        B, n, _ = x.shape
        heads = self.num_heads if heads is None else heads
        return x.view(B, n, heads, self.d_k).transpose(1, 2)  # (B, heads, n, d_k)

    def _split_columns(self, w: Tensor, heads: int | None = None) -> Tensor:
        heads = self.num_heads if heads is None else heads
        return w.view(self.d_model, heads, self.d_k).transpose(0, 1)  # (heads, d_model, d_k)

    @property
    def w_q_heads(self) -> Tensor:
        """``(h, d_model, d_k)``: ``w_q_heads[i]`` is :math:`W_i^Q`, a view of ``w_q``."""
        return self._split_columns(self.w_q)

    @property
    def w_k_heads(self) -> Tensor:
        """``(g, d_model, d_k)``: ``w_k_heads[j]`` is key/value group ``j``'s :math:`W^K`, a view
        of ``w_k``; with ``g = h`` (the default) it is head ``j``'s :math:`W_j^K`."""
        return self._split_columns(self.w_k, self.num_kv_heads)

    @property
    def w_v_heads(self) -> Tensor:
        """``(g, d_model, d_v)``: ``w_v_heads[j]`` is group ``j``'s :math:`W^V`, a view of ``w_v``
        (head ``j``'s :math:`W_j^V` when ``g = h``)."""
        return self._split_columns(self.w_v, self.num_kv_heads)

    @property
    def w_o_heads(self) -> Tensor:
        """``(h, d_v, d_model)``: ``w_o_heads[i]`` is :math:`W_i^O`, the rows of ``w_o``
        that multiply head i's output in the concatenation; a view of ``w_o``."""
        return self.w_o.view(self.num_heads, self.d_v, self.d_model)

    def head(self, i: int) -> HeadWeights:
        """Head ``i``'s weights as views into the fused parameters. Its key and value
        blocks are those of its group ``i // (h / g)``, shared with the group's other heads."""
        i = check_index("head", i, self.num_heads, f"num_heads={self.num_heads}")
        cols = slice(i * self.d_k, (i + 1) * self.d_k)
        j = i // self.group_size  # the key/value group of head i
        kv = slice(j * self.d_k, (j + 1) * self.d_k)
        return HeadWeights(
            w_q=self.w_q[:, cols],
            w_k=self.w_k[:, kv],
            w_v=self.w_v[:, kv],
            w_o=self.w_o[cols, :],
            b_q=None if self.b_q is None else self.b_q[cols],
            b_k=None if self.b_k is None else self.b_k[kv],
            b_v=None if self.b_v is None else self.b_v[kv],
        )

    # ---- forward ------------------------------------------------------------------
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = True,
        *,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        r""":math:`\mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{h-1})\, W^O`, all heads at once.

        Project: one product per role, split into heads ``(B, h, n, d_k)`` (keys and
        values into ``g`` groups). With RoPE, rotate queries and keys; with a cache,
        append the new keys and values and attend causally over all of them. Attend:
        :math:`\mathrm{softmax}(q k^\top / \sqrt{d_k})\, v` per head, written out when the
        weights are asked for, else PyTorch's ``scaled_dot_product_attention``.
        Shapes: see the class docstring.
        """
        if cache is not None:
            _check_cache_call(cache, KVCache, mask)
            if not (_same_tensor(query, key) and _same_tensor(key, value)):
                raise ValueError(
                    "a call with a cache is self-attention over the new tokens: pass one tensor "
                    "(the same memory) as query, key and value, mha(x_new, x_new, x_new, cache=cache)"
                )
        _check_inputs(query, key, value, mask, self.d_model, self.num_heads)
        B, n_q, _ = query.shape
        n_k = key.shape[1]
        h, g = self.num_heads, self.num_kv_heads
        past = 0
        if cache is not None:
            cache._check(self, B, None, query.device)  # dtype: in update, after autocast
            past = len(cache)
        # project: one product per role, then a view hands each head its d_k columns
        q = self._split_heads(_linear(query, self.w_q, self.b_q))  # (B, h, n_q, d_k)
        k = self._split_heads(_linear(key, self.w_k, self.b_k), g)  # (B, g, n_k, d_k)
        v = self._split_heads(_linear(value, self.w_v, self.b_v), g)  # (B, g, n_k, d_v)
        if self.rope_base is not None:  # rotate by position: 0.., or continuing after the cache
            q = apply_rope(q, torch.arange(past, past + n_q, device=q.device), self.rope_base)  # (B, h, n_q, d_k)
            k = apply_rope(k, torch.arange(past, past + n_k, device=k.device), self.rope_base)  # (B, g, n_k, d_k)
        if cache is not None:
            k, v = cache.update(self, k, v)  # (B, g, past + n_q, d_k), (B, g, past + n_q, d_v)
            n_k = past + n_q
            mask = causal_mask(n_q, n_k, device=query.device)  # (n_q, n_k)
        if g < h:  # grouped: the h/g query heads of a group read the same keys, stacked as rows
            q = q.reshape(B, g, (h // g) * n_q, self.d_k)  # (B, g, (h/g)*n_q, d_k)
            if mask is not None:
                mask = _group_mask(mask, h, g, n_q, n_k)  # (B or 1, g, (h/g)*n_q, n_k)
        # attend: every head at once
        weights: Tensor | None = None
        if need_weights:
            scores = (q * self.d_k**-0.5) @ k.transpose(-2, -1)  # (B, h, n_q, n_k)
            if mask is None and not scores.requires_grad:
                # in place: no autograd graph keeps the scores; one fewer B*h*n_q*n_k buffer
                # saved about a sixth of this pass's time at the book's reference layer (CPU)
                weights = torch.softmax(scores, dim=-1, out=scores)  # (B, h, n_q, n_k)
            else:
                weights = masked_softmax(scores, mask)  # (B, h, n_q, n_k); all 0 for a query with no key
            heads = weights @ v  # (B, h, n_q, d_v)
        else:
            if mask is not None and mask.dim() == 1:
                mask = mask.unsqueeze(0)  # (n_k,) -> (1, n_k): SDPA rejects a 1-D mask
            heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, h, n_q, d_v)
        if g < h:  # back from groups to heads
            heads = heads.reshape(B, h, n_q, self.d_v)  # (B, h, n_q, d_v)
            weights = None if weights is None else weights.view(B, h, n_q, n_k)  # (B, h, n_q, n_k)
        # concatenate the heads and project back
        concat = heads.transpose(1, 2).reshape(B, n_q, self.num_heads * self.d_v)  # (B, n_q, h*d_v)
        return _linear(concat, self.w_o, self.b_o), weights  # (B, n_q, d_model)

    # ---- conversions --------------------------------------------------------------
    def attention_weights(self) -> AttentionWeights:
        """The four projections (detached copies), paper orientation.

        Raises:
            ValueError: for grouped keys and values (``num_kv_heads != num_heads``), whose
                ``w_k``, ``w_v`` are narrower than ``AttentionWeights`` holds; use
                :meth:`grouped_weights`. (RoPE is not a weight: the record leaves it out.)
        """
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"attention_weights() holds (d_model, d_model) matrices, but this module has "
                f"num_kv_heads={self.num_kv_heads} < num_heads={self.num_heads}; use grouped_weights()"
            )

        g = self.grouped_weights()  # detached copies
        return AttentionWeights(
            w_q=g.w_q, w_k=g.w_k, w_v=g.w_v, w_o=g.w_o, b_q=g.b_q, b_k=g.b_k, b_v=g.b_v, b_o=g.b_o
        )

    def _copy_from(self, weights: AttentionWeights | GroupedAttentionWeights) -> None:
        """Copy the four projections and biases of a record of the same shapes into this module."""
        with torch.no_grad():
            for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
                src = getattr(weights, name)
                if src is not None:
                    getattr(self, name).copy_(src)

    @classmethod
    def from_weights(cls, weights: AttentionWeights | GroupedAttentionWeights, num_heads: int) -> "MultiHeadAttention":
        """A module holding copies of ``weights`` (paper orientation).

        A :class:`~attnlib.decoding.GroupedAttentionWeights` (what :meth:`grouped_weights`
        returns) keeps its ``num_kv_heads`` and ``rope_base``: this is then
        :meth:`from_grouped_weights`, and ``num_heads`` must equal ``weights.num_heads``.

        Raises:
            TypeError: ``weights`` is neither record.
            ValueError: ``num_heads`` differs from a ``GroupedAttentionWeights``' own.
        """
        if isinstance(weights, GroupedAttentionWeights):
            if num_heads != weights.num_heads:
                raise ValueError(
                    f"num_heads={num_heads!r} does not match the GroupedAttentionWeights' "
                    f"num_heads={weights.num_heads}"
                )
            return cls.from_grouped_weights(weights)
        if not isinstance(weights, AttentionWeights):
            raise TypeError(
                f"weights must be an AttentionWeights or GroupedAttentionWeights, got {type(weights).__name__}"
            )
        mha = cls(weights.d_model, num_heads, bias=weights.bias, device=weights.w_q.device, dtype=weights.w_q.dtype)
        mha._copy_from(weights)
        return mha

    def grouped_weights(self) -> GroupedAttentionWeights:
        """The projections (detached copies) with ``num_heads``, ``num_kv_heads`` and
        ``rope_base``: everything :meth:`from_grouped_weights` needs to rebuild the module."""

        def c(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().clone()

        return GroupedAttentionWeights(
            w_q=self.w_q.detach().clone(),
            w_k=self.w_k.detach().clone(),
            w_v=self.w_v.detach().clone(),
            w_o=self.w_o.detach().clone(),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            b_q=c(self.b_q),
            b_k=c(self.b_k),
            b_v=c(self.b_v),
            b_o=c(self.b_o),
            rope_base=self.rope_base,
        )

    @classmethod
    def from_grouped_weights(cls, weights: GroupedAttentionWeights) -> "MultiHeadAttention":
        """A module holding copies of ``weights``, with its heads, groups and RoPE base."""
        if not isinstance(weights, GroupedAttentionWeights):
            raise TypeError(f"weights must be a GroupedAttentionWeights, got {type(weights).__name__}")
        w_q = weights.w_q
        mha = cls(
            weights.d_model,
            weights.num_heads,
            bias=weights.bias,
            num_kv_heads=weights.num_kv_heads,
            rope_base=weights.rope_base,
            device=w_q.device,
            dtype=w_q.dtype,
        )
        mha._copy_from(weights)
        return mha

    def expand_kv_heads(self) -> "MultiHeadAttention":
        """Plain multi-head attention (``num_kv_heads = num_heads``) computing the same
        function: each group's key and value column blocks (and biases) are repeated for
        the ``h / g`` heads that read them, in ``repeat_interleave`` order. RoPE is kept."""
        w = self.grouped_weights()
        r, d_k = self.group_size, self.d_k

        def rep(t: Tensor | None, dim: int) -> Tensor | None:
            if t is None:
                return None
            blocks = t.unflatten(dim, (self.num_kv_heads, d_k))  # (.., g, d_k, ..)
            return blocks.repeat_interleave(r, dim=dim).flatten(dim, dim + 1)  # (.., h*d_k, ..)

        expanded = GroupedAttentionWeights(
            w_q=w.w_q,
            w_k=rep(w.w_k, 1),  # type: ignore[arg-type]
            w_v=rep(w.w_v, 1),  # type: ignore[arg-type]
            w_o=w.w_o,
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            b_q=w.b_q,
            b_k=rep(w.b_k, 0),
            b_v=rep(w.b_v, 0),
            b_o=w.b_o,
            rope_base=self.rope_base,
        )
        return type(self).from_grouped_weights(expanded)

    @classmethod
    def from_torch(
        cls, m: nn.MultiheadAttention, *, num_kv_heads: int | None = None, rope_base: float | None = None
    ) -> "MultiHeadAttention":
        """The same function as ``m`` (batch-first inputs; ``m`` in eval mode, since
        attnlib has no dropout). Weights are copied and transposed to ``x @ W``.

        Raises:
            ValueError: ``num_kv_heads`` other than ``m.num_heads``, or a ``rope_base``:
                ``nn.MultiheadAttention`` has neither grouped keys nor RoPE.
        """
        h = getattr(m, "num_heads", None)
        if (num_kv_heads is not None and num_kv_heads != h) or rope_base is not None:
            raise ValueError(
                f"torch.nn.MultiheadAttention has no grouped keys/values and no RoPE: from_torch "
                f"needs num_kv_heads=None (or num_heads={h}) and rope_base=None, got "
                f"num_kv_heads={num_kv_heads!r}, rope_base={rope_base!r}"
            )
        return cls.from_weights(read_torch_mha(m), m.num_heads)

    def to_torch(self) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention(batch_first=True)`` computing the same function.

        Raises:
            ValueError: when ``num_kv_heads != num_heads`` or RoPE is on: torch's module
                has neither (:meth:`expand_kv_heads` removes the grouping).
        """
        if self.num_kv_heads != self.num_heads or self.rope_base is not None:
            raise ValueError(
                f"torch.nn.MultiheadAttention has no grouped keys/values and no RoPE; this module has "
                f"num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads}, rope_base={self.rope_base}"
            )
        return write_torch_mha(self.attention_weights(), self.num_heads, batch_first=True)

    def extra_repr(self) -> str:
        extra = ""
        if self.num_kv_heads != self.num_heads:
            extra += f", num_kv_heads={self.num_kv_heads}"
        if self.rope_base is not None:
            extra += f", rope_base={self.rope_base:g}"
        return f"d_model={self.d_model}, num_heads={self.num_heads}, d_k={self.d_k}, bias={self.bias}{extra}"


class SeparateHeadsAttention(nn.Module):
    r"""Multi-head attention written literally: h independent heads, concatenated.

    Head ``i`` has its own small parameters ``w_q[i], w_k[i]``: ``(d_model, d_k)``,
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

    def __init__(self, d_model: int, num_heads: int, bias: bool = True, *, device: _Device = None, dtype: _DType = None) -> None:
        super().__init__()
        fused = MultiHeadAttention(d_model, num_heads, bias=bias, device=device, dtype=dtype)  # checks the sizes
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

        Raises:
            TypeError: ``mha`` is not a :class:`MultiHeadAttention`.
            ValueError: ``mha`` has RoPE or grouped keys/values (chapter 8), which this
                plain layer does not have (:meth:`MultiHeadAttention.expand_kv_heads`
                removes the grouping).
        """
        if not isinstance(mha, MultiHeadAttention):
            raise TypeError(f"mha must be an attnlib.MultiHeadAttention, got {type(mha).__name__}")
        _require_plain(
            mha, "SeparateHeadsAttention (the plain layer of chapters 3-5)",
            "it has no rotation to copy; build the MultiHeadAttention without rope_base to compare the two",
        )
        # built on the meta device (no memory, no random numbers drawn), then filled
        sep = cls(mha.d_model, mha.num_heads, bias=mha.bias, device="meta", dtype=mha.w_q.dtype)
        sep._load(mha)
        return sep

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
        return MultiHeadAttention.from_weights(weights, self.num_heads)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        _check_inputs(query, key, value, mask, self.d_model, self.num_heads)
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
