"""Hugging Face's Llama attention layout, read into and written from chapter 8's
:class:`~attnlib.decoding.GroupedAttentionWeights` (also importable from :mod:`attnlib.interop`,
with the other layouts)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnlib.checks import check_positive_int, warn_dropout
from attnlib.decoding.grouped import GroupedAttentionWeights
from attnlib.decoding.rope import rope_angle_error, rope_frequency_error, rope_inv_freq

# Llama's layer: four nn.Linear, grouped keys and values, RoPE. Read into (and written
# from) GroupedAttentionWeights; DecoderAttention.from_grouped_projections builds the module.
__all__ = ["GroupedAttentionWeights", "read_llama", "write_llama", "float32_attention_widths"]


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
            (e.g. ``Qwen3Attention``'s ``q_norm`` and ``k_norm``: QK-norm), which would be
            dropped; partial rotary (``partial_rotary_factor`` below 1).
        ValueError: ``num_heads`` missing (no config) or disagreeing with the config; a
            RoPE type other than ``"default"`` (scaled frequencies);
            shapes that do not fit (``head_dim`` may be any width: ``q_proj`` is
            ``(h*head_dim, hidden_size)``).

    Warns (``UserWarning``) when ``attn`` is in training mode with ``attention_dropout > 0``,
    as every reader does (:func:`attnlib.checks.warn_dropout`).
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
        qk_norm = " (QK-norm: q and k normalised per head, which no attnlib reference computes)" if {
            "q_norm", "k_norm"} & set(extra) else ""
        raise ValueError(
            f"attn ({type(attn).__name__}) has {', '.join(extra)} besides q_proj, k_proj, v_proj, "
            f"o_proj{qk_norm}; read_llama maps those four only and would silently drop the rest"
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
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"partial rotary (partial_rotary_factor={partial}): RoPE turns part of each head only, "
                f"which no attnlib reference computes (DecoderAttention rotates all of d_k)"
            )
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if rope_base is not None and theta is not None and float(rope_base) != float(theta):
            raise ValueError(f"rope_base={rope_base} disagrees with the config's rope_theta={theta}")
        rope_base = None if theta is None else float(theta)
        warn_dropout("attention_dropout", float(getattr(config, "attention_dropout", 0.0) or 0.0), attn.training)
        head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // h_cfg)  # any width
        if layers["q_proj"].out_features != h_cfg * head_dim:
            raise ValueError(
                f"q_proj has {layers['q_proj'].out_features} outputs, not num_attention_heads ({h_cfg}) "
                f"* head_dim ({head_dim})"
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
        # Hugging Face computes base ** (2l / d_k) in float32: the rounding of the exponent
        # 2l/d_k is amplified by ln(base) in the power (13 for Llama 3's 500000), then the power
        # and the division round; rope_frequency_error counts it, for theirs and for ours
        tol = rope_frequency_error(d_k, rope_base, torch.float32) + rope_frequency_error(d_k, rope_base)
        if got.shape != want.shape or not bool(((got - want).abs() <= tol * want / (1 - tol)).all()):
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



def float32_attention_widths(
    scores: Tensor,
    q: Tensor | None = None,
    k: Tensor | None = None,
    positions: Tensor | None = None,
    base: float = 10000.0,
    scale: float | None = None,
) -> tuple[int, int, int]:
    r"""How far transformers' eager attention weights may be from attnlib's float64 ones,
    in units of :math:`\varepsilon_{32}`, relative to each weight: widths for
    :func:`attnlib.assert_rounding_close` with ``dtype=torch.float32``.

    Hugging Face's eager Llama (and BLOOM) attention, run in float64, rounds to float32 in
    two places:

    - its softmax casts the scores to float32 (a relative :math:`u` each), subtracts the
      row's maximum (:math:`u` of a difference up to :math:`2S`, :math:`S` the largest
      :math:`|\text{score}|`), exponentiates (an ulp), sums :math:`n` terms and divides:
      each weight is within :math:`u\,(6S + n + 5) \le \varepsilon_{32}\,(n + 4 + 4S)` of
      the exact softmax of its scores, relative;
    - with RoPE (``q``, ``k``, ``positions`` given), ``LlamaRotaryEmbedding``'s cos and sin
      are float32: each is off by :math:`e = \alpha + \varepsilon_{32}` (the angle's error
      :math:`\alpha`, :func:`~attnlib.decoding.rope.rope_angle_error` in float32, and an
      ulp), which moves a rotated pair by at most :math:`2 e` times its norm, so a score
      by at most :math:`4 e T`, :math:`T = \text{scale} \sum_\ell \lVert q_\ell \rVert
      \lVert k_\ell \rVert` over the rotation's pairs; a weight then moves by :math:`8 e T`,
      relative.

    These are first-order counts. Each rounding multiplies a weight by some :math:`e^\delta`,
    so together they move it by a factor within :math:`e^{\pm y}`,
    :math:`y = 6uS + (n + 5)\,|\log(1 - u)| + 8eT`: the relative error is at most
    :math:`e^y - 1`, which is :math:`y` only while :math:`y \ll 1`. Near-tied scores of
    :math:`10^8` in float32 (:math:`y \approx 36`) are far from it: a weight of
    :math:`e^{-20}` came out 54 times too large where the first-order count allowed 48.

    Returns ``(n, 4, c)``, ``c`` the larger of ``ceil(4 S + 8 T e / eps32)`` (the first-order
    count, whose slack over :math:`y` covers :math:`e^y - 1` for moderate scores) and
    ``ceil((e^y - 1) / eps32) - n - 4``: the bound is :math:`\varepsilon_{32}` times their sum,
    relative to each weight; the outputs, :math:`\sum_j a_j v_j` then :math:`W^O`, are
    within the same multiple of :math:`(|A|\,|V|)\,|W^O|`, plus float64's rounding.

    Raises:
        ValueError: if :math:`y > 650` (scores near :math:`2 \cdot 10^9` or more): the
            bound would overflow a float; a float32 softmax resolves nothing there.

    Args:
        scores: ``(..., n_q, n_k)``, the scaled scores (``-inf`` where masked).
        q, k: ``(..., n_q, d_k)``, ``(..., n_k, d_k)``, the queries and keys (after RoPE or
            before: pair norms do not change), rotate-half layout.
        positions: the largest position rotated (or all of them).
        base: RoPE's theta; scale: the scores' scale, default ``1/sqrt(d_k)``.
    """
    eps32 = torch.finfo(torch.float32).eps
    finite = scores[torch.isfinite(scores)]
    s_max = float(finite.abs().max()) if finite.numel() else 0.0
    rope = 0.0
    if q is not None and k is not None and positions is not None:
        d_k = q.shape[-1]
        half = d_k // 2
        q_pairs = (q[..., :half].square() + q[..., half:].square()).sqrt()  # (..., n_q, d_k/2)
        k_pairs = (k[..., :half].square() + k[..., half:].square()).sqrt()  # (..., n_k, d_k/2)
        t = float((q_pairs @ k_pairs.mT).max()) * (d_k**-0.5 if scale is None else scale)
        e = float(rope_angle_error(positions.flatten(), d_k, base, torch.float32).max()) / eps32 + 1
        rope = 8 * t * e  # in units of eps32
    n = scores.shape[-1]
    first_order = max(1, math.ceil(4 * s_max + rope))
    y = 6 * (eps32 / 2) * s_max + (n + 5) * -math.log1p(-eps32 / 2) + eps32 * rope
    if y > 650:
        raise ValueError(f"scores up to {s_max:.3g} in float32: the weights' relative error bound "
                         f"e^{y:.3g} - 1 overflows (a float32 softmax resolves nothing there)")
    return n, 4, max(first_order, math.ceil(math.expm1(y) / eps32) - n - 4)
