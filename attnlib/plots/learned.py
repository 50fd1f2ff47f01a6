"""Figures of chapter 7: a trained head's signed matrices and the sweep over its rank."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from attnlib.plots.common import figure_and_axes, finish_figure, to_numpy

__all__ = ["signed_heatmap", "rank_sweep"]


def signed_heatmap(
    values: torch.Tensor | np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    xlabel: str,
    ylabel: str,
    colorbar_label: str,
    ax: Axes | None = None,
    title: str | None = None,
    row_split: int | None = None,
    col_split: int | None = None,
    annotate: bool = False,
) -> Figure:
    """Heat map of a matrix ``(rows, cols)`` of either sign, e.g. a trained W^QK.

    The colour scale is symmetric about 0 (red positive, blue negative, white 0).
    ``row_split`` / ``col_split`` draw a line before that row / column, to mark the
    blocks of a matrix (such as the key and value blocks of a token). With
    ``annotate`` every cell shows its value (two decimals).
    """
    v = to_numpy(values)
    if v.ndim != 2 or v.shape != (len(row_labels), len(col_labels)):
        raise ValueError(
            f"values must have shape (len(row_labels), len(col_labels)) = "
            f"({len(row_labels)}, {len(col_labels)}), got {v.shape}"
        )
    for name, split, n in (("row_split", row_split, v.shape[0]), ("col_split", col_split, v.shape[1])):
        if split is not None and not 0 < split < n:
            raise ValueError(f"{name} must lie strictly between 0 and {n}, got {split}")
    fig, ax = figure_and_axes(ax, (1.8 + 0.35 * v.shape[1], 1.2 + 0.3 * v.shape[0]))
    top = float(np.abs(v).max()) or 1.0
    im = ax.imshow(v, cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto")
    ax.set_xticks(range(v.shape[1]), list(col_labels), rotation=90 if v.shape[1] > 6 else 0)
    ax.set_yticks(range(v.shape[0]), list(row_labels))
    ax.tick_params(labelsize=8)
    if row_split is not None:
        ax.axhline(row_split - 0.5, color="black", linewidth=1.2)
    if col_split is not None:
        ax.axvline(col_split - 0.5, color="black", linewidth=1.2)
    if annotate:
        for i in range(v.shape[0]):
            for j in range(v.shape[1]):
                ax.text(j, i, f"{v[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if abs(v[i, j]) > 0.6 * top else "black")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label=colorbar_label)
    return fig


def rank_sweep(
    d_ks: Sequence[int],
    series: dict[str, Sequence[float] | np.ndarray],
    references: dict[str, float],
    ylabel: str,
    ax: Axes | None = None,
    title: str | None = None,
    spreads: dict[str, tuple[Sequence[float] | np.ndarray, Sequence[float] | np.ndarray]] | None = None,
    levels: dict[str, float] | None = None,
) -> Figure:
    """Results against the head width ``d_k`` (log-2 axis), one line per entry of
    ``series``, with a dashed vertical line at each value of ``references``
    (label -> d_k), e.g. the number of keys a naive argument asks for.

    ``spreads`` (a label of ``series`` -> (lowest, highest) per ``d_k``) shades the
    range of that series over seeds; ``levels`` (label -> y) draws a horizontal line,
    e.g. the accuracy of a control that does not depend on ``d_k``."""
    spreads, levels = spreads or {}, levels or {}
    for label, y in series.items():
        if len(y) != len(d_ks):
            raise ValueError(f"series[{label!r}] must have len(d_ks) = {len(d_ks)} values, got {len(y)}")
    for label, (lo, hi) in spreads.items():
        if label not in series:
            raise ValueError(f"spreads[{label!r}] names no series; series are {list(series)}")
        if len(lo) != len(d_ks) or len(hi) != len(d_ks):
            raise ValueError(f"spreads[{label!r}] must hold two sequences of len(d_ks) = {len(d_ks)} values")
    fig, ax = figure_and_axes(ax, (5.5, 3.6))
    for label, y in series.items():
        (line,) = ax.plot(list(d_ks), to_numpy(np.asarray(y)), marker="o", label=label)
        if label in spreads:
            lo, hi = spreads[label]
            ax.fill_between(list(d_ks), to_numpy(np.asarray(lo)), to_numpy(np.asarray(hi)),
                            color=line.get_color(), alpha=0.2, linewidth=0)
    for k, (label, y0) in enumerate(levels.items()):
        ax.axhline(y0, color="black", linestyle=["--", ":"][k % 2], linewidth=1.0, label=label)
    styles = [":", "--", "-."]
    for k, (label, x) in enumerate(references.items()):
        ax.axvline(x, color="grey", linestyle=styles[k % len(styles)], linewidth=1.2, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(d_ks), [str(d) for d in d_ks])
    ax.minorticks_off()
    finish_figure(ax, "head width $d_k$", ylabel, title)
    ax.legend(fontsize="small")
    return fig
