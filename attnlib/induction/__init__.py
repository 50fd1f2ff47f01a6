"""Two heads that work together: an induction head in a two-layer attention-only model (chapter 11).

- :mod:`attnlib.induction.data`: the task, a block of random tokens repeated (:class:`RepeatTask`)
- :mod:`attnlib.induction.model`: :class:`InductionRuns`, several seeds of a two-layer
  attention-only transformer trained as one batched model; :func:`train_induction`;
  :func:`save_runs` / :func:`load_runs` (the chapter's twelve runs ship with the package)
- :mod:`attnlib.induction.heads`: finding heads by their attention patterns, by ablation, and by
  the part of the stream (token or position) a layer-0 head copies
- :mod:`attnlib.induction.composition`: Q-, K- and V-composition scores on
  :class:`attnlib.FactoredMatrix`
- :mod:`attnlib.induction.circuits`: the full virtual circuits between the embeddings (which
  token or position each head pair connects) and their diagonal rates
- :mod:`attnlib.induction.survey`: every per-seed number of chapter 11, the kind of first step a
  run found, and the stored table of 72 runs
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
from attnlib.induction.circuits import circuit_rates, diagonal_rate, head_circuits, virtual_circuits
from attnlib.induction.heads import (
    PATTERNS,
    ablation_accuracy,
    part_accuracy,
    pattern_masks,
    pattern_scores,
    previous_by_position,
)
from attnlib.induction.model import InductionRuns, load_runs, save_runs, train_induction
from attnlib.induction.survey import (
    DATA_ORDER,
    LEARNED,
    SURVEY_SEEDS,
    Kind,
    composition_table,
    layer0_kinds,
    load_induction_survey,
    save_induction_survey,
    seed_numbers,
)

# The settings of the shipped runs (scripts/train_induction.py reads them); "seeds": the runs whose
# weights ship (runs.safetensors), a sample of the 48 seeds whose numbers ship (survey.json).
CHAPTER_SETTINGS: dict = {
    "n_vocab": 24, "seq_len": 20, "min_period": 4, "max_period": 10,
    "d_model": 32, "num_heads": 2, "seeds": list(range(12)),
    "steps": 400, "batch_size": 32, "lr": 0.01,
}

__all__ = [
    "RepeatTask", "RepeatBatch", "InductionRuns", "train_induction", "save_runs", "load_runs",
    "PATTERNS", "pattern_masks", "pattern_scores", "ablation_accuracy", "part_accuracy", "previous_by_position",
    "head_circuits", "virtual_circuits", "diagonal_rate", "circuit_rates",
    "SURVEY_SEEDS", "DATA_ORDER", "LEARNED", "Kind", "composition_table", "seed_numbers", "layer0_kinds", "save_induction_survey",
    "load_induction_survey",
    "KINDS", "frobenius", "composition_score", "composition_ceiling", "composition_scores", "random_composition_scores",
    "CHAPTER_SETTINGS",
]
