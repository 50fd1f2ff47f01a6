"""Train chapter 11's runs and store what the chapter reads:

- attnlib/induction/runs.safetensors: the weights of seeds 0-11 (the runs the chapter reads in
  detail, and its figures);
- attnlib/induction/survey.json: the per-seed numbers (attnlib.induction.survey.seed_numbers) of
  seeds 0-47, of twelve runs that start from seed 0's weights and train on the data streams
  1000-1011 ("same start"), and of twelve that start from the weights of seeds 1000-1011 and
  train on seed 0's data stream ("same data").

    PYTHONPATH=. python scripts/train_induction.py            # train, measure, write both files
    PYTHONPATH=. python scripts/train_induction.py --compare  # train, measure, compare with them
    PYTHONPATH=. python scripts/train_induction.py --order-base 300  # the data-order runs for another
        # base seed (its start on data streams 2000-2011, its data from starts 2000-2011): print
        # the first step each run finds; writes nothing (about 75 s of CPU)

One thread, float32 (the model's dtype), seeded: on one machine the same files every time. Another
CPU's rounding (try --compare under PyTorch's portable kernels, ATEN_CPU_CAPABILITY=default
MKL_ENABLE_INSTRUCTIONS=SSE4_2 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1) moves the trained weights
visibly: --compare reports, run by run, whether the first step found is the same and how far the
numbers moved. About 4 minutes of CPU on the book's 2-core machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from attnlib.induction import (CHAPTER_SETTINGS, InductionRuns, RepeatBatch, RepeatTask, load_runs, save_runs,
                               train_induction)
from attnlib.induction.survey import (DATA_ORDER, SURVEY_SEEDS, TEST_SEED, layer0_kinds, load_induction_survey,
                                      save_induction_survey, seed_numbers)


def trained(task: RepeatTask, seeds: list[int], data_seeds: list[int] | None = None) -> InductionRuns:
    s = CHAPTER_SETTINGS
    runs = InductionRuns(task, s["d_model"], s["num_heads"], seeds)
    train_induction(runs, steps=s["steps"], batch_size=s["batch_size"], lr=s["lr"], data_seeds=data_seeds)
    return runs


def order_for(task: RepeatTask, test: RepeatBatch, base: int, others: list[int]) -> None:
    """Print the first step of ``base`` itself, of its start on each data stream of ``others`` and
    of its data stream from each start of ``others``, as chapter 11's data-order section does for
    seed 0."""
    runs = {"itself": ([base], trained(task, [base])),
            "its start, data stream": (others, trained(task, [base] * len(others), others)),
            "its data, start": (others, trained(task, others, [base] * len(others)))}
    for part, (seeds, r) in runs.items():
        found = layer0_kinds(seed_numbers(r, test))
        print(f"seed {base}, {part}: " + ", ".join(
            f"{x} {k.kind}" + (f" head {k.needed}" if k.needed is not None else "") for x, k in zip(seeds, found)))


def main() -> None:
    torch.set_num_threads(1)
    s = CHAPTER_SETTINGS
    task = RepeatTask(s["n_vocab"], s["seq_len"], s["min_period"], s["max_period"])
    test = task.sample(256, torch.Generator().manual_seed(TEST_SEED))
    if "--order-base" in sys.argv[1:]:
        order_for(task, test, int(sys.argv[sys.argv.index("--order-base") + 1]), list(range(2000, 2012)))
        return
    start = time.process_time()
    shipped = trained(task, list(s["seeds"]))  # seeds 0-11: their weights ship
    rest = trained(task, [x for x in SURVEY_SEEDS if x not in s["seeds"]])
    same_start = trained(task, [0] * len(DATA_ORDER), list(DATA_ORDER))
    same_data = trained(task, list(DATA_ORDER), [0] * len(DATA_ORDER))
    took = time.process_time() - start
    first, second = seed_numbers(shipped, test), seed_numbers(rest, test)
    tables = {"seeds": (list(SURVEY_SEEDS), {k: first[k] + second[k] for k in first}),
              "same start": (list(DATA_ORDER), seed_numbers(same_start, test)),
              "same data": (list(DATA_ORDER), seed_numbers(same_data, test))}
    here = Path(__file__).resolve().parents[1] / "attnlib" / "induction"
    if "--compare" not in sys.argv[1:]:
        save_runs(shipped, here / "runs.safetensors")
        save_induction_survey(tables, here / "survey.json")
        print(f"trained {sum(len(v[0]) for v in tables.values())} runs in {took:.0f} s of CPU; "
              f"wrote runs.safetensors (seeds {shipped.seeds[0]}-{shipped.seeds[-1]}) and survey.json")
        return
    stored = load_induction_survey(here / "survey.json")
    weights = load_runs(here / "runs.safetensors")
    moved = max((shipped.state_dict()[k] - weights.state_dict()[k]).abs().max().item() for k in weights.state_dict())
    print(f"trained in {took:.0f} s of CPU; seeds 0-11: largest change of a weight {moved:.2g}")
    for part, (seeds, numbers) in tables.items():
        old, new = layer0_kinds(stored[part]), layer0_kinds(numbers)
        changed = [(x, o.kind, o.needed, n.kind, n.needed) for x, o, n in zip(seeds, old, new) if o[:2] != n[:2]]
        drift = {k: max(abs(a - b) for a, b in zip(v, stored[part].numbers[k])) for k, v in numbers.items()}
        worst = sorted(drift.items(), key=lambda kv: -kv[1])[:4]
        print(f"{part}: {len(seeds) - len(changed)} of {len(seeds)} runs find the stored first step; changed: "
              f"{changed}; largest moves: " + ", ".join(f"{k} {v:.3f}" for k, v in worst))


if __name__ == "__main__":
    main()
