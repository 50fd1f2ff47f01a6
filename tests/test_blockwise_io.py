"""attnlib.blockwise_io: the bytes attention holds (measured op by op) and moves between HBM and
SRAM (simulated). The simulated algorithms compute attention and its gradients (checked against
attnlib.attention and autograd), their counts equal the closed forms, and the measured peak of
live tensors equals attnlib.blockwise_bounds.intermediate_bytes."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from strategies import examples

from attnlib import attention
from attnlib.blockwise import blockwise_attention
from attnlib.blockwise_bounds import intermediate_bytes
from attnlib.blockwise_io import ALGORITHMS, SRAM, block_sizes, count_io, io_formula, peak_live_bytes, simulate

F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 1e-10}  # float64 against float64 summed in other orders


# ---- bytes held ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,block,dtype", [(300, 64, torch.float32), (257, 100, F64), (300, 64, torch.bfloat16),
                                           (130, 48, torch.float16), (64, 100, torch.float32)])
def test_peak_live_bytes_is_the_count(n: int, block: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, 16, generator=g).to(dtype) for _ in range(3))
    with torch.no_grad():
        naive = peak_live_bytes(lambda: attention(q, k, v)[0])
        tiles = peak_live_bytes(lambda: blockwise_attention(q, k, v, block_q=block, block_k=block).out)
    assert naive == intermediate_bytes(n, n, 16, dtype=dtype)  # S and P, nothing else
    assert tiles == intermediate_bytes(n, n, 16, block_q=block, block_k=block, dtype=dtype)


def test_peak_live_bytes_leaves_out_inputs_and_output_and_sees_frees() -> None:
    x = torch.ones(1000)
    assert peak_live_bytes(lambda: x.mul_(2)) == 0  # in place: nothing new
    assert peak_live_bytes(lambda: x * 2) == 0  # the result is returned
    assert peak_live_bytes(lambda: (x * 2).sum()) == 4000  # one temporary of 1000 floats
    assert peak_live_bytes(lambda: ((x * 2) * 3)[:1]) == 4000  # the first dies before the second
    kept: list[torch.Tensor] = []
    assert peak_live_bytes(lambda: kept.append(x[None] * 2) or kept.append(x * 3)) == 8000  # held at once
    assert peak_live_bytes(lambda: kept.append(torch.empty(1000, 1000, device="meta")) or x + 1) == 0  # no memory


# ---- bytes moved -----------------------------------------------------------------------------------------
@examples(10)
@given(st.sampled_from(ALGORITHMS), st.integers(5, 70), st.integers(1, 9), st.integers(40, 900),
       st.sampled_from([2, 4]), st.integers(0, 2**16))
def test_simulated_algorithms_compute_attention_and_count_their_formula(
        algorithm: str, n: int, d: int, numbers: int, itemsize: int, seed: int) -> None:
    sram = numbers * itemsize
    if numbers < 2 * d + 1 or (algorithm == "standard" and numbers < n + 2):
        with pytest.raises(ValueError, match="cannot hold a row|needs a row of n"):
            block_sizes(algorithm, n, d, sram, itemsize)
        return
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(n, d, generator=g, dtype=F64) for _ in range(4))
    out, count = simulate(algorithm, q, k, v, sram, itemsize, d_out=do)
    assert count == count_io(algorithm, n, d, sram, itemsize)  # values or sizes only: one count
    assert count.moved == io_formula(algorithm, n, d, sram, itemsize)
    if algorithm.startswith("backward"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        grads = torch.autograd.grad((attention(*leaves)[0] * do).sum(), leaves)
        for name, g_ref in zip(("dQ", "dK", "dV"), grads):
            torch.testing.assert_close(out[name], g_ref, **TOL)
    else:
        torch.testing.assert_close(out["O"], attention(q, k, v)[0], **TOL)
    if algorithm == "standard":
        assert count.peak <= sram  # its tiles are chosen to fit
    if algorithm == "flash":  # the paper's tiles: 2 B_c d + 3 B_r d + B_r B_c + 6 B_r numbers at most
        b_r, b_c = block_sizes(algorithm, n, d, sram, itemsize)
        assert count.peak <= (2 * b_c * d + 3 * b_r * d + b_r * b_c + 6 * b_r) * itemsize


def test_theorem_2_constants_at_the_top_and_bottom_of_a_grid() -> None:
    """Where B_c = M / 4d divides n: Algorithm 1 moves 12 N^2 d^2 / M (1 + 4/(3d)) + 3 N d + 2 N
    numbers (3 N d + 4 N per key tile, 4 N d / M tiles); Algorithm 0 4 N^2 + (2 + 2T) N d."""
    n, d, m = 4096, 64, 32768  # numbers: 64 KiB of float16
    flash = io_formula("flash", n, d, 2 * m) // 2
    assert flash / (n * n * d * d / m) == 12 + 16 / d + 3 * m / (n * d) + 2 * m / (n * d * d)
    standard = io_formula("standard", n, d, 2 * m) // 2
    t = -(-n // block_sizes("standard", n, d, 2 * m)[0])
    assert standard == 4 * n * n + (2 + 2 * t) * n * d
    kv, qo = io_formula("backward_kv_outer", n, d, 2 * m), io_formula("backward_q_outer", n, d, 2 * m)
    assert 0.6 < kv / qo < 0.7  # two accumulators on chip instead of one: 4 N d per pass, not 6


def test_sram_and_block_sizes_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="algorithm must be one of"):
        block_sizes("flash3", 8, 4, 1000)
    with pytest.raises(ValueError, match="an SRAM of 8 numbers cannot hold a row of Q and of K"):
        block_sizes("flash", 8, 4, 16)
    with pytest.raises(ValueError, match="needs a row of n = 100 scores on chip"):
        block_sizes("standard", 100, 4, 2 * 50)
    c = SRAM({"Q": (8, 4)})
    block = c.load("Q", range(0, 2))
    with pytest.raises(ValueError, match=r"a \(2, 4\) block cannot fill \(3, 4\) of Q"):
        c.store(block, "Q", range(0, 3))
    assert (c.read, c.written, c.peak) == (16, 0, 16)  # 2 x 4 numbers of 2 bytes
    with pytest.raises(ValueError, match="the backward needs d_out of shape"):
        simulate("backward_kv_outer", *torch.zeros(3, 8, 4), sram_bytes=1000)
    with pytest.raises(ValueError, match="q, k and v must all have one shape"):
        simulate("flash", torch.zeros(8, 4), torch.zeros(9, 4), torch.zeros(8, 4), sram_bytes=1000)
    assert math.isqrt(64 * 64 + 1000) - 64 == block_sizes("standard", 10, 64, 2000)[0]


def test_io_scaling_draws_the_points_and_lines_given() -> None:
    from attnlib import plots

    fig = plots.io_scaling({"flash": ([0.25, 0.5], [3.0, 6.0])}, {"12 x": ([0.25, 0.5], [3.0, 6.0])},
                           "d^2 / M", "moved / N^2")
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert ax.collections[0].get_offsets().tolist() == [[0.25, 3.0], [0.5, 6.0]]
    assert ax.lines[0].get_xydata().tolist() == [[0.25, 3.0], [0.5, 6.0]]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["flash", "12 x"]
    with pytest.raises(ValueError, match="points must hold at least one group"):
        plots.io_scaling({})
    with pytest.raises(ValueError, match="'a': a log-log plot needs positive x and y"):
        plots.io_scaling({"a": ([0.0], [1.0])})
    with pytest.raises(ValueError, match="'a': x and y must be 1-D of one non-zero length"):
        plots.io_scaling({"a": ([1.0, 2.0], [1.0])})
