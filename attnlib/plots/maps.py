"""Figures of chapters 1-4: attention maps, curves, singular values, the heads' blocks."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from attnlib.plots.common import figure_and_axes, finish_figure, to_numpy

__all__ = ["attention_map", "attention_maps", "line_plot", "singular_values", "head_blocks"]


def attention_map(
    weights: torch.Tensor | np.ndarray,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    ax: Axes | None = None,
    title: str | None = None,
    annotate: bool = True,
    colorbar: bool = True,
) -> Figure:
    """Heat map of attention weights ``(n_q, n_k)``: rows are queries, columns keys.

    Cells are annotated with their weight (two decimals) when ``annotate`` and the
    map is small enough to read.
    """
    w = to_numpy(weights)
    if w.ndim != 2:
        raise ValueError(f"weights must have shape (n_q, n_k), got {w.shape}")
    fig, ax = figure_and_axes(ax, (1.2 + 0.7 * w.shape[1], 1.0 + 0.6 * w.shape[0]))
    im = ax.imshow(w, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xlabel("key (position read from)")
    ax.set_ylabel("query (position reading)")
    ax.set_xticks(range(w.shape[1]), list(key_labels) if key_labels is not None else [str(j) for j in range(w.shape[1])])
    ax.set_yticks(range(w.shape[0]), list(query_labels) if query_labels is not None else [str(i) for i in range(w.shape[0])])
    if annotate and w.size <= 144:
        for i in range(w.shape[0]):
            for j in range(w.shape[1]):
                ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center",
                        color="white" if w[i, j] > 0.6 else "black", fontsize=8)
    if title:
        ax.set_title(title)
    if colorbar:
        fig.colorbar(im, ax=ax, label="attention weight")
    return fig


def attention_maps(
    weights: torch.Tensor | np.ndarray,
    labels: Sequence[str] | None = None,
    ncols: int = 4,
    title: str | None = None,
    panel_titles: Sequence[str] | None = None,
    colorbar: bool = True,
) -> Figure:
    """A grid of attention maps, one panel per head: ``weights`` is ``(h, n_q, n_k)``.

    Every panel uses the same colour scale, 0 to 1, shown once by a shared colour bar.
    Every panel reads the same tokens, so their names label the outer panels only: the
    keys under each panel with no panel below it, the queries on the first column.
    (Each label is a text to lay out; on twelve panels, repeating them tripled the
    figure's drawing time.)
    """
    w = to_numpy(weights)
    if w.ndim != 3:
        raise ValueError(f"weights must have shape (h, n_q, n_k), got {w.shape}")
    h = w.shape[0]
    ncols = min(ncols, h)
    nrows = -(-h // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.6 * ncols, 2.5 * nrows), layout="constrained",
                             squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.axis("off")
            continue
        ax.imshow(w[i], cmap="Blues", vmin=0.0, vmax=1.0)
        ticks_q, ticks_k = range(w.shape[1]), range(w.shape[2])
        ax.set_xticks(ticks_k, labels if labels is not None else ticks_k, rotation=90, fontsize=7)
        ax.set_yticks(ticks_q, labels if labels is not None else ticks_q, fontsize=7)
        # the same names on every panel: shown on the outer ones only
        ax.tick_params(labelbottom=i >= h - ncols, labelleft=i % ncols == 0)
        ax.set_title(panel_titles[i] if panel_titles is not None else f"head {i}", fontsize=9)
        if i % ncols == 0:
            ax.set_ylabel("query")
        if i >= h - ncols:
            ax.set_xlabel("key")
    if colorbar:
        fig.colorbar(axes.flat[0].images[0], ax=axes, shrink=0.8 if nrows == 1 else 0.5,
                     label="attention weight")
    if title:
        fig.suptitle(title)
    return fig


def line_plot(
    x: Sequence[float] | np.ndarray,
    series: dict[str, Sequence[float] | np.ndarray],
    xlabel: str,
    ylabel: str,
    ax: Axes | None = None,
    title: str | None = None,
    logx: bool = False,
    logy: bool = False,
) -> Figure:
    """One line per entry of ``series`` (legend label -> y values) against ``x``."""
    fig, ax = figure_and_axes(ax, (5.5, 3.6))
    for label, y in series.items():
        ax.plot(to_numpy(np.asarray(x)), to_numpy(np.asarray(y)), marker="o", markersize=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    finish_figure(ax, xlabel, ylabel, title)
    ax.legend()
    return fig


def singular_values(
    spectra: dict[str, torch.Tensor | np.ndarray],
    ax: Axes | None = None,
    title: str | None = None,
    floor: float = 1e-12,
) -> Figure:
    """Singular values in decreasing order on a log scale, one line per entry.

    Values below ``floor`` (numerically zero) are drawn at ``floor`` so a rank
    cut-off shows as a cliff rather than disappearing from a log axis.
    """
    fig, ax = figure_and_axes(ax, (5.5, 3.6))
    for label, s in spectra.items():
        v = np.sort(to_numpy(s))[::-1]
        ax.plot(np.arange(1, len(v) + 1), np.maximum(v, floor), label=label)
    ax.set_yscale("log")
    finish_figure(ax, "index of singular value (largest first)", "singular value", title)
    ax.legend()
    return fig


def head_blocks(
    w_q: torch.Tensor | np.ndarray,
    concat: torch.Tensor | np.ndarray,
    w_o: torch.Tensor | np.ndarray,
    num_heads: int,
) -> Figure:
    r"""Where each head lives in the fused layer: three panels, one colour per head.

    Left: ``w_q`` ``(d_model, h d_k)``, whose column block ``i`` is :math:`W_i^Q`.
    Middle: ``concat`` ``(n, h d_v)``, :math:`\mathrm{Concat}(\mathrm{head}_0, \dots)`,
    whose column block ``i`` is head ``i``'s output. Right: ``w_o`` ``(h d_v, d_model)``,
    whose row block ``i`` is :math:`W_i^O`, the rows that read head ``i``. Each panel
    shows the magnitudes of the entries in grey, tinted with the head's colour; heads
    are numbered from 0.
    """
    q, c, o = to_numpy(w_q), to_numpy(concat), to_numpy(w_o)
    if not (isinstance(num_heads, int) and num_heads > 0):
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if q.ndim != 2 or q.shape[1] % num_heads:
        raise ValueError(
            f"w_q must have shape (d_model, h*d_k) with h = {num_heads} dividing its "
            f"columns, got {q.shape}"
        )
    if c.ndim != 2 or c.shape[1] % num_heads:
        raise ValueError(
            f"concat must have shape (n, h*d_v) with h = {num_heads} dividing its "
            f"columns, got {c.shape}"
        )
    if o.ndim != 2 or o.shape[0] != c.shape[1]:
        raise ValueError(
            f"w_o must have shape (h*d_v, d_model) = ({c.shape[1]}, d_model), got {o.shape}"
        )
    d_k, d_v = q.shape[1] // num_heads, c.shape[1] // num_heads
    colours = plt.get_cmap("tab10")
    # dpi 130 and words in the titles: at 100 dpi the italic Q of W^Q read as an O
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.6), layout="constrained", dpi=130,
                             width_ratios=[q.shape[1], c.shape[1], o.shape[1]])
    panels = [
        (axes[0], q, "1. $W^Q$ (queries): block $i$ is $W_i^Q$", "column (block $i$: head $i$)",
         "row (input feature)", "col", d_k, "$W_{%d}^Q$"),
        (axes[1], c, "2. Concat: block $i$ is head $i$", "column (block $i$: head $i$)",
         "row (position)", "col", d_v, "head %d"),
        (axes[2], o, "3. $W^O$ (output): row block $i$ is $W_i^O$", "column (output feature)",
         "row (block $i$: head $i$)", "row", d_v, "$W_{%d}^O$"),
    ]
    for ax, m, title, xlabel, ylabel, kind, width, label in panels:
        ax.imshow(np.abs(m), cmap="Greys", aspect="auto", interpolation="nearest")
        for i in range(num_heads):
            start = i * width - 0.5
            if kind == "col":
                xy, w, h_ = (start, -0.5), width, m.shape[0]
                centre = (start + width / 2, m.shape[0] / 2 - 0.5)
            else:
                xy, w, h_ = (-0.5, start), m.shape[1], width
                centre = (m.shape[1] / 2 - 0.5, start + width / 2)
            ax.add_patch(plt.Rectangle(xy, w, h_, facecolor=colours(i % 10), alpha=0.35,
                                       edgecolor=colours(i % 10), linewidth=2))
            ax.text(*centre, label % i, ha="center", va="center", fontsize=11,
                    bbox=dict(facecolor="white", alpha=0.8, edgecolor="none", pad=1))
        finish_figure(ax, xlabel, ylabel, None, grid="both")
        ax.grid(False)
        ax.set_title(title, fontsize=11)
    return fig
