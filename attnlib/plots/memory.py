"""Figures of chapters 8 and 10: the bytes a cache holds per token, the online softmax's steps,
the bytes attention moves between HBM and SRAM."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from attnlib.plots.common import figure_and_axes, finish_figure, to_numpy

__all__ = ["cache_bytes", "online_softmax_steps", "io_scaling"]


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
    fig, ax = figure_and_axes(ax, (6.4, 0.9 + 0.42 * len(labels)))
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
    finish_figure(ax, "cache per token (KiB, log scale)", "", title, grid="x")
    return fig


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
    s = to_numpy(scores)
    if s.ndim != 1 or s.size == 0:
        raise ValueError(f"scores must have shape (n_k,) with n_k >= 1, got {s.shape}")
    n = s.size
    if not (isinstance(block, int) and 1 <= block <= n):
        raise ValueError(f"block must be an int from 1 to n_k = {n}, got {block!r}")
    if not (isinstance(seen, int) and 0 <= seen <= n):
        raise ValueError(f"seen must be an int from 0 to n_k = {n}, got {seen!r}")
    fig, ax = figure_and_axes(ax, (6.4, 3.0))
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
    finish_figure(ax, "key j (visited left to right, in blocks)", "score $s_j$", title, grid="y")
    return fig


def io_scaling(
    points: dict[str, tuple[Sequence[float], Sequence[float]]],
    lines: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    xlabel: str = "x",
    ylabel: str = "y",
    ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """Log-log scatter, one group of markers per entry of ``points`` (label -> (x, y)), and a
    dashed reference line per entry of ``lines`` (label -> (x, y)): chapter 10's bytes moved
    by each algorithm against the quantity a theorem says they grow with."""
    if not points:
        raise ValueError("points must hold at least one group (label -> (x, y)), got none")
    groups = {**points, **(lines or {})}
    for label, (x, y) in groups.items():
        xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if xs.shape != ys.shape or xs.ndim != 1 or xs.size == 0:
            raise ValueError(f"{label!r}: x and y must be 1-D of one non-zero length, got {xs.shape} and {ys.shape}")
        if not ((xs > 0).all() and (ys > 0).all()):
            raise ValueError(f"{label!r}: a log-log plot needs positive x and y")
    fig, ax = figure_and_axes(ax, (5.6, 3.8))
    for c, (label, (x, y)) in enumerate(points.items()):
        ax.scatter(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), s=18, color=f"C{c}", label=label)
    for c, (label, (x, y)) in enumerate((lines or {}).items()):
        order = np.argsort(np.asarray(x, dtype=np.float64))
        ax.plot(np.asarray(x, dtype=np.float64)[order], np.asarray(y, dtype=np.float64)[order], linestyle="--",
                linewidth=1, color=f"C{c}", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    finish_figure(ax, xlabel, ylabel, title)
    ax.legend(fontsize="small")
    return fig
