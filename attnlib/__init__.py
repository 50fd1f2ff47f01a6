"""attnlib: multi-head attention, small and checked.

The library behind the book. One module per idea, in the order of the chapters:

- :mod:`attnlib.attention`: scaled dot-product attention, one query or many (ch. 1)
- :mod:`attnlib.multihead`: per-head projections, fused (ch. 2-5), and :func:`~attnlib.multihead.plain_view`,
  which every tool for that layer asks first
- :mod:`attnlib.separate`: the same layer as h separate heads (ch. 3, 5)
- :mod:`attnlib.lowrank`: the factored products W_i^QK, W_i^OV: SVD, rank, costs, gauge (ch. 4)
- :mod:`attnlib.interop`: other libraries' weight layouts, and mask conventions (ch. 5, 8)
- :mod:`attnlib.pretrained`: all-MiniLM-L6-v2's attention, read offline from its package (ch. 6)
- :mod:`attnlib.recall`: the phone-book recall task and one trained head (ch. 7)
- :mod:`attnlib.decoding`: RoPE, the KV cache, :class:`DecoderAttention` (grouped
  keys/values, RoPE and the cache as a subclass of ``MultiHeadAttention``) and latent
  attention (ch. 8)
- :mod:`attnlib.audit`: is my attention right? diagnose a learner's module, or its KV cache (ch. 9)
- :mod:`attnlib.blockwise`: attention tile by tile, without the n x n matrix: the online
  softmax, the log-sum-exp merge, split-K, the backward from the saved log-sum-exp (ch. 10)
- :mod:`attnlib.induction`: two heads that work together: a two-layer attention-only model,
  its induction heads, ablations and composition scores (ch. 11)
- :mod:`attnlib.plots`, :mod:`attnlib.explorers`: the book's figures, static and interactive

Shared by every chapter: :mod:`attnlib.checks` (the argument checks and their one rule),
:mod:`attnlib.records` (:class:`AttentionWeights`, a layer's projections) and
:mod:`attnlib.rounding` (tolerances derived from the computation, not tuned).
Orientation everywhere: row vectors, ``y = x @ W``, weights ``(d_in, d_out)``.
Masks: boolean, ``True`` = may attend.
"""

from attnlib import audit
from attnlib.records import AttentionWeights
from attnlib.rounding import assert_rounding_close, rounding_tolerance
from attnlib.attention import attention, masked_softmax
from attnlib.audit import AuditReport, diagnose
from attnlib.blockwise import Partial, blockwise_attention, merge, split_k_attention
from attnlib.decoding import DecoderAttention, KVCache, LatentAttention, LatentCache
from attnlib.explorers import head_explorer, sharpness_explorer
from attnlib.induction import InductionRuns, RepeatTask, composition_score, composition_scores
from attnlib.lowrank import FactoredMatrix, FlopCount, fix_signs, ov_circuit, qk_circuit
from attnlib.multihead import HeadWeights, MultiHeadAttention
from attnlib.pretrained import mean_pool, minilm_attention
from attnlib.recall import (
    PhoneBookTask,
    RecallBatch,
    RecallHead,
    RecallRuns,
    block_fractions,
    train_recall,
    train_recall_runs,
)
from attnlib.separate import SeparateHeadsAttention

__all__ = [
    # chapters 1-3
    "attention",
    "masked_softmax",
    "AttentionWeights",
    "HeadWeights",
    "MultiHeadAttention",
    "SeparateHeadsAttention",
    # rounding: tolerances derived, not tuned (every chapter)
    "rounding_tolerance",
    "assert_rounding_close",
    # chapter 4
    "FactoredMatrix",
    "FlopCount",
    "qk_circuit",
    "ov_circuit",
    "fix_signs",
    # chapter 6
    "minilm_attention",
    "mean_pool",
    # chapter 7
    "PhoneBookTask",
    "RecallBatch",
    "RecallHead",
    "train_recall",
    "RecallRuns",
    "train_recall_runs",
    "block_fractions",
    # chapter 8
    "DecoderAttention",
    "KVCache",
    "LatentCache",
    "LatentAttention",
    # chapter 9
    "audit",
    "AuditReport",
    "diagnose",
    # chapter 10
    "blockwise_attention",
    "Partial",
    "merge",
    "split_k_attention",
    # chapter 11
    "RepeatTask",
    "InductionRuns",
    "composition_score",
    "composition_scores",
    # interactive figures
    "head_explorer",
    "sharpness_explorer",
]
__version__ = "0.1.0"  # the one place; pyproject.toml reads it
