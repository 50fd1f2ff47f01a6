r"""Chapter 11's model over many seeds: every per-seed number the chapter reports, the kind of
first step each seed found, and the stored table (chapter 11).

:func:`seed_numbers` measures trained :class:`~attnlib.induction.InductionRuns` on one test batch:
accuracy, attention patterns, ablations, the token/position restriction of the layer-0 heads, the
diagonal rates of the full circuits and the composition scores, one value per run.
:func:`layer0_kinds` names, from those numbers, the first step each run found.
``scripts/train_induction.py`` trains the seeds :data:`SURVEY_SEEDS` and the data-order runs and
stores their numbers with the package (``survey.json``, read by :func:`load_induction_survey`); the
chapter recomputes the rows of the runs whose weights ship, and retrains a sample.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from attnlib.induction.circuits import circuit_rates, head_circuits
from attnlib.induction.composition import KINDS, composition_ceiling, composition_score
from attnlib.induction.data import RepeatBatch
from attnlib.induction.heads import ablation_accuracy, part_accuracy, pattern_scores, previous_by_position
from attnlib.induction.model import InductionRuns
from attnlib.lowrank import FactoredMatrix
from attnlib.recall.survey import DIGITS, SurveyTable

__all__ = ["SURVEY_SEEDS", "DATA_ORDER", "TEST_SEED", "KEPT_SHARED", "KEPT_BACKUP", "PATTERN_CUT", "LEARNED",
           "Kind", "composition_table", "seed_numbers", "layer0_kinds", "save_induction_survey", "load_induction_survey"]

SURVEY_SEEDS = tuple(range(48))  # the seeds of the stored table; runs.safetensors holds 0-11
DATA_ORDER = tuple(range(1000, 1012))  # other data streams (with seed 0's start), other starts (with its data)
TEST_SEED = 100  # the test sequences' generator
KEPT_SHARED = 0.9  # a head is needed when ablating it keeps less than this share of what layer 0 adds
KEPT_BACKUP = 0.15  # ... and has a backup when ablating it still keeps at least this share
PATTERN_CUT = 0.8  # previous-token / duplicate-token: this share of the head's attention or more
LEARNED = 0.9  # a run below this accuracy is still learning: its first step is not named


def composition_table(runs: InductionRuns) -> tuple[Tensor, Tensor]:
    """Every run's (layer-0 head ``a``, layer-1 head ``b``) composition score of each kind, and its
    share of :func:`~attnlib.induction.composition_ceiling`: two ``(R, 3, h0, h1)`` tensors,
    float64, kinds in the order of :data:`KINDS`. The scores of
    :func:`~attnlib.induction.composition_scores`, for all runs at once, from the factors."""
    R, h, d, k = runs.n_runs, runs.num_heads, runs.d_model, runs.d_k

    def factors(l: int) -> tuple[Tensor, ...]:
        cols = [getattr(runs, n)[:, l].detach().double().view(R, d, h, k).transpose(1, 2) for n in ("w_q", "w_k", "w_v")]
        return (*cols, runs.w_o[:, l].detach().double().view(R, h, k, d))  # (R, h, d, d_k) x 3, (R, h, d_k, d)

    _, _, v0, o0 = factors(0)
    q1, k1, v1, o1 = factors(1)
    ov0 = FactoredMatrix(v0[:, :, None], o0[:, :, None])  # batch (R, h0, 1)
    readers = {"Q": FactoredMatrix(q1[:, None], k1[:, None].mT), "K": FactoredMatrix(k1[:, None], q1[:, None].mT),
               "V": FactoredMatrix(v1[:, None], o1[:, None])}  # batch (R, 1, h1); K reads W^QK transposed
    scores = torch.stack([composition_score(ov0, readers[kind]) for kind in KINDS], 1)  # (R, 3, h0, h1)
    ceilings = torch.stack([composition_ceiling(ov0, readers[kind]) for kind in KINDS], 1)
    return scores, scores / ceilings


def seed_numbers(runs: InductionRuns, batch: RepeatBatch) -> dict[str, list[float]]:
    """Every number chapter 11 reports per run, keyed ``"measurement | head"`` (heads written
    ``L0 h0``; pairs ``L0 h0 -> L1 h1``), one value per run, all on ``batch``:

    - accuracy on the positions the repeat decides, and every head's previous-token, duplicate
      and induction shares over them (:func:`~attnlib.induction.pattern_scores`);
    - for the layer-1 heads, from the third block on, the share on the answer's first-block copy
      and on its latest copy;
    - for the layer-0 heads, the previous-token share over the first block (the mean, and the
      lowest over positions 1 .. max_period - 1) and the share on the first duplicate;
    - accuracy with each head, and each layer's two heads, ablated; with one layer-0 head
      reading only the token part or only the position part of the stream;
    - the diagonal rates of :func:`~attnlib.induction.circuits.circuit_rates`, the composition
      scores and their share of :func:`~attnlib.induction.composition_ceiling`.
    """
    task, h = runs.task, runs.num_heads
    out: dict[str, list[float]] = {}

    def put(key: str, values: Tensor) -> None:
        out[key] = [float(v) for v in values]

    # the intact model, run once: its accuracy and attention maps give the first numbers
    # (ablation_accuracy with no head, pattern_scores and previous_by_position, without rerunning it)
    R, (tokens, period) = runs.n_runs, batch
    with torch.no_grad():
        logits, maps = runs(tokens.expand(R, -1, -1))  # (R, B, T, V), per layer (R, B, h, T, T)
    put("accuracy", runs.score_logits(logits, tokens.expand(R, -1, -1), period.expand(R, -1))[0])
    ps = pattern_scores(runs, batch, maps=maps)
    block = task.block(period)  # (B, T)
    later = task.predictable(period) & (block >= 2)  # two or more earlier copies
    pl = pattern_scores(runs, batch, later, maps)
    first_block = (block == 0) & (torch.arange(task.seq_len) >= 1)
    pf = pattern_scores(runs, batch, first_block, maps)["previous"][:, 0]  # (R, h)
    lowest = previous_by_position(runs, batch, 0, maps).amin(-1)  # (R, h)
    for l in range(2):
        for a in range(h):
            for name in ("previous", "duplicate", "induction"):
                put(f"{name} | L{l} h{a}", ps[name][:, l, a])
    for b in range(h):
        put(f"first-block copy | L1 h{b}", pl["first induction"][:, 1, b])
        put(f"latest copy | L1 h{b}", pl["latest induction"][:, 1, b])
    for a in range(h):
        put(f"previous, first block | L0 h{a}", pf[:, a])
        put(f"previous, lowest position | L0 h{a}", lowest[:, a])
        put(f"first duplicate | L0 h{a}", ps["first duplicate"][:, 0, a])
    for l in range(2):
        for a in range(h):
            put(f"ablated | L{l} h{a}", ablation_accuracy(runs, batch, [(l, a)]))
        put(f"ablated | both L{l}", ablation_accuracy(runs, batch, [(l, a) for a in range(h)]))
    for a in range(h):
        for part in ("token", "position"):
            put(f"{part} part only | L0 h{a}", part_accuracy(runs, batch, [a] * runs.n_runs, part))
    rates = circuit_rates(runs)
    scores, shares = composition_table(runs)
    for a in range(h):
        for b in range(h):
            pair = f"L0 h{a} -> L1 h{b}"
            put(f"K circuit | {pair}", rates["K"][:, a, b])
            put(f"positional circuit | {pair}", rates["positional"][:, a, b])
            for i, kind in enumerate(KINDS):
                put(f"{kind}-composition | {pair}", scores[:, i, a, b])
                put(f"{kind}-composition, share of ceiling | {pair}", shares[:, i, a, b])
    for b in range(h):
        put(f"copying circuit | L1 h{b}", rates["copying"][:, b])
    return out


class Kind(NamedTuple):
    """The first step a run found: ``kind`` (``"previous-token"``, ``"previous-token with backup"``,
    ``"duplicate-token"``, ``"duplicate-token with backup"``, ``"other"``, ``"other with backup"``,
    ``"shared"`` or ``"still learning"``) and its needed layer-0 head (``None`` when shared or still
    learning); ``kept``: per layer-0 head,
    the share of what layer 0 adds that survives its ablation."""

    kind: str
    needed: int | None
    kept: tuple[float, ...]


def layer0_kinds(table: SurveyTable | dict[str, list[float]], num_heads: int = 2) -> list[Kind]:
    r"""Name each run's first step from its numbers (a :class:`SurveyTable` or a dict of
    :func:`seed_numbers`). With :math:`a` the intact accuracy, :math:`a_\varnothing` the accuracy
    without layer 0 and :math:`a_h` without head ``h``, ablating ``h`` keeps the share
    :math:`\kappa_h = (a_h - a_\varnothing) / (a - a_\varnothing)` of what layer 0 adds.

    - **shared**: every head's ablation costs accuracy, :math:`\kappa_h <` :data:`KEPT_SHARED` for all ``h``;
    - otherwise the **needed** head is the one with the smallest :math:`\kappa_h`; its kind is
      *previous-token* if its previous-token share over the first block is at least
      :data:`PATTERN_CUT`, else *duplicate-token* if its share on the current token's first
      occurrence is, else *other*;
    - **with backup** when the other heads keep some of the work without it,
      :math:`\kappa_{needed} \ge` :data:`KEPT_BACKUP`;
    - **still learning**, before any of these, when :math:`a <` :data:`LEARNED`: a run that has not
      learnt the task has no settled first step (its ablations can look like a shared one).
    """
    numbers = table.numbers if isinstance(table, SurveyTable) else table
    acc, none = numbers["accuracy"], numbers["ablated | both L0"]
    kinds = []
    for r in range(len(acc)):
        gain = acc[r] - none[r]
        kept = tuple((numbers[f"ablated | L0 h{a}"][r] - none[r]) / gain if gain > 0 else 1.0 for a in range(num_heads))
        if acc[r] < LEARNED:
            kinds.append(Kind("still learning", None, kept))
            continue
        if all(k < KEPT_SHARED for k in kept):
            kinds.append(Kind("shared", None, kept))
            continue
        a = min(range(num_heads), key=lambda x: kept[x])
        if numbers[f"previous, first block | L0 h{a}"][r] >= PATTERN_CUT:
            name = "previous-token"
        elif numbers[f"first duplicate | L0 h{a}"][r] >= PATTERN_CUT:
            name = "duplicate-token"
        else:
            name = "other"
        kinds.append(Kind(name + (" with backup" if kept[a] >= KEPT_BACKUP else ""), a, kept))
    return kinds


# ---- the stored table -----------------------------------------------------------------------
SHIPPED = "survey.json"
PARTS = ("seeds", "same start", "same data")  # the main seeds; seed 0's start on other data; its data from other starts


def save_induction_survey(tables: Mapping[str, tuple[Sequence[int], dict[str, list[float]]]], path: str | Path) -> None:
    """Write ``{part: (seeds, numbers)}`` for the parts of :data:`PARTS` as JSON (``DIGITS``
    significant digits). For ``"same start"`` the seeds are the data streams, for ``"same data"``
    the initial weights' seeds."""
    if set(tables) != set(PARTS):
        raise ValueError(f"tables must have the parts {PARTS}, got {sorted(tables)}")
    body = {part: {"seeds": list(seeds), "numbers": {k: [float(f"{v:.{DIGITS}g}") for v in vals]
                                                      for k, vals in numbers.items()}}
            for part, (seeds, numbers) in tables.items()}
    Path(path).write_text(json.dumps(body, indent=0, sort_keys=True) + "\n")


def load_induction_survey(path: str | Path | None = None) -> dict[str, SurveyTable]:
    """The stored tables, one per part of :data:`PARTS`; by default those shipped with attnlib."""
    path = Path(__file__).with_name(SHIPPED) if path is None else Path(path)
    body = json.loads(path.read_text())
    return {part: SurveyTable(tuple(body[part]["seeds"]), body[part]["numbers"]) for part in PARTS}
