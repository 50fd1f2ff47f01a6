"""Reading and writing attention weights in other libraries' layouts (chapter 5).

attnlib keeps one orientation everywhere, the paper's: ``y = x @ W + b`` with
``W`` of shape ``(d_in, d_out)``. Every conversion to or from another layout lives
here, named for the layout it reads or writes, and is round-trip tested.

=====================================  =======================================
layout                                  what it stores (``d = d_model = E``)
=====================================  =======================================
attnlib / the paper                     ``W^Q, W^K, W^V, W^O``: ``(d, d)`` each, ``x @ W``
``torch.nn.MultiheadAttention``         ``in_proj_weight`` = ``[W^Q | W^K | W^V]ᵀ``: ``(3E, E)``,
                                        ``out_proj.weight`` = ``(W^O)ᵀ``: ``(E, E)``
packed ``nn.Linear(d, 3d)`` (nanoGPT)   ``c_attn.weight`` = ``[W^Q | W^K | W^V]ᵀ``: ``(3d, d)``,
                                        ``c_proj.weight`` = ``(W^O)ᵀ``: ``(d, d)``
separate ``nn.Linear`` (BERT)           ``query/key/value/output.dense.weight`` = ``Wᵀ``: ``(out, in)``;
                                        BERT keeps W^O in another module (``read_bert``)
a list of heads (Raschka's wrapper)     head ``i``: ``W_query/W_key/W_value.weight`` = ``(W_i)ᵀ``: ``(d_k, d)``;
                                        W^O one ``nn.Linear`` or none (``read_linear_heads``)
GPT-2 ``Conv1D`` (in, out)              ``c_attn.weight`` = ``[W^Q | W^K | W^V]``: ``(d, 3d)``,
                                        ``c_proj.weight`` = ``W^O``: ``(d, d)``
Hugging Face Llama (chapter 8)          ``q_proj.weight`` = ``(W^Q)ᵀ``: ``(h d_k, d)``,
                                        ``k_proj/v_proj.weight`` = ``(W^K)ᵀ, (W^V)ᵀ``: ``(g d_k, d)``
                                        (``g`` key/value heads), ``o_proj.weight`` = ``(W^O)ᵀ``: ``(d, h d_k)``
Hugging Face BLOOM (chapter 8)          ``query_key_value.weight``: ``(3d, d)``, grouped by head:
                                        head ``i``'s ``(W_i^Q)ᵀ, (W_i^K)ᵀ, (W_i^V)ᵀ`` in turn
                                        (``view(h, 3, d_k, d)``), ``dense.weight`` = ``(W^O)ᵀ``
=====================================  =======================================

Readers (``read_*``) return an :class:`AttentionWeights` of copies (``read_llama``: a
:class:`GroupedAttentionWeights`); writers (``write_*``) take one and return the other
layout. The table writes the paper's ``h d_k = d``; heads of another width (Llama's
``head_dim``) are read and written the same way, with ``h d_k`` columns where a ``d`` counts
heads (``write_torch_mha`` refuses them: torch's heads are ``E / h`` wide). ``read_X(write_X(w)) == w`` exactly: the conversions only transpose, cut and
concatenate.

Masks: attnlib uses ``True`` = may attend; ``nn.MultiheadAttention``'s
``attn_mask`` and ``key_padding_mask`` use ``True`` = may **not** attend. Hugging Face
models take a 0/1 ``attention_mask`` ``(B, n_k)``; in transformers 5 ``BertModel`` hands
its layers ``create_bidirectional_mask``'s ``(B, 1, n_q, n_k)`` mask (additive, 0 or
``finfo(dtype).min``, with eager attention; boolean, ``True`` = may attend, with SDPA;
``None`` when nothing is padding). The helpers ``additive_mask``, ``mask_from_additive``,
``mask_from_padding``, ``hf_extended_mask``, ``to_torch_mha_masks``,
``from_torch_mha_masks`` and ``fully_masked_rows`` convert between these.

The code lives in three modules: :mod:`attnlib.interop.torch_mha` (``nn.MultiheadAttention``'s
layout, which chapter 3's :class:`~attnlib.MultiHeadAttention` uses in ``from_torch`` and
``to_torch``), :mod:`attnlib.interop.layouts` (the other weight layouts of chapter 5) and
:mod:`attnlib.interop.masks` (the mask conventions). Hugging Face's Llama and BLOOM layouts
read into chapter 8's records, so they live with them, in :mod:`attnlib.decoding.llama`
and :mod:`attnlib.decoding.bloom`. Every name of these five modules is importable from
``attnlib.interop`` itself, each module imported when one of its names is first used: so
importing :mod:`attnlib.interop.torch_mha` (chapter 3) loads nothing else, and this
package never imports chapter 8's modules before they are asked for.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

MODULES = ("attnlib.interop.torch_mha", "attnlib.interop.layouts", "attnlib.interop.masks",
           "attnlib.decoding.llama", "attnlib.decoding.bloom")
"""Where the names of ``attnlib.interop`` live, in chapter order."""


def _module(short: str) -> ModuleType | None:
    """The module of :data:`MODULES` whose last name is ``short``, or ``None``."""
    full = next((m for m in MODULES if m.rpartition(".")[2] == short), None)
    return None if full is None else importlib.import_module(full)


def __getattr__(name: str) -> Any:
    """``attnlib.interop.X``: the module ``X`` of :data:`MODULES`, or the name ``X`` of the
    first module that exports it, imported on first use and kept."""
    if name == "__all__":
        value: Any = [n for m in MODULES for n in importlib.import_module(m).__all__]
    elif (module := _module(name)) is not None:
        value = module
    elif name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        owner = next((m for m in map(importlib.import_module, MODULES) if name in m.__all__), None)
        if owner is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(owner, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | {m.rpartition(".")[2] for m in MODULES} | set(__getattr__("__all__")))
