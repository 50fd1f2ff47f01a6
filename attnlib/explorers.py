r"""Interactive figures for the rendered book: data computed by attnlib, drawn in the browser.

An :class:`Explorer` is what a notebook cell displays. Its HTML holds

- the data, as JSON, computed here with attnlib (numbers rounded to keep pages small);
- a static PNG of the default view, for readers who run the notebook in Jupyter,
  where the book's JavaScript is not loaded;
- no script: the book serves one script, ``_static/explorers.js`` (registered in
  ``_config.yml``), which finds every ``[data-explorer]`` element, replaces the PNG by
  a drawing with native, labelled controls, and redraws when a control changes.
  Nothing is fetched: the page works offline and from ``file://``.

The HTML is deterministic (no random ids, no timestamps), so strict nbval can compare
it: the root's id is ``explorer-<name>``, and the PNG is drawn by matplotlib's Agg
backend with no metadata.

Three explorers:

- :func:`sharpness_explorer` (chapter 1): the weights of a soft look-up,
  :math:`\alpha = \mathrm{softmax}(\beta\, K q)`, over a grid of sharpness values
  :math:`\beta`, and what the look-up reads, :math:`\alpha V`.
- :func:`head_explorer` (chapter 6): every head of a model, as low-rank factors from
  which the page computes the head's attention map for any rank of its
  :math:`W_i^{QK}` (see the function for the formula).
- :func:`online_softmax_explorer` (chapter 10): one query's keys visited block by block,
  with the running maximum, running sum and partial output after each block.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from attnlib.checks import check_tensor, format_shape
from attnlib.attention import attention
from attnlib.blockwise import blockwise_attention
from attnlib.lowrank import FactoredMatrix, qk_circuit
from attnlib.multihead import MultiHeadAttention, plain_view

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

# matplotlib (and attnlib.plots) are imported where a figure is drawn, so that
# `import attnlib` does not load matplotlib.

__all__ = ["Explorer", "sharpness_explorer", "head_explorer", "online_softmax_explorer",
           "round_array", "from_rounded"]

_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


def round_array(x: Tensor | np.ndarray, digits: int = 3) -> dict[str, Any]:
    """``x`` flattened (row-major) and rounded to ``digits`` significant digits *of its
    largest entry*, stored as integers: ``{"e": e, "m": [m_0, m_1, ...]}`` with
    ``x_i ~ m_i * 10**e``. Every entry is rounded to the same power of ten, so the
    absolute error is at most ``0.5 * 10**e``; ``|m_i| < 10**digits``. Integers keep
    the page small (``-123`` instead of ``-0.01234``). An all-zero array gives
    ``e = 0`` and zeros."""
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits must be a positive int, got {digits!r}")
    a = x.detach().cpu().to(torch.float64).numpy() if isinstance(x, Tensor) else np.asarray(x, np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError("x must hold only finite numbers")
    a = a.reshape(-1)  # (size,)
    top = float(np.abs(a).max()) if a.size else 0.0
    e = math.floor(math.log10(top)) - digits + 1 if top > 0 else 0
    m = np.round(_scaled(a, e)).astype(np.int64)  # (size,)
    if m.size and int(np.abs(m).max()) >= 10**digits:  # e.g. 9.996 at 3 digits rounds to 1000
        e += 1
        m = np.round(_scaled(a, e)).astype(np.int64)
    return {"e": e, "m": [int(v) for v in m]}


def _scaled(a: np.ndarray, e: int) -> np.ndarray:
    """``a / 10**e`` in two steps, so that ``10**e`` itself neither overflows nor
    underflows (``e = -324`` for the smallest subnormal)."""
    half = e // 2
    return a / 10.0**half / 10.0 ** (e - half)


def from_rounded(r: dict[str, Any]) -> np.ndarray:
    """The numbers of :func:`round_array`'s output, ``m * 10**e`` (flat, float64): what
    ``_static/explorers.js`` computes from the page's data."""
    return np.asarray(r["m"], np.float64) * 10.0 ** r["e"]


