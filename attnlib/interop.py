"""Reading and writing attention weights in other libraries' layouts (chapter 5).

attnlib keeps one orientation everywhere, the paper's: ``y = x @ W + b`` with
``W`` of shape ``(d_in, d_out)``. Every conversion to or from another layout lives
here, named for the layout it reads or writes, and is round-trip tested.

=====================================  =======================================
layout                                  what it stores (``d = d_model = E``)
=====================================  =======================================
attnlib / the paper                     ``W^Q, W^K, W^V, W^O``: ``(d, d)`` each, ``x @ W``
``torch.nn.MultiheadAttention``         ``in_proj_weight`` = ``[W^Q | W^K | W^V]ᵀ``: ``(3E, E)``,
                                        ``out_proj.weight`` = ``(W^O)ᵀ``: ``(E, E)``
packed ``nn.Linear(d, 3d)`` (nanoGPT)   ``c_attn.weight`` = ``[W^Q | W^K | W^V]ᵀ``: ``(3d, d)``,
                                        ``c_proj.weight`` = ``(W^O)ᵀ``: ``(d, d)``
separate ``nn.Linear`` (BERT)           ``query/key/value/output.dense.weight`` = ``Wᵀ``: ``(out, in)``;
                                        BERT keeps W^O in another module (``read_bert``)
a list of heads (Raschka's wrapper)     head ``i``: ``W_query/W_key/W_value.weight`` = ``(W_i)ᵀ``: ``(d_k, d)``;
                                        W^O one ``nn.Linear`` or none (``read_linear_heads``)
GPT-2 ``Conv1D`` (in, out)              ``c_attn.weight`` = ``[W^Q | W^K | W^V]``: ``(d, 3d)``,
                                        ``c_proj.weight`` = ``W^O``: ``(d, d)``
Hugging Face Llama (chapter 8)          ``q_proj.weight`` = ``(W^Q)ᵀ``: ``(h d_k, d)``,
                                        ``k_proj/v_proj.weight`` = ``(W^K)ᵀ, (W^V)ᵀ``: ``(g d_k, d)``
                                        (``g`` key/value heads), ``o_proj.weight`` = ``(W^O)ᵀ``: ``(d, h d_k)``
=====================================  =======================================

Readers (``read_*``) return an :class:`AttentionWeights` of copies (``read_llama``: a
:class:`GroupedAttentionWeights`); writers (``write_*``) take one and return the other
layout. ``read_X(write_X(w)) == w`` exactly: the conversions only transpose, cut and
concatenate.

Masks: attnlib uses ``True`` = may attend; ``nn.MultiheadAttention``'s
``attn_mask`` and ``key_padding_mask`` use ``True`` = may **not** attend. Hugging Face
models take a 0/1 ``attention_mask`` ``(B, n_k)``; in transformers 5 ``BertModel`` hands
its layers ``create_bidirectional_mask``'s ``(B, 1, n_q, n_k)`` mask (additive, 0 or
``finfo(dtype).min``, with eager attention; boolean, ``True`` = may attend, with SDPA;
``None`` when nothing is padding). The helpers ``additive_mask``, ``mask_from_additive``,
``mask_from_padding``, ``hf_extended_mask``, ``to_torch_mha_masks``,
``from_torch_mha_masks`` and ``fully_masked_rows`` convert between these.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlib._core import (
    AttentionWeights,
    check_head_mask,
    check_positive_int,
    check_tensor,
    rounding_tolerance,
    format_shape,
    pack_qkv,
    read_torch_mha,
    split_qkv,
    write_torch_mha,
)
from attnlib.decoding import GroupedAttentionWeights
from attnlib.decoding.rope import rope_inv_freq

__all__ = [
    "AttentionWeights",
    "read_torch_mha",
    "write_torch_mha",
    "read_separate_linear",
    "write_separate_linear",
    "read_packed_linear",
    "write_packed_linear",
    "read_conv1d",
    "write_conv1d",
    "torch_attn_mask",
    "read_bert",
    "write_bert",
    "read_linear_heads",
    "write_linear_heads",
]

WeightAndBias = tuple[Tensor, Tensor | None]
"""A ``(weight, bias)`` pair as one layer stores it; ``bias`` may be ``None``."""

# AttentionWeights, read_torch_mha and write_torch_mha live in attnlib._core (the
# fused module converts to and from torch's layout too); they are part of this
# module's interface all the same.


def _check_pair(name: str, pair: object) -> WeightAndBias:
    """``pair`` if it is a ``(weight, bias)`` pair of tensors (``bias`` may be ``None``)."""
    if not (
        isinstance(pair, tuple)
        and len(pair) == 2
        and isinstance(pair[0], Tensor)
        and (pair[1] is None or isinstance(pair[1], Tensor))
    ):
        raise TypeError(f"{name} must be a (weight, bias) pair of tensors (bias may be None), got {pair!r:.60}")
    return pair[0].detach(), None if pair[1] is None else pair[1].detach()


def read_separate_linear(q: WeightAndBias, k: WeightAndBias, v: WeightAndBias, o: WeightAndBias) -> AttentionWeights:
    """Read four ``nn.Linear``-layout ``(weight, bias)`` pairs, as BERT stores its
    ``query``, ``key``, ``value`` and ``output.dense`` layers.

    Each ``weight`` is ``(d_out, d_in)`` (``y = x @ weight.T + bias``), so the paper's
    ``W`` is ``weight.T``. Returns copies in paper orientation.

    Biases on some layers only (Raschka's default: ``W_query/W_key/W_value`` without bias,
    ``out_proj`` with one) are read with zeros for the missing ones, which computes the
    same function.

    Raises:
        TypeError: an argument that is not a ``(weight, bias)`` pair of tensors.
        ValueError: a weight that is not square, or a bias of the wrong shape.
    """
    pairs = {name: _check_pair(name, pair) for name, pair in (("q", q), ("k", k), ("v", v), ("o", o))}
    for name, (w, _) in pairs.items():
        if w.dim() != 2 or w.shape[0] != w.shape[1]:
            raise ValueError(f"{name} weight must be square (d_model, d_model), got {format_shape(w)}")
    biases = _zeros_for_missing({name: (w, b) for name, (w, b) in pairs.items()})
    return AttentionWeights(
        w_q=pairs["q"][0].T.clone(),
        w_k=pairs["k"][0].T.clone(),
        w_v=pairs["v"][0].T.clone(),
        w_o=pairs["o"][0].T.clone(),
        b_q=biases["q"],
        b_k=biases["k"],
        b_v=biases["v"],
        b_o=biases["o"],
    )


def _zeros_for_missing(pairs: dict[str, WeightAndBias]) -> dict[str, Tensor | None]:
    """Copies of the biases of ``nn.Linear``-layout pairs (weight ``(d_out, d_in)``); when some
    are ``None`` and others not, zeros ``(d_out,)`` stand in for the missing ones."""
    if all(b is None for _, b in pairs.values()):
        return {name: None for name in pairs}
    return {
        name: b.clone() if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
        for name, (w, b) in pairs.items()
    }


def write_separate_linear(weights: AttentionWeights) -> dict[str, nn.Linear]:
    """Four ``nn.Linear`` layers ``{"q", "k", "v", "o"}`` computing ``x @ W + b``
    (the inverse of :func:`read_separate_linear`)."""
    e = weights.d_model
    biases = weights.biases
    layers: dict[str, nn.Linear] = {}
    for i, (name, w) in enumerate(zip("qkvo", (weights.w_q, weights.w_k, weights.w_v, weights.w_o))):
        lin = nn.Linear(e, e, bias=biases is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w.T)
            if biases is not None:
                lin.bias.copy_(biases[i])
        layers[name] = lin
    return layers


def read_bert(self_attention: nn.Module, self_output: nn.Module) -> AttentionWeights:
    """Read BERT's attention, whose W^O lives in another module: ``self_attention.query``,
    ``.key``, ``.value`` (``BertSelfAttention``) and ``self_output.dense`` (``BertSelfOutput``,
    whose dropout, residual and LayerNorm are not part of attention). Each an ``nn.Linear``
    ``(d, d)``; copies in paper orientation, as :func:`read_separate_linear`.

    Raises:
        TypeError: a layer missing or not an ``nn.Linear``.
    """
    layers = []
    for owner, where, name in ((self_attention, "self_attention", "query"), (self_attention, "self_attention", "key"),
                               (self_attention, "self_attention", "value"), (self_output, "self_output", "dense")):
        lin = getattr(owner, name, None)
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"{where}.{name} must be an nn.Linear, got {type(lin).__name__}")
        layers.append((lin.weight, lin.bias))
    return read_separate_linear(*layers)


def write_bert(weights: AttentionWeights) -> tuple[nn.ModuleDict, nn.ModuleDict]:
    """``(self_attention, self_output)``: ``nn.ModuleDict`` s with ``query, key, value`` and
    ``dense`` holding ``weights`` (the inverse of :func:`read_bert`); their ``state_dict()`` s
    load into a ``BertSelfAttention`` and a ``BertSelfOutput``'s dense layer of the same width."""
    layers = write_separate_linear(weights)
    self_attention = nn.ModuleDict({"query": layers["q"], "key": layers["k"], "value": layers["v"]})
    return self_attention, nn.ModuleDict({"dense": layers["o"]})


