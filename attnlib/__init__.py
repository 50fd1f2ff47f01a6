"""attnlib: multi-head attention, small and checked.

The library behind the book. One module per idea, in the order of the chapters:

- :mod:`attnlib.attention`: scaled dot-product attention, one query or many (ch. 1)
- :mod:`attnlib.multihead`: per-head projections, fused and separate (ch. 2-3)
- :mod:`attnlib.lowrank`: the factored products W_i^QK, W_i^OV: SVD, rank, costs, gauge (ch. 4)
- :mod:`attnlib.interop`: other libraries' weight layouts, and mask conventions (ch. 5)
- :mod:`attnlib.pretrained`: all-MiniLM-L6-v2's attention, read offline from its package (ch. 6)
- :mod:`attnlib.plots`: the book's figures

Orientation everywhere: row vectors, ``y = x @ W``, weights ``(d_in, d_out)``.
Masks: boolean, ``True`` = may attend.
"""

from attnlib.attention import attention, masked_softmax
from attnlib._core import AttentionWeights
from attnlib.lowrank import FactoredMatrix, FlopCount, ov_circuit, qk_circuit
from attnlib.pretrained import mean_pool, minilm_attention
from attnlib.multihead import HeadWeights, MultiHeadAttention, SeparateHeadsAttention

__all__ = [
    "attention",
    "masked_softmax",
    "AttentionWeights",
    "FactoredMatrix",
    "FlopCount",
    "qk_circuit",
    "ov_circuit",
    "HeadWeights",
    "MultiHeadAttention",
    "SeparateHeadsAttention",
    "minilm_attention",
    "mean_pool",
]
__version__ = "0.1.0"  # the one place; pyproject.toml reads it

# interactive figures of the rendered book (attnlib.explorers)
from attnlib.explorers import head_explorer, sharpness_explorer  # noqa: E402

__all__ += ["head_explorer", "sharpness_explorer"]

# chapter 7: the phone book, learned (attnlib.recall)
from attnlib.recall import PhoneBookTask, RecallBatch, RecallHead, block_fractions, train_recall  # noqa: E402

__all__ += ["PhoneBookTask", "RecallBatch", "RecallHead", "train_recall", "block_fractions"]

# chapter 9: is my attention right?
from attnlib import audit  # noqa: E402
from attnlib.audit import AuditReport, diagnose  # noqa: E402

__all__ += ["audit", "AuditReport", "diagnose"]

# chapter 8: decoding (RoPE, the KV cache, multi-head latent attention)
from attnlib.decoding import KVCache, LatentAttention, LatentCache  # noqa: E402

__all__ += ["KVCache", "LatentCache", "LatentAttention"]
