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
separate ``nn.Linear`` (BERT)           ``query/key/value/output.dense.weight`` = ``Wᵀ``: ``(out, in)``
GPT-2 ``Conv1D`` (in, out)              ``c_attn.weight`` = ``[W^Q | W^K | W^V]``: ``(d, 3d)``,
                                        ``c_proj.weight`` = ``W^O``: ``(d, d)``
=====================================  =======================================

Readers (``read_*``) return an :class:`AttentionWeights` of copies; writers
(``write_*``) take one and return the other layout. ``read_X(write_X(w)) == w``
exactly: the conversions only transpose, cut and concatenate.

Masks: attnlib uses ``True`` = may attend; ``nn.MultiheadAttention``'s
``attn_mask`` and ``key_padding_mask`` use ``True`` = may **not** attend.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlib._core import (
    AttentionWeights,
    check_tensor,
    format_shape,
    pack_qkv,
    read_torch_mha,
    split_qkv,
    write_torch_mha,
)

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

    Raises:
        TypeError: an argument that is not a ``(weight, bias)`` pair of tensors.
        ValueError: a weight that is not square, a bias of the wrong shape, or
            biases on some layers only.
    """
    pairs = {name: _check_pair(name, pair) for name, pair in (("q", q), ("k", k), ("v", v), ("o", o))}
    for name, (w, _) in pairs.items():
        if w.dim() != 2 or w.shape[0] != w.shape[1]:
            raise ValueError(f"{name} weight must be square (d_model, d_model), got {format_shape(w)}")
    (w_q, b_q), (w_k, b_k), (w_v, b_v), (w_o, b_o) = pairs.values()
    return AttentionWeights(
        w_q=w_q.T.clone(),
        w_k=w_k.T.clone(),
        w_v=w_v.T.clone(),
        w_o=w_o.T.clone(),
        b_q=None if b_q is None else b_q.clone(),
        b_k=None if b_k is None else b_k.clone(),
        b_v=None if b_v is None else b_v.clone(),
        b_o=None if b_o is None else b_o.clone(),
    )


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
    if (b_attn is None) != (b_proj is None):
        raise ValueError("c_attn and c_proj must both have a bias or both have none")
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

    Raises:
        ValueError: a weight or bias of the wrong shape (the message names it, the
            expected and the received shape), or a bias on one layer only.
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

    Raises:
        ValueError: a weight or bias of the wrong shape (the message names it, the
            expected and the received shape), or a bias on one layer only.
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


# ---- Hugging Face Llama: q_proj, k_proj, v_proj, o_proj (chapter 8) -----------------------
# Llama's layer: four nn.Linear, grouped keys and values, RoPE. Read into (and written
# from) attnlib.decoding.GroupedAttentionWeights; MultiHeadAttention.from_grouped_weights
# builds the module.

from attnlib._core import check_positive_int  # noqa: E402
from attnlib.decoding import GroupedAttentionWeights  # noqa: E402

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
