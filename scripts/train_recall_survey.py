"""Train every head of chapter 7 for the seeds 0-39; store their per-seed numbers in
attnlib/recall/survey.json (what attnlib.recall.load_survey reads) and the trained heads of
seeds 0-4 in attnlib/recall/runs.safetensors (what attnlib.recall.load_survey_runs reads).

    PYTHONPATH=. python scripts/train_recall_survey.py            # train, measure, write
    PYTHONPATH=. python scripts/train_recall_survey.py --compare  # train, measure, compare with the files

One thread, float64, seeded. With --compare nothing is written: the numbers are checked against
the stored table (attnlib.recall.compare_with_survey) and the heads of seeds 0-4 against the
stored ones (attnlib.recall.compare_with_runs), e.g. under PyTorch's portable kernels
(ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1).
Chapter 7 reads the stored heads of seeds 0-4, checks them against the table, and retrains the
main task's heads of seed 0 itself; tests/test_recall.py retrains more. About 2 minutes of CPU
on the book's 2-core machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from attnlib.recall.survey import (RUN_SEEDS, SURVEY_SEEDS, compare_with_runs, compare_with_survey, load_survey,
                                   load_survey_runs, save_survey, save_survey_runs, survey_groups, survey_numbers,
                                   train_survey)


def main() -> None:
    torch.set_num_threads(1)
    start = time.process_time()
    survey = train_survey(SURVEY_SEEDS)
    numbers = survey_numbers(survey)
    took = time.process_time() - start
    here = Path(__file__).resolve().parents[1] / "attnlib" / "recall"
    table, runs = here / "survey.json", here / "runs.safetensors"
    if "--compare" in sys.argv[1:]:
        n = compare_with_survey(numbers, SURVEY_SEEDS, load_survey(table))
        trained = survey_groups(survey)  # every stored run must be one trained here
        w = sum(compare_with_runs(g, trained[name]) for name, g in survey_groups(load_survey_runs(runs)).items())
        print(f"{n} numbers of {len(SURVEY_SEEDS)} seeds equal the stored table, {w} weights and losses "
              f"of seeds {RUN_SEEDS[0]}-{RUN_SEEDS[-1]} the stored heads ({took:.0f} s of CPU)")
    else:
        save_survey(numbers, SURVEY_SEEDS, table)
        save_survey_runs(survey, runs, RUN_SEEDS)
        print(f"{len(numbers)} measurements of {len(SURVEY_SEEDS)} seeds in {took:.0f} s of CPU; wrote {table.name}"
              f" and the heads of seeds {RUN_SEEDS[0]}-{RUN_SEEDS[-1]} to {runs.name}")


if __name__ == "__main__":
    main()
