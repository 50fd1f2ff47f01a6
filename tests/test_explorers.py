"""attnlib.explorers: the data behind the book's interactive figures, and their HTML."""

from __future__ import annotations

import json
import math
import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra.numpy import arrays  # noqa: E402

from attnlib import DecoderAttention, MultiHeadAttention, attention  # noqa: E402
from attnlib.explorers import (  # noqa: E402
    Explorer,
    from_rounded,
    head_explorer,
    online_softmax_explorer,
    round_array,
    sharpness_explorer,
)
from strategies import examples  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _data(html: str) -> dict:
    m = re.search(r'<script type="application/json" class="explorer-data">(.*?)</script>', html, re.S)
    assert m, "no data script in the HTML"
    return json.loads(m.group(1))


# ---- round_array ---------------------------------------------------------------------
@examples(30)
@given(arrays(np.float64, st.integers(1, 20),
              elements=st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False)),
       st.integers(1, 5))
def test_round_array_error_is_half_a_unit_of_the_last_digit(a: np.ndarray, digits: int) -> None:
    r = round_array(a, digits)
    back = from_rounded(r)  # (size,)
    assert back.shape == a.shape
    assert all(isinstance(m, int) for m in r["m"])
    assert max(abs(m) for m in r["m"]) < 10**digits
    assert np.abs(back - a).max() <= 0.5 * 10.0 ** r["e"] * (1 + 1e-9) + 1e-300
    top = np.abs(a).max()
    if top > 0:  # the unit is digits significant digits of the largest entry
        assert 10.0 ** r["e"] <= top / 10 ** (digits - 1) * 10 * (1 + 1e-12)


def test_round_array_examples() -> None:
    assert round_array(torch.tensor([[1.2345, -0.5], [0.0, 2.0]]), 3) == {"e": -2, "m": [123, -50, 0, 200]}
    assert round_array(np.array([9.996]), 3) == {"e": -1, "m": [100]}  # 10.0: one more digit up
    assert round_array(np.zeros(3)) == {"e": 0, "m": [0, 0, 0]}


@pytest.mark.parametrize("digits", [0, -1, 1.5, True])
def test_round_array_rejects_bad_digits(digits: object) -> None:
    with pytest.raises(ValueError, match="digits must be a positive int"):
        round_array(np.ones(2), digits)  # type: ignore[arg-type]


def test_round_array_rejects_non_finite() -> None:
    with pytest.raises(ValueError, match="finite"):
        round_array(np.array([1.0, np.nan]))


# ---- Explorer ------------------------------------------------------------------------
def _fig() -> plt.Figure:
    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [0, 1])
    return fig


def test_explorer_html_is_deterministic_and_names_its_root() -> None:
    a = Explorer("demo-1", {"x": [1, 2]}, _fig(), "a line")._repr_html_()
    b = Explorer("demo-1", {"x": [1, 2]}, _fig(), "a line")._repr_html_()
    assert a == b  # the same HTML on every run: strict nbval can compare it
    assert 'data-explorer="demo-1"' in a and 'id="explorer-demo-1"' in a
    assert 'alt="a line"' in a and "data:image/png;base64," in a
    assert _data(a) == {"x": [1, 2]}


def test_explorer_png_is_the_fallback() -> None:
    ex = Explorer("demo", {}, _fig(), "a line")
    assert ex.png().startswith(b"\x89PNG")
    assert "demo" in repr(ex)


def test_explorer_data_cannot_close_the_script_element() -> None:
    tricky = {"tokens": ["</script><b>", "a & b"]}
    html = Explorer("demo", tricky, _fig(), "x")._repr_html_()
    assert html.count("</script>") == 1
    assert _data(html) == tricky


@pytest.mark.parametrize("name", ["", "Heads", "1x", "a b", "a_b", None])
def test_explorer_rejects_bad_names(name: object) -> None:
    with pytest.raises(ValueError, match="name must be lower-case"):
        Explorer(name, {}, _fig(), "x")  # type: ignore[arg-type]


def test_explorer_rejects_empty_alt_and_nan() -> None:
    with pytest.raises(ValueError, match="alt"):
        Explorer("demo", {}, _fig(), " ")
    with pytest.raises(ValueError):
        Explorer("demo", {"x": float("nan")}, _fig(), "x")


# ---- sharpness_explorer --------------------------------------------------------------
def _lookup() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, generator=g, dtype=torch.float64),
            torch.randn(3, 4, generator=g, dtype=torch.float64),
            torch.randn(3, 2, generator=g, dtype=torch.float64))


def test_sharpness_explorer_holds_the_soft_lookups() -> None:
    q, k, v = _lookup()
    betas = [0.5, 1.0, 8.0]
    ex = sharpness_explorer(q, k, v, ["a", "b"], ["x", "y", "z"], betas, default=(1, 2))
    d = ex.data
    w = np.array(d["weights"]).reshape(2, 3, 3)
    reads = from_rounded(d["reads"]).reshape(2, 3, 2)
    for j, beta in enumerate(betas):
        out, ref = attention(q, k, v, scale=beta)  # (2, 2), (2, 3)
        assert np.abs(w[:, j] - ref.numpy()).max() <= 5e-4
        assert np.abs(reads[:, j] - out.numpy()).max() <= 1e-3 * out.abs().max().item()
    assert d["default"] == [1, 2] and d["keys"] == ["x", "y", "z"] and d["dv"] == 2
    assert 'data-explorer="sharpness"' in ex._repr_html_()


