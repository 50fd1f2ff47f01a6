"""Train every head of chapter 7 for the seeds 0-39 and store their per-seed numbers in
attnlib/recall/survey.json (what attnlib.recall.load_survey reads).

    PYTHONPATH=. python scripts/train_recall_survey.py            # train, measure, write
    PYTHONPATH=. python scripts/train_recall_survey.py --compare  # train, measure, compare with the file

One thread, float64, seeded. With --compare nothing is written: the numbers are checked against
the stored table (attnlib.recall.compare_with_survey), e.g. under PyTorch's portable kernels
(ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1).
Chapter 7 trains seeds 0-4 itself and makes the same comparison; tests/test_recall.py retrains
one more seed. About 2 minutes of CPU on the book's 2-core machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from attnlib.recall.survey import SURVEY_SEEDS, compare_with_survey, load_survey, save_survey, survey_numbers, train_survey


def main() -> None:
    torch.set_num_threads(1)
    start = time.process_time()
    numbers = survey_numbers(train_survey(SURVEY_SEEDS))
    took = time.process_time() - start
    out = Path(__file__).resolve().parents[1] / "attnlib" / "recall" / "survey.json"
    if "--compare" in sys.argv[1:]:
        n = compare_with_survey(numbers, SURVEY_SEEDS, load_survey(out))
        print(f"{n} numbers of {len(SURVEY_SEEDS)} seeds equal the stored table ({took:.0f} s of CPU)")
    else:
        save_survey(numbers, SURVEY_SEEDS, out)
        print(f"{len(numbers)} measurements of {len(SURVEY_SEEDS)} seeds in {took:.0f} s of CPU; wrote {out.name}")


if __name__ == "__main__":
    main()