def _png(fig: "Figure") -> bytes:
    """The figure as PNG bytes (Agg, no metadata: the same bytes on every run); closes it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


class Explorer:
    """An interactive figure: a name, its data and a static view of its default state.

    - ``name``: lower-case letters, digits and ``-``; it selects the drawing code in
      ``_static/explorers.js`` (``data-explorer="<name>"``) and gives the root element
      its id, ``explorer-<name>`` (so the HTML is the same on every run);
    - ``data``: a JSON-serialisable dict, embedded in the page;
    - ``fallback``: a matplotlib figure of the default view (turned into PNG bytes
      and closed here), shown where the book's script does not run;
    - ``alt``: the fallback image's alt text.

    In a notebook the object displays as HTML (:meth:`_repr_html_`); :meth:`png`
    returns the fallback alone.
    """

    def __init__(self, name: str, data: dict[str, Any], fallback: "Figure", alt: str) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                f"name must be lower-case letters, digits and '-', starting with a letter, got {name!r}"
            )
        if not isinstance(alt, str) or not alt.strip():
            raise ValueError("alt must be a non-empty description of the static view")
        self.name = name
        self.data = data
        self.alt = alt
        self._png = _png(fallback)
        # allow_nan=False: a NaN would be invalid JSON in the browser
        self._json = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)

    def png(self) -> bytes:
        """The static view of the default settings, as PNG bytes."""
        return self._png

    def __repr__(self) -> str:
        return f"Explorer({self.name!r}, {len(self._json):,} bytes of data)"

    def _repr_html_(self) -> str:
        # "<" escaped so that no token can close the <script> element early
        payload = self._json.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        image = base64.b64encode(self._png).decode("ascii")
        return (
            f'<div class="attnlib-explorer" data-explorer="{self.name}" id="explorer-{self.name}">\n'
            f'<img class="explorer-fallback" alt="{html.escape(self.alt)}" '
            f'src="data:image/png;base64,{image}">\n'
            '<p class="explorer-fallback">A static view of the default settings; '
            "in the rendered book this figure is interactive.</p>\n"
            f'<script type="application/json" class="explorer-data">{payload}</script>\n'
            "</div>"
        )


# ---- chapter 1: the soft look-up's sharpness -------------------------------------------
def sharpness_explorer(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    query_labels: Sequence[str],
    key_labels: Sequence[str],
    betas: Sequence[float],
    default: tuple[int, int] = (0, 0),
    name: str = "sharpness",
) -> Explorer:
    r"""The soft look-up of each query at every sharpness :math:`\beta` in ``betas``.

    .. math::
        \alpha(\beta) = \mathrm{softmax}(\beta\, K q), \qquad \text{read} = \alpha(\beta)\, V,

    computed by :func:`attnlib.attention` with ``scale=beta``.

    Shapes: ``queries``: ``(n_q, d_k)``, ``keys``: ``(n_k, d_k)``, ``values``:
    ``(n_k, d_v)``; ``query_labels``: ``n_q`` names, ``key_labels``: ``n_k`` names;
    ``betas``: increasing positive numbers. ``default`` = (query index, beta index)
    of the first view. Embedded: the weights ``(n_q, len(betas), n_k)`` (3 decimals), the reads
    ``(n_q, len(betas), d_v)`` and the values (4 significant digits, :func:`round_array`).
    """
    for arg, t in (("queries", queries), ("keys", keys), ("values", values)):
        if check_tensor(arg, t).dim() != 2:
            raise ValueError(f"{arg} must be a 2-D tensor, got {format_shape(t)}")
    n_q, n_k = queries.shape[0], keys.shape[0]
    if len(query_labels) != n_q:
        raise ValueError(f"query_labels must have n_q = {n_q} names, got {len(query_labels)}")
    if len(key_labels) != n_k:
        raise ValueError(f"key_labels must have n_k = {n_k} names, got {len(key_labels)}")
    b = [float(x) for x in betas]
    if not b or any(x <= 0 for x in b) or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"betas must be increasing positive numbers, got {list(betas)!r}")
    q_idx, b_idx = default
    if not (0 <= q_idx < n_q and 0 <= b_idx < len(b)):
        raise ValueError(f"default must index a query (< {n_q}) and a beta (< {len(b)}), got {default!r}")
    weights, reads = [], []
    for beta in b:
        out, w = attention(queries, keys, values, scale=beta)  # (n_q, d_v), (n_q, n_k)
        weights.append(w)
        reads.append(out)
    w_all = torch.stack(weights, dim=1)  # (n_q, n_betas, n_k)
    r_all = torch.stack(reads, dim=1)  # (n_q, n_betas, d_v)
    data = {
        "queries": list(query_labels),
        "keys": list(key_labels),
        "betas": [float(f"{x:.4g}") for x in b],
        "weights": [round(float(v), 3) + 0.0 for v in w_all.reshape(-1).tolist()],
        "reads": round_array(r_all, 4),
        "values": round_array(values, 4),
        "dv": int(values.shape[1]),
        "default": [q_idx, b_idx],
    }
    from attnlib import plots

    fig = plots.attention_map(w_all[q_idx, b_idx][None], [f"β = {b[b_idx]:.3g}"], list(key_labels))
    fig.axes[0].set_ylabel(f"query: {query_labels[q_idx]}")
    fig.set_size_inches(1.6 + 0.8 * n_k, 1.8)
    alt = (f"Weights of the look-up of {query_labels[q_idx]} over the keys "
           f"{', '.join(key_labels)} at sharpness {b[b_idx]:.3g}.")
    return Explorer(name, data, fig, alt)


# ---- chapter 6: every head of a model, at every rank of W^QK -------------------------------
def head_explorer(
    mhas: Sequence[MultiHeadAttention],
    inputs: Sequence[Tensor],
    tokens: Sequence[Sequence[str]],
    default: tuple[int, int] = (0, 0),
    name: str = "heads",
) -> Explorer:
    r"""Every head of every layer, as the factors of its scores at each rank of :math:`W_i^{QK}`.

    With a head's weights :math:`W^Q, W^K` ``(d_model, d_k)``, biases :math:`b^Q, b^K`
    and the thin SVD :math:`W^{QK} = W^Q {W^K}^\top = U \Sigma V^\top`
    (:func:`attnlib.qk_circuit`), the scores of tokens :math:`X` ``(t, d_model)`` are

    .. math::
        \frac{(XW^Q + b^Q)(XW^K + b^K)^\top}{\sqrt{d_k}}
        = \underbrace{P K^\top + \mathbf 1 c^\top}_{\text{kept}} + (\text{terms equal along each row}),

    .. math::
        P = X U D,\quad K = X V D,\quad D = \mathrm{diag}\big(\sqrt{\sigma_a}\big) / d_k^{1/4},
        \quad c = X W^K {b^Q}^\top / \sqrt{d_k} .

    The row-constant terms (:math:`X W^Q {b^K}^\top` and :math:`b^Q {b^K}^\top`)
    cancel in the softmax, so :math:`\mathrm{softmax}(P K^\top + \mathbf 1 c^\top)` is the
    head's attention map; keeping only the first :math:`r` columns of :math:`P` and
    :math:`K` gives the map of the head whose :math:`W^{QK}` is cut to its best rank-``r``
    approximation (the bias term kept). The page computes

    ``s[i][j] = sum(P[i][a] * K[j][a] for a < r) + c[j]``, then a softmax over ``j``.

    Args:
        mhas: one :class:`MultiHeadAttention` per layer (same ``num_heads``, ``d_model``),
            each read through its plain view (:func:`attnlib.multihead.plain_view`, as
            :func:`attnlib.qk_circuit` reads it): RoPE, ALiBi and latent attention are
            refused, naming the feature.
        inputs: per layer, its input hidden states ``(B, n, d_model)``, in the dtype of
            that layer's weights.
        tokens: per sentence ``b < B``, its real tokens: ``t_b <= n`` of them, at
            positions ``0..t_b-1`` (later positions are padding and are left out).
        default: (layer, head) of the first view (sentence 0, full rank).

    Embedded per sentence, layer and head: ``P``, ``K`` ``(t_b, d_k)`` and ``c`` ``(t_b,)``,
    each rounded to 3 significant digits of its largest entry (:func:`round_array`;
    on all-MiniLM-L6-v2 that moves no attention weight by more than about 0.01).
    The SVD is computed in float64 with :func:`~attnlib.lowrank.fix_signs`' sign rule,
    so the embedded numbers do not depend on the machine when the inputs do not (pass
    float64 hidden states for that: float32 rounding could move a rounded digit).
    """
    if len(mhas) == 0 or len(mhas) != len(inputs):
        raise ValueError(
            f"mhas and inputs must be non-empty and of equal length (one per layer), "
            f"got {len(mhas)} and {len(inputs)}"
        )
    mhas = [plain_view(m, f"mhas[{layer}]", f"head_explorer (mhas[{layer}])") for layer, m in enumerate(mhas)]
    h, d_model, d_k = mhas[0].num_heads, mhas[0].d_model, mhas[0].d_k
    if any((m.num_heads, m.d_model) != (h, d_model) for m in mhas):
        raise ValueError("mhas must all have the same num_heads and d_model")
    first = check_tensor("inputs[0]", inputs[0])
    if first.dim() != 3 or first.shape[-1] != d_model:
        raise ValueError(f"inputs[0] must have shape (B, n, d_model={d_model}), got {format_shape(first)}")
    for i, x in enumerate(inputs):
        if check_tensor(f"inputs[{i}]", x).shape != first.shape:
            raise ValueError(
                f"inputs[{i}] must have shape {format_shape(first)} like inputs[0], got {format_shape(x)}"
            )
        if x.dtype != mhas[i].w_q.dtype:
            raise ValueError(
                f"inputs[{i}] has dtype {x.dtype} but mhas[{i}]'s weights have dtype {mhas[i].w_q.dtype}: "
                f"give both one dtype, e.g. inputs[{i}].to({mhas[i].w_q.dtype})"
            )
    B, n, _ = first.shape
    if len(tokens) != B:
        raise ValueError(f"tokens must list the tokens of B = {B} sentences, got {len(tokens)}")
    for b, toks in enumerate(tokens):
        if not 1 <= len(toks) <= n:
            raise ValueError(f"tokens[{b}] must have 1 to n = {n} tokens, got {len(toks)}")
    layer0, head0 = default
    if not (0 <= layer0 < len(mhas) and 0 <= head0 < h):
        raise ValueError(f"default must be (layer < {len(mhas)}, head < {h}), got {default!r}")

    f64 = torch.float64
    per_sentence: list[list[list[dict[str, dict[str, Any]]]]] = [[] for _ in range(B)]
    with torch.no_grad():
        for m, x in zip(mhas, inputs):
            qk = qk_circuit(m)  # the SVD in float64: rounding cannot move a printed digit
            qk = FactoredMatrix(qk.left.to(f64), qk.right.to(f64))
            u, s, vh = qk.svd()  # (h, d_model, d_k), (h, d_k), (h, d_k, d_model), signs fixed
            v = vh.mT  # (h, d_model, d_k)
            d = s.sqrt() / d_k**0.25  # (h, d_k)
            w_k = m.w_k_heads.detach().to(f64)  # (h, d_model, d_k)
            b_q = (m.b_q.detach().to(f64).view(h, d_k) if m.b_q is not None
                   else torch.zeros(h, d_k, dtype=f64))  # (h, d_k)
            x64 = x.detach().to(f64)  # (B, n, d_model)
            p_all = (x64[:, None] @ u[None]) * d[None, :, None]  # (B, h, n, d_k)
            k_all = (x64[:, None] @ v[None]) * d[None, :, None]  # (B, h, n, d_k)
            keys = x64[:, None] @ w_k[None]  # (B, h, n, d_k): keys without bias
            c_all = (keys @ b_q[None, :, :, None]).squeeze(-1) / math.sqrt(d_k)  # (B, h, n)
            for b, toks in enumerate(tokens):
                t = len(toks)
                per_sentence[b].append([
                    {"p": round_array(p_all[b, i, :t]), "k": round_array(k_all[b, i, :t]),
                     "c": round_array(c_all[b, i, :t])}
                    for i in range(h)
                ])
    data = {
        "tokens": [list(t) for t in tokens],
        "layers": len(mhas),
        "heads": h,
        "rank": d_k,
        "default": [layer0, head0],
        "sentences": per_sentence,
    }
    from attnlib import plots

    toks0 = list(tokens[0])
    with torch.no_grad():
        x0 = inputs[layer0][:1, : len(toks0)]  # (1, t, d_model)
        _, w0 = mhas[layer0](x0, x0, x0)  # (1, h, t, t)
    assert w0 is not None
    fig = plots.attention_map(w0[0, head0], toks0, toks0,
                              title=f"layer {layer0}, head {head0}, full rank")
    alt = (f"Attention map of layer {layer0}, head {head0} on the sentence "
           f"{' '.join(toks0)}: rows are the reading tokens, columns the tokens read.")
    return Explorer(name, data, fig, alt)


# ---- chapter 10: the online softmax, one block of keys at a time ----------------------------
def online_softmax_explorer(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    blocks: Sequence[int],
    default: tuple[int, int] = (0, 1),
    name: str = "online-softmax",
) -> Explorer:
    r"""One query's keys visited in blocks: the state of the online softmax after each block.

    For each block size ``b`` in ``blocks`` and each step ``t = 0 .. ceil(n_k / b)`` (blocks
    visited so far), with the first ``c = min(t b, n_k)`` keys seen:

    .. math::
        m_t = \max_{j < c} s_j, \qquad \ell_t = \sum_{j < c} e^{s_j - m_t}, \qquad
        o_t = \frac{1}{\ell_t} \sum_{j < c} e^{s_j - m_t}\, v_j ,

    computed by :func:`attnlib.blockwise.blockwise_attention` over the first ``c`` keys
    (``o_t`` its output, :math:`m_t + \log \ell_t` its log-sum-exp), with
    :math:`s = q K^\top / \sqrt{d_k}`. At the last step :math:`o_t` is the attention output.

    Shapes: ``q`` ``(d_k,)``, ``keys`` ``(n_k, d_k)``, ``values`` ``(n_k, d_v)``; ``blocks``:
    increasing block sizes from 1 to ``n_k``. ``default``: (index into ``blocks``, step) of the
    first view. Embedded (computed in float64): the scores (4 decimals), and per block size and
    step :math:`m_t, \ell_t` (4 decimals) and :math:`o_t` (4 decimals); step 0 has no keys:
    ``m = ell = 0`` stand for :math:`-\infty` and 0, and ``o = 0``.
    """
    if check_tensor("q", q).dim() != 1:
        raise ValueError(f"q must be one query of shape (d_k,), got {format_shape(q)}")
    for arg, t in (("keys", keys), ("values", values)):
        if check_tensor(arg, t).dim() != 2:
            raise ValueError(f"{arg} must be a 2-D tensor, got {format_shape(t)}")
    n_k = int(keys.shape[0])
    if keys.shape[1] != q.shape[0] or values.shape[0] != n_k:
        raise ValueError(f"keys must be (n_k, d_k = {q.shape[0]}) and values (n_k, d_v) with one n_k, "
                         f"got keys {format_shape(keys)} and values {format_shape(values)}")
    bs = list(blocks)
    if (not bs or any(isinstance(b, bool) or not isinstance(b, int) for b in bs)
            or any(not 1 <= b <= n_k for b in bs) or any(a >= b for a, b in zip(bs, bs[1:]))):
        raise ValueError(f"blocks must be increasing ints from 1 to n_k = {n_k}, got {list(blocks)!r}")
    b_idx, step0 = default
    if not (0 <= b_idx < len(bs) and 0 <= step0 <= -(-n_k // bs[b_idx])):
        raise ValueError(f"default must be (an index into blocks < {len(bs)}, a step of that block size), got {default!r}")
    f64 = torch.float64
    q64, k64, v64 = (t.detach().to(f64) for t in (q, keys, values))
    scores = (k64 @ q64) / math.sqrt(q.shape[0])  # (n_k,)
    per_block: list[dict[str, list[Any]]] = []
    for b in bs:
        m, ell, outs = [0.0], [0.0], [[0.0] * v64.shape[1]]
        for step in range(1, -(-n_k // b) + 1):
            c = min(step * b, n_k)
            r = blockwise_attention(q64, k64[:c], v64[:c], block_k=b)  # out (d_v,), lse ()
            m_t = float(scores[:c].max())
            m.append(round(m_t, 4) + 0.0)
            ell.append(round(math.exp(float(r.lse) - m_t), 4) + 0.0)
            outs.append([round(float(x), 4) + 0.0 for x in r.out])
        per_block.append({"m": m, "ell": ell, "out": outs})
    data = {
        "scores": [round(float(x), 4) + 0.0 for x in scores],
        "blocks": bs,
        "dv": int(values.shape[1]),
        "default": [b_idx, step0],
        "steps": per_block,
    }
    from attnlib import plots

    b0 = bs[b_idx]
    seen = min(step0 * b0, n_k)
    fig = plots.online_softmax_steps(scores, b0, seen, per_block[b_idx]["m"][step0],
                                     title=f"block size {b0}, after {step0} block(s)")
    alt = (f"Bar chart of one query's {n_k} scores; the first {seen} keys, visited in blocks of {b0}, "
           f"are solid, with the running maximum {per_block[b_idx]['m'][step0]:.2f} as a dashed line.")
    return Explorer(name, data, fig, alt)
