r"""The stored table of chapter 7's per-seed numbers (chapter 7): :class:`SurveyTable`, written by
:func:`save_survey` and read by :func:`load_survey`, and :func:`compare_with_survey`, the check
that numbers measured again (by :func:`~attnlib.recall.survey.survey_numbers`) are the stored
ones; and :func:`compare_with_runs`, the same check for trained heads (weights and losses)
against the stored ones, group by group (:class:`SurveyGroup`, also importable from
:mod:`attnlib.recall.survey`). ``scripts/train_recall_survey.py`` writes the table shipped
with the package (``survey.json``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from attnlib.recall.runs import RecallRuns
    from attnlib.recall.task import PhoneBookTask

__all__ = ["DIGITS", "SHIPPED", "SurveyTable", "SurveyGroup", "save_survey", "load_survey",
           "compare_with_survey", "compare_with_runs"]

F64 = torch.float64


# ---- one batched training, as trained here or as stored ------------------------------------
@dataclass
class SurveyGroup:
    """One batched training: run ``r`` is head ``labels[r]`` trained on the stream of ``seeds[r]``."""

    task: PhoneBookTask
    runs: RecallRuns
    labels: list[str]
    seeds: list[int]
    losses: Tensor  # (steps, R)

    def members(self, label: str) -> list[int]:
        """The runs of one label, in the order of the seeds."""
        found = [r for r, lab in enumerate(self.labels) if lab == label]
        if not found:
            raise KeyError(f"no run is labelled {label!r}; labels: {sorted(set(self.labels))}")
        return found


# ---- the stored table -----------------------------------------------------------------------
SHIPPED = "survey.json"
DIGITS = 12  # significant digits stored: far below every printed digit, far above rounding


@dataclass(frozen=True)
class SurveyTable:
    """Per-seed numbers: ``numbers[key][k]`` belongs to ``seeds[k]``."""

    seeds: tuple[int, ...]
    numbers: dict[str, list[float]]

    def __getitem__(self, key: str) -> Tensor:
        """One measurement over every seed, ``(S,)`` float64."""
        if key not in self.numbers:
            raise KeyError(f"no measurement {key!r} in the table")
        return torch.tensor(self.numbers[key], dtype=F64)

    def of(self, key: str, seeds: Sequence[int]) -> Tensor:
        """One measurement for the listed seeds, in their order."""
        missing = [s for s in seeds if s not in self.seeds]
        if missing:
            raise KeyError(f"seeds {missing} are not in the table (it holds {self.seeds[0]}..{self.seeds[-1]})")
        return self[key][[self.seeds.index(s) for s in seeds]]


def save_survey(numbers: dict[str, list[float]], seeds: Sequence[int], path: str | Path) -> None:
    """Write a table of :func:`survey_numbers` (``DIGITS`` significant digits) as JSON."""
    body = {"seeds": list(seeds), "numbers": {k: [float(f"{v:.{DIGITS}g}") for v in vals] for k, vals in numbers.items()}}
    Path(path).write_text(json.dumps(body, indent=0, sort_keys=True) + "\n")


def load_survey(path: str | Path | None = None) -> SurveyTable:
    """The table at ``path``; by default the one stored with attnlib (seeds :data:`SURVEY_SEEDS`)."""
    path = Path(__file__).with_name(SHIPPED) if path is None else Path(path)
    body = json.loads(path.read_text())
    return SurveyTable(tuple(body["seeds"]), body["numbers"])


def compare_with_survey(numbers: dict[str, list[float]], seeds: Sequence[int], table: SurveyTable,
                        rel: float = 1e-6) -> int:
    """Check that ``numbers`` (from :func:`survey_numbers` for ``seeds``) are the table's, key by
    key and seed by seed, within ``rel`` (relative, or 1e-9 absolute near 0). Shares of a fixed
    test set are multiples of 1/1000 (or 1/100000), so one book answered otherwise misses by far
    more; the rest (weights, errors, norms) move only by rounding, which training carried to
    about 1e-11 between the CPU's fastest kernels and PyTorch's portable ones. Raises
    ``AssertionError`` naming the first difference (or a measurement the table lacks); returns
    how many numbers agreed."""
    unknown = sorted(set(numbers) - set(table.numbers))
    if unknown:
        raise AssertionError(f"measurements not in the table: {unknown}")
    for key, values in numbers.items():
        for seed, v, w in zip(seeds, values, table.of(key, seeds).tolist()):
            if not math.isclose(v, w, rel_tol=rel, abs_tol=1e-9):
                raise AssertionError(f"{key!r}, seed {seed}: {v!r} here, {w!r} in the table")
    return len(numbers) * len(seeds)


def compare_with_runs(trained: SurveyGroup, stored: SurveyGroup, rel: float = 1e-6,
                      seeds: Sequence[int] | None = None) -> int:
    """Check that every run of ``trained`` (of the ``seeds`` listed, or all) has the weights and
    the losses of the run of ``stored`` with its label and seed (e.g. a seed retrained here against the shipped
    :func:`load_survey_runs`), entry by entry within ``rel`` (relative, or 1e-9 absolute near
    0: the tolerance of :func:`compare_with_survey`, since training carries the rounding of one
    set of kernels to about 1e-11). Raises ``AssertionError`` naming the first difference, as a
    share of the stored value (or a run that ``stored`` lacks); returns how many numbers agreed."""
    where = {(label, seed): r for r, (label, seed) in enumerate(zip(stored.labels, stored.seeds))}
    mine, theirs = trained.runs.state_dict(), stored.runs.state_dict()
    if trained.losses.shape[0] != stored.losses.shape[0] or mine.keys() != theirs.keys():
        raise AssertionError(f"not the same training: {trained.losses.shape[0]} and {stored.losses.shape[0]} steps")
    count = 0
    for r, (label, seed) in enumerate(zip(trained.labels, trained.seeds)):
        if seeds is not None and seed not in seeds:
            continue
        if (label, seed) not in where:
            raise AssertionError(f"run {label!r}, seed {seed} is not among the stored runs")
        k = where[label, seed]
        pairs = [(key, mine[key][r], theirs[key][k]) for key in mine] + [("losses", trained.losses[:, r], stored.losses[:, k])]
        for key, a, b in pairs:
            if a.shape != b.shape:
                raise AssertionError(f"{key} of run {label!r}, seed {seed}: shapes {tuple(a.shape)} and {tuple(b.shape)}")
            a, b = a.to(F64).flatten(), b.to(F64).flatten()
            close = torch.isclose(a, b, rtol=rel, atol=1e-9)
            if not close.all():
                i = int((~close).nonzero()[0])
                off = abs(a[i] - b[i]).item() / max(abs(b[i].item()), 1e-300)
                raise AssertionError(f"{key} of run {label!r}, seed {seed}, entry {i}: {off:.1e} of the "
                                     f"stored value apart (allowed: {rel:.0e})")
            count += a.numel()
    if not count:
        raise AssertionError(f"no run of seeds {seeds} to compare")
    return count