def test_sharpness_explorer_rejects_bad_input() -> None:
    q, k, v = _lookup()
    with pytest.raises(ValueError, match="queries must be a 2-D tensor"):
        sharpness_explorer(q[0], k, v, ["a"], ["x", "y", "z"], [1.0])
    with pytest.raises(TypeError, match="keys must be a torch.Tensor"):
        sharpness_explorer(q, k.tolist(), v, ["a", "b"], ["x", "y", "z"], [1.0])
    with pytest.raises(ValueError, match="query_labels must have n_q = 2"):
        sharpness_explorer(q, k, v, ["a"], ["x", "y", "z"], [1.0])
    with pytest.raises(ValueError, match="key_labels must have n_k = 3"):
        sharpness_explorer(q, k, v, ["a", "b"], ["x"], [1.0])
    with pytest.raises(ValueError, match="betas must be increasing positive"):
        sharpness_explorer(q, k, v, ["a", "b"], ["x", "y", "z"], [2.0, 1.0])
    with pytest.raises(ValueError, match="betas must be increasing positive"):
        sharpness_explorer(q, k, v, ["a", "b"], ["x", "y", "z"], [])
    with pytest.raises(ValueError, match="default must index"):
        sharpness_explorer(q, k, v, ["a", "b"], ["x", "y", "z"], [1.0], default=(0, 1))


# ---- head_explorer -------------------------------------------------------------------
def _model(layers: int = 2, bias: bool = True) -> tuple[list[MultiHeadAttention], list[torch.Tensor]]:
    torch.manual_seed(0)
    mhas = [MultiHeadAttention(16, 2, bias=bias).double() for _ in range(layers)]
    if bias:
        with torch.no_grad():
            for m in mhas:  # non-zero biases: the page must account for them
                for b in (m.b_q, m.b_k, m.b_v, m.b_o):
                    b.normal_()
    xs = [torch.randn(2, 5, 16, dtype=torch.float64) for _ in range(layers)]
    return mhas, xs


def _page_map(entry: dict, t: int, d_k: int, r: int) -> np.ndarray:
    """What _static/explorers.js computes: softmax_j(sum_{a<r} P_ia K_ja + c_j)."""
    p = from_rounded(entry["p"]).reshape(t, d_k)[:, :r]
    k = from_rounded(entry["k"]).reshape(t, d_k)[:, :r]
    s = p @ k.T + from_rounded(entry["c"])  # (t, t)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("bias", [True, False])
def test_head_explorer_full_rank_gives_the_models_maps(bias: bool) -> None:
    mhas, xs = _model(bias=bias)
    tokens = [["a", "b", "c"], ["d", "e", "f", "g", "h"]]
    ex = head_explorer(mhas, xs, tokens, default=(1, 1))
    d = ex.data
    assert (d["layers"], d["heads"], d["rank"], d["default"]) == (2, 2, 8, [1, 1])
    for b, toks in enumerate(tokens):
        t = len(toks)
        for layer, (m, x) in enumerate(zip(mhas, xs)):
            xb = x[b : b + 1, :t]  # (1, t, 16): real tokens only
            with torch.no_grad():
                _, w = m(xb, xb, xb)  # (1, h, t, t)
            for i in range(2):
                page = _page_map(d["sentences"][b][layer][i], t, 8, 8)
                assert np.abs(page - w[0, i].numpy()).max() < 0.02


def test_head_explorer_rank_r_cuts_w_qk_to_its_best_rank_r() -> None:
    from attnlib.lowrank import FactoredMatrix, qk_circuit

    mhas, xs = _model(layers=1)
    ex = head_explorer(mhas, xs, [["a", "b", "c", "d"], ["e"]])
    m, x = mhas[0], xs[0][0, :4]  # (4, 16)
    hw = m.head(1)
    assert hw.b_q is not None and hw.b_k is not None
    for r in (1, 3, 8):
        m_r = FactoredMatrix.from_matrix(qk_circuit(m, 1).full(), r).full()  # (16, 16)
        s = (x @ m_r @ x.T + (x @ hw.w_k @ hw.b_q)[None, :] + (x @ hw.w_q @ hw.b_k)[:, None]
             + hw.b_q @ hw.b_k) / math.sqrt(8)
        ref = torch.softmax(s, -1).detach().numpy()  # (4, 4)
        assert np.abs(_page_map(ex.data["sentences"][0][0][1], 4, 8, r) - ref).max() < 0.02


