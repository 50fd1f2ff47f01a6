"""Train the twelve runs (seeds 0-11) that chapter 11 reads and store them in attnlib/induction/runs.safetensors.

    PYTHONPATH=. python scripts/train_induction.py

One thread, seeded: the same file on every run of this script on one machine (another CPU
may round differently; the chapter's claims are checked on whatever it loads).
tests/test_induction.py retrains a smaller model (d_model 16, 250 steps, a seed outside
these) and checks the robust properties: accuracy far above chance, a layer-1 induction
head, and chance again without the layer-1 heads. Takes about 15 s on one core.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from attnlib.induction import CHAPTER_SETTINGS, InductionRuns, RepeatTask, save_runs, train_induction


def main() -> None:
    torch.set_num_threads(1)
    s = CHAPTER_SETTINGS
    task = RepeatTask(s["n_vocab"], s["seq_len"], s["min_period"], s["max_period"])
    runs = InductionRuns(task, s["d_model"], s["num_heads"], seeds=s["seeds"])
    start = time.process_time()
    losses = train_induction(runs, steps=s["steps"], batch_size=s["batch_size"], lr=s["lr"])
    took = time.process_time() - start
    out = Path(__file__).resolve().parents[1] / "attnlib" / "induction" / "runs.safetensors"
    save_runs(runs, out)
    print(f"trained {runs.n_runs} runs in {took:.1f} s of CPU; last losses {losses[-1].numpy().round(3)}; wrote {out.name}")


if __name__ == "__main__":
    main()
