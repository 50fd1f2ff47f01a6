"""Two heads that work together: an induction head in a two-layer attention-only model (chapter 11).

- :mod:`attnlib.induction.data`: the task, a block of random tokens repeated (:class:`RepeatTask`)
- :mod:`attnlib.induction.model`: :class:`InductionRuns`, several seeds of a two-layer
  attention-only transformer trained as one batched model; :func:`train_induction`;
  :func:`save_runs` / :func:`load_runs` (the chapter's twelve runs ship with the package)
- :mod:`attnlib.induction.heads`: finding heads by their attention patterns and by ablation
- :mod:`attnlib.induction.composition`: Q-, K- and V-composition scores on
  :class:`attnlib.FactoredMatrix`
- :mod:`attnlib.induction.explorer`: the interactive composition map
"""

from attnlib.induction.composition import (
    KINDS,
    composition_ceiling,
    composition_score,
    composition_scores,
    frobenius,
    random_composition_scores,
)
from attnlib.induction.data import RepeatBatch, RepeatTask
from attnlib.induction.heads import PATTERNS, ablation_accuracy, pattern_masks, pattern_scores
from attnlib.induction.model import InductionRuns, load_runs, save_runs, train_induction

# The settings of the shipped runs (scripts/train_induction.py reads them).
CHAPTER_SETTINGS: dict = {
    "n_vocab": 24, "seq_len": 20, "min_period": 4, "max_period": 10,
    "d_model": 32, "num_heads": 2, "seeds": list(range(12)),
    "steps": 400, "batch_size": 32, "lr": 0.01,
}

__all__ = [
    "RepeatTask", "RepeatBatch", "InductionRuns", "train_induction", "save_runs", "load_runs",
    "PATTERNS", "pattern_masks", "pattern_scores", "ablation_accuracy",
    "KINDS", "frobenius", "composition_score", "composition_ceiling", "composition_scores", "random_composition_scores",
    "CHAPTER_SETTINGS",
]
