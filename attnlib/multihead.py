r"""Multi-head attention with fused per-role weights (chapters 2 and 3).

.. math::
    \mathrm{head}_i = \mathrm{Attention}(Q W_i^Q,\; K W_i^K,\; V W_i^V), \qquad
    \mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{h-1})\, W^O

with :math:`W_i^Q, W_i^K \in \mathbb{R}^{d_{model} \times d_k}`,
:math:`W_i^V \in \mathbb{R}^{d_{model} \times d_v}`,
:math:`W^O \in \mathbb{R}^{h d_v \times d_{model}}` and, as in the paper,
:math:`d_k = d_v = d_{model} / h` (Vaswani et al., 2017, section 3.2.2), unless a head width
``d_k`` is given: many models choose it apart from :math:`d_{model}` (Llama's ``head_dim``, T5's
``d_kv``), and nothing in the formula needs :math:`h d_k = d_{model}`.

:class:`MultiHeadAttention` stores the h per-head matrices of each role side by
side as one ``(d_model, h*d_k)`` matrix (``(d_model, d_model)`` in the paper). The literal form, h independent small
heads (:class:`~attnlib.separate.SeparateHeadsAttention`, chapters 3 and 5), builds on
this module and lives in :mod:`attnlib.separate`.

Every tool written for this plain layer (chapters 2-4: the circuits, the composition
scores, the explorers, the conversions) asks the module it is given for its plain view,
:func:`plain_view`, so that a later chapter's layer that computes something else (RoPE,
ALiBi, latent attention) is refused by its type, with a message naming the feature.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlib.attention import masked_softmax
from attnlib.checks import check_attention_inputs, check_heads, check_index, check_positive_int
from attnlib.interop.torch_mha import read_torch_mha, write_torch_mha
from attnlib.records import AttentionWeights, plain_record, record_tensors

__all__ = ["MultiHeadAttention", "HeadWeights", "plain_view"]

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

    ``MultiHeadAttention(d_model, num_heads, bias=True, *, d_k=None)``: ``d_k`` is the head
    width, ``d_model / num_heads`` by default; ``d_v = d_k``.

    Parameters (each used as ``x @ W``): ``w_q, w_k, w_v``: ``(d_model, h*d_k)``, ``w_o``:
    ``(h*d_v, d_model)``; biases ``b_q, b_k, b_v``: ``(h*d_k,)`` and ``b_o``: ``(d_model,)``
    when ``bias=True``. Head ``i`` owns columns ``i*d_k:(i+1)*d_k`` of ``w_q, w_k, w_v`` and
    rows ``i*d_v:(i+1)*d_v`` of ``w_o``; :meth:`head` and the ``*_heads`` properties return
    views of them.

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

    This is the layer of chapters 2-5, with no positions; chapter 8 extends it
    (:class:`attnlib.decoding.DecoderAttention`: grouped keys and values, RoPE, the KV
    cache).

    Initialisation: each weight matrix Xavier-uniform, biases zero.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        bias: bool = True,
        *,
        d_k: int | None = None,
        device: Device = None,
        dtype: DType = None,
    ) -> None:
        super().__init__()
        self.d_k = check_heads(d_model, num_heads, d_k)
        self.d_model = d_model
        self.num_heads = num_heads
        hd = num_heads * self.d_k  # the heads side by side: d_model in the paper
        self.w_q = nn.Parameter(torch.empty(d_model, hd, device=device, dtype=dtype))  # (d_model, h*d_k)
        self.w_k = nn.Parameter(torch.empty(d_model, hd, device=device, dtype=dtype))  # (d_model, h*d_k)
        self.w_v = nn.Parameter(torch.empty(d_model, hd, device=device, dtype=dtype))  # (d_model, h*d_v)
        self.w_o = nn.Parameter(torch.empty(hd, d_model, device=device, dtype=dtype))  # (h*d_v, d_model)
        if bias:
            self.b_q = nn.Parameter(torch.empty(hd, device=device, dtype=dtype))  # (h*d_k,)
            self.b_k = nn.Parameter(torch.empty(hd, device=device, dtype=dtype))  # (h*d_k,)
            self.b_v = nn.Parameter(torch.empty(hd, device=device, dtype=dtype))  # (h*d_v,)
            self.b_o = nn.Parameter(torch.empty(d_model, device=device, dtype=dtype))  # (d_model,)
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

    @staticmethod
    def _project(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        """``x @ w + b`` in one fused call; ``w`` is ``(d_in, d_out)``."""
        return F.linear(x, w.T, b)

    def reset_parameters(self) -> None:
        """Xavier-uniform weights (bound ``sqrt(6 / (d_model + h d_k))``), zero biases."""
        for w in (self.w_q, self.w_k, self.w_v, self.w_o):
            nn.init.xavier_uniform_(w)
        for b in (self.b_q, self.b_k, self.b_v, self.b_o):
            if b is not None:
                nn.init.zeros_(b)

    # ---- per-head views -------------------------------------------------------
    def _split_heads(self, x: Tensor) -> Tensor:
        """``(B, n, heads*d_k)`` -> ``(B, heads, n, d_k)``: head ``i`` gets columns ``i*d_k:(i+1)*d_k`` (a view)."""
        B, n, _ = x.shape
        return x.view(B, n, -1, self.d_k).transpose(1, 2)  # (B, heads, n, d_k)

    def _split_columns(self, w: Tensor) -> Tensor:
        """``(d_model, heads*d_k)`` -> ``(heads, d_model, d_k)`` (a view)."""
        return w.view(self.d_model, -1, self.d_k).transpose(0, 1)  # (heads, d_model, d_k)

    @property
    def w_q_heads(self) -> Tensor:
        """``(h, d_model, d_k)``: ``w_q_heads[i]`` is :math:`W_i^Q`, a view of ``w_q``."""
        return self._split_columns(self.w_q)

    @property
    def w_k_heads(self) -> Tensor:
        """``(h, d_model, d_k)``: ``w_k_heads[i]`` is :math:`W_i^K`, a view of ``w_k``."""
        return self._split_columns(self.w_k)

    @property
    def w_v_heads(self) -> Tensor:
        """``(h, d_model, d_v)``: ``w_v_heads[i]`` is :math:`W_i^V`, a view of ``w_v``."""
        return self._split_columns(self.w_v)

    @property
    def w_o_heads(self) -> Tensor:
        """``(h, d_v, d_model)``: ``w_o_heads[i]`` is :math:`W_i^O`, the rows of ``w_o``
        that multiply head i's output in the concatenation; a view of ``w_o``."""
        return self.w_o.view(self.num_heads, self.d_v, self.d_model)

    def head(self, i: int) -> HeadWeights:
        """Head ``i``'s weights as views into the fused parameters."""
        i = check_index("head", i, self.num_heads, f"num_heads={self.num_heads}")
        cols = slice(i * self.d_k, (i + 1) * self.d_k)
        return HeadWeights(
            w_q=self.w_q[:, cols],
            w_k=self.w_k[:, cols],
            w_v=self.w_v[:, cols],
            w_o=self.w_o[cols, :],
            b_q=None if self.b_q is None else self.b_q[cols],
            b_k=None if self.b_k is None else self.b_k[cols],
            b_v=None if self.b_v is None else self.b_v[cols],
        )

    # ---- forward: project, split, attend, merge, project --------------------------
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = True,
        *,
        cache: None = None,
    ) -> tuple[Tensor, Tensor | None]:
        r""":math:`\mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{h-1})\, W^O`, all heads at once,
        :math:`\mathrm{head}_i = \mathrm{softmax}(q_i k_i^\top / \sqrt{d_k})\, v_i`. Shapes: see the class.

        ``cache``: this layer keeps no KV cache; one passed here is refused (``TypeError``)
        with where the cache is: chapter 8's decoder layer, which takes one.
        """
        if cache is not None:
            raise TypeError(
                f"{type(self).__name__} keeps no KV cache (cache={type(cache).__name__}): the plain layer "
                f"attends over the keys it is given; a cache is attnlib.DecoderAttention's (chapter 8), "
                f"built as DecoderAttention.from_projections(layer.projections(), layer.num_heads)"
            )
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

    # ---- the plain view and conversions ----------------------------------------------
    def as_plain(self) -> MultiHeadAttention:
        """The plain layer of chapters 2-4 that computes this module's function: the
        module itself. Every class of attnlib says what plain view of itself it can give
        (a later chapter's layer returns a plain copy, or raises, naming what the plain
        layer lacks); :func:`plain_view` asks for it."""
        return self

    def projections(self) -> AttentionWeights:
        """The four projections and biases (detached copies), paper orientation."""

        def c(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().clone()

        return AttentionWeights(
            w_q=c(self.w_q), w_k=c(self.w_k), w_v=c(self.w_v), w_o=c(self.w_o),  # type: ignore[arg-type]
            b_q=c(self.b_q), b_k=c(self.b_k), b_v=c(self.b_v), b_o=c(self.b_o),
        )

    @classmethod
    def from_projections(cls, weights: AttentionWeights, num_heads: int) -> Self:
        """A module holding copies of the projections ``weights`` (paper orientation, what
        :meth:`projections` returns), with ``num_heads`` heads of width
        ``d_k = weights.heads_width / num_heads``.

        Raises:
            TypeError: ``weights`` is not an :class:`~attnlib.AttentionWeights`, or is the
                record of a layer that adds more than weights (ALiBi), named by
                ``weights.as_plain()``; ``num_heads`` not an int.
            ValueError: ``num_heads`` does not divide ``h*d_k``.
        """
        weights = plain_record(weights)
        h, hd = check_positive_int("num_heads", num_heads), weights.heads_width
        if hd % h:
            raise ValueError(f"num_heads ({h}) must divide the weights' h*d_k = {hd} (w_q is {tuple(weights.w_q.shape)})")
        layer = cls(weights.d_model, h, bias=weights.bias, d_k=hd // h, device=weights.w_q.device,
                    dtype=weights.w_q.dtype)
        layer.load_state_dict(record_tensors(weights))  # copies, checked against the shapes
        return layer

    @classmethod
    def from_weights(cls, weights: AttentionWeights, num_heads: int) -> Self:
        """:meth:`from_projections`, by its name from before the rename (the book's chapters and
        other code call it): "weights" alone means the softmax map in the book."""
        return cls.from_projections(weights, num_heads)

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> Self:
        """The same function as ``m`` (batch-first inputs; ``m`` in eval mode, since
        attnlib has no dropout). Weights are copied and transposed to ``x @ W``
        (:func:`attnlib.interop.read_torch_mha`).

        Raises:
            TypeError: ``m`` is not an ``nn.MultiheadAttention`` (the message names the readers
                of :mod:`attnlib.interop` that build a reference from other layouts).
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(
                f"expected torch.nn.MultiheadAttention, got {type(m).__name__}: from_torch reads torch's module "
                f"only; build the reference from your module's weights with a reader of attnlib.interop, e.g. "
                f"MultiHeadAttention.from_weights(read_separate_linear((q.weight, q.bias), (k.weight, k.bias), "
                f"(v.weight, v.bias), (o.weight, o.bias)), num_heads) for four nn.Linear layers; "
                f"read_packed_linear for one packed q/k/v layer (nanoGPT's c_attn), read_conv1d for GPT-2, "
                f"read_linear_heads for a list of heads, read_llama for Llama-style layers (chapter 9)"
            )
        return cls.from_projections(read_torch_mha(m), m.num_heads)

    def to_torch(self) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention(batch_first=True)`` computing the same function,
        built from :func:`plain_view` (a layer torch's module cannot compute is refused; so is
        ``h*d_k != d_model``: torch's heads are ``embed_dim / num_heads`` wide)."""
        plain = plain_view(self, "self", "to_torch")
        return write_torch_mha(plain.projections(), plain.num_heads, batch_first=True)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_heads={self.num_heads}, d_k={self.d_k}, bias={self.bias}"


def plain_view(module: object, name: str, user: str) -> MultiHeadAttention:
    """The plain layer of chapters 2-4 that ``module`` computes, asked of its class:
    what every tool written for that layer calls first (``user`` names the tool, ``name``
    its argument).

    ``module.as_plain()``: a :class:`MultiHeadAttention` returns itself; chapter 8's
    decoder layer without RoPE a plain copy with its key/value groups written out; a
    layer that computes something the plain layer cannot (RoPE, ALiBi, latent
    attention) raises, naming it. A subclass that does not define its own ``as_plain``
    is refused: it may change what the layer computes, and has not said that it does not.

    Raises:
        TypeError: ``module``'s class has no ``as_plain`` (it is not an attention layer of
            attnlib), inherits it without defining its own, or refuses by its type (ALiBi,
            latent attention).
        ValueError: ``module`` refuses by a value of its own (``rope_base``).
    """
    kind = type(module)
    if not callable(getattr(kind, "as_plain", None)):
        raise TypeError(f"{name} must be an attnlib.MultiHeadAttention, got {kind.__name__}")
    if "as_plain" not in vars(kind):
        raise TypeError(
            f"{user} cannot read {kind.__name__}: it inherits as_plain() without defining its own, so it "
            f"does not say whether it computes the plain layer's function (a subclass may add positions, "
            f"groups or a bias); define {kind.__name__}.as_plain()"
        )
    try:
        plain: Any = module.as_plain()  # type: ignore[attr-defined]
    except (TypeError, ValueError) as error:
        raise type(error)(f"{user}: {error}") from error
    if not isinstance(plain, MultiHeadAttention):
        raise TypeError(f"{kind.__name__}.as_plain() must return an attnlib.MultiHeadAttention, got {type(plain).__name__}")
    return plain
