"""Figures for the book, all in one place (every chapter).

Each helper draws on a given matplotlib ``Axes`` (or makes one), labels its axes
and returns the ``Figure``, so a notebook cell is one call. Captions and alt text
are set on the notebook cell (``mystnb`` metadata), not here.

The helpers live by chapter: :mod:`~attnlib.plots.maps` (chapters 1-4),
:mod:`~attnlib.plots.measures` (5-6), :mod:`~attnlib.plots.learned` (7) and
:mod:`~attnlib.plots.memory` (8, 10); each is importable from ``attnlib.plots``.
"""

from attnlib.plots.learned import rank_sweep, signed_heatmap
from attnlib.plots.maps import attention_map, attention_maps, head_blocks, line_plot, singular_values
from attnlib.plots.measures import benchmark_panels, block_heatmap, spectra_groups, strip_plot
from attnlib.plots.memory import cache_bytes, io_scaling, online_softmax_steps

__all__ = [
    # chapters 1-4
    "attention_map",
    "attention_maps",
    "line_plot",
    "singular_values",
    "head_blocks",
    # chapters 5-6
    "benchmark_panels",
    "block_heatmap",
    "spectra_groups",
    "strip_plot",
    # chapter 7
    "signed_heatmap",
    "rank_sweep",
    # chapters 8 and 10
    "cache_bytes",
    "online_softmax_steps",
    "io_scaling",
]
