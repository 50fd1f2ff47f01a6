r"""The decoder layer of chapter 8: :class:`DecoderAttention`, chapter 3's layer plus
grouped keys and values, RoPE and the KV cache.

It is a subclass of :class:`attnlib.MultiHeadAttention` that changes two steps of its
``forward``: the projection (keys and values in ``g`` groups, queries and keys rotated
by position) and the attention (the cache appended to, the ``h/g`` query heads of a
group stacked so that they read the same keys). Everything else, the weights' layout,
the attention of each head, the merge and ``W^O``, is the parent's; :meth:`~DecoderAttention.head`
adds which group a head reads. Its plain view (:meth:`~DecoderAttention.as_plain`, what chapter
2-4's tools read) is the plain layer with the groups written out, and there is none with RoPE.

- ``num_kv_heads=g`` (grouped-query attention, Ainslie et al. 2023; ``g = 1`` is
  multi-query attention, Shazeer 2019): ``g`` must divide ``h``; ``w_k, w_v`` are
  ``(d_model, g*d_k)``, ``b_k, b_v`` ``(g*d_k,)``, and query head ``i`` reads key/value
  group ``i // (h/g)`` (the order of ``repeat_interleave`` and of Hugging Face's
  ``repeat_kv``). ``w_k_heads``/``w_v_heads`` are then ``(g, d_model, d_k)``.
- ``rope_base``: rotary position embedding (:func:`attnlib.decoding.apply_rope`,
  Su et al. 2021, in Llama's rotate-half layout) on queries and keys after the
  projections, before the scores; positions ``0..n-1`` for queries and keys alike,
  or continuing from the cache. ``d_k`` must be even.
- ``cache=KVCache()`` (keyword of the call): self-attention over new tokens
  ``(B, t, d_model)`` (one tensor as query, key and value); their keys (after RoPE)
  and values are appended to the cache, and the new queries attend causally to all
  cached positions. No ``mask`` with a cache. A prefill plus one-token steps equals
  the causal pass over the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor, nn

from attnlib.attention import causal_mask
from attnlib.checks import check_attention_inputs, check_positive_int, check_tensor, format_shape
from attnlib.decoding.cache import KVCache, check_cache_call
from attnlib.decoding.rope import apply_rope, check_rope_base
from attnlib.multihead import Device, DType, HeadWeights, MultiHeadAttention
from attnlib.records import AttentionWeights, record_tensors

__all__ = ["GroupedAttentionWeights", "DecoderAttention"]


# ---- grouped weights ----------------------------------------------------------------------


@dataclass(frozen=True)
class GroupedAttentionWeights:
    """Multi-head attention with grouped keys and values (GQA/MQA) and optional RoPE,
    paper orientation (each weight used as ``x @ w``).

    ``w_q``: ``(d_model, h*d_k)``, ``w_k``, ``w_v``: ``(d_model, g*d_k)``,
    ``w_o``: ``(h*d_k, d_model)``, ``h = num_heads``, ``g = num_kv_heads`` dividing ``h``,
    any head width ``d_k`` (:attr:`d_k`, from ``w_q``'s columns; ``h*d_k = d_model`` in the
    paper, not in Llama with its own ``head_dim``); biases ``(h*d_k,)`` / ``(g*d_k,)`` /
    ``(d_model,)``, all four or none. Query head ``i`` reads key/value group ``i // (h/g)``.
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
        if self.w_q.dim() != 2 or self.w_q.shape[1] % h or not self.w_q.shape[1]:
            raise ValueError(
                f"w_q must have shape (d_model, h*d_k) with num_heads={h} heads, got {format_shape(self.w_q)}"
            )
        d, hd = int(self.w_q.shape[0]), int(self.w_q.shape[1])
        d_kv = g * (hd // h)
        expected = {
            "w_k": (d, d_kv), "w_v": (d, d_kv), "w_o": (hd, d),
            "b_q": (hd,), "b_k": (d_kv,), "b_v": (d_kv,), "b_o": (d,),
        }
        for name, shape in expected.items():
            t = getattr(self, name)
            if name.startswith("b_") and t is None:
                continue
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} must have shape {format_shape(shape)} for d_model={d}, num_heads={h}, "
                    f"num_kv_heads={g}, d_k={hd // h}, got {format_shape(t)}"
                )
        has_bias = [getattr(self, n) is not None for n in ("b_q", "b_k", "b_v", "b_o")]
        if any(has_bias) and not all(has_bias):
            raise ValueError("biases must be given for all four projections or for none")
        if self.rope_base is not None:
            check_rope_base(self.rope_base, "rope_base")

    @property
    def d_model(self) -> int:
        return int(self.w_q.shape[0])

    @property
    def d_k(self) -> int:
        """The head width: ``w_q``'s columns over ``num_heads``."""
        return int(self.w_q.shape[1]) // self.num_heads

    @property
    def bias(self) -> bool:
        return self.b_q is not None


# ---- the decoder layer ------------------------------------------------------------


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
    base = check_rope_base(rope_base, "rope_base")
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


