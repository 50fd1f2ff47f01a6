"""Figures of chapters 5 and 6: timing panels, block heat maps, a real model's spectra and strips."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from attnlib.plots.common import figure_and_axes, finish_figure, to_numpy

__all__ = ["benchmark_panels", "block_heatmap", "spectra_groups", "strip_plot"]


def benchmark_panels(
    rows: Sequence[dict[str, object]],
    h_fixed: int = 8,
    n_fixed: int = 256,
    variants: Sequence[str] | None = None,
    labels: dict[str, str] | None = None,
    modes: Sequence[str] = ("forward", "train"),
) -> Figure:
    """Timings from ``benchmarks/bench_attention.py``: median time against sequence
    length ``n`` (at ``h = h_fixed``) and against head count ``h`` (at ``n = n_fixed``),
    one row of panels per mode, log-log, with the GEMM floor dashed.

    ``rows``: dicts with keys ``mode, n, h, variant, median_ms, floor_ms`` (one per
    measurement, as ``read_results`` in ``benchmarks/bench_attention.py`` returns them).
    """
    variants = list(variants) if variants is not None else list(dict.fromkeys(str(r["variant"]) for r in rows))
    labels = labels or {}
    modes = [m for m in modes if any(r["mode"] == m for r in rows)]
    if not modes:
        raise ValueError("rows hold none of the requested modes")
    fig, axes = plt.subplots(len(modes), 2, figsize=(10.5, 3.4 * len(modes) + 0.9), layout="constrained",
                             squeeze=False)
    for i, mode in enumerate(modes):
        for j, (key, fixed_key, fixed) in enumerate((("n", "h", h_fixed), ("h", "n", n_fixed))):
            ax = axes[i, j]
            sel = [r for r in rows if r["mode"] == mode and r[fixed_key] == fixed]
            xs = sorted({int(str(r[key])) for r in sel})
            if not xs:
                raise ValueError(f"no {mode!r} rows with {fixed_key} = {fixed}")
            for v in variants:
                pts = {int(str(r[key])): float(str(r["median_ms"])) for r in sel if r["variant"] == v}
                if pts:
                    x = [k for k in xs if k in pts]
                    ax.plot(x, [pts[k] for k in x], marker="o", markersize=3, label=labels.get(v, v))
            floor = {int(str(r[key])): float(str(r["floor_ms"])) for r in sel}
            ax.plot(xs, [floor[k] for k in xs], "k--", linewidth=1, label="GEMM floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(xs, [str(k) for k in xs])
            ax.set_xlabel("sequence length n" if key == "n" else "number of heads h")
            ax.set_ylabel("median time (ms)")
            ax.set_title(f"{mode}, {fixed_key} = {fixed}", fontsize=10)
            ax.grid(alpha=0.3, which="both")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=min(5, len(names)), fontsize="small")
    return fig


def block_heatmap(
    values: torch.Tensor | np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    xlabel: str,
    ylabel: str,
    colorbar_label: str,
    ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """Heat map of a small non-negative matrix ``(rows, cols)`` with every cell annotated
    (three significant digits; exact zeros print as ``0``), e.g. how strongly block ``j``
    of a weight matrix influences output ``i``."""
    v = to_numpy(values)
    if v.ndim != 2 or v.shape != (len(row_labels), len(col_labels)):
        raise ValueError(
            f"values must have shape (len(row_labels), len(col_labels)) = "
            f"({len(row_labels)}, {len(col_labels)}), got {v.shape}"
        )
    fig, ax = figure_and_axes(ax, (1.8 + 0.75 * v.shape[1], 1.2 + 0.6 * v.shape[0]))
    top = float(v.max()) if v.size and v.max() > 0 else 1.0
    im = ax.imshow(v, cmap="Greens", vmin=0.0, vmax=top, aspect="auto")
    ax.set_xticks(range(v.shape[1]), col_labels)
    ax.set_yticks(range(v.shape[0]), row_labels)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    for i in range(v.shape[0]):
        for j in range(v.shape[1]):
            text = "0" if v[i, j] == 0 else f"{v[i, j]:.3g}"
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="white" if v[i, j] > 0.6 * top else "black")
    if title:
        ax.set_title(title)
    fig.colorbar(im, ax=ax, label=colorbar_label)
    return fig


def spectra_groups(
    groups: dict[str, torch.Tensor | np.ndarray],
    ax: Axes | None = None,
    title: str | None = None,
    normalize: bool = True,
    floor: float = 1e-12,
) -> Figure:
    """Many spectra at once, one colour per group, on a log scale.

    ``groups[label]`` is ``(n_lines, k)``: one row of singular values per matrix
    (e.g. one per head). Each row is sorted in decreasing order and, when
    ``normalize``, divided by its largest value, so matrices of different scale share
    one axis. Values below ``floor`` are drawn at ``floor`` (a rank cut-off shows as a
    cliff). One legend entry per group.
    """
    fig, ax = figure_and_axes(ax, (5.5, 3.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for g, (label, spectra) in enumerate(groups.items()):
        s = to_numpy(spectra)
        if s.ndim != 2:
            raise ValueError(f"groups[{label!r}] must have shape (n_lines, k), got {s.shape}")
        s = -np.sort(-s, axis=1)  # (n_lines, k), decreasing
        if normalize:
            s = s / np.where(s[:, :1] > 0, s[:, :1], 1.0)
        x = np.arange(1, s.shape[1] + 1)
        for row, v in enumerate(s):
            ax.plot(x, np.maximum(v, floor), color=colors[g % len(colors)], alpha=0.6, linewidth=1.0,
                    label=label if row == 0 else None)
    ax.set_yscale("log")
    ylabel = "singular value / largest" if normalize else "singular value"
    finish_figure(ax, "index of singular value (largest first)", ylabel, title)
    ax.legend()
    return fig


def strip_plot(
    x_labels: Sequence[str],
    series: dict[str, torch.Tensor | np.ndarray],
    xlabel: str,
    ylabel: str,
    ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """Points grouped by category: ``series[label]`` is ``(len(x_labels), n_points)``.

    Each series gets its own colour and a small horizontal offset, so several series
    (e.g. trained against random weights, one point per head) sit side by side over
    each x label.
    """
    fig, ax = figure_and_axes(ax, (1.5 + 0.9 * len(x_labels), 3.6))
    k = len(series)
    for j, (label, values) in enumerate(series.items()):
        v = to_numpy(values)
        if v.ndim != 2 or v.shape[0] != len(x_labels):
            raise ValueError(
                f"series[{label!r}] must have shape (len(x_labels)={len(x_labels)}, n_points), got {v.shape}"
            )
        offset = (j - (k - 1) / 2) * 0.8 / max(k, 1)
        xs = np.repeat(np.arange(v.shape[0]) + offset, v.shape[1])
        ax.scatter(xs, v.reshape(-1), s=12, alpha=0.7, label=label)
    ax.set_xticks(range(len(x_labels)), x_labels)
    ax.set_ylim(0, None)
    finish_figure(ax, xlabel, ylabel, title, grid="y")
    ax.legend(loc="lower center", ncol=k, fontsize="small")
    return fig
