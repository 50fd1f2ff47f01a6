"""Reading and writing attention weights in other libraries' layouts (chapter 5).

attnlib keeps one orientation everywhere, the paper's: ``y = x @ W + b`` with
``W`` of shape ``(d_in, d_out)``. Every conversion to or from another layout lives
here, named for the layout it reads or writes, and is round-trip tested.

=====================================  =======================================
layout                                  what it stores
=====================================  =======================================
attnlib / the paper                     ``W^Q, W^K, W^V, W^O``: ``(d_model, d_model)``, ``x @ W``
``torch.nn.MultiheadAttention``         ``in_proj_weight`` = ``[W^Q; W^K; W^V]ᵀ`` stacked: ``(3E, E)``,
                                        ``out_proj.weight`` = ``(W^O)ᵀ``: ``(E, E)``
separate ``nn.Linear`` (BERT)           ``query/key/value/output.dense.weight`` = ``Wᵀ``: ``(out, in)``
=====================================  =======================================

Masks: attnlib uses ``True`` = may attend; ``nn.MultiheadAttention``'s
``attn_mask`` and ``key_padding_mask`` use ``True`` = may **not** attend.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

__all__ = [
    "AttentionWeights",
    "read_torch_mha",
    "write_torch_mha",
    "read_separate_linear",
    "write_separate_linear",
    "torch_attn_mask",
]


@dataclass(frozen=True)
class AttentionWeights:
    """The four projections of one multi-head attention layer, paper orientation.

    ``w_q, w_k, w_v``: ``(d_model, d_model)``, ``w_o``: ``(d_model, d_model)``, each
    used as ``x @ w``; biases ``(d_model,)`` or all ``None``. Head ``i`` owns columns
    ``i*d_k:(i+1)*d_k`` of ``w_q, w_k, w_v`` and rows ``i*d_v:(i+1)*d_v`` of ``w_o``.
    """

    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    w_o: Tensor
    b_q: Tensor | None = None
    b_k: Tensor | None = None
    b_v: Tensor | None = None
    b_o: Tensor | None = None

    def __post_init__(self) -> None:
        d_model = self.w_q.shape[0] if self.w_q.dim() == 2 else -1
        for f in fields(self):
            t = getattr(self, f.name)
            if f.name.startswith("w_"):
                if t.shape != (d_model, d_model):
                    raise ValueError(
                        f"{f.name} must have shape (d_model, d_model) = ({d_model}, {d_model}), "
                        f"got {tuple(t.shape)}"
                    )
            elif t is not None and t.shape != (d_model,):
                raise ValueError(f"{f.name} must have shape (d_model,) = ({d_model},), got {tuple(t.shape)}")
        has_bias = [getattr(self, n) is not None for n in ("b_q", "b_k", "b_v", "b_o")]
        if any(has_bias) and not all(has_bias):
            raise ValueError("biases must be given for all four projections or for none")

    @property
    def d_model(self) -> int:
        return int(self.w_q.shape[0])

    @property
    def bias(self) -> bool:
        return self.b_q is not None


def read_torch_mha(m: nn.MultiheadAttention) -> AttentionWeights:
    """Read a ``torch.nn.MultiheadAttention`` into paper orientation (copies).

    ``in_proj_weight`` is ``(3E, E)`` in ``nn.Linear`` orientation ``(out, in)``:
    rows ``0:E`` are ``(W^Q)ᵀ``, ``E:2E`` are ``(W^K)ᵀ``, ``2E:3E`` are ``(W^V)ᵀ``.

    Raises:
        ValueError: for features attnlib does not have (``kdim``/``vdim`` other than
            ``embed_dim``, ``add_bias_kv``, ``add_zero_attn``), naming the feature.
    """
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(m).__name__}")
    if not m._qkv_same_embed_dim:
        raise ValueError(
            f"kdim={m.kdim} and vdim={m.vdim} must equal embed_dim={m.embed_dim}: "
            "attnlib.MultiHeadAttention takes keys and values of width d_model"
        )
    if m.bias_k is not None:
        raise ValueError("add_bias_kv=True is not supported by attnlib.MultiHeadAttention")
    if m.add_zero_attn:
        raise ValueError("add_zero_attn=True is not supported by attnlib.MultiHeadAttention")
    e = m.embed_dim
    w = m.in_proj_weight.detach()  # (3E, E), (out, in)
    b = m.in_proj_bias.detach() if m.in_proj_bias is not None else None  # (3E,)
    b_o = m.out_proj.bias.detach() if m.out_proj.bias is not None else None
    if (b is None) != (b_o is None):
        raise ValueError("in_proj_bias and out_proj.bias must both exist or both be absent")
    return AttentionWeights(
        w_q=w[:e].T.clone(),
        w_k=w[e : 2 * e].T.clone(),
        w_v=w[2 * e :].T.clone(),
        w_o=m.out_proj.weight.detach().T.clone(),
        b_q=None if b is None else b[:e].clone(),
        b_k=None if b is None else b[e : 2 * e].clone(),
        b_v=None if b is None else b[2 * e :].clone(),
        b_o=None if b_o is None else b_o.clone(),
    )


def write_torch_mha(weights: AttentionWeights, num_heads: int, batch_first: bool = True) -> nn.MultiheadAttention:
    """Build a ``torch.nn.MultiheadAttention`` holding ``weights`` (the inverse of
    :func:`read_torch_mha`): ``in_proj_weight = [W^Q | W^K | W^V]ᵀ``, ``(3E, E)``."""
    e = weights.d_model
    w_q = weights.w_q
    m = nn.MultiheadAttention(
        e, num_heads, bias=weights.bias, batch_first=batch_first, device=w_q.device, dtype=w_q.dtype
    )
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.cat([weights.w_q, weights.w_k, weights.w_v], dim=1).T)
        m.out_proj.weight.copy_(weights.w_o.T)
        if weights.bias:
            assert m.in_proj_bias is not None and weights.b_q is not None
            m.in_proj_bias.copy_(torch.cat([weights.b_q, weights.b_k, weights.b_v]))  # type: ignore[list-item]
            m.out_proj.bias.copy_(weights.b_o)  # type: ignore[arg-type]
    return m


def read_separate_linear(
    q: tuple[Tensor, Tensor | None],
    k: tuple[Tensor, Tensor | None],
    v: tuple[Tensor, Tensor | None],
    o: tuple[Tensor, Tensor | None],
) -> AttentionWeights:
    """Read four ``nn.Linear``-layout ``(weight, bias)`` pairs, as BERT stores its
    ``query``, ``key``, ``value`` and ``output.dense`` layers.

    Each ``weight`` is ``(d_out, d_in)`` (``y = x @ weight.T + bias``), so the paper's
    ``W`` is ``weight.T``. Returns copies in paper orientation.
    """
    pairs = {"q": q, "k": k, "v": v, "o": o}
    for name, (w, b) in pairs.items():
        if w.dim() != 2 or w.shape[0] != w.shape[1]:
            raise ValueError(f"{name} weight must be square (d_model, d_model), got {tuple(w.shape)}")
    return AttentionWeights(
        w_q=q[0].detach().T.clone(),
        w_k=k[0].detach().T.clone(),
        w_v=v[0].detach().T.clone(),
        w_o=o[0].detach().T.clone(),
        b_q=None if q[1] is None else q[1].detach().clone(),
        b_k=None if k[1] is None else k[1].detach().clone(),
        b_v=None if v[1] is None else v[1].detach().clone(),
        b_o=None if o[1] is None else o[1].detach().clone(),
    )


def write_separate_linear(weights: AttentionWeights) -> dict[str, nn.Linear]:
    """Four ``nn.Linear`` layers ``{"q", "k", "v", "o"}`` computing ``x @ W + b``
    (the inverse of :func:`read_separate_linear`)."""
    e = weights.d_model
    layers: dict[str, nn.Linear] = {}
    for name in ("q", "k", "v", "o"):
        w, b = getattr(weights, f"w_{name}"), getattr(weights, f"b_{name}")
        lin = nn.Linear(e, e, bias=weights.bias, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w.T)
            if b is not None:
                lin.bias.copy_(b)
        layers[name] = lin
    return layers


def torch_attn_mask(mask: Tensor) -> Tensor:
    """attnlib's mask (``True`` = may attend) as ``nn.MultiheadAttention``'s
    ``attn_mask`` (``True`` = may not attend): the logical negation."""
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must have dtype torch.bool, got {mask.dtype}")
    return ~mask