def read_linear_heads(
    heads: list[tuple[WeightAndBias, WeightAndBias, WeightAndBias]] | tuple[tuple[WeightAndBias, WeightAndBias, WeightAndBias], ...],
    o: WeightAndBias | None = None,
) -> AttentionWeights:
    r"""Read a list of heads, as Raschka's ``MultiHeadAttentionWrapper`` keeps them
    (``nn.ModuleList`` of single-head modules, concatenated): head ``i``'s ``(q, k, v)``
    ``nn.Linear`` pairs, weight ``(d_k, d_model)`` each, and ``o``, W^O's pair
    ``(d_model, d_model)``, or ``None`` for a wrapper that only concatenates (W^O = I).

    .. math::
        W^Q = [\,W_0^Q \,|\, \dots \,|\, W_{h-1}^Q\,], \qquad W_i^Q = (\texttt{heads[i][0].weight})^\top
        \in \mathbb{R}^{d_{model} \times d_k},

    and so for K and V. Partial biases read as zeros (see :func:`read_separate_linear`).
    Build the module with ``MultiHeadAttention.from_weights(w, num_heads=len(heads))``.

    Raises:
        TypeError: ``heads`` not a list of ``(q, k, v)`` pairs of tensors.
        ValueError: no heads, heads of different widths, or ``h * d_k != d_model``.
    """
    if not isinstance(heads, (list, tuple)) or not heads:
        raise ValueError(f"heads must be a non-empty list of (q, k, v) pairs, got {heads!r:.60}")
    per_role: dict[str, list[WeightAndBias]] = {"q": [], "k": [], "v": []}
    for i, head in enumerate(heads):
        if not (isinstance(head, (list, tuple)) and len(head) == 3):
            raise TypeError(f"heads[{i}] must be a (q, k, v) triple of (weight, bias) pairs, got {head!r:.60}")
        for role, pair in zip("qkv", head):
            per_role[role].append(_check_pair(f"heads[{i}].{role}", tuple(pair) if isinstance(pair, list) else pair))
    w0 = per_role["q"][0][0]
    d_k, d = (int(w0.shape[0]), int(w0.shape[1])) if w0.dim() == 2 else (-1, -1)
    for role, pairs in per_role.items():
        for i, (w, _) in enumerate(pairs):
            if tuple(w.shape) != (d_k, d):
                raise ValueError(f"heads[{i}].{role} weight must have shape (d_k, d_model) = ({d_k}, {d}) "
                                 f"like heads[0].q, got {format_shape(w)}")
    if d_k * len(heads) != d:
        raise ValueError(f"{len(heads)} heads of width d_k = {d_k} make {d_k * len(heads)} columns, "
                         f"not d_model = {d}: attnlib needs h * d_k = d_model")
    if o is None:
        o = (torch.eye(d, dtype=w0.dtype, device=w0.device), None)  # a wrapper that only concatenates

    def cat(role: str) -> WeightAndBias:
        pairs = per_role[role]
        biases = [b for _, b in pairs]
        b = None if all(x is None for x in biases) else torch.cat(
            [x if x is not None else w.new_zeros(d_k) for (w, _), x in zip(pairs, biases)])
        return torch.cat([w for w, _ in pairs], dim=0), b  # (h*d_k, d): nn.Linear layout

    return read_separate_linear(cat("q"), cat("k"), cat("v"), o)


