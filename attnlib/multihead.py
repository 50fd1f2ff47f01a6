r"""Multi-head attention with fused per-role weights (chapters 2 and 3).

.. math::
    \mathrm{head}_i = \mathrm{Attention}(Q W_i^Q,\; K W_i^K,\; V W_i^V), \qquad
    \mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{h-1})\, W^O

with :math:`W_i^Q, W_i^K \in \mathbb{R}^{d_{model} \times d_k}`,
:math:`W_i^V \in \mathbb{R}^{d_{model} \times d_v}`,
:math:`W^O \in \mathbb{R}^{h d_v \times d_{model}}` and
:math:`d_k = d_v = d_{model} / h` (Vaswani et al., 2017, section 3.2.2).

:class:`MultiHeadAttention` stores the h per-head matrices of each role side by
side as one ``(d_model, d_model)`` matrix. The literal form, h independent small
heads (:class:`~attnlib.separate.SeparateHeadsAttention`, chapters 3 and 5), builds on
this module and lives in :mod:`attnlib.separate`.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlib._core import (
    AttentionWeights,
    check_attention_inputs,
    check_heads,
    check_index,
    read_torch_mha,
    write_torch_mha,
)
from attnlib.attention import masked_softmax

__all__ = ["MultiHeadAttention", "SeparateHeadsAttention", "HeadWeights"]

Device = torch.device | str | None  # what the constructors take as device= and dtype=
DType = torch.dtype | None


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


class MultiHeadAttention(nn.Module):
    r"""Multi-head attention with fused per-role weights, paper orientation.

    Parameters (each used as ``x @ W``): ``w_q, w_k, w_v, w_o``: ``(d_model, d_model)``;
    biases ``b_q, b_k, b_v, b_o``: ``(d_model,)`` when ``bias=True``. Head ``i`` owns
    columns ``i*d_k:(i+1)*d_k`` of ``w_q, w_k, w_v`` and rows ``i*d_v:(i+1)*d_v`` of
    ``w_o``; :meth:`head` and the ``*_heads`` properties return views of them.

    Call: ``out, weights = mha(query, key, value, mask=None, need_weights=True)``

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

    This is the layer of chapters 2-5: one key and one value head per query head
    (``num_kv_heads == num_heads``) and no positions (``rope_base is None``).
    Chapter 8's decoder features, grouped keys and values, RoPE and the KV cache, are
    a subclass, :class:`attnlib.decoding.DecoderAttention`. For code written before
    the split, ``MultiHeadAttention(..., num_kv_heads=g, rope_base=b)`` still works: it
    builds that subclass.

    Initialisation: each weight matrix Xavier-uniform, biases zero.
    """

    num_kv_heads: int  # key/value heads: num_heads here, fewer in DecoderAttention
    rope_base: float | None  # RoPE's theta: None here (no positions)
    # The decoder subclass, registered by attnlib.decoding (a later chapter) when it is
    # imported, so that this module imports nothing of chapter 8.
    _decoder_class: ClassVar[type["MultiHeadAttention"] | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "MultiHeadAttention":
        num_heads = kwargs.get("num_heads", args[1] if len(args) > 1 else None)
        wants_decoder = kwargs.get("rope_base") is not None or kwargs.get("num_kv_heads") not in (None, num_heads)
        if cls is MultiHeadAttention and wants_decoder:
            if MultiHeadAttention._decoder_class is None:
                raise TypeError("num_kv_heads and rope_base need attnlib.decoding.DecoderAttention: import attnlib")
            cls = MultiHeadAttention._decoder_class
        return super().__new__(cls)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        bias: bool = True,
        *,
        num_kv_heads: int | None = None,
        rope_base: float | None = None,
        device: Device = None,
        dtype: DType = None,
    ) -> None:
        super().__init__()
        self.d_k = check_heads(d_model, num_heads)
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads, self.rope_base = self._check_decoder_options(num_kv_heads, rope_base)
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

    def _check_decoder_options(self, num_kv_heads: object, rope_base: object) -> tuple[int, float | None]:
        """The plain layer: ``num_kv_heads`` None or ``num_heads``, ``rope_base`` None.
        (:class:`~attnlib.decoding.DecoderAttention` overrides this.)"""
        if num_kv_heads not in (None, self.num_heads) or rope_base is not None:
            raise ValueError(
                f"{type(self).__name__} is the plain layer (num_kv_heads = num_heads, no RoPE), got "
                f"num_kv_heads={num_kv_heads!r}, rope_base={rope_base!r}: use attnlib.decoding.DecoderAttention"
            )
        return self.num_heads, None

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

    @staticmethod
    def _project(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        """``x @ w + b`` in one fused call; ``w`` is ``(d_in, d_out)``."""
        return F.linear(x, w.T, b)

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

    # ---- forward: project, split, attend, merge, project --------------------------
    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None, need_weights: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        r""":math:`\mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{h-1})\, W^O`, all heads at once,
        :math:`\mathrm{head}_i = \mathrm{softmax}(q_i k_i^\top / \sqrt{d_k})\, v_i`. Shapes: see the class.
        """
        check_attention_inputs(query, key, value, mask, self.d_model, self.num_heads)
        # project: one product per role, then a view hands each head its d_k columns
        q = self._split_heads(self._project(query, self.w_q, self.b_q))  # (B, h, n_q, d_k)
        k = self._split_heads(self._project(key, self.w_k, self.b_k))  # (B, h, n_k, d_k)
        v = self._split_heads(self._project(value, self.w_v, self.b_v))  # (B, h, n_k, d_v)
        # attend: every head at once
        heads, weights = self._attend(q, k, v, mask, need_weights)  # (B, h, n_q, d_v), (B, h, n_q, n_k)
        # concatenate the heads and project back
        return self._merge(heads), weights  # (B, n_q, d_model)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Scaled dot-product attention of every head: ``q`` ``(B, H, m, d_k)``, ``k``, ``v``
        ``(B, H, n_k, d_k)``, ``mask`` broadcastable to ``(B, H, m, n_k)`` -> ``(B, H, m, d_v)``
        and the weights ``(B, H, m, n_k)`` (``None`` with ``need_weights=False``: SDPA)."""
        if not need_weights:
            if mask is not None and mask.dim() == 1:
                mask = mask.unsqueeze(0)  # (n_k,) -> (1, n_k): SDPA rejects a 1-D mask
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), None  # (B, H, m, d_v)
        scores = (q * self.d_k**-0.5) @ k.transpose(-2, -1)  # (B, H, m, n_k)
        if mask is None and not scores.requires_grad:
            # in place: no autograd graph keeps the scores; one fewer B*h*n_q*n_k buffer
            # saved about a sixth of this pass's time at the book's reference layer (CPU)
            weights = torch.softmax(scores, dim=-1, out=scores)  # (B, H, m, n_k)
        else:
            weights = masked_softmax(scores, mask)  # (B, H, m, n_k); all 0 for a query with no key
        return weights @ v, weights  # (B, H, m, d_v), (B, H, m, n_k)

    def _merge(self, heads: Tensor) -> Tensor:
        """Concatenate the heads and apply :math:`W^O`: ``(B, h, n_q, d_v)`` -> ``(B, n_q, d_model)``."""
        B, h, n_q, d_v = heads.shape
        concat = heads.transpose(1, 2).reshape(B, n_q, h * d_v)  # (B, n_q, h*d_v)
        return self._project(concat, self.w_o, self.b_o)  # (B, n_q, d_model)

    # ---- conversions --------------------------------------------------------------
    def projections(self) -> AttentionWeights:
        """The four projections and biases (detached copies), paper orientation.

        Raises:
            ValueError: for grouped keys and values (``num_kv_heads != num_heads``), whose
                ``w_k``, ``w_v`` are narrower than ``AttentionWeights`` holds; use
                :meth:`~attnlib.decoding.DecoderAttention.grouped_weights`. (RoPE is not a
                weight: the record leaves it out.)
        """
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"projections() holds (d_model, d_model) matrices, but this module has "
                f"num_kv_heads={self.num_kv_heads} < num_heads={self.num_heads}; use grouped_weights()"
            )

        def c(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().clone()

        return AttentionWeights(
            w_q=c(self.w_q), w_k=c(self.w_k), w_v=c(self.w_v), w_o=c(self.w_o),  # type: ignore[arg-type]
            b_q=c(self.b_q), b_k=c(self.b_k), b_v=c(self.b_v), b_o=c(self.b_o),
        )

    def attention_weights(self) -> AttentionWeights:
        """Deprecated name of :meth:`projections` (which this calls): "weights" means the
        softmax map everywhere else in the book. Kept for one release."""
        warnings.warn(
            "MultiHeadAttention.attention_weights() is now projections(); the old name goes in the next release",
            DeprecationWarning, stacklevel=2,
        )
        return self.projections()

    def _copy_from(self, weights: Any) -> None:
        """Copy the four projections and biases of a record of the same shapes into this module."""
        with torch.no_grad():
            for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
                src = getattr(weights, name)
                if src is not None:
                    getattr(self, name).copy_(src)

    @classmethod
    def from_weights(cls, weights: Any, num_heads: int) -> "MultiHeadAttention":
        """A module holding copies of ``weights`` (paper orientation).

        A record with grouped keys/values or RoPE (chapter 8's
        :class:`~attnlib.decoding.GroupedAttentionWeights`, what ``grouped_weights()``
        returns) keeps its ``num_kv_heads`` and ``rope_base``: the module is then a
        :class:`~attnlib.decoding.DecoderAttention`, and ``num_heads`` must equal
        ``weights.num_heads``.

        Raises:
            TypeError: ``weights`` is neither record.
            ValueError: ``num_heads`` differs from a grouped record's own.
        """
        if hasattr(weights, "num_kv_heads"):  # a GroupedAttentionWeights (chapter 8)
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

    @classmethod
    def from_grouped_weights(cls, weights: Any) -> "MultiHeadAttention":
        """Chapter 8's :meth:`attnlib.decoding.DecoderAttention.from_grouped_weights`
        (a module with the record's heads, groups and RoPE), reachable from here."""
        decoder = MultiHeadAttention._decoder_class
        if decoder is None:  # pragma: no cover - attnlib/__init__ imports attnlib.decoding
            raise TypeError("grouped weights need attnlib.decoding: import attnlib")
        return decoder.from_grouped_weights(weights)

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
                has neither (``expand_kv_heads()`` removes the grouping).
        """
        if self.num_kv_heads != self.num_heads or self.rope_base is not None:
            raise ValueError(
                f"torch.nn.MultiheadAttention has no grouped keys/values and no RoPE; this module has "
                f"num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads}, rope_base={self.rope_base}"
            )
        return write_torch_mha(self.projections(), self.num_heads, batch_first=True)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_heads={self.num_heads}, d_k={self.d_k}, bias={self.bias}"


def __getattr__(name: str) -> Any:
    """``attnlib.multihead.SeparateHeadsAttention``, where it was defined before it got its
    own module: imported on first use, so that this module imports nothing built on it, and
    deprecated (it goes in the next release; import it from ``attnlib`` or ``attnlib.separate``)."""
    if name == "SeparateHeadsAttention":
        warnings.warn(
            "attnlib.multihead.SeparateHeadsAttention is now attnlib.separate.SeparateHeadsAttention "
            "(also attnlib.SeparateHeadsAttention); the old path goes in the next release",
            DeprecationWarning, stacklevel=2,
        )
        from attnlib.separate import SeparateHeadsAttention

        return SeparateHeadsAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