class DecoderAttention(MultiHeadAttention):
    r"""Chapter 3's :class:`~attnlib.MultiHeadAttention` with a decoder's three additions:
    grouped keys and values (``num_kv_heads``), RoPE (``rope_base``) and the KV cache
    (``cache=`` in the call). See the module's docstring for each.

    ``DecoderAttention(d_model, num_heads, bias=True, *, num_kv_heads=None, rope_base=None, d_k=None)``
    (``d_k``, the head width, as in the parent);
    with both left at their defaults and no cache it computes exactly what its parent does.
    ``w_k``, ``w_v`` are ``(d_model, g*d_k)`` and ``w_k_heads``, ``w_v_heads``
    ``(g, d_model, d_k)``: one block per key/value group.

    Call: ``out, weights = layer(query, key, value, mask=None, need_weights=True, *, cache=None)``,
    shapes as in the parent; the weights are ``(B, h, n_q, n_k)`` per query head.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        bias: bool = True,
        *,
        num_kv_heads: int | None = None,
        rope_base: float | None = None,
        d_k: int | None = None,
        device: Device = None,
        dtype: DType = None,
    ) -> None:
        # the parent checks the sizes and lays out its parameters on the meta device (no
        # memory, nothing drawn); they are made here, w_k and w_v with g groups of d_k columns
        super().__init__(d_model, num_heads, bias, d_k=d_k, device="meta", dtype=dtype)
        self.num_kv_heads = _check_kv_heads(num_heads, num_kv_heads)
        self.rope_base = _check_rope(rope_base, self.d_k)
        d_kv = self.num_kv_heads * self.d_k
        for name, p in list(self.named_parameters()):  # w_k, w_v, b_k, b_v: (.., g*d_k)
            shape = (*p.shape[:-1], d_kv) if name[-1] in "kv" else p.shape
            setattr(self, name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        self.reset_parameters()  # the parent's initialisation, in its order

    @property
    def group_size(self) -> int:
        """``h / g``: how many query heads share one key/value head (1 = plain MHA)."""
        return self.num_heads // self.num_kv_heads

    def head(self, i: int) -> HeadWeights:
        """The parent's head ``i``, with the key and value blocks of its group ``i // (h / g)``
        (views, shared with the group's other heads)."""
        own = super().head(i)  # checks i
        j = i // self.group_size  # the key/value group of head i
        kv = slice(j * self.d_k, (j + 1) * self.d_k)
        return own._replace(
            w_k=self.w_k[:, kv],
            w_v=self.w_v[:, kv],
            b_k=None if self.b_k is None else self.b_k[kv],
            b_v=None if self.b_v is None else self.b_v[kv],
        )

    def forward(  # adds the keyword-only cache
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = True,
        *,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The parent's steps, with keys and values in ``g`` groups, RoPE, and the cache."""
        if cache is not None:
            check_cache_call(cache, KVCache, mask)
            if not (_same_tensor(query, key) and _same_tensor(key, value)):
                raise ValueError(
                    "a call with a cache is self-attention over the new tokens: pass one tensor "
                    "(the same memory) as query, key and value, mha(x_new, x_new, x_new, cache=cache)"
                )
        check_attention_inputs(query, key, value, mask, self.d_model, self.num_heads)
        B, n_q, _ = query.shape
        past = 0
        if cache is not None:
            cache.check(self, B, None, query.device)  # dtype: in update, after autocast
            past = len(cache)
        # project: as the parent, but keys and values in g groups
        q = self._split_heads(self._project(query, self.w_q, self.b_q))  # (B, h, n_q, d_k)
        k = self._split_heads(self._project(key, self.w_k, self.b_k))  # (B, g, n_k, d_k)
        v = self._split_heads(self._project(value, self.w_v, self.b_v))  # (B, g, n_k, d_v)
        if self.rope_base is not None:  # rotate by position: 0.., or continuing after the cache
            q = apply_rope(q, torch.arange(past, past + n_q, device=q.device), self.rope_base)  # (B, h, n_q, d_k)
            k = apply_rope(k, torch.arange(past, past + k.shape[2], device=k.device), self.rope_base)  # (B, g, n_k, d_k)
        if cache is not None:
            k, v = cache.update(self, k, v)  # (B, g, past + n_q, d_k), (B, g, past + n_q, d_v)
            mask = causal_mask(n_q, past + n_q, device=query.device)  # (n_q, n_k)
        heads, weights = self._attend_grouped(q, k, v, mask, need_weights)  # (B, h, n_q, d_v), (B, h, n_q, n_k)
        return self._merge(heads), weights  # (B, n_q, d_model)

    def _attend_grouped(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The parent's attention with the ``h/g`` query heads of a group stacked as rows:
        ``q`` ``(B, h, n_q, d_k)``, ``k``, ``v`` ``(B, g, n_k, d_k)`` -> ``(B, h, n_q, d_v)``
        and ``(B, h, n_q, n_k)``."""
        B, h, n_q, d_k = q.shape
        g, n_k = k.shape[1], k.shape[2]
        if g == h:
            return self._attend(q, k, v, mask, need_weights)
        q = q.reshape(B, g, (h // g) * n_q, d_k)  # (B, g, (h/g)*n_q, d_k)
        if mask is not None:
            mask = _group_mask(mask, h, g, n_q, n_k)  # (B or 1, g, (h/g)*n_q, n_k)
        heads, weights = self._attend(q, k, v, mask, need_weights)  # (B, g, (h/g)*n_q, d_v), ...
        heads = heads.reshape(B, h, n_q, self.d_v)  # (B, h, n_q, d_v): back from groups to heads
        return heads, None if weights is None else weights.view(B, h, n_q, n_k)  # (B, h, n_q, n_k)

    # ---- the plain view and conversions ----------------------------------------------
    def as_plain(self) -> MultiHeadAttention:
        """The plain layer computing this function (see :func:`attnlib.multihead.plain_view`):
        without RoPE, a :class:`MultiHeadAttention` holding :meth:`expand_kv_heads`' weights
        (copies: each group's key and value blocks repeated for its heads).

        Raises:
            ValueError: with RoPE, which the plain layer cannot compute.
        """
        if self.rope_base is not None:
            raise ValueError(
                f"{type(self).__name__} with RoPE (rope_base={self.rope_base:g}) has no plain view: RoPE "
                f"rotates queries and keys by their positions, so query i and key j score "
                f"x_i W^Q R_(j-i) W^K^T x_j^T, not the plain layer's x_i W^QK x_j^T"
            )
        expanded = self._expanded_projections()
        plain = AttentionWeights(**record_tensors(expanded))
        return MultiHeadAttention.from_projections(plain, self.num_heads)

    def projections(self) -> AttentionWeights:
        """The parent's record (detached copies) when the layer is the plain layer: one
        key/value head per query head and no RoPE.

        Raises:
            ValueError: grouped keys/values or RoPE, which an :class:`AttentionWeights`
                cannot hold (it would drop them): use :meth:`grouped_projections`.
        """
        if self.num_kv_heads != self.num_heads or self.rope_base is not None:
            raise ValueError(
                f"projections() is the plain layer's record, (d_model, d_model) matrices without RoPE, but "
                f"this module has num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads}, "
                f"rope_base={self.rope_base}; use grouped_projections(), which keeps them"
            )
        return super().projections()

    def grouped_projections(self) -> GroupedAttentionWeights:
        """The projections (detached copies) with ``num_heads``, ``num_kv_heads`` and
        ``rope_base``: everything :meth:`from_grouped_projections` needs to rebuild the module."""

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

    def grouped_weights(self) -> GroupedAttentionWeights:
        """:meth:`grouped_projections`, by its name from before the rename."""
        return self.grouped_projections()

    @classmethod
    def from_grouped_projections(cls, weights: GroupedAttentionWeights) -> Self:
        """A module holding copies of ``weights``, with its heads, groups and RoPE base."""
        if not isinstance(weights, GroupedAttentionWeights):
            raise TypeError(f"weights must be a GroupedAttentionWeights, got {type(weights).__name__}")
        w_q = weights.w_q
        layer = cls(
            weights.d_model,
            weights.num_heads,
            bias=weights.bias,
            num_kv_heads=weights.num_kv_heads,
            rope_base=weights.rope_base,
            d_k=weights.d_k,
            device=w_q.device,
            dtype=w_q.dtype,
        )
        layer.load_state_dict(record_tensors(weights))  # copies, checked against the shapes
        return layer

    @classmethod
    def from_grouped_weights(cls, weights: GroupedAttentionWeights) -> Self:
        """:meth:`from_grouped_projections`, by its name from before the rename."""
        return cls.from_grouped_projections(weights)

    def expand_kv_heads(self) -> Self:
        """The same function with ``num_kv_heads = num_heads``: each group's key and value
        column blocks (and biases) are repeated for the ``h / g`` heads that read them, in
        ``repeat_interleave`` order. RoPE is kept (without it, :meth:`as_plain` gives the
        same weights as chapter 3's plain class)."""
        return type(self).from_grouped_projections(self._expanded_projections())

    def _expanded_projections(self) -> GroupedAttentionWeights:
        """:meth:`grouped_projections` with each group's blocks repeated for its ``h / g`` heads."""
        w = self.grouped_projections()
        r, d_k = self.group_size, self.d_k

        def rep(t: Tensor | None, dim: int) -> Tensor | None:
            if t is None:
                return None
            blocks = t.unflatten(dim, (self.num_kv_heads, d_k))  # (.., g, d_k, ..)
            return blocks.repeat_interleave(r, dim=dim).flatten(dim, dim + 1)  # (.., h*d_k, ..)

        return GroupedAttentionWeights(
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

    def extra_repr(self) -> str:
        extra = ""
        if self.num_kv_heads != self.num_heads:
            extra += f", num_kv_heads={self.num_kv_heads}"
        if self.rope_base is not None:
            extra += f", rope_base={self.rope_base:g}"
        return super().extra_repr() + extra

