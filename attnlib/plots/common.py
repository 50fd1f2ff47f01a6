"""What every figure helper shares: arrays in float64, the axes to draw on, the labels.

Public so that the chapter modules of :mod:`attnlib.plots` share them; not part of
``attnlib.plots``' own names.
"""

from __future__ import annotations

from typing import Literal

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure

__all__ = ["to_numpy", "figure_and_axes", "finish_figure"]


def to_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """``x`` as a float64 NumPy array (a tensor detached and moved to the CPU first)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def figure_and_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """``ax`` and the top-level ``Figure`` that holds it, or a new figure of ``figsize`` with one ``Axes``."""
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
        return fig, ax
    owner: Figure | SubFigure = ax.figure
    while not isinstance(owner, Figure):  # an Axes on a SubFigure: the Figure that holds it
        owner = owner.figure
    return owner, ax


def finish_figure(
    ax: Axes, xlabel: str, ylabel: str, title: str | None, grid: Literal["both", "x", "y"] = "both"
) -> None:
    """Label both axes, set the optional title, draw a light grid."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(axis=grid, alpha=0.3)
