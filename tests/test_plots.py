"""attnlib.plots: each helper draws the data it is given, on labelled axes, and rejects data
of the wrong shape. Each test reads the numbers back from what was drawn (the image's
array, the lines' and bars' coordinates, the annotations) and compares them with its input.

One section per chapter, in the order the book first uses each helper.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from attnlib import MultiHeadAttention, plots  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _labelled(fig: Figure) -> None:
    """Every axes that shows data names its x and y axes."""
    drawn = [ax for ax in fig.axes if ax.has_data() and ax.get_label() != "<colorbar>"]
    assert drawn, "the figure draws nothing"
    for ax in drawn:
        assert ax.get_xlabel() or ax.get_xticklabels(), "x axis has neither label nor ticks"
        assert ax.get_ylabel() or ax.get_yticklabels(), "y axis has neither label nor ticks"


# ---- chapter 1: one query, many keys -----------------------------------------------

def test_attention_map() -> None:
    w = torch.softmax(torch.randn(3, 4), -1)
    fig = plots.attention_map(w, ["a", "b", "c"], ["w", "x", "y", "z"], title="t")
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("key") and ax.get_ylabel().startswith("query")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["w", "x", "y", "z"]
    np.testing.assert_array_equal(ax.images[0].get_array(), w.numpy())  # the weights drawn, row = query
    # every cell annotated with its own weight, row by row
    assert [t.get_text() for t in ax.texts] == [f"{v:.2f}" for v in w.flatten().tolist()]
    with pytest.raises(ValueError, match=r"weights must have shape \(n_q, n_k\), got \(2, 3, 4\)"):
        plots.attention_map(torch.rand(2, 3, 4))


# ---- chapters 2 and 3: where Q, K and V come from; many heads ----------------------

def test_attention_maps() -> None:
    w = torch.rand(5, 3, 3)
    fig = plots.attention_maps(w, labels=["a", "b", "c"], ncols=4)
    titled = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in titled] == [f"head {i}" for i in range(5)]
    for i, ax in enumerate(titled):  # panel i draws head i's map
        np.testing.assert_array_equal(ax.images[0].get_array(), w[i].numpy())
    assert sum(not ax.axison for ax in fig.axes) == 3  # the unused panels of a 2 x 4 grid
    # the tokens label the outer panels: keys where no panel lies below, queries on column 0
    for i, ax in enumerate(titled):
        keys = [t.get_text() for t in ax.get_xticklabels() if t.get_visible()]
        queries = [t.get_text() for t in ax.get_yticklabels() if t.get_visible()]
        assert keys == (["a", "b", "c"] if i >= 1 else [])  # heads 1-4 have none below
        assert queries == (["a", "b", "c"] if i in (0, 4) else [])
    with pytest.raises(ValueError, match=r"weights must have shape \(h, n_q, n_k\), got \(3, 3\)"):
        plots.attention_maps(torch.rand(3, 3))


def test_attention_maps_share_one_colour_bar() -> None:
    fig = plots.attention_maps(torch.rand(3, 4, 4), ncols=3)
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1 and bars[0].get_ylabel() == "attention weight"
    assert all(im.get_clim() == (0.0, 1.0) for ax in fig.axes for im in ax.images)
    fig = plots.attention_maps(torch.rand(2, 4, 4), colorbar=False)
    assert not [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]


def test_head_blocks_draws_one_block_per_head_in_each_panel() -> None:
    mha = MultiHeadAttention(16, 4)
    concat = torch.randn(5, 16)  # (n, h*d_v)
    fig = plots.head_blocks(mha.w_q, concat, mha.w_o, 4)
    axes = fig.axes
    assert len(axes) == 3
    for ax in axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
        assert len(ax.patches) == 4  # one tinted block per head
    texts = [[t.get_text() for t in ax.texts] for ax in axes]
    assert texts[0] == [f"$W_{{{i}}}^Q$" for i in range(4)]
    assert texts[1] == [f"head {i}" for i in range(4)]
    assert texts[2] == [f"$W_{{{i}}}^O$" for i in range(4)]
    # the titles say which matrix in words too: at low resolution Q and O look alike
    assert "queries" in axes[0].get_title() and "output" in axes[2].get_title()
    # column blocks of W^Q and of Concat, row blocks of W^O, each d_k = 4 wide
    q_block, o_block = axes[0].patches[1], axes[2].patches[1]
    assert (q_block.get_x(), q_block.get_width()) == (3.5, 4)
    assert (o_block.get_y(), o_block.get_height()) == (3.5, 4)


@pytest.mark.parametrize(
    ("w_q", "concat", "w_o", "num_heads", "match"),
    [
        (torch.randn(8, 8), torch.randn(3, 8), torch.randn(8, 8), 0, "num_heads"),
        (torch.randn(8, 6), torch.randn(3, 8), torch.randn(8, 8), 4, "w_q must have shape"),
        (torch.randn(8), torch.randn(3, 8), torch.randn(8, 8), 2, "w_q must have shape"),
        (torch.randn(8, 8), torch.randn(3, 6), torch.randn(6, 8), 4, "concat must have shape"),
        (torch.randn(8, 8), torch.randn(3, 8), torch.randn(6, 8), 2, "w_o must have shape"),
    ],
)
def test_head_blocks_rejects_shapes_that_do_not_fit(w_q, concat, w_o, num_heads, match) -> None:
    with pytest.raises(ValueError, match=match):
        plots.head_blocks(w_q, concat, w_o, num_heads)


# ---- chapter 4: why not one matrix W_Q W_K^T? ----------------------------------------

def test_line_plot_and_singular_values() -> None:
    fig = plots.line_plot([1, 2, 4], {"a": [1.0, 2.0, 3.0], "b": [3.0, 2.0, 1.0]}, "x", "y", logx=True, logy=True,
                          title="t")
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("x", "y", "t")
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
    assert drawn == {"a": ([1, 2, 4], [1.0, 2.0, 3.0]), "b": ([1, 2, 4], [3.0, 2.0, 1.0])}
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    fig = plots.singular_values({"rank 2": torch.tensor([3.0, 1.0, 0.0])})
    line = fig.axes[0].lines[0]
    assert list(line.get_xdata()) == [1, 2, 3]  # index of the singular value, from 1
    assert list(line.get_ydata()) == [3.0, 1.0, 1e-12]  # the zero is drawn at the floor
    _labelled(fig)


# ---- chapter 5: one big matrix or h small ones? (and the benchmark) -----------------

def test_block_heatmap() -> None:
    values = torch.tensor([[1.0, 0.0], [0.5, 2.0]])
    fig = plots.block_heatmap(values, ["r0", "r1"], ["c0", "c1"], "block", "output", "gradient norm")
    _labelled(fig)
    np.testing.assert_array_equal(fig.axes[0].images[0].get_array(), values.numpy())
    assert [t.get_text() for t in fig.axes[0].texts].count("0") == 1  # an exact zero prints as 0
    with pytest.raises(ValueError, match=r"values must have shape .* = \(2, 2\), got \(2, 3\)"):
        plots.block_heatmap(torch.rand(2, 3), ["r0", "r1"], ["c0", "c1"], "b", "o", "g")


def _bench() -> ModuleType:
    """benchmarks/bench_attention.py, imported as a module."""
    spec = importlib.util.spec_from_file_location("bench_attention", RESULTS.parent / "bench_attention.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up while it runs
    spec.loader.exec_module(bench)
    return bench


def test_benchmark_panels_on_the_committed_results() -> None:
    bench = _bench()
    rows = bench.read_results(RESULTS / "cpu_sweep.csv")
    fig = plots.benchmark_panels(rows)
    _labelled(fig)
    # each line is one variant's medians, at h = 8 against n (left) and at n = 256 against h (right)
    for ax, (key, fixed_key, fixed) in zip(fig.axes[:2], (("n", "h", 8), ("h", "n", 256))):
        mode = ax.get_title().split(",")[0]
        for line in ax.lines:
            label = line.get_label()
            column = "floor_ms" if label == "GEMM floor" else "median_ms"
            want = {int(str(r[key])): float(str(r[column])) for r in rows
                    if r["mode"] == mode and r[fixed_key] == fixed and (label == "GEMM floor" or r["variant"] == label)}
            assert dict(zip(line.get_xdata(), line.get_ydata())) == want, (mode, key, label)
    with pytest.raises(ValueError, match="none of the requested modes"):
        plots.benchmark_panels(rows, modes=("inference",))
    with pytest.raises(ValueError, match="no 'forward' rows with"):
        plots.benchmark_panels(rows, h_fixed=3)


def test_benchmark_quick_run_leaves_the_committed_results_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    committed = {f: f.read_bytes() for f in RESULTS.iterdir() if f.is_file()}
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes its folder
    _bench().main(["--quick", "--device", "cpu", "--modes", "forward", "--variants", "attnlib"])
    written = [Path(line.removeprefix("wrote ")) for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert [f.suffix for f in written] == [".csv", ".png"]
    assert all(tmp_path in f.parents and f.exists() for f in written)
    assert {f: f.read_bytes() for f in RESULTS.iterdir() if f.is_file()} == committed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--quick", "--out", str(RESULTS / "cpu_sweep.csv")], "--quick is a smoke test and must not write into"),
        (["--quick", "--decoding", "--out", str(RESULTS / "x.csv")], "--quick is a smoke test and must not write into"),
        (["--rounds", "1"], "cpu_sweep.csv exists (committed results): give --out elsewhere"),
        (["--decoding"], "cpu_decoding.csv exists (committed results)"),
        (["--clock", "cpu"], "--clock cpu sums the CPU time of all the process's threads: use it with --threads 1"),
        (["--clock", "cpu", "--threads", "2", "--quick"], "use it with --threads 1"),
    ],
)
def test_benchmark_refuses_to_overwrite_results_and_cpu_time_of_many_threads(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error, before anything runs
        _bench().main(["--device", "cpu", *argv])
    assert message in " ".join(capsys.readouterr().err.split())
    assert torch.get_num_threads() == threads


# ---- chapter 7: the phone book, learned --------------------------------------------

def test_signed_heatmap() -> None:
    v = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.25, -0.5]])
    fig = plots.signed_heatmap(v, ["a", "b"], ["x", "y", "z"], "key token", "query token", "entry",
                               row_split=1, col_split=2, annotate=True, title="t")
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("key token", "query token", "t")
    assert ax.images[0].get_clim() == (-2.0, 2.0)  # symmetric about zero
    np.testing.assert_array_equal(ax.images[0].get_array(), v.numpy())
    assert [t.get_text() for t in ax.texts] == [f"{x:.2f}" for x in v.flatten().tolist()]  # every cell
    assert len(ax.lines) == 2 and ax.lines[0].get_ydata()[0] == 0.5 and ax.lines[1].get_xdata()[0] == 1.5  # the splits
    assert fig.axes[1].get_ylabel() == "entry"  # the colour bar
    with pytest.raises(ValueError, match=r"values must have shape \(len\(row_labels\), len\(col_labels\)\) = \(3, 3\)"):
        plots.signed_heatmap(v, ["a", "b", "c"], ["x", "y", "z"], "x", "y", "c")
    with pytest.raises(ValueError, match="col_split must lie strictly between 0 and 3, got 3"):
        plots.signed_heatmap(v, ["a", "b"], ["x", "y", "z"], "x", "y", "c", col_split=3)


def test_rank_sweep() -> None:
    fig = plots.rank_sweep([1, 2, 4], {"accuracy": [0.2, 0.7, 1.0]}, {"names": 3.0, "numbers": 2.0},
                           ylabel="share", title="t")
    ax = fig.axes[0]
    curve = next(line for line in ax.lines if line.get_label() == "accuracy")
    assert (list(curve.get_xdata()), list(curve.get_ydata())) == ([1, 2, 4], [0.2, 0.7, 1.0])
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


# ---- chapter 8: why two matrices, today (cache bytes per token) ---------------------

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


def test_online_softmax_steps() -> None:
    s = torch.tensor([0.5, -1.0, 2.0, 0.3, 1.0])
    fig = plots.online_softmax_steps(s, block=2, seen=4, running_max=2.0, title="t")
    _labelled(fig)
    ax = fig.axes[0]
    assert len(ax.patches) == 5 and ax.get_title() == "t"
    assert [p.get_height() for p in ax.patches] == pytest.approx(s.tolist())  # bar k is score k
    faces = [p.get_facecolor() for p in ax.patches]
    assert faces[2] == faces[3] != faces[0] and faces[4] != faces[0]  # last block seen, unseen
    assert "running max m = 2.00" in [t.get_text() for t in ax.get_legend().get_texts()]
    for kwargs, match in [(dict(block=0, seen=1), "block must be an int from 1 to n_k = 5"),
                          (dict(block=2, seen=6), "seen must be an int from 0 to n_k = 5")]:
        with pytest.raises(ValueError, match=match):
            plots.online_softmax_steps(s, running_max=0.0, **kwargs)
    with pytest.raises(ValueError, match=r"scores must have shape \(n_k,\)"):
        plots.online_softmax_steps(torch.rand(2, 2), 1, 1, 0.0)