def test_head_explorer_rejects_bad_input() -> None:
    mhas, xs = _model()
    toks = [["a"], ["b"]]
    with pytest.raises(ValueError, match="one per layer"):
        head_explorer(mhas, xs[:1], toks)
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        head_explorer([torch.nn.Linear(2, 2)], xs[:1], toks)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="same num_heads and d_model"):
        head_explorer([mhas[0], MultiHeadAttention(16, 4).double()], xs, toks)
    with pytest.raises(ValueError, match=r"inputs\[0\] must have shape \(B, n, d_model=16\)"):
        head_explorer(mhas, [xs[0][0], xs[1]], toks)
    with pytest.raises(TypeError, match=r"inputs\[1\] must be a torch.Tensor"):
        head_explorer(mhas, [xs[0], xs[1].tolist()], toks)
    with pytest.raises(ValueError, match=r"inputs\[1\] must have shape \(2, 5, 16\)"):
        head_explorer(mhas, [xs[0], xs[1][:1]], toks)
    with pytest.raises(ValueError, match="tokens of B = 2 sentences"):
        head_explorer(mhas, xs, toks[:1])
    with pytest.raises(ValueError, match=r"tokens\[1\] must have 1 to n = 5 tokens"):
        head_explorer(mhas, xs, [["a"], list("abcdef")])
    with pytest.raises(ValueError, match="default must be"):
        head_explorer(mhas, xs, toks, default=(0, 2))


def test_head_explorer_reads_the_plain_view_and_refuses_mixed_dtypes_up_front() -> None:
    """RoPE is refused by name, before anything is computed."""
    mhas, xs = _model()
    toks = [["a"], ["b"]]
    rope = DecoderAttention(16, 2, rope_base=10000.0).double()
    with pytest.raises(ValueError, match=r"head_explorer \(mhas\[1\]\): DecoderAttention with RoPE .* has no plain view"):
        head_explorer([mhas[0], rope], xs, toks)
    # a grouped layer is read with its groups written out: tests/test_refusals.py
    with pytest.raises(ValueError, match=r"inputs\[1\] has dtype torch.float32 but mhas\[1\]'s weights have dtype torch.float64"):
        head_explorer(mhas, [xs[0], xs[1].float()], toks)
    with pytest.raises(ValueError, match=r"inputs\[0\] has dtype torch.float64 but mhas\[0\]'s weights have dtype torch.float32"):
        head_explorer([m.float() for m in mhas], xs, toks)


# ---- online_softmax_explorer -----------------------------------------------------------
def _row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(4, generator=g, dtype=torch.float64), torch.randn(7, 4, generator=g, dtype=torch.float64),
            torch.randn(7, 2, generator=g, dtype=torch.float64))


def test_online_softmax_explorer_holds_the_running_state_after_each_block() -> None:
    q, k, v = _row()
    ex = online_softmax_explorer(q, k, v, [1, 3, 7], default=(1, 2))
    d = ex.data
    s = (k @ q) / 2.0  # (7,), 1/sqrt(d_k) = 1/2
    assert np.abs(np.array(d["scores"]) - s.numpy()).max() <= 5e-5
    assert d["blocks"] == [1, 3, 7] and d["dv"] == 2 and d["default"] == [1, 2]
    for b, steps in zip(d["blocks"], d["steps"]):
        n_steps = -(-7 // b)
        assert len(steps["m"]) == len(steps["ell"]) == len(steps["out"]) == n_steps + 1
        assert steps["m"][0] == steps["ell"][0] == 0 and steps["out"][0] == [0, 0]
        for t in range(1, n_steps + 1):
            c = min(t * b, 7)
            m = s[:c].max()
            assert abs(steps["m"][t] - m.item()) <= 5e-5
            assert abs(steps["ell"][t] - torch.exp(s[:c] - m).sum().item()) <= 5e-5
            out, _ = attention(q, k[:c], v[:c])  # what the first c keys give
            assert np.abs(np.array(steps["out"][t]) - out.numpy()).max() <= 5e-5
        assert np.abs(np.array(steps["out"][-1]) - attention(q, k, v)[0].numpy()).max() <= 5e-5
    html = ex._repr_html_()
    assert 'data-explorer="online-softmax"' in html and 'id="explorer-online-softmax"' in html
    assert html == online_softmax_explorer(q, k, v, [1, 3, 7], default=(1, 2))._repr_html_()  # deterministic


def test_online_softmax_explorer_rejects_bad_input() -> None:
    q, k, v = _row()
    with pytest.raises(ValueError, match=r"q must be one query of shape \(d_k,\), got \(1, 4\)"):
        online_softmax_explorer(q[None], k, v, [1])
    with pytest.raises(TypeError, match="keys must be a torch.Tensor"):
        online_softmax_explorer(q, k.tolist(), v, [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"values must be a 2-D tensor, got \(7,\)"):
        online_softmax_explorer(q, k, v[:, 0], [1])
    with pytest.raises(ValueError, match="keys must be \\(n_k, d_k = 4\\)"):
        online_softmax_explorer(q, k[:, :3], v, [1])
    for blocks in ([], [0], [2, 2], [8], [True], [1.5]):
        with pytest.raises(ValueError, match="blocks must be increasing ints from 1 to n_k = 7"):
            online_softmax_explorer(q, k, v, blocks)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="default must be"):
        online_softmax_explorer(q, k, v, [1, 3], default=(1, 4))