def write_linear_heads(weights: AttentionWeights, num_heads: int) -> tuple[list[dict[str, nn.Linear]], nn.Linear]:
    """``(heads, o)``: ``num_heads`` dicts of ``nn.Linear(d_model, d_k)`` layers ``{"q", "k", "v"}``
    and W^O as ``nn.Linear(d_model, d_model)`` (the inverse of :func:`read_linear_heads`)."""
    d = weights.d_model
    d_k = d // check_positive_int("num_heads", num_heads)
    if d_k * num_heads != d:
        raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d})")
    layers = write_separate_linear(weights)
    heads = []
    for i in range(num_heads):
        rows = slice(i * d_k, (i + 1) * d_k)
        head = {}
        for role in "qkv":
            full = layers[role]
            lin = nn.Linear(d, d_k, bias=full.bias is not None, device=full.weight.device, dtype=full.weight.dtype)
            with torch.no_grad():
                lin.weight.copy_(full.weight[rows])  # (d_k, d)
                if full.bias is not None:
                    lin.bias.copy_(full.bias[rows])
            head[role] = lin
        heads.append(head)
    return heads, layers["o"]


def _packed_pairs(
    c_attn: WeightAndBias, c_proj: WeightAndBias, attn_out_first: bool
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """Check a packed layer pair and return ``(w_attn, b_attn, w_proj, b_proj)``, detached.

    ``attn_out_first``: ``c_attn.weight`` is ``(3d, d)`` (``nn.Linear``) when True,
    ``(d, 3d)`` (GPT-2 ``Conv1D``) when False.
    """
    layout = "(3*d_model, d_model), nn.Linear (out, in)" if attn_out_first else "(d_model, 3*d_model), Conv1D (in, out)"
    w_attn, b_attn = _check_pair("c_attn", c_attn)
    w_proj, b_proj = _check_pair("c_proj", c_proj)
    if w_attn.dim() != 2:
        raise ValueError(f"c_attn weight must have shape {layout}, got {format_shape(w_attn)}")
    d = int(w_attn.shape[1] if attn_out_first else w_attn.shape[0])
    expected = (3 * d, d) if attn_out_first else (d, 3 * d)
    if d == 0 or tuple(w_attn.shape) != expected:
        raise ValueError(f"c_attn weight must have shape {layout}, got {format_shape(w_attn)}")
    if tuple(w_proj.shape) != (d, d):
        raise ValueError(
            f"c_proj weight must have shape (d_model, d_model) = ({d}, {d}) to match c_attn, "
            f"got {format_shape(w_proj)}"
        )
    if b_attn is not None and tuple(b_attn.shape) != (3 * d,):
        raise ValueError(f"c_attn bias must have shape (3*d_model,) = ({3 * d},), got {format_shape(b_attn)}")
    if b_proj is not None and tuple(b_proj.shape) != (d,):
        raise ValueError(f"c_proj bias must have shape (d_model,) = ({d},), got {format_shape(b_proj)}")
    if (b_attn is None) != (b_proj is None):  # timm's qkv_bias=False with a biased proj: zeros
        b_attn = w_attn.new_zeros(3 * d) if b_attn is None else b_attn
        b_proj = w_proj.new_zeros(d) if b_proj is None else b_proj
    return w_attn, b_attn, w_proj, b_proj


def read_packed_linear(c_attn: WeightAndBias, c_proj: WeightAndBias) -> AttentionWeights:
    r"""Read a packed ``nn.Linear(d, 3d)`` + ``nn.Linear(d, d)`` pair, as nanoGPT's
    ``CausalSelfAttention`` stores ``c_attn`` and ``c_proj``.

    ``nn.Linear`` computes ``y = x @ weight.T + bias`` with ``weight``: ``(out, in)``, so

    .. math::
        \texttt{c\_attn.weight} = [W^Q \,|\, W^K \,|\, W^V]^\top \in \mathbb{R}^{3d \times d},
        \qquad \texttt{c\_proj.weight} = (W^O)^\top \in \mathbb{R}^{d \times d},

    and ``q, k, v = c_attn(x).split(d, dim=-1)`` are ``x @ W^Q``, ``x @ W^K``, ``x @ W^V``
    (the same numbers as ``nn.MultiheadAttention.in_proj_weight``).

    Args:
        c_attn: ``(weight (3d, d), bias (3d,) or None)``.
        c_proj: ``(weight (d, d), bias (d,) or None)``.

    Returns:
        copies in paper orientation.

    A bias on one layer only (timm's ``qkv_bias=False`` with a biased ``proj``) is read with
    zeros for the other, which computes the same function.

    Raises:
        ValueError: a weight or bias of the wrong shape (the message names it, the
            expected and the received shape).
    """
    w_attn, b_attn, w_proj, b_proj = _packed_pairs(c_attn, c_proj, attn_out_first=True)
    return split_qkv(w_attn.T, b_attn, w_proj.T, b_proj)  # (3d, d) -> (d, 3d)


def write_packed_linear(weights: AttentionWeights) -> dict[str, nn.Linear]:
    """Two ``nn.Linear`` layers ``{"c_attn": Linear(d, 3d), "c_proj": Linear(d, d)}``
    holding ``weights`` (the inverse of :func:`read_packed_linear`)."""
    d = weights.d_model
    w_qkv, b_qkv = pack_qkv(weights)  # (d, 3d), (3d,) or None
    c_attn = nn.Linear(d, 3 * d, bias=weights.bias, device=w_qkv.device, dtype=w_qkv.dtype)
    c_proj = nn.Linear(d, d, bias=weights.bias, device=w_qkv.device, dtype=w_qkv.dtype)
    with torch.no_grad():
        c_attn.weight.copy_(w_qkv.T)  # (3d, d)
        c_proj.weight.copy_(weights.w_o.T)  # (d, d)
        if b_qkv is not None and weights.b_o is not None:
            c_attn.bias.copy_(b_qkv)  # (3d,)
            c_proj.bias.copy_(weights.b_o)  # (d,)
    return {"c_attn": c_attn, "c_proj": c_proj}


def read_conv1d(c_attn: WeightAndBias, c_proj: WeightAndBias) -> AttentionWeights:
    r"""Read GPT-2's ``Conv1D`` pair ``c_attn`` + ``c_proj`` (Hugging Face ``GPT2Attention``).

    Despite its name, ``Conv1D(nf, nx)`` is a linear layer stored the paper's way round:
    ``y = x @ weight + bias`` with ``weight``: ``(in, out)`` = ``(nx, nf)``. So

    .. math::
        \texttt{c\_attn.weight} = [W^Q \,|\, W^K \,|\, W^V] \in \mathbb{R}^{d \times 3d},
        \qquad \texttt{c\_proj.weight} = W^O \in \mathbb{R}^{d \times d},

    no transpose needed: the packed columns are cut into three ``(d, d)`` blocks.

    Args:
        c_attn: ``(weight (d, 3d), bias (3d,) or None)``.
        c_proj: ``(weight (d, d), bias (d,) or None)``.

    Returns:
        copies in paper orientation.

    A bias on one layer only is read with zeros for the other.

    Raises:
        ValueError: a weight or bias of the wrong shape (the message names it, the
            expected and the received shape).
    """
    w_attn, b_attn, w_proj, b_proj = _packed_pairs(c_attn, c_proj, attn_out_first=False)
    return split_qkv(w_attn, b_attn, w_proj, b_proj)


def write_conv1d(weights: AttentionWeights) -> dict[str, WeightAndBias]:
    """GPT-2 ``Conv1D`` tensors ``{"c_attn": (weight (d, 3d), bias (3d,)), "c_proj":
    (weight (d, d), bias (d,))}`` (biases ``None`` without bias); the inverse of
    :func:`read_conv1d`, so ``read_conv1d(**write_conv1d(w))`` gives ``w`` back.
    Load into a ``transformers`` ``Conv1D`` with ``conv.weight.copy_(weight)``."""
    w_qkv, b_qkv = pack_qkv(weights)  # (d, 3d), (3d,) or None: new tensors
    b_o = None if weights.b_o is None else weights.b_o.detach().clone()
    b_qkv = None if b_qkv is None else b_qkv.detach()
    return {"c_attn": (w_qkv.detach(), b_qkv), "c_proj": (weights.w_o.detach().clone(), b_o)}


def torch_attn_mask(mask: Tensor) -> Tensor:
    """attnlib's mask (``True`` = may attend) as ``nn.MultiheadAttention``'s
    ``attn_mask`` (``True`` = may not attend): the logical negation."""
    mask = check_tensor("mask", mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must have dtype torch.bool, got {mask.dtype}")
    return ~mask


# ---------------------------------------------------------------------------
# Masks across libraries (chapter 5's mask Rosetta stone)
#
# attnlib, and F.scaled_dot_product_attention with a boolean mask: True = may attend.
# nn.MultiheadAttention's boolean attn_mask and key_padding_mask: True = may NOT attend.
# Additive (float) masks, in every library: added to the scores before the softmax,
# 0 = may attend, -inf (PyTorch) or torch.finfo(dtype).min (Hugging Face) = may not.
# ---------------------------------------------------------------------------


def _require_bool(mask: object, name: str) -> Tensor:
    mask = check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must have dtype torch.bool, got {name} of shape {format_shape(mask)} and dtype {mask.dtype}")
    return mask


def additive_mask(mask: Tensor, dtype: torch.dtype = torch.float32, fill: str = "-inf") -> Tensor:
    """attnlib's boolean mask (``True`` = may attend) as an additive float mask.

    ``A = 0`` where ``mask`` is ``True`` and ``A = fill`` where it is ``False``, so that
    ``softmax(S + A)`` ignores the masked keys. ``fill="-inf"`` is PyTorch's convention
    (``nn.MultiheadAttention``, SDPA); ``fill="min"`` uses ``torch.finfo(dtype).min``, the
    large finite negative number of Hugging Face's extended masks. Same shape as ``mask``.
    """
    mask = _require_bool(mask, "mask")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    if fill not in ("-inf", "min"):
        raise ValueError(f"fill must be '-inf' or 'min', got {fill!r}")
    blocked = float("-inf") if fill == "-inf" else torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return zero.masked_fill(~mask, blocked).expand(mask.shape).clone()  # same shape as mask


def mask_from_additive(additive: Tensor) -> Tensor:
    """An additive mask (0 = may attend; ``-inf`` or ``torch.finfo(dtype).min`` = may not)
    as attnlib's boolean mask, same shape. Any other value is a bias, not a mask, and an
    error: its information would be lost."""
    if not isinstance(additive, Tensor) or not additive.dtype.is_floating_point:
        raise TypeError("additive must be a floating-point torch.Tensor")
    blocked = additive <= torch.finfo(additive.dtype).min  # -inf or finfo.min
    if not ((additive == 0) | blocked).all():
        raise ValueError(
            f"additive of shape {format_shape(additive)} holds values other than 0 and -inf/finfo.min: "
            "it is a bias, not a mask"
        )
    return ~blocked


def mask_from_padding(attention_mask: Tensor, padding_is_true: bool = False) -> Tensor:
    """A per-sequence padding mask ``(B, n_k)`` as attnlib's mask ``(B, 1, 1, n_k)``,
    broadcastable to ``(B, h, n_q, n_k)``.

    ``padding_is_true=False``: Hugging Face's ``attention_mask`` (1 = real token, 0 = padding;
    any integer or bool dtype). ``padding_is_true=True``: ``nn.MultiheadAttention``'s boolean
    ``key_padding_mask`` (``True`` = padding, may not be attended)."""
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        got = format_shape(attention_mask) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a 2-D tensor (B, n_k), got {got}")
    if padding_is_true:
        real = ~_require_bool(attention_mask, "key_padding_mask")
    else:
        if attention_mask.dtype.is_floating_point or not ((attention_mask == 0) | (attention_mask == 1)).all():
            raise ValueError("attention_mask must hold only 0 and 1 (1 = real token) in an integer or bool dtype")
        real = attention_mask.bool()
    return real[:, None, None, :]  # (B, 1, 1, n_k)


def hf_extended_mask(attention_mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Hugging Face's additive mask for eager attention: ``(B, n_k)`` of 1/0 ->
    ``(B, 1, 1, n_k)``, 0 for real tokens and ``torch.finfo(dtype).min`` for padding.

    This is the ``(1 - mask) * finfo.min`` that transformers 4's
    ``get_extended_attention_mask`` returned. transformers 5's ``create_bidirectional_mask``
    (which ``BertModel`` calls) returns, with eager attention and some padding, the same
    values broadcast to ``(B, 1, n_q, n_k)``: ``hf_extended_mask(m).expand(B, 1, n_q, n_k)``;
    with SDPA it returns a boolean mask instead (``mask_from_padding`` broadcast), and
    ``None`` in both cases when nothing is padding."""
    return additive_mask(mask_from_padding(attention_mask), dtype=dtype, fill="min")


def to_torch_mha_masks(mask: Tensor, batch_size: int, num_heads: int) -> Tensor:
    """attnlib's mask, broadcastable to ``(B, h, n_q, n_k)``, as ``nn.MultiheadAttention``'s
    boolean ``attn_mask`` (``True`` = may **not** attend).

    A mask with at most two dimensions ``(n_q, n_k)`` stays 2-D. Anything else becomes the
    3-D ``(B * h, n_q, n_k)`` torch wants, with the heads of one sequence adjacent: row
    ``b * h + i`` is sequence ``b``, head ``i``. (A per-sequence mask ``(B, n_q, n_k)``
    therefore needs ``repeat_interleave(h, 0)``; ``repeat(h, 1, 1)`` would give sequence
    ``r mod B`` to row ``r``.) A 3-D attnlib mask is refused, as by
    :class:`attnlib.MultiHeadAttention`: write ``mask[:, None]`` or ``mask[None]``."""
    mask = _require_bool(mask, "mask")
    if mask.dim() <= 2:
        return ~mask
    if mask.dim() == 3:  # ambiguous: check_head_mask raises, saying how to write it
        check_head_mask(mask, torch.Size([batch_size, num_heads, *mask.shape[1:]]))
    if mask.dim() > 4:
        raise ValueError(f"mask must have at most 4 dimensions (B, h, n_q, n_k), got {format_shape(mask)}")
    m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B or 1, h or 1, n_q, n_k)
    b, h = m4.shape[0], m4.shape[1]
    if b not in (1, batch_size) or h not in (1, num_heads):
        raise ValueError(
            f"mask of shape {format_shape(mask)} does not broadcast to (B, h, n_q, n_k) with "
            f"B = {batch_size}, h = {num_heads}"
        )
    full = m4.expand(batch_size, num_heads, *m4.shape[2:])  # (B, h, n_q, n_k)
    return ~full.reshape(batch_size * num_heads, *m4.shape[2:])  # (B*h, n_q, n_k), batch-major


def from_torch_mha_masks(
    attn_mask: Tensor | None, key_padding_mask: Tensor | None, batch_size: int, num_heads: int
) -> Tensor:
    """What ``nn.MultiheadAttention`` lets each head attend to, as attnlib's mask
    ``(B, h, n_q, n_k)`` (``True`` = may attend), from its ``attn_mask`` (``(n_q, n_k)``
    or ``(B * h, n_q, n_k)``, boolean ``True`` = blocked or additive) and boolean
    ``key_padding_mask`` ``(B, n_k)`` (``True`` = padding). torch blocks a key if
    **either** mask blocks it, so the result is the logical AND of what each allows."""
    if attn_mask is None and key_padding_mask is None:
        raise ValueError("give attn_mask, key_padding_mask or both")
    allowed: Tensor | None = None
    if attn_mask is not None:
        allowed = ~attn_mask if attn_mask.dtype == torch.bool else mask_from_additive(attn_mask)
        if allowed.dim() == 3:
            if allowed.shape[0] != batch_size * num_heads:
                raise ValueError(
                    f"a 3-D attn_mask must have shape (B * h, n_q, n_k) with B * h = "
                    f"{batch_size * num_heads}, got {format_shape(attn_mask)}"
                )
            allowed = allowed.view(batch_size, num_heads, *allowed.shape[1:])  # (B, h, n_q, n_k)
        elif allowed.dim() != 2:
            raise ValueError(f"attn_mask must be (n_q, n_k) or (B * h, n_q, n_k), got {format_shape(attn_mask)}")
    if key_padding_mask is not None:
        if key_padding_mask.dim() != 2 or key_padding_mask.shape[0] != batch_size:
            raise ValueError(f"key_padding_mask must have shape (B, n_k) with B = {batch_size}, got {format_shape(key_padding_mask)}")
        keys = mask_from_padding(key_padding_mask, padding_is_true=True)  # (B, 1, 1, n_k)
        allowed = keys if allowed is None else allowed & keys
    assert allowed is not None
    n_q, n_k = allowed.shape[-2], allowed.shape[-1]
    return allowed.expand(batch_size, num_heads, n_q, n_k)  # (B, h, n_q, n_k)


def fully_masked_rows(mask: Tensor) -> Tensor:
    """``(..., n_q)``: ``True`` for the queries that may attend to no key at all. Their
    output differs by library: attnlib and ``F.scaled_dot_product_attention`` give 0;
    ``nn.MultiheadAttention`` gives NaN on its explicit-softmax paths and its inference
    fast path, 0 on its SDPA path (training with ``need_weights=False``); an additive
    ``finfo.min`` mask (Hugging Face) gives the plain average of all values."""
    return ~_require_bool(mask, "mask").any(dim=-1)


__all__ += [
    "additive_mask",
    "mask_from_additive",
    "mask_from_padding",
    "hf_extended_mask",
    "to_torch_mha_masks",
    "from_torch_mha_masks",
    "fully_masked_rows",
]

# ---- Hugging Face Llama: q_proj, k_proj, v_proj, o_proj (chapter 8) -----------------------
# Llama's layer: four nn.Linear, grouped keys and values, RoPE. Read into (and written
# from) attnlib.decoding.GroupedAttentionWeights; MultiHeadAttention.from_grouped_weights
# builds the module.

__all__ += ["GroupedAttentionWeights", "read_llama", "write_llama"]


def read_llama(
    attn: nn.Module,
    *,
    num_heads: int | None = None,
    rope_base: float | None = None,
) -> GroupedAttentionWeights:
    r"""Read Hugging Face Llama attention (``LlamaAttention``) into paper orientation (copies).

    Llama keeps four ``nn.Linear`` layers, weight ``(out, in)``, ``y = x @ weight.T + bias``:

    .. math::
        \texttt{q\_proj.weight} = (W^Q)^\top \in \mathbb{R}^{h d_k \times d},\quad
        \texttt{k\_proj.weight} = (W^K)^\top,\ \texttt{v\_proj.weight} = (W^V)^\top
        \in \mathbb{R}^{g d_k \times d},\quad
        \texttt{o\_proj.weight} = (W^O)^\top \in \mathbb{R}^{d \times h d_k},

    with ``g = num_key_value_heads`` (grouped-query attention; ``repeat_kv`` gives query
    head ``i`` the key/value head ``i // (h/g)``) and RoPE applied to queries and keys
    after the projections, with ``rope_theta`` as base.

    Args:
        attn: a module with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (``nn.Linear``),
            e.g. ``LlamaAttention`` or the ``nn.ModuleDict`` of :func:`write_llama`.
        num_heads: ``h``; default ``attn.config.num_attention_heads``. ``g`` follows from
            the shapes (it must equal ``config.num_key_value_heads`` when there is a config).
        rope_base: default ``attn.config.rope_parameters["rope_theta"]``; without a
            config, ``None`` (no RoPE).

    Returns:
        a :class:`GroupedAttentionWeights`; a layer without bias whose siblings have one
        (e.g. Qwen2's ``o_proj``) gets a zero bias, which computes the same function.

    Raises:
        TypeError: a projection missing or not an ``nn.Linear``.
        ValueError: a submodule, parameter or buffer other than the four projections
            (e.g. ``Qwen3Attention``'s ``q_norm`` and ``k_norm``), which would be dropped.
        ValueError: ``num_heads`` missing (no config) or disagreeing with the config; a
            RoPE type other than ``"default"`` (scaled frequencies); ``head_dim *
            num_heads != hidden_size``; ``attention_dropout > 0``; shapes that do not fit.
    """
    layers: dict[str, nn.Linear] = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        layer = getattr(attn, name, None)
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"attn.{name} must be an nn.Linear, got {type(layer).__name__}")
        layers[name] = layer
    # RoPE's frequencies, as a buffer ``inv_freq`` (on the module or on a child that holds
    # nothing else, e.g. an older ``rotary_emb``), are checked against rope_base below
    freqs = {n: b for n, b in attn.named_buffers() if n.split(".")[-1] == "inv_freq"}
    rope_children = {n.split(".")[0] for n in freqs if "." in n}
    extra = sorted({n for n, _ in attn.named_children()} - set(layers) - rope_children)
    extra += sorted(n for n, _ in attn.named_parameters() if n.split(".")[0] in rope_children)
    extra += sorted(n for n, _ in attn.named_buffers()
                    if n.split(".")[0] in rope_children and n not in freqs)
    extra += sorted(n for n, _ in attn.named_parameters(recurse=False))
    extra += sorted(n for n, _ in attn.named_buffers(recurse=False) if n not in freqs)
    if extra:  # e.g. Qwen3's q_norm, k_norm: they change the function, and would be dropped
        raise ValueError(
            f"attn ({type(attn).__name__}) has {', '.join(extra)} besides q_proj, k_proj, v_proj, "
            f"o_proj; read_llama maps those four only and would silently drop the rest"
        )
    if num_heads is not None:
        check_positive_int("num_heads", num_heads)
    config = getattr(attn, "config", None)
    if config is not None:
        h_cfg = int(config.num_attention_heads)
        if num_heads is not None and num_heads != h_cfg:
            raise ValueError(f"num_heads={num_heads} disagrees with attn.config.num_attention_heads={h_cfg}")
        num_heads = h_cfg
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_type {rope.get('rope_type')!r} rescales RoPE's frequencies; attnlib has the default RoPE only"
            )
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if rope_base is not None and theta is not None and float(rope_base) != float(theta):
            raise ValueError(f"rope_base={rope_base} disagrees with the config's rope_theta={theta}")
        rope_base = None if theta is None else float(theta)
        if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
            raise ValueError(
                f"attention_dropout={config.attention_dropout} > 0: attnlib has no dropout; "
                f"set it to 0 (inference)"
            )
        d_cfg = int(config.hidden_size)
        head_dim = int(getattr(config, "head_dim", None) or d_cfg // h_cfg)
        if head_dim * h_cfg != d_cfg:
            raise ValueError(
                f"head_dim ({head_dim}) * num_attention_heads ({h_cfg}) must equal hidden_size ({d_cfg}): "
                f"attnlib.MultiHeadAttention has d_k = d_model / num_heads"
            )
        g_cfg = int(getattr(config, "num_key_value_heads", None) or h_cfg)
        g_shape = layers["k_proj"].out_features // head_dim
        if g_shape != g_cfg:
            raise ValueError(
                f"k_proj has {layers['k_proj'].out_features} outputs = {g_shape} heads of width {head_dim}, "
                f"but config.num_key_value_heads = {g_cfg}"
            )
    if num_heads is None:
        raise ValueError("num_heads must be given when attn has no config")
    w_q = layers["q_proj"].weight.detach()  # (h*d_k, d)
    d_k = w_q.shape[0] // num_heads
    if d_k == 0 or w_q.shape[0] % num_heads:
        raise ValueError(f"q_proj has {w_q.shape[0]} outputs, not a multiple of num_heads={num_heads}")
    g = max(1, layers["k_proj"].out_features // d_k)  # a misfit shows in GroupedAttentionWeights' check
    for name, inv_freq in freqs.items():  # RoPE's frequencies must be those of rope_base
        if rope_base is None:
            raise ValueError(f"attn has RoPE frequencies ({name}) but no rope_base: pass rope_base=")
        want = rope_inv_freq(d_k, rope_base, dtype=torch.float64)  # (d_k/2,)
        got = inv_freq.detach().to(torch.float64).flatten()
        # computed in float32 by a power, a division and a cast: a few float32 roundings
        tol = rounding_tolerance(torch.float32, 8)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=0.0):
            raise ValueError(
                f"attn.{name} holds RoPE frequencies other than rope_base={rope_base:g}'s for d_k={d_k} "
                f"(scaled or another layout): read_llama reads the default RoPE only"
            )
    biases = {n: layers[f"{n}_proj"].bias for n in "qkvo"}
    any_bias = any(b is not None for b in biases.values())

    def bias(n: str) -> Tensor | None:
        b = biases[n]
        if b is not None:
            return b.detach().clone()
        if not any_bias:
            return None
        lin = layers[f"{n}_proj"]
        return torch.zeros(lin.out_features, device=lin.weight.device, dtype=lin.weight.dtype)

    return GroupedAttentionWeights(
        w_q=w_q.T.clone(),  # (d, h*d_k)
        w_k=layers["k_proj"].weight.detach().T.clone(),  # (d, g*d_k)
        w_v=layers["v_proj"].weight.detach().T.clone(),  # (d, g*d_k)
        w_o=layers["o_proj"].weight.detach().T.clone(),  # (h*d_k, d)
        num_heads=num_heads,
        num_kv_heads=g,
        b_q=bias("q"),
        b_k=bias("k"),
        b_v=bias("v"),
        b_o=bias("o"),
        rope_base=rope_base,
    )


def write_llama(weights: GroupedAttentionWeights) -> nn.ModuleDict:
    """Four ``nn.Linear`` layers ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` holding
    ``weights`` in Llama's layout (the inverse of :func:`read_llama`). Its ``state_dict()``
    loads into a ``LlamaAttention`` of the same shape (``attn.load_state_dict(...)``);
    ``num_heads`` and ``rope_base`` belong to the Llama config, not to the layers."""
    if not isinstance(weights, GroupedAttentionWeights):
        raise TypeError(f"weights must be a GroupedAttentionWeights, got {type(weights).__name__}")
    layers = nn.ModuleDict()
    for n in "qkvo":
        w, b = getattr(weights, f"w_{n}"), getattr(weights, f"b_{n}")  # w: (d_in, d_out)
        lin = nn.Linear(w.shape[0], w.shape[1], bias=weights.bias, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w.T)  # (d_out, d_in)
            if b is not None:
                lin.bias.copy_(b)
        layers[f"{n}_proj"] = lin
    return layers
