r"""Attention in a decoder today: rotary positions, the KV cache, grouped and latent
attention (chapter 8). One module per piece:

- :mod:`attnlib.decoding.rope`: **RoPE** (rotary position embedding, Su et al. 2021):
  queries and keys are rotated by an angle proportional to their position, so that the
  score of query ``i`` and key ``j`` depends on ``j - i`` only. attnlib uses the
  "rotate-half" layout of Llama in Hugging Face ``transformers``: dimension ``l`` is
  paired with dimension ``l + d_k/2`` and turned by the angle :math:`p\,\omega_\ell`,
  :math:`\omega_\ell = \text{base}^{-2\ell/d_k}`.
- :mod:`attnlib.decoding.cache`: **the KV cache** (:class:`KVCache`): when a decoder
  generates token ``n``, the keys and values of tokens ``0..n-1`` have not changed, so
  they are kept instead of recomputed; and MLA's :class:`LatentCache`.
- :mod:`attnlib.decoding.grouped`: :class:`DecoderAttention`, chapter 3's
  :class:`attnlib.MultiHeadAttention` with grouped keys and values (GQA/MQA), RoPE and
  the cache, as a subclass that changes two steps of the parent's ``forward``.
- :mod:`attnlib.decoding.latent`: **multi-head latent attention**
  (:class:`LatentAttention`, DeepSeek-AI 2024, "DeepSeek-V2", section 2.1): the cache
  holds one latent vector :math:`c_j = x_j W^{DKV}` per token instead of ``h`` keys and
  ``h`` values; with :math:`W^{UK}` folded into the queries and :math:`W^{UV}` into
  :math:`W^O`, attention reads the latents directly and never forms the keys.
- :mod:`attnlib.decoding.positions`: positions seen through :math:`W^{QK}`: additive
  encodings, and **ALiBi** (:class:`AlibiAttention`, Press et al. 2022), a per-head bias
  on the scores.
- :mod:`attnlib.decoding.llama` and :mod:`attnlib.decoding.bloom`: Hugging Face's Llama
  and BLOOM layouts, read into this chapter's records (:func:`read_llama`,
  :func:`read_bloom`, and their writers; :mod:`attnlib.interop` hands them on with the
  other layouts).

Orientation as everywhere in attnlib: row vectors, ``x @ W``, masks boolean with
``True`` = may attend. Every name is importable from ``attnlib.decoding`` itself.
"""

from attnlib.attention import causal_mask
from attnlib.decoding.bloom import read_bloom, write_bloom
from attnlib.decoding.cache import KVCache, LatentCache, kv_cache_bytes_per_token, latent_cache_bytes_per_token
from attnlib.decoding.grouped import DecoderAttention, GroupedAttentionWeights
from attnlib.decoding.latent import LatentAttention
from attnlib.decoding.llama import float32_attention_widths, read_llama, write_llama
from attnlib.decoding.positions import (
    AlibiAttention,
    AlibiWeights,
    ScoreTerms,
    alibi_bias,
    alibi_slopes,
    score_terms,
    score_terms_bound,
    sinusoidal_positions,
)
from attnlib.decoding.rope import (
    apply_rope,
    rope_angle_error,
    rope_angles,
    rope_frequency_error,
    rope_inv_freq,
    rope_merged_bound,
    rope_rotation,
    rotate_half,
)

__all__ = [
    "rope_inv_freq",
    "rope_angles",
    "rotate_half",
    "apply_rope",
    "rope_rotation",
    "rope_frequency_error",
    "rope_angle_error",
    "rope_merged_bound",
    "causal_mask",
    "KVCache",
    "LatentCache",
    "LatentAttention",
    "kv_cache_bytes_per_token",
    "latent_cache_bytes_per_token",
    "GroupedAttentionWeights",
    "DecoderAttention",
    "sinusoidal_positions",
    "ScoreTerms",
    "score_terms",
    "score_terms_bound",
    "alibi_slopes",
    "alibi_bias",
    "AlibiWeights",
    "AlibiAttention",
    "read_llama",
    "write_llama",
    "float32_attention_widths",
    "read_bloom",
    "write_bloom",
]
