"""attnlib.plots.head_blocks: the fused layer's head blocks, labelled, and its errors."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from attnlib import MultiHeadAttention, plots  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


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
