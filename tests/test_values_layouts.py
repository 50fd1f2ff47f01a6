"""attnlib.interop.layouts on hand-sized weights whose every entry is distinct: each reader
puts each stored block where the paper's orientation says (a transposed or swapped block
changes some entry), each writer is its reader's inverse, and a bias given on one side only
is read with zeros. Written to kill what mutation testing (``make mutants``) and planted
bugs found unchecked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlib.interop import (
    read_bert,
    read_conv1d,
    read_linear_heads,
    read_packed_linear,
    read_separate_linear,
    write_bert,
    write_conv1d,
    write_linear_heads,
    write_packed_linear,
    write_separate_linear,
)

D = 3
F64 = torch.float64


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


def test_partial_biases_are_zeros_of_each_weights_rows_and_dtype() -> None:
    """Heads 4 wide on d_model = 3 (q, k, v weights (4, 3), o (3, 4)), float64, biases on k and v
    only: the missing ones are float64 zeros, 4 long for q and 3 for o (a weight's rows)."""
    q, k, v, o = (_m(4, D), None), (_m(4, D, 20.0), torch.arange(4.0, dtype=F64)), (_m(4, D, 40.0), None), (_m(D, 4, 60.0), None)
    w = read_separate_linear(q, k, v, o)
    assert w.b_q is not None and w.b_o is not None and w.b_k is not None
    assert w.b_q.dtype == F64 and torch.equal(w.b_q, torch.zeros(4, dtype=F64))
    assert w.b_o.dtype == F64 and torch.equal(w.b_o, torch.zeros(D, dtype=F64))
    assert torch.equal(w.b_k, torch.arange(4.0, dtype=F64)) and torch.equal(w.w_o, _m(D, 4, 60.0).T)


def test_readers_and_writers_keep_the_device() -> None:
    """Every tensor and layer a reader or writer makes is on its input's device: on "meta" (shapes
    and dtypes, no data), so that a CPU-only run checks it too."""

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=F64, device="meta")

    w = read_separate_linear((meta(4, D), None), (meta(4, D), None), (meta(4, D), None), (meta(D, 4), meta(D)))
    assert w.b_q is not None and w.b_q.device.type == "meta" and w.b_q.dtype == F64
    layers = list(write_separate_linear(w).values())
    heads, o = write_linear_heads(w, 2)
    layers += [o, *(lin for head in heads for lin in head.values())]
    for lin in layers:
        assert lin.weight.device.type == "meta" and lin.bias is not None and lin.bias.device.type == "meta"
    # write_packed_linear (torch.cat) and read_linear_heads' W^O = I (torch.eye) are checked the other
    # way round below: the first torch.cat or torch.eye on "meta" in a process imports torch._dynamo (2-4 s).


def test_new_layers_and_identity_follow_the_weights_not_the_default_device() -> None:
    """With "meta" as the default device, what write_packed_linear and read_linear_heads (o=None) make
    from CPU weights stays on the CPU: they name the weights' device, not the default."""
    w = read_separate_linear(*[(_m(4, D, 10.0 * i), None) for i in range(3)], (_m(D, 4), None))
    heads = [((_m(2, 4), None), (_m(2, 4, 8.0), None), (_m(2, 4, 16.0), None))] * 2
    with torch.device("meta"):
        layers = write_packed_linear(w)
        concat = read_linear_heads(heads)
    assert all(lin.weight.device.type == "cpu" and lin.bias is None for lin in layers.values())
    assert torch.equal(layers["c_attn"].weight, torch.cat([w.w_q, w.w_k, w.w_v], 1).T)
    assert concat.w_o.device.type == "cpu" and torch.equal(concat.w_o, torch.eye(4, dtype=F64))


def test_read_linear_heads_one_head_as_lists_and_identity_output() -> None:
    """One head, given as lists, without W^O (d_k = d_model = 2): W^Q = heads[0].q.weight^T, and
    W^O the identity in the weights' dtype."""
    heads = [[[_m(2, 2), None], [_m(2, 2, 4.0), None], [_m(2, 2, 8.0), None]]]
    w = read_linear_heads(heads)  # type: ignore[arg-type]
    assert torch.equal(w.w_q, _m(2, 2).T) and torch.equal(w.w_k, _m(2, 2, 4.0).T) and torch.equal(w.w_v, _m(2, 2, 8.0).T)
    assert w.w_o.dtype == F64 and torch.equal(w.w_o, torch.eye(2, dtype=F64)) and w.b_q is None


