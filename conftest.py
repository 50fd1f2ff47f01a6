"""Settings for every test process, unit tests and notebook kernels alike.

Under pytest-xdist each worker is a process of its own, and torch (through OpenMP)
would start as many threads as the machine has cores in every one of them: with two
workers on two cores that is four busy threads on two cores. Each worker gets its share
of the cores instead, and the notebook kernels it starts inherit the same limit through
``OMP_NUM_THREADS`` (set before any kernel starts). Outputs do not depend on it: the
chapters print no number that a thread count can change (CI checks them with one thread
and with the native setting).

Hypothesis runs under one of four profiles: ``ci`` (the default, and what CI and
``make test`` use; derandomized, so every run draws the same examples) gives every
property test the example count its file names
(``strategies.examples``); ``dev`` gives each a tenth of it (at least one), for a quick
run while editing: ``pytest --hypothesis-profile=dev`` or ``HYPOTHESIS_PROFILE=dev``;
``thorough`` gives the bound-hunting properties (``strategies.hunt``, in
``tests/test_bounds_search.py`` and ``tests/test_blockwise_bounds.py``) at least 2,000
examples each, where ``ci`` gives them a few: ``pytest tests/test_bounds_search.py
tests/test_blockwise_bounds.py --hypothesis-profile=thorough``, which ``.ci/run`` runs
after ``make test``. With ``CI`` set (GitHub Actions, .ci/run) the
environment variable is ignored and only an explicit ``--hypothesis-profile`` chooses
another profile. A fourth, ``mutants``, is for ``make mutants`` only (scripts/mutants.py
passes it).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import Phase, settings

# max_examples is the base the per-test counts are scaled from (strategies.examples):
# 100 under ci, hypothesis's own default, so a test that names no count keeps it.
# ci is derandomized: every run of `make test` draws the same examples, so a clean clone
# passes or fails the same way each time. Searching for new breaks is the thorough
# profile's job (random examples, many more of them, in .ci/run after make test).
settings.register_profile(
    "ci", max_examples=100, print_blob=True, derandomize=True, database=None,
)
settings.register_profile("dev", max_examples=10)
# thorough: 20 x ci's base for every property, and at least 2,000 for each bound hunt
settings.register_profile("thorough", max_examples=2000, print_blob=True)
# `make mutants` (scripts/mutants.py): a tenth of the examples, the same ones every run
# (derandomize, no database), and no shrinking, which only makes a failing mutant slower
# to report. A mutant is run against many tests; this keeps each run cheap and each
# verdict reproducible.
settings.register_profile(
    "mutants", max_examples=10, derandomize=True, database=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
_ON_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")
settings.load_profile("ci" if _ON_CI else os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _threads_per_worker() -> int | None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return None  # not under xdist: leave torch's default
    return max(1, (os.cpu_count() or 1) // int(workers))


def pytest_configure(config: pytest.Config) -> None:
    threads = _threads_per_worker()
    if threads is None:
        return
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))  # an explicit setting wins
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# ---- scheduling under pytest-xdist (--dist loadfile, pyproject.toml) ----------------------
# One file per worker at a time: a notebook's cells run in order on one worker (they share
# its kernel; grouping them with xdist_group markers under --dist loadgroup split a
# notebook's setup cell from the rest), a test file's module fixtures are made once. The groups start
# longest first, so that no slow notebook is left to start last while the other workers
# idle; the rest keep their collection order. The slowest files today, longest first:
SLOWEST_FIRST = (
    "tests/test_book_browser.py",  # about 35 s on one worker: first, beside the notebooks
    "chapters/06_real_model.ipynb",
    "chapters/07_phone_book_learned.ipynb",
    "chapters/11_two_heads_together.ipynb",
    "chapters/03_many_heads.ipynb",
    "chapters/05_fused_vs_separate.ipynb",
    "chapters/09_is_my_attention_right.ipynb",
    "chapters/08_two_matrices_today.ipynb",
)


def _group(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]  # the notebook or the test file, relative to the rootdir


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: files keep their order inside
