"""Figures for the book, all in one place (every chapter).

Each helper draws on a given matplotlib ``Axes`` (or makes one), labels its axes
and returns the ``Figure``, so a notebook cell is one call. Captions and alt text
are set on the notebook cell (``mystnb`` metadata), not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure

__all__ = ["attention_map", "attention_maps", "line_plot", "singular_values",
           "spectra_groups", "strip_plot", "benchmark_panels", "block_heatmap"]


def _to_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
        return fig, ax
    owner: Figure | SubFigure = ax.figure
    while not isinstance(owner, Figure):  # an Axes on a SubFigure: the Figure that holds it
        owner = owner.figure
    return owner, ax


def _finish_figure(
    ax: Axes, xlabel: str, ylabel: str, title: str | None, grid: Literal["both", "x", "y"] = "both"
) -> None:
    """Label both axes, set the optional title, draw a light grid."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(axis=grid, alpha=0.3)


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
    w = _to_numpy(weights)
    if w.ndim != 2:
        raise ValueError(f"weights must have shape (n_q, n_k), got {w.shape}")
    fig, ax = _axes(ax, (1.2 + 0.7 * w.shape[1], 1.0 + 0.6 * w.shape[0]))
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
    """
    w = _to_numpy(weights)
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
    fig, ax = _axes(ax, (5.5, 3.6))
    for label, y in series.items():
        ax.plot(_to_numpy(np.asarray(x)), _to_numpy(np.asarray(y)), marker="o", markersize=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    _finish_figure(ax, xlabel, ylabel, title)
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
    fig, ax = _axes(ax, (5.5, 3.6))
    for label, s in spectra.items():
        v = np.sort(_to_numpy(s))[::-1]
        ax.plot(np.arange(1, len(v) + 1), np.maximum(v, floor), label=label)
    ax.set_yscale("log")
    _finish_figure(ax, "index of singular value (largest first)", "singular value", title)
    ax.legend()
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
    fig, ax = _axes(ax, (5.5, 3.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for g, (label, spectra) in enumerate(groups.items()):
        s = _to_numpy(spectra)
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
    _finish_figure(ax, "index of singular value (largest first)", ylabel, title)
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
    fig, ax = _axes(ax, (1.5 + 0.9 * len(x_labels), 3.6))
    k = len(series)
    for j, (label, values) in enumerate(series.items()):
        v = _to_numpy(values)
        if v.ndim != 2 or v.shape[0] != len(x_labels):
            raise ValueError(
                f"series[{label!r}] must have shape (len(x_labels)={len(x_labels)}, n_points), got {v.shape}"
            )
        offset = (j - (k - 1) / 2) * 0.8 / max(k, 1)
        xs = np.repeat(np.arange(v.shape[0]) + offset, v.shape[1])
        ax.scatter(xs, v.reshape(-1), s=12, alpha=0.7, label=label)
    ax.set_xticks(range(len(x_labels)), x_labels)
    ax.set_ylim(0, None)
    _finish_figure(ax, xlabel, ylabel, title, grid="y")
    ax.legend(loc="lower center", ncol=k, fontsize="small")
    return fig


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
    v = _to_numpy(values)
    if v.ndim != 2 or v.shape != (len(row_labels), len(col_labels)):
        raise ValueError(
            f"values must have shape (len(row_labels), len(col_labels)) = "
            f"({len(row_labels)}, {len(col_labels)}), got {v.shape}"
        )
    fig, ax = _axes(ax, (1.8 + 0.75 * v.shape[1], 1.2 + 0.6 * v.shape[0]))
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
    q, c, o = _to_numpy(w_q), _to_numpy(concat), _to_numpy(w_o)
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
        _finish_figure(ax, xlabel, ylabel, None, grid="both")
        ax.grid(False)
        ax.set_title(title, fontsize=11)
    return fig


__all__ += ["head_blocks"]

# ---- chapter 7: the phone book, learned ------------------------------------------------
__all__ += ["signed_heatmap", "rank_sweep"]


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
    v = _to_numpy(values)
    if v.ndim != 2 or v.shape != (len(row_labels), len(col_labels)):
        raise ValueError(
            f"values must have shape (len(row_labels), len(col_labels)) = "
            f"({len(row_labels)}, {len(col_labels)}), got {v.shape}"
        )
    for name, split, n in (("row_split", row_split, v.shape[0]), ("col_split", col_split, v.shape[1])):
        if split is not None and not 0 < split < n:
            raise ValueError(f"{name} must lie strictly between 0 and {n}, got {split}")
    fig, ax = _axes(ax, (1.8 + 0.35 * v.shape[1], 1.2 + 0.3 * v.shape[0]))
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
    fig, ax = _axes(ax, (5.5, 3.6))
    for label, y in series.items():
        (line,) = ax.plot(list(d_ks), _to_numpy(np.asarray(y)), marker="o", label=label)
        if label in spreads:
            lo, hi = spreads[label]
            ax.fill_between(list(d_ks), _to_numpy(np.asarray(lo)), _to_numpy(np.asarray(hi)),
                            color=line.get_color(), alpha=0.2, linewidth=0)
    for k, (label, y0) in enumerate(levels.items()):
        ax.axhline(y0, color="black", linestyle=["--", ":"][k % 2], linewidth=1.0, label=label)
    styles = [":", "--", "-."]
    for k, (label, x) in enumerate(references.items()):
        ax.axvline(x, color="grey", linestyle=styles[k % len(styles)], linewidth=1.2, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(d_ks), [str(d) for d in d_ks])
    ax.minorticks_off()
    _finish_figure(ax, "head width $d_k$", ylabel, title)
    ax.legend(fontsize="small")
    return fig


# ---- chapter 8: decoding ---------------------------------------------------------------
__all__ += ["cache_bytes"]


def cache_bytes(
    per_token: dict[str, float],
    ax: Axes | None = None,
    title: str | None = None,
    groups: dict[str, str] | None = None,
) -> Figure:
    """Horizontal bars of cache bytes per token, one bar per entry of ``per_token``
    (label -> bytes), top to bottom in the dict's order, on a log axis in KiB, each bar
    annotated with its size. ``groups`` (label -> group name) colours the bars by group
    and adds a legend; every label must then have a group.
    """
    if not per_token:
        raise ValueError("per_token must hold at least one entry (label -> bytes), got none")
    bad = {k: v for k, v in per_token.items() if not v > 0}
    if bad:
        raise ValueError(f"per_token values must be positive byte counts, got {bad}")
    if groups is not None and set(groups) != set(per_token):
        raise ValueError(
            f"groups must name a group for every label of per_token: "
            f"missing {sorted(set(per_token) - set(groups))}, extra {sorted(set(groups) - set(per_token))}"
        )
    labels = list(per_token)
    kib = np.array([per_token[k] for k in labels], dtype=np.float64) / 1024
    fig, ax = _axes(ax, (6.4, 0.9 + 0.42 * len(labels)))
    y = np.arange(len(labels))
    if groups is None:
        ax.barh(y, kib, color="C0")
    else:
        names = list(dict.fromkeys(groups[k] for k in labels))
        for c, name in enumerate(names):
            sel = [i for i, k in enumerate(labels) if groups[k] == name]
            ax.barh(y[sel], kib[sel], color=f"C{c}", label=name)
        ax.legend(loc="lower right", fontsize="small")
    ax.set_xscale("log")
    ax.set_yticks(y, labels)
    ax.invert_yaxis()  # first entry on top
    for yi, v in zip(y, kib):
        ax.text(float(v) * 1.08, float(yi), f"{v:,.4g} KiB", va="center", fontsize=8)
    ax.set_xlim(kib.min() / 2, kib.max() * 12)
    _finish_figure(ax, "cache per token (KiB, log scale)", "", title, grid="x")
    return fig


# ---- chapter 10: attention without the n x n matrix -------------------------------------
__all__ += ["online_softmax_steps"]


def online_softmax_steps(
    scores: torch.Tensor | np.ndarray,
    block: int,
    seen: int,
    running_max: float,
    ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """One query's scores ``(n_k,)`` as bars, visited in blocks of ``block`` keys: the first
    ``seen`` keys drawn solid (the last block of them highlighted), the rest faint, block
    boundaries dotted, and the running maximum of the seen scores as a dashed line."""
    s = _to_numpy(scores)
    if s.ndim != 1 or s.size == 0:
        raise ValueError(f"scores must have shape (n_k,) with n_k >= 1, got {s.shape}")
    n = s.size
    if not (isinstance(block, int) and 1 <= block <= n):
        raise ValueError(f"block must be an int from 1 to n_k = {n}, got {block!r}")
    if not (isinstance(seen, int) and 0 <= seen <= n):
        raise ValueError(f"seen must be an int from 0 to n_k = {n}, got {seen!r}")
    fig, ax = _axes(ax, (6.4, 3.0))
    last = max(0, seen - ((seen - 1) % block + 1)) if seen else 0  # first key of the last block seen
    colours = ["C1" if last <= j < seen else "C0" if j < seen else "0.8" for j in range(n)]
    ax.bar(np.arange(n), s, color=colours)
    for b in range(block, n, block):
        ax.axvline(b - 0.5, color="0.5", linestyle=":", linewidth=1)
    if seen:
        ax.axhline(running_max, color="C3", linestyle="--", linewidth=1.2,
                   label=f"running max m = {running_max:.2f}")
        ax.legend(loc="lower right", fontsize="small")
    ax.axhline(0, color="0.3", linewidth=0.6)
    ax.set_xticks(range(n), [str(j) for j in range(n)])
    _finish_figure(ax, "key j (visited left to right, in blocks)", "score $s_j$", title, grid="y")
    return fig
