"""attnlib.plots.cache_bytes: chapter 8's bar chart of cache bytes per token."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from attnlib import plots  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_cache_bytes_draws_one_labelled_bar_per_entry() -> None:
    per_token = {"MHA": 524_288.0, "GQA": 131_072.0, "MQA": 16_384.0}
    fig = plots.cache_bytes(per_token, title="t")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == list(per_token)
    widths = [p.get_width() for p in ax.patches]
    assert widths == [512.0, 128.0, 16.0]  # KiB, in the dict's order
    assert ax.get_xscale() == "log"
    assert "KiB" in ax.get_xlabel()
    assert [t.get_text() for t in ax.texts] == ["512 KiB", "128 KiB", "16 KiB"]
    assert ax.get_title() == "t"


def test_cache_bytes_groups_colour_and_legend() -> None:
    per_token = {"a": 2048.0, "b": 1024.0, "c": 4096.0}
    fig = plots.cache_bytes(per_token, groups={"a": "one", "b": "two", "c": "one"})
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["one", "two"]
    colours = {p.get_y(): p.get_facecolor() for p in ax.patches}
    assert len(set(colours.values())) == 2


def test_cache_bytes_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one entry"):
        plots.cache_bytes({})
    with pytest.raises(ValueError, match=r"positive byte counts, got \{'b': 0.0\}"):
        plots.cache_bytes({"a": 1.0, "b": 0.0})
    with pytest.raises(ValueError, match=r"missing \['b'\], extra \['z'\]"):
        plots.cache_bytes({"a": 1.0, "b": 2.0}, groups={"a": "g", "z": "g"})
