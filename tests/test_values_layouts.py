"""attnlib.interop.layouts on hand-sized weights whose every entry is distinct: each reader
puts each stored block where the paper's orientation says (a transposed or swapped block
changes some entry), each writer is its reader's inverse, and a bias given on one side only
is read with zeros. Written to kill what mutation testing (``make mutants``) and planted
bugs found unchecked."""

from __future__ import annotations

import pytest
import torch

from attnlib.interop import read_conv1d, read_packed_linear, read_separate_linear, write_conv1d, write_packed_linear

D = 3


def _m(rows: int, cols: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) + start


def test_read_packed_linear_blocks() -> None:
    w_attn, b_attn = _m(3 * D, D), torch.arange(3.0 * D, dtype=torch.float64)  # nn.Linear: (out, in)
    w_proj, b_proj = _m(D, D, 100.0), torch.arange(D, dtype=torch.float64) + 200
    w = read_packed_linear((w_attn, b_attn), (w_proj, b_proj))
    assert torch.equal(w.w_q, w_attn[:D].T) and torch.equal(w.w_k, w_attn[D:2 * D].T)
    assert torch.equal(w.w_v, w_attn[2 * D:].T) and torch.equal(w.w_o, w_proj.T)
    assert torch.equal(w.b_q, b_attn[:D]) and torch.equal(w.b_k, b_attn[D:2 * D])
    assert torch.equal(w.b_v, b_attn[2 * D:]) and torch.equal(w.b_o, b_proj)
    back = write_packed_linear(w)
    assert torch.equal(back["c_attn"].weight, w_attn) and torch.equal(back["c_proj"].weight, w_proj)
    assert torch.equal(back["c_attn"].bias, b_attn) and torch.equal(back["c_proj"].bias, b_proj)
    x = _m(2, D, -3.0)  # the same function: q|k|v = c_attn(x), the output projection c_proj
    assert torch.equal(back["c_attn"](x), x @ w_attn.T + b_attn)


def test_read_conv1d_blocks() -> None:
    w_attn, b_attn = _m(D, 3 * D), torch.arange(3.0 * D, dtype=torch.float64)  # Conv1D: (in, out)
    w_proj, b_proj = _m(D, D, 100.0), torch.arange(D, dtype=torch.float64) + 200
    w = read_conv1d((w_attn, b_attn), (w_proj, b_proj))
    assert torch.equal(w.w_q, w_attn[:, :D]) and torch.equal(w.w_k, w_attn[:, D:2 * D])
    assert torch.equal(w.w_v, w_attn[:, 2 * D:]) and torch.equal(w.w_o, w_proj)
    assert torch.equal(w.b_v, b_attn[2 * D:]) and torch.equal(w.b_o, b_proj)
    back = write_conv1d(w)
    assert torch.equal(back["c_attn"][0], w_attn) and torch.equal(back["c_proj"][0], w_proj)
    assert torch.equal(back["c_attn"][1], b_attn) and torch.equal(back["c_proj"][1], b_proj)


def test_a_bias_on_one_side_only_reads_as_zeros() -> None:
    w = read_packed_linear((_m(3 * D, D), None), (_m(D, D), torch.ones(D, dtype=torch.float64)))
    assert torch.equal(w.b_q, torch.zeros(D, dtype=torch.float64)) and torch.equal(w.b_o, torch.ones(D, dtype=torch.float64))
    w = read_conv1d((_m(D, 3 * D), torch.ones(3 * D, dtype=torch.float64)), (_m(D, D), None))
    assert torch.equal(w.b_o, torch.zeros(D, dtype=torch.float64)) and torch.equal(w.b_k, torch.ones(D, dtype=torch.float64))
    none = read_conv1d((_m(D, 3 * D), None), (_m(D, D), None))
    assert none.b_q is None and none.b_o is None


def test_read_separate_linear_blocks() -> None:
    pairs = [(_m(D, D, 10.0 * i), torch.arange(D, dtype=torch.float64) + 10 * i) for i in range(4)]
    w = read_separate_linear(*pairs)
    for got, (weight, _) in zip((w.w_q, w.w_k, w.w_v, w.w_o), pairs):
        assert torch.equal(got, weight.T)
    for got, (_, bias) in zip((w.b_q, w.b_k, w.b_v, w.b_o), pairs):
        assert torch.equal(got, bias)


@pytest.mark.parametrize(("c_attn", "c_proj", "match"), [
    ((_m(3 * D + 1, D), None), (_m(D, D), None), r"c_attn weight must have shape \(3\*h\*d_k, d_model\)"),
    ((_m(3 * D, D), None), (_m(D, D + 1), None), r"c_proj weight must have shape \(d_model, h\*d_v\) = \(3, 3\)"),
    ((_m(3 * D, D), torch.zeros(D)), (_m(D, D), torch.zeros(D)), r"c_attn bias must have shape \(3\*h\*d_k,\) = \(9,\)"),
    ((_m(3 * D, D), torch.zeros(3 * D)), (_m(D, D), torch.zeros(1)), r"c_proj bias must have shape \(d_model,\) = \(3,\)"),
])
def test_read_packed_linear_refuses_wrong_shapes(c_attn: tuple, c_proj: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_packed_linear(c_attn, c_proj)
    with pytest.raises(TypeError, match="c_attn must be a \\(weight, bias\\) pair of tensors"):
        read_packed_linear([c_attn[0], None], c_proj)  # type: ignore[arg-type]
