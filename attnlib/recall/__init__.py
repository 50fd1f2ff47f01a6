r"""The phone book, learned: an associative-recall task and one trained head (chapter 7).

A sequence holds ``n_pairs`` (name, number) tokens and then one query token that
names one of them; the target is that name's number. Every token is the
concatenation of two one-hot blocks, so the key part and the value part of a
token can be read off its coordinates:

.. math::
    x(\text{name } a, \text{number } m) = e_a \oplus e_m \in \mathbb{R}^{N + M},
    \qquad x_{query}(a) = e_a \oplus 0 ,

with ``N = n_names`` and ``M = n_numbers``; ``d_model = N + M``. The first
``N`` coordinates are the **key block**, the last ``M`` the **value block**.

:class:`RecallHead` is one :class:`~attnlib.multihead.MultiHeadAttention` layer
(the query token attends to the pair tokens) followed by a linear read-out to
``M`` number logits; :func:`train_recall` trains it deterministically with AdamW.
Tasks of this kind go back to Ba et al. (2016); Olsson et al. (2022) and
Arora et al. (2023) use them to study attention.

The package's modules: :mod:`~attnlib.recall.task` (the task and its batches),
:mod:`~attnlib.recall.head` (one head, its training, :func:`block_fractions`) and
:mod:`~attnlib.recall.runs` (many heads, over seeds and widths, trained at once as one
batched computation) and :mod:`~attnlib.recall.survey` (every head of chapter 7 over many
seeds, the per-seed numbers the chapter reports, and the trained heads of a few seeds, stored)
and :mod:`~attnlib.recall.table` (the stored table of those numbers, and the checks that
numbers or heads trained again are the stored ones) and
:mod:`~attnlib.recall.rates` (a count of seeds as a rate with its interval); every name is
importable from ``attnlib.recall``.
"""

from attnlib.recall.head import RecallHead, block_fractions, train_recall
from attnlib.recall.runs import RecallRuns, train_recall_runs
from attnlib.recall.survey import (
    CONFIGS,
    RUN_SEEDS,
    SURVEY_SEEDS,
    TEST_SEED,
    RecallSurvey,
    SurveyGroup,
    SurveyTable,
    compare_with_runs,
    compare_with_survey,
    load_survey,
    load_survey_runs,
    save_survey,
    save_survey_runs,
    survey_groups,
    survey_numbers,
    train_group,
    train_survey,
)
from attnlib.recall.rates import binomial_counts, binomial_interval, rate_text
from attnlib.recall.task import PhoneBookTask, RecallBatch

__all__ = [
    "PhoneBookTask",
    "RecallBatch",
    "RecallHead",
    "train_recall",
    "block_fractions",
    "RecallRuns",
    "train_recall_runs",
    "CONFIGS",
    "SURVEY_SEEDS",
    "TEST_SEED",
    "RecallSurvey",
    "SurveyGroup",
    "SurveyTable",
    "train_group",
    "train_survey",
    "survey_numbers",
    "save_survey",
    "load_survey",
    "compare_with_survey",
    "RUN_SEEDS",
    "survey_groups",
    "save_survey_runs",
    "load_survey_runs",
    "compare_with_runs",
    "binomial_interval",
    "binomial_counts",
    "rate_text",
]