def test_read_linear_heads_partial_biases_across_heads() -> None:
    """Head 0's q has a bias, head 1's not: b_q is head 0's bias then zeros; no head has a k bias:
    b_k is zeros all the same (some projection has one)."""
    b = torch.tensor([1.0, 2.0], dtype=F64)
    heads = [((_m(2, 4), b), (_m(2, 4, 8.0), None), (_m(2, 4, 16.0), None)),
             ((_m(2, 4, 24.0), None), (_m(2, 4, 32.0), None), (_m(2, 4, 40.0), None))]
    w = read_linear_heads(heads)
    assert w.b_q is not None and torch.equal(w.b_q, torch.tensor([1.0, 2.0, 0.0, 0.0], dtype=F64))
    assert w.b_k is not None and torch.equal(w.b_k, torch.zeros(4, dtype=F64))
    assert torch.equal(w.w_k, torch.cat([_m(2, 4, 8.0), _m(2, 4, 32.0)]).T)


def test_read_linear_heads_refusals() -> None:
    good = (_m(2, 4), None)
    with pytest.raises(TypeError, match=r"heads\[0\]\.q must be a \(weight, bias\) pair"):
        read_linear_heads([(_m(2, 4), good, good)])  # type: ignore[list-item]  # a 2-row tensor is no pair
    with pytest.raises(ValueError, match=r"heads\[0\]\.q weight must be a matrix \(d_k, d_model\), got \(4,\)"):
        read_linear_heads([((torch.zeros(4, dtype=F64), None), good, good)])


def test_write_linear_heads_without_bias_and_rows() -> None:
    w = read_separate_linear(*[(_m(4, D, 20.0 * i), None) for i in range(3)], (_m(D, 4, 60.0), None))
    heads, o = write_linear_heads(w, 2)
    assert all(lin.bias is None for head in heads for lin in head.values()) and o.bias is None
    assert torch.equal(heads[1]["k"].weight, _m(4, D, 20.0)[2:]) and torch.equal(o.weight, _m(D, 4, 60.0))


def test_read_separate_linear_refusals_name_the_layer_and_shapes() -> None:
    q, k, v, o = (_m(4, D), None), (_m(4, D), None), (_m(4, D), None), (_m(D, 4), None)
    with pytest.raises(TypeError, match=r"^q must be a \(weight, bias\) pair"):
        read_separate_linear(_m(4, D), k, v, o)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^q weight must have shape \(h\*d_k, d_model\), got \(4,\)$"):
        read_separate_linear((torch.zeros(4), None), k, v, o)
    bad = (_m(4, 2), None)
    with pytest.raises(ValueError, match=r"^k weight must have shape \(h\*d_k, d_model\) = \(4, 3\) to match q's, got \(4, 2\)$"):
        read_separate_linear(q, bad, v, o)
    with pytest.raises(ValueError, match=r"^v weight must have shape \(h\*d_v, d_model\) = \(4, 3\)"):
        read_separate_linear(q, k, bad, o)
    with pytest.raises(ValueError, match=r"^o weight must have shape \(d_model, h\*d_v\) = \(3, 4\)"):
        read_separate_linear(q, k, v, bad)


def test_read_bert_names_the_missing_layer() -> None:
    self_attention, self_output = write_bert(read_separate_linear(*[(_m(D, D), None)] * 4))
    with pytest.raises(TypeError, match=r"^self_attention\.key must be an nn\.Linear, got NoneType"):
        read_bert(nn.ModuleDict({"query": self_attention["query"]}), self_output)
    with pytest.raises(TypeError, match=r"^self_attention\.value must be an nn\.Linear, got NoneType"):
        read_bert(nn.ModuleDict({"query": self_attention["query"], "key": self_attention["key"]}), self_output)


def test_packed_pairs_degenerate_and_one_wide() -> None:
    """d_model = 0 or no heads' columns are refused; d_model = 1 is read."""
    with pytest.raises(ValueError, match=r"^c_attn weight must have shape \(3\*h\*d_k, d_model\), nn\.Linear"):
        read_packed_linear((torch.zeros(6, 0), None), (torch.zeros(0, 2), None))  # d_model = 0
    with pytest.raises(ValueError, match=r"^c_attn weight must have shape \(3\*h\*d_k, d_model\), nn\.Linear"):
        read_packed_linear((torch.zeros(0, 3), None), (torch.zeros(3, 0), None))  # h*d_k = 0
    w = read_packed_linear((_m(3, 1), None), (_m(1, 1, 5.0), None))  # d_model = h*d_k = 1
    assert torch.equal(w.w_q, _m(1, 1)) and torch.equal(w.w_v, _m(1, 1, 2.0)) and torch.equal(w.w_o, _m(1, 1, 5.0))
    with pytest.raises(ValueError, match=r"^c_proj weight must have shape \(h\*d_v, d_model\) = \(3, 3\), Conv1D"):
        read_conv1d((_m(D, 3 * D), None), (_m(D + 1, D), None))
