"""attnlib.plots, chapter 7 helpers: labelled axes, block lines, errors."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from attnlib import plots  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_signed_heatmap() -> None:
    v = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.25, -0.5]])
    fig = plots.signed_heatmap(v, ["a", "b"], ["x", "y", "z"], "key token", "query token", "entry",
                               row_split=1, col_split=2, annotate=True, title="t")
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("key token", "query token", "t")
    assert ax.images[0].get_clim() == (-2.0, 2.0)  # symmetric about zero
    assert len(ax.lines) == 2 and len(ax.texts) == 6  # two block lines, every cell annotated
    assert fig.axes[1].get_ylabel() == "entry"  # the colour bar
    with pytest.raises(ValueError, match=r"values must have shape \(len\(row_labels\), len\(col_labels\)\) = \(3, 3\)"):
        plots.signed_heatmap(v, ["a", "b", "c"], ["x", "y", "z"], "x", "y", "c")
    with pytest.raises(ValueError, match="col_split must lie strictly between 0 and 3, got 3"):
        plots.signed_heatmap(v, ["a", "b"], ["x", "y", "z"], "x", "y", "c", col_split=3)


def test_rank_sweep() -> None:
    fig = plots.rank_sweep([1, 2, 4], {"accuracy": [0.2, 0.7, 1.0]}, {"names": 3.0, "numbers": 2.0},
                           ylabel="share", title="t")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "head width $d_k$" and ax.get_ylabel() == "share"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["accuracy", "names", "numbers"]
    with pytest.raises(ValueError, match=r"series\['accuracy'\] must have len\(d_ks\) = 3 values, got 2"):
        plots.rank_sweep([1, 2, 4], {"accuracy": [0.2, 0.7]}, {}, ylabel="y")


def test_rank_sweep_spreads_and_levels() -> None:
    fig = plots.rank_sweep([1, 2, 4], {"accuracy": [0.2, 0.7, 1.0]}, {"numbers": 3.0},
                           ylabel="share", spreads={"accuracy": ([0.1, 0.6, 1.0], [0.3, 0.8, 1.0])},
                           levels={"never searches": 0.5})
    ax = fig.axes[0]
    assert len(ax.collections) == 1  # the shaded spread
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["accuracy", "never searches", "numbers"]
    with pytest.raises(ValueError, match=r"spreads\['loss'\] names no series"):
        plots.rank_sweep([1, 2], {"accuracy": [0.2, 0.7]}, {}, ylabel="y", spreads={"loss": ([0, 0], [1, 1])})
    with pytest.raises(ValueError, match=r"spreads\['accuracy'\] must hold two sequences of len\(d_ks\) = 2"):
        plots.rank_sweep([1, 2], {"accuracy": [0.2, 0.7]}, {}, ylabel="y", spreads={"accuracy": ([0], [1])})
