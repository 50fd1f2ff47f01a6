r"""The composition map of chapter 11, as an interactive figure.

:func:`composition_explorer` embeds, for every run and every kind of composition (Q, K, V),
the ``h0 x h1`` scores :math:`C(W^{OV}_{0,i}, \cdot)` of
:func:`attnlib.induction.composition_scores`, and the range that random matrices of the same
shapes score (the control). The book's ``_static/explorers.js`` (kind ``"composition"``)
draws one map at a time, with a seed and a kind to choose.
"""

from __future__ import annotations

from torch import Tensor

from attnlib.explorers import Explorer
from attnlib.induction.composition import KINDS, composition_scores
from attnlib.induction.model import InductionRuns

__all__ = ["composition_explorer"]


def composition_explorer(
    runs: InductionRuns,
    control: tuple[float, float],
    default: tuple[int, int] = (0, 1),
    name: str = "composition",
) -> Explorer:
    r"""Every run's Q-, K- and V-composition scores between layer 0 and layer 1.

    Embedded: ``scores[r][k]``, the ``(h, h)`` matrix (rows: layer-0 heads, columns: layer-1
    heads) of kind ``KINDS[k]`` for run ``r``, to 3 decimals (computed in float64);
    ``seeds``; ``control`` = ``(low, high)``, the range of random-matrix scores given (e.g.
    the 1st and 99th percentiles of :func:`~attnlib.induction.random_composition_scores`);
    ``default`` = (run, kind index) of the first view.
    """
    if not isinstance(runs, InductionRuns):
        raise TypeError(f"runs must be an attnlib.induction.InductionRuns, got {type(runs).__name__}")
    lo, hi = (float(x) for x in control)
    if not 0 <= lo <= hi <= 1:
        raise ValueError(f"control must be (low, high) with 0 <= low <= high <= 1, got {control!r}")
    r0, k0 = default
    if not (0 <= r0 < runs.n_runs and 0 <= k0 < len(KINDS)):
        raise ValueError(f"default must be (run < {runs.n_runs}, kind < {len(KINDS)}), got {default!r}")
    scores: list[list[Tensor]] = [
        [composition_scores(runs.layer(r, 0), runs.layer(r, 1), k) for k in KINDS] for r in range(runs.n_runs)
    ]
    data = {
        "seeds": list(runs.seeds),
        "kinds": list(KINDS),
        "heads": runs.num_heads,
        "scores": [[_rounded(s) for s in per_kind] for per_kind in scores],
        "control": [round(lo, 3) + 0.0, round(hi, 3) + 0.0],
        "default": [r0, k0],
    }
    from attnlib import plots

    h = runs.num_heads
    fig = plots.block_heatmap(
        scores[r0][k0], [f"L0 head {i}" for i in range(h)], [f"L1 head {j}" for j in range(h)],
        xlabel="reader: layer-1 head", ylabel="writer: layer-0 head", colorbar_label="composition score",
        title=f"seed {runs.seeds[r0]}, {KINDS[k0]}-composition")
    fig.set_size_inches(4.2, 2.8)
    alt = (f"Heat map of the {KINDS[k0]}-composition scores of seed {runs.seeds[r0]}: rows are the layer-0 "
           f"heads, columns the layer-1 heads; random matrices score {lo:.2f} to {hi:.2f}.")
    return Explorer(name, data, fig, alt)


def _rounded(s: Tensor) -> list[list[float]]:
    return [[round(float(x), 3) + 0.0 for x in row] for row in s.tolist()]

