"""Weight layouts of other libraries, read into and written from attnlib's (chapter 5).

See :mod:`attnlib.interop` for the table of layouts. Readers (``read_*``) return an
:class:`AttentionWeights` of copies; writers (``write_*``) take one and return the other
layout; ``read_X(write_X(w)) == w`` exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlib.checks import check_positive_int, check_tensor, format_shape
from attnlib.records import AttentionWeights, pack_qkv, plain_record, split_qkv

__all__ = [
    "AttentionWeights",
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

# AttentionWeights lives in attnlib.records (the fused module builds on it too); it is
# part of this module's interface all the same. torch.nn.MultiheadAttention's layout is
# attnlib.interop.torch_mha.


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
    ``W`` is ``weight.T``: ``q, k, v`` weights ``(h*d_k, d_model)``, ``o`` ``(d_model, h*d_v)``
    (square in the paper; heads of any width otherwise). Returns copies in paper orientation.

    Biases on some layers only (Raschka's default: ``W_query/W_key/W_value`` without bias,
    ``out_proj`` with one) are read with zeros for the missing ones, which computes the
    same function.

    Raises:
        TypeError: an argument that is not a ``(weight, bias)`` pair of tensors.
        ValueError: weights that do not fit together, or a bias of the wrong shape.
    """
    pairs = {name: _check_pair(name, pair) for name, pair in (("q", q), ("k", k), ("v", v), ("o", o))}
    w_q = pairs["q"][0]
    if w_q.dim() != 2:
        raise ValueError(f"q weight must have shape (h*d_k, d_model), got {format_shape(w_q)}")
    hd, d = w_q.shape
    for name, shape, names in (("k", (hd, d), "(h*d_k, d_model)"), ("v", (hd, d), "(h*d_v, d_model)"),
                               ("o", (d, hd), "(d_model, h*d_v)")):
        if pairs[name][0].shape != shape:
            raise ValueError(f"{name} weight must have shape {names} = {format_shape(shape)} to match q's, "
                             f"got {format_shape(pairs[name][0])}")
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
    weights = plain_record(weights)  # a layer with more than weights (ALiBi) is refused, named
    biases = weights.biases
    layers: dict[str, nn.Linear] = {}
    for i, (name, w) in enumerate(zip("qkvo", (weights.w_q, weights.w_k, weights.w_v, weights.w_o))):
        d_in, d_out = w.shape
        lin = nn.Linear(d_in, d_out, bias=biases is not None, device=w.device, dtype=w.dtype)
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
    ``(d_model, h*d_v)``, or ``None`` for a wrapper that only concatenates (W^O = I, which
    needs ``h*d_k = d_model``).

    .. math::
        W^Q = [\,W_0^Q \,|\, \dots \,|\, W_{h-1}^Q\,], \qquad W_i^Q = (\texttt{heads[i][0].weight})^\top
        \in \mathbb{R}^{d_{model} \times d_k},

    and so for K and V. Partial biases read as zeros (see :func:`read_separate_linear`).
    Build the module with ``MultiHeadAttention.from_projections(w, num_heads=len(heads))``.

    Raises:
        TypeError: ``heads`` not a list of ``(q, k, v)`` pairs of tensors.
        ValueError: no heads, heads of different widths, or no ``o`` with ``h * d_k != d_model``.
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
    if w0.dim() != 2:
        raise ValueError(f"heads[0].q weight must be a matrix (d_k, d_model), got {format_shape(w0)}")
    d_k, d = int(w0.shape[0]), int(w0.shape[1])
    for role, pairs in per_role.items():
        for i, (w, _) in enumerate(pairs):
            if tuple(w.shape) != (d_k, d):
                raise ValueError(f"heads[{i}].{role} weight must have shape (d_k, d_model) = ({d_k}, {d}) "
                                 f"like heads[0].q, got {format_shape(w)}")
    if o is None and d_k * len(heads) != d:
        raise ValueError(f"{len(heads)} heads of width d_k = {d_k} make {d_k * len(heads)} columns, not "
                         f"d_model = {d}: a wrapper without W^O (o=None) outputs their concatenation, which "
                         f"must then be d_model wide; pass o")
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
    and W^O as ``nn.Linear(h*d_v, d_model)`` (the inverse of :func:`read_linear_heads`)."""
    layers = write_separate_linear(weights)
    d, hd = layers["q"].in_features, layers["q"].out_features
    d_k = hd // check_positive_int("num_heads", num_heads)
    if d_k * num_heads != hd:
        raise ValueError(f"num_heads ({num_heads}) must divide h*d_k ({hd})")
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

    ``attn_out_first``: ``c_attn.weight`` is ``(3D, d)`` and ``c_proj.weight`` ``(d, D)``
    (``nn.Linear``) when True, ``(d, 3D)`` and ``(D, d)`` (GPT-2 ``Conv1D``) when False;
    ``d = d_model``, ``D = h*d_k`` (``d`` in the paper).
    """
    kind = "nn.Linear (out, in)" if attn_out_first else "Conv1D (in, out)"
    layout, proj = ("(3*h*d_k, d_model)", "(d_model, h*d_v)") if attn_out_first else ("(d_model, 3*h*d_k)", "(h*d_v, d_model)")
    w_attn, b_attn = _check_pair("c_attn", c_attn)
    w_proj, b_proj = _check_pair("c_proj", c_proj)
    rows, cols = w_attn.shape if w_attn.dim() == 2 else (0, 0)
    d, three_hd = (cols, rows) if attn_out_first else (rows, cols)
    if d == 0 or three_hd == 0 or three_hd % 3:
        raise ValueError(f"c_attn weight must have shape {layout}, {kind}, got {format_shape(w_attn)}")
    hd = three_hd // 3
    expected = (d, hd) if attn_out_first else (hd, d)
    if tuple(w_proj.shape) != expected:
        raise ValueError(
            f"c_proj weight must have shape {proj} = {format_shape(expected)}, {kind}, to match c_attn, "
            f"got {format_shape(w_proj)}"
        )
    if b_attn is not None and tuple(b_attn.shape) != (3 * hd,):
        raise ValueError(f"c_attn bias must have shape (3*h*d_k,) = ({3 * hd},), got {format_shape(b_attn)}")
    if b_proj is not None and tuple(b_proj.shape) != (d,):
        raise ValueError(f"c_proj bias must have shape (d_model,) = ({d},), got {format_shape(b_proj)}")
    if (b_attn is None) != (b_proj is None):  # timm's qkv_bias=False with a biased proj: zeros
        b_attn = w_attn.new_zeros(3 * hd) if b_attn is None else b_attn
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
        c_attn: ``(weight (3d, d), bias (3d,) or None)``; ``(3D, d)`` and ``(3D,)`` for heads of
            another width, ``D = h*d_k``.
        c_proj: ``(weight (d, d), bias (d,) or None)``; weight ``(d, D)``.

    Returns:
        copies in paper orientation.

    A bias on one layer only (timm's ``qkv_bias=False`` with a biased ``proj``) is read with
    zeros for the other, which computes the same function.

    Raises:
        ValueError: a weight or bias of the wrong shape (the message names it, the
            expected and the received shape).
    """
    w_attn, b_attn, w_proj, b_proj = _packed_pairs(c_attn, c_proj, attn_out_first=True)
    return split_qkv(w_attn.T, b_attn, w_proj.T, b_proj)  # (3D, d) -> (d, 3D)


def write_packed_linear(weights: AttentionWeights) -> dict[str, nn.Linear]:
    """Two ``nn.Linear`` layers ``{"c_attn": Linear(d, 3D), "c_proj": Linear(D, d)}``
    holding ``weights`` (``D = h*d_k``, ``d`` in the paper; the inverse of
    :func:`read_packed_linear`)."""
    weights = plain_record(weights)  # a layer with more than weights (ALiBi) is refused, named
    d, hd = weights.d_model, weights.heads_width
    w_qkv, b_qkv = pack_qkv(weights)  # (d, 3D), (3D,) or None
    c_attn = nn.Linear(d, 3 * hd, bias=weights.bias, device=w_qkv.device, dtype=w_qkv.dtype)
    c_proj = nn.Linear(hd, d, bias=weights.bias, device=w_qkv.device, dtype=w_qkv.dtype)
    with torch.no_grad():
        c_attn.weight.copy_(w_qkv.T)  # (3D, d)
        c_proj.weight.copy_(weights.w_o.T)  # (d, D)
        if b_qkv is not None and weights.b_o is not None:
            c_attn.bias.copy_(b_qkv)  # (3D,)
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
        c_attn: ``(weight (d, 3d), bias (3d,) or None)``; ``(d, 3D)`` and ``(3D,)`` for heads of
            another width, ``D = h*d_k``.
        c_proj: ``(weight (d, d), bias (d,) or None)``; weight ``(D, d)``.

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
    """GPT-2 ``Conv1D`` tensors ``{"c_attn": (weight (d, 3D), bias (3D,)), "c_proj":
    (weight (D, d), bias (d,))}`` (``D = h*d_k``; biases ``None`` without bias); the inverse of
    :func:`read_conv1d`, so ``read_conv1d(**write_conv1d(w))`` gives ``w`` back.
    Load into a ``transformers`` ``Conv1D`` with ``conv.weight.copy_(weight)``."""
    weights = plain_record(weights)  # a layer with more than weights (ALiBi) is refused, named
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


