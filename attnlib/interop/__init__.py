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
layout. ``read_X(write_X(w)) == w`` exactly: the conversions only transpose, cut and
concatenate.

Masks: attnlib uses ``True`` = may attend; ``nn.MultiheadAttention``'s
``attn_mask`` and ``key_padding_mask`` use ``True`` = may **not** attend. Hugging Face
models take a 0/1 ``attention_mask`` ``(B, n_k)``; in transformers 5 ``BertModel`` hands
its layers ``create_bidirectional_mask``'s ``(B, 1, n_q, n_k)`` mask (additive, 0 or
``finfo(dtype).min``, with eager attention; boolean, ``True`` = may attend, with SDPA;
``None`` when nothing is padding). The helpers ``additive_mask``, ``mask_from_additive``,
``mask_from_padding``, ``hf_extended_mask``, ``to_torch_mha_masks``,
``from_torch_mha_masks`` and ``fully_masked_rows`` convert between these.

The code lives in four modules: :mod:`attnlib.interop.layouts` (the weight layouts of
chapter 5), :mod:`attnlib.interop.masks` (the mask conventions),
:mod:`attnlib.interop.llama` and :mod:`attnlib.interop.bloom` (Hugging Face's Llama and
BLOOM layouts, chapter 8). Every name is
importable from ``attnlib.interop`` itself.
"""

from attnlib.interop import bloom, layouts, llama, masks
from attnlib.interop.bloom import *  # noqa: F403
from attnlib.interop.layouts import *  # noqa: F403
from attnlib.interop.llama import *  # noqa: F403
from attnlib.interop.masks import *  # noqa: F403

__all__ = layouts.__all__ + masks.__all__ + llama.__all__ + bloom.__all__
