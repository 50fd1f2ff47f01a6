r"""Multi-head latent attention (MLA) of DeepSeek-V2 (DeepSeek-AI 2024, section 2.1; chapter 8).

The cache holds one latent vector :math:`c_j = x_j W^{DKV}` per token instead of ``h``
keys and ``h`` values; with :math:`W^{UK}` folded into the queries and :math:`W^{UV}` into
:math:`W^O`, attention reads the latents directly and never forms the keys.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlib.checks import check_head_mask, check_positive_int, check_tensor, check_width, format_shape
from attnlib.attention import causal_mask, masked_softmax
from attnlib.decoding.cache import LatentCache, check_cache_call, latent_cache_bytes_per_token
from attnlib.decoding.rope import apply_rope, check_rope_base

__all__ = ["LatentAttention"]


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

    **Absorption.** :math:`q^C_{t,i} \cdot k^C_{j,i} = (x_t W^Q_i W^{UK\top}_i) \cdot c_j` and
    :math:`\sum_j a_j v_{j,i} W^O_i = (\sum_j a_j c_j)(W^{UV}_i W^O_i)`: :math:`W^{UK}_i` is
    *absorbed into* :math:`W^Q_i` and :math:`W^{UV}_i` into :math:`W^O_i` (DeepSeek-V2's
    wording), that is, merged with them, so that the scores and the mixture read the latents
    directly. The merged products are :attr:`w_q_absorbed` and :attr:`w_o_absorbed`.
    ``absorb=True`` computes with them, evaluating each as its two factors in turn (at
    DeepSeek-V2's widths the products hold more numbers than the factors), and never forms
    a key or value of a cached token; ``absorb=False`` up-projects the cache to K and V.
    Both give the same function. All heads then read the same latents and the same rotary key, which
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
        check_width("d_c", d_c)
        check_width("d_r", d_r, even=True, zero_ok=True, why="RoPE pairs dimension l with l + d_r/2")
        if d_k is None:
            if d_model % num_heads:
                raise ValueError(
                    f"d_model ({d_model}) must be divisible by num_heads ({num_heads}) when d_k is not given"
                )
            d_k = d_model // num_heads
        check_width("d_k", d_k)
        d_v = d_k if d_v is None else check_width("d_v", d_v)
        self.rope_base = check_rope_base(rope_base, "rope_base")
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
            check_cache_call(cache, LatentCache, mask)
            cache.check(self, B, None, x.device)  # dtype: in update, after autocast
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

    def as_plain(self) -> NoReturn:
        """Raises ``TypeError``: MLA has no plain view (see :func:`attnlib.multihead.plain_view`)."""
        raise TypeError(
            "LatentAttention has no plain view: multi-head latent attention (MLA) up-projects every "
            "head's keys and values from one shared latent and adds a shared rotary key (RoPE) to the "
            "scores, which the plain layer of chapters 2-4 does not have"
        )

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, d_c={self.d_c}, d_r={self.d_r}, "
            f"d_k={self.d_k}, d_v={self.d_v}, rope_base={self.rope_base:g}"
        )

