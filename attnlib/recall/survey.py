r"""Chapter 7's heads over many seeds: every run the chapter trains, and every per-seed number
it reports (chapter 7).

A claim about training holds for a rate of seeds, not for the few a page can afford to train.
:func:`train_survey` trains, for a list of seeds, every head of chapter 7 (the widths, the
never-searching control, the tied heads, the other tasks and the parity heads) as six batched
computations; :func:`survey_numbers` measures each of them on fixed test books and returns one
value per seed for each measurement. ``scripts/train_recall_survey.py`` does this for the seeds
:data:`SURVEY_SEEDS` and stores the result with the package (``survey.json``, read by
:func:`load_survey`), with the trained heads of the seeds :data:`RUN_SEEDS` (``runs.safetensors``,
read by :func:`load_survey_runs`). The chapter reads those heads and checks, with
:func:`compare_with_survey`, that their numbers are the stored ones; it retrains a sample of them
and checks, with :func:`compare_with_runs`, that training gives the stored heads.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Required, TypedDict

import torch
from torch import Tensor

from attnlib.recall.head import Loss, block_fractions
from attnlib.recall.runs import RecallRuns, Target, train_recall_runs
from attnlib.recall.table import (DIGITS, SHIPPED, SurveyGroup, SurveyTable, compare_with_runs, compare_with_survey, load_survey,
                                  save_survey)
from attnlib.recall.task import Pairing, PhoneBookTask, RecallBatch

__all__ = ["SURVEY_SEEDS", "CONFIGS", "HeadConfig", "TEST_SEED", "SurveyGroup", "RecallSurvey", "SurveyTable",
           "train_group", "train_survey", "survey_numbers", "load_survey", "save_survey",
           "compare_with_survey", "RUN_SEEDS", "survey_groups", "save_survey_runs", "load_survey_runs",
           "compare_with_runs"]

SURVEY_SEEDS = tuple(range(40))  # the seeds of the stored table
TEST_SEED = 1000  # the test books' generator: no training seed
F64 = torch.float64
TASK = PhoneBookTask(n_names=12, n_numbers=4, n_pairs=4)



class HeadConfig(TypedDict, total=False):
    """What differs from the squared-error head of width ``d_k`` with centred targets and
    weight decay 0.05 (the arguments of :class:`RecallRuns` and :func:`train_recall_runs`)."""

    d_k: Required[int]
    search: bool
    tie_vk: bool
    weight_decay: float
    loss: Loss
    target: Target


# label -> what differs from the squared-error head of width d_k (centred targets, weight decay 0.05)
CONFIGS: dict[str, HeadConfig] = {
    **{str(d): {"d_k": d} for d in (1, 2, 4, 8, 16)},
    "never searches": {"d_k": 16, "search": False},
    "tied 4": {"d_k": 4, "tie_vk": True}, "tied 8": {"d_k": 8, "tie_vk": True},
    "tied 4, cross-entropy": {"d_k": 4, "tie_vk": True, "loss": "cross_entropy"},
    "one-hot 16": {"d_k": 16, "target": "one_hot"},
    "no decay 2": {"d_k": 2, "weight_decay": 0.0},
    "no decay 16": {"d_k": 16, "weight_decay": 0.0},
    "cross-entropy 2": {"d_k": 2, "loss": "cross_entropy"},
    "cross-entropy 16": {"d_k": 16, "loss": "cross_entropy"},
}
# the other tasks, 150 steps: (names, numbers) -> widths
MORE = {(26, 4): (3, 2), (13, 8): (3, 7), (12, 4): (2,)}
BLOCK_ROWS = ("W^QK name -> name", "W^QK name -> number", "W^QK number rows", "W^OV number rows",
              "W^OV W^R number rows", "  shared row taken out")


def _build_group(task: PhoneBookTask, configs: dict[str, HeadConfig], seeds: Sequence[int],
                 extra: Sequence[tuple[str, int]] = ()) -> tuple[RecallRuns, list[str], list[int], list[HeadConfig]]:
    """The untrained runs of :func:`train_group`: every ``configs`` head for every seed
    (label-major), then the ``extra`` (label, seed) runs; their labels, seeds and configurations."""
    unknown = [label for label, _ in extra if label not in configs]
    if unknown:
        raise KeyError(f"extra runs with labels {unknown} not in configs; labels: {sorted(configs)}")
    plan = [(label, s) for label in configs for s in seeds] + list(extra)
    cfg = [configs[label] for label, _ in plan]
    runs = RecallRuns(task.d_model, task.n_numbers, [c["d_k"] for c in cfg], [s for _, s in plan],
                      [c.get("search", True) for c in cfg], [c.get("tie_vk", False) for c in cfg], dtype=F64)
    return runs, [label for label, _ in plan], [s for _, s in plan], cfg


def train_group(task: PhoneBookTask, configs: dict[str, HeadConfig], seeds: Sequence[int],
                steps: int = 300, batch_size: int = 128, pairing: Pairing = "all",
                extra: Sequence[tuple[str, int]] = ()) -> SurveyGroup:
    """Every ``configs`` head (keys ``d_k`` and optionally ``search``, ``tie_vk``, ``weight_decay``,
    ``loss``, ``target``) for every seed, and the ``extra`` runs ``(label, seed)`` after them,
    trained as one :class:`RecallRuns` in float64 (each run as it would train alone)."""
    runs, labels, run_seeds, cfg = _build_group(task, configs, seeds, extra)
    losses = train_recall_runs(
        runs, task, steps=steps, batch_size=batch_size, pairing=pairing,
        weight_decay=[c.get("weight_decay", 0.05) for c in cfg],
        loss=[c.get("loss", "squared") for c in cfg],
        target=[c.get("target", "centred") for c in cfg])
    return SurveyGroup(task, runs, labels, run_seeds, losses)


@dataclass
class RecallSurvey:
    """Every head of chapter 7 for ``seeds``: ``main`` (:data:`CONFIGS` on 12 names, 4 numbers,
    4 entries, 300 steps), ``untrained`` (the width-16 heads at their start), ``wide`` (14 names,
    ``d_k = 3``, centred and one-hot targets), ``more`` (the tasks of :data:`MORE`, 150 steps,
    label ``"N M d_k"``) and ``parity`` (widths 16, 8, 4 trained on even pairs)."""

    seeds: list[int]
    main: SurveyGroup
    untrained: RecallRuns
    wide: SurveyGroup | None
    more: dict[tuple[int, int], SurveyGroup]
    parity: SurveyGroup | None


def _survey_plan() -> dict[str, tuple[PhoneBookTask, dict[str, HeadConfig], int, Pairing]]:
    """The batched trainings of :func:`train_survey`: name -> (task, heads, steps, pairing)."""
    plan: dict[str, tuple[PhoneBookTask, dict[str, HeadConfig], int, Pairing]] = {
        "main": (TASK, CONFIGS, 300, "all"),
        "wide": (PhoneBookTask(n_names=14, n_numbers=4, n_pairs=4),
                 {"centred": {"d_k": 3}, "one-hot": {"d_k": 3, "target": "one_hot"}}, 300, "all")}
    for (n, m), widths in MORE.items():
        plan[f"more {n} {m}"] = (PhoneBookTask(n_names=n, n_numbers=m, n_pairs=4),
                                 {f"{n} {m} {d}": {"d_k": d} for d in widths}, 150, "all")
    plan["parity"] = (TASK, {f"parity {d}": {"d_k": d} for d in (16, 8, 4)}, 300, "even")
    return plan


def _untrained(seeds: Sequence[int]) -> RecallRuns:
    return RecallRuns(TASK.d_model, TASK.n_numbers, [16] * len(seeds), list(seeds), dtype=F64)


def _check_seeds(seeds: Sequence[int]) -> list[int]:
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds) or TEST_SEED in seeds:
        raise ValueError(f"seeds must be distinct, non-empty and exclude the test seed {TEST_SEED}, got {seeds}")
    return seeds


def _assemble(seeds: list[int], groups: dict[str, SurveyGroup]) -> RecallSurvey:
    more = {(g.task.n_names, g.task.n_numbers): g for name, g in groups.items() if name.startswith("more ")}
    return RecallSurvey(seeds, groups["main"], _untrained(seeds), groups.get("wide"), more, groups.get("parity"))


def survey_groups(s: RecallSurvey) -> dict[str, SurveyGroup]:
    """The trained groups of ``s`` by name: ``"main"``, ``"wide"``, ``"more 26 4"``,
    ``"more 13 8"``, ``"more 12 4"``, ``"parity"`` (only ``"main"`` for a ``main_only`` survey)."""
    out = {"main": s.main}
    if s.wide is not None:
        out["wide"] = s.wide
    out.update({f"more {n} {m}": g for (n, m), g in s.more.items()})
    if s.parity is not None:
        out["parity"] = s.parity
    return out


def train_survey(seeds: Sequence[int], main_only: bool = False) -> RecallSurvey:
    """Train every head of chapter 7 for each seed (deterministic on one thread); with
    ``main_only``, only ``main`` (and ``untrained``): the other groups are left empty."""
    seeds = _check_seeds(seeds)
    groups = {name: train_group(task, configs, seeds, steps=steps, pairing=pairing)
              for name, (task, configs, steps, pairing) in _survey_plan().items() if name == "main" or not main_only}
    return _assemble(seeds, groups)


def _test(task: PhoneBookTask, pairing: Pairing = "all", seed: int = TEST_SEED, n: int = 1000) -> RecallBatch:
    return task.sample(n, torch.Generator().manual_seed(seed), pairing=pairing, dtype=F64)


def _book_code(names: Tensor, numbers: Tensor, slot: Tensor, n_names: int, n_numbers: int) -> Tensor:
    """One integer per (book, question): ``(B,)``."""
    digits = torch.cat([names, numbers, slot[:, None]], 1)  # (B, 2P + 1)
    bases = [n_names] * names.shape[1] + [n_numbers] * (numbers.shape[1] + 1)
    code = torch.zeros(len(slot), dtype=torch.long)
    for col, base in zip(digits.T, bases):
        code = code * base + col
    return code


def _shares(qk: Tensor, ov: Tensor, readout: Tensor, task: PhoneBookTask) -> list[float]:
    """The six block shares of :data:`BLOCK_ROWS` for one head."""
    blocks, everything = [task.key_block, task.value_block], [slice(None)]
    ovr = ov @ readout  # (d_model, M)
    centred = ovr.clone()
    centred[task.key_block] -= centred[task.key_block].mean(0)  # the row shared by all names, out
    f_qk = block_fractions(qk, blocks, blocks)  # (2, 2)
    return [f_qk[0, 0].item(), f_qk[0, 1].item(), f_qk[1].sum().item(),
            block_fractions(ov, blocks, everything)[1, 0].item(),
            block_fractions(ovr, blocks, everything)[1, 0].item(),
            block_fractions(centred, blocks, everything)[1, 0].item()]


def _reads(runs: RecallRuns, batch: RecallBatch) -> dict[str, Tensor]:
    """Per run: accuracy, mean and lowest weight on the asked entry, share of books whose largest
    weight is on it, squared error against centred targets, the least returned number's share."""
    with torch.no_grad():
        y, a = runs.run_batch(batch)  # (R, B, M), (R, B, P)
    rows = torch.arange(len(batch.slot))
    on = a[:, rows, batch.slot]  # (R, B)
    m = runs.readout.shape[2]
    goal = torch.nn.functional.one_hot(batch.target, m).to(y.dtype) - 1 / m  # (B, M)
    pred = y.argmax(-1)  # (R, B)
    per_number = torch.stack([(pred[:, batch.target == k] == k).double().mean(-1) for k in range(m)], -1)
    return {"accuracy": (pred == batch.target).double().mean(-1), "weight on match": on.mean(-1),
            "lowest weight on match": on.amin(-1), "match read most": (a.argmax(-1) == batch.slot).double().mean(-1),
            "squared error": (y - goal).square().sum(-1).mean(-1), "least returned share": per_number.amin(-1)}


def survey_numbers(s: RecallSurvey) -> dict[str, list[float]]:
    """Every number chapter 7 reports about training, one value per seed of ``s.seeds``, keyed
    ``"measurement | head"``. Test books: 1,000 from ``TEST_SEED`` (the rank-one search's share
    is exact, over every book and question, since the chapter compares it with an
    exact ceiling); see chapter 7 for each."""
    out: dict[str, list[float]] = {}

    def put(key: str, values: Tensor | Sequence[float | Tensor]) -> None:
        out[key] = [float(v) for v in values]

    main, test = s.main, _test(TASK)
    reads = _reads(main.runs, test)
    for label in CONFIGS:
        for name, v in reads.items():
            put(f"{name} | {label}", v[main.members(label)])
    put("accuracy | untrained 16", s.untrained.accuracy(test))
    sixteen = main.members("16")
    put("loss at step 1 | 16", main.losses[0, sixteen])
    put("loss at step 300 | 16", main.losses[-1, sixteen])
    # test books that also occurred in training, and the right number in every other one
    code = _book_code(test.names, test.numbers, test.slot, TASK.n_names, TASK.n_numbers)
    with torch.no_grad():
        y16 = main.runs.run_batch(test)[0][sixteen].argmax(-1)  # (S, B)
    seen_counts, unseen_right = [], []
    for k, seed in enumerate(s.seeds):
        gen = torch.Generator().manual_seed(seed)
        draws = [TASK.draw(128, gen) for _ in range(300)]  # its training stream, regenerated
        names_t, numbers_t, slot_t = (torch.cat(part) for part in zip(*draws))
        seen = _book_code(names_t, numbers_t, slot_t, TASK.n_names, TASK.n_numbers)
        unseen = ~torch.isin(code, seen)
        seen_counts.append(float((~unseen).sum()))
        unseen_right.append(float(bool((y16[k][unseen] == test.target[unseen]).all())))
    put("test books seen in training | 16", seen_counts)
    put("unseen books all right | 16", unseen_right)
    # block shares of the circuits
    qk, ov = main.runs.circuits()  # (R, d, d) each
    readout = main.runs.readout.detach()
    qk0, ov0 = s.untrained.circuits()
    for label in ("untrained 16", "never searches", "16", "no decay 16", "one-hot 16"):
        if label == "untrained 16":
            per = [_shares(qk0[k], ov0[k], s.untrained.readout.detach()[k], TASK) for k in range(len(s.seeds))]
        else:
            per = [_shares(qk[r], ov[r], readout[r], TASK) for r in main.members(label)]
        for i, row in enumerate(BLOCK_ROWS):
            put(f"{row.strip()} | {label}", [p[i] for p in per])
    ovr = ov @ readout  # (R, d, M)
    names, numbers = TASK.key_block, TASK.value_block
    put("names whose W^QK row peaks at themselves | 16",
        [(qk[r, names, names].argmax(1) == torch.arange(TASK.n_names)).sum() for r in sixteen])
    put("numbers whose W^OV W^R row peaks at themselves | 16",
        [(ovr[r, numbers].argmax(1) == torch.arange(TASK.n_numbers)).sum() for r in sixteen])
    # finding: the name block's order, gaps and size, per width
    eye = torch.eye(TASK.n_names, dtype=torch.bool)
    for d in (1, 2, 4, 8, 16):
        own, distinct, gap, norm = [], [], [], []
        for r in main.members(str(d)):
            block = qk[r, names, names] / math.sqrt(d)  # (N, N): the scaled scores
            winners = block.argmax(1)
            own.append((winners == torch.arange(TASK.n_names)).sum())
            distinct.append(len(set(winners.tolist())))
            gap.append((block.diag() - block.masked_fill(eye, -math.inf).amax(1)).min())
            norm.append((qk[r] / math.sqrt(d)).norm())
        put(f"names found | {d}", own)
        put(f"distinct winners | {d}", distinct)
        put(f"smallest scaled gap | {d}", gap)
        put(f"norm of W^QK / sqrt(d_k) | {d}", norm)
    # the rank-one search, exactly: every asked name, every 3 other names, every 4 numbers
    others = torch.tensor(list(itertools.combinations(range(TASK.n_names - 1), TASK.n_pairs - 1)))  # (165, 3)
    every = torch.tensor(list(itertools.product(range(TASK.n_numbers), repeat=TASK.n_pairs)))  # (256, P)
    found = []
    for r in main.members("1"):
        hits = 0
        for a in range(TASK.n_names):
            rest = torch.tensor([n for n in range(TASK.n_names) if n != a])
            book = torch.cat([torch.full((len(others), 1), a), rest[others]], 1)  # (165, P): entry 0 asked
            scores = qk[r, a, book][:, None] + qk[r, a, TASK.n_names + every][None]  # (165, 256, P)
            hits += int((scores.argmax(-1) == 0).sum())
        found.append(hits / (TASK.n_names * len(others) * len(every)))
    put("match read most, every book | 1", found)
    # new numbers for the same names
    gen = torch.Generator().manual_seed(2)
    shift = torch.randint(1, TASK.n_numbers, test.numbers.shape, generator=gen)  # 1, 2 or 3
    swapped = TASK.batch(test.names, (test.numbers + shift) % TASK.n_numbers, test.slot, dtype=F64)
    with torch.no_grad():
        y_new, a_new = main.runs.run_batch(swapped)
        _, a_old = main.runs.run_batch(test)
    put("returns the new number | 16", (y_new[sixteen].argmax(-1) == swapped.target).double().mean(-1))
    put("returns the old number | 16", (y_new[sixteen].argmax(-1) == test.target).double().mean(-1))
    put("largest change of an attention weight | 16", (a_new[sixteen] - a_old[sixteen]).abs().amax((1, 2)))
    if s.wide is None or s.parity is None:  # main_only
        return out
    # 14 names, width 3
    t14 = s.wide.task
    b14 = _test(t14)
    with torch.no_grad():
        y14 = s.wide.runs.run_batch(b14)[0]  # (R, B, M)
    hot = torch.nn.functional.one_hot(b14.target, 4).to(F64)
    for label, goal in (("centred", hot - 0.25), ("one-hot", hot)):
        w = s.wide.members(label)
        put(f"accuracy | 14 names, d_k 3, {label}", (y14[w].argmax(-1) == b14.target).double().mean(-1))
        put(f"squared error | 14 names, d_k 3, {label}", (y14[w] - goal).square().sum(-1).mean(-1))
    # the other tasks, 150 steps
    for group in s.more.values():
        g_reads = _reads(group.runs, _test(group.task))
        for label in dict.fromkeys(group.labels):
            for name in ("accuracy", "match read most", "weight on match"):
                put(f"{name} | {label}, 150 steps", g_reads[name][group.members(label)])
    # trained on even pairs, tested on odd ones
    par = s.parity
    odd = _test(TASK, "odd", seed=3)
    p_reads = _reads(par.runs, odd)
    for d in (16, 8, 4):
        members = par.members(f"parity {d}")
        for name in ("accuracy", "match read most", "weight on match", "lowest weight on match"):
            put(f"{name} on odd pairs | parity {d}", p_reads[name][members])
    qk_p, ov_p = par.runs.circuits()
    ovr_p = ov_p @ par.runs.readout.detach()  # (R, d, M)
    same = (torch.arange(TASK.n_names)[:, None] + torch.arange(TASK.n_numbers)) % 2 == 0  # (N, M)
    with torch.no_grad():
        _, a_odd = par.runs.run_batch(odd)
    rows: dict[str, list[float | Tensor]] = {k: [] for k in ("name share", "name signs", "from names", "from numbers", "qk share", "qk signs")}
    for r in par.members("parity 16"):
        name_part = ovr_p[r, names]  # (N, M)
        read = (a_odd[r].unsqueeze(1) @ odd.context)[:, 0]  # (B, d_model)
        rows["name share"].append(block_fractions(ovr_p[r], [names, numbers], [slice(None)])[0, 0])
        rows["name signs"].append(float((name_part[same] > 0).all() and (name_part[~same] < 0).all()))
        rows["from names"].append(((read[:, names] @ name_part).argmax(-1) == odd.target).double().mean())
        rows["from numbers"].append(((read[:, numbers] @ ovr_p[r, numbers]).argmax(-1) == odd.target).double().mean())
        cross = qk_p[r, names, numbers]  # (N, M)
        rows["qk share"].append(block_fractions(qk_p[r], [names, numbers], [names, numbers])[0, 1])
        rows["qk signs"].append(float((cross[same] > 0).all() and (cross[~same] < 0).all()))
    put("W^OV W^R name rows | parity 16", rows["name share"])
    put("name rows follow the parity | parity 16", rows["name signs"])
    put("right from the name rows alone | parity 16", rows["from names"])
    put("right from the number rows alone | parity 16", rows["from numbers"])
    put("W^QK name -> number | parity 16", rows["qk share"])
    put("W^QK name -> number follows the parity | parity 16", rows["qk signs"])
    return out


# ---- the trained weights of a few seeds, shipped with the package --------------------------------
RUN_SEEDS = (0, 1, 2, 3, 4)  # the seeds whose trained heads ship (runs.safetensors)
SHIPPED_RUNS = "runs.safetensors"
_META = "attnlib.recall"


def save_survey_runs(s: RecallSurvey, path: str | Path, seeds: Sequence[int] = RUN_SEEDS) -> None:
    """Write the trained weights and losses of ``s``'s runs for ``seeds`` (a subset of
    ``s.seeds``, in their order there) to a safetensors file, every group of ``s``, with each
    group's labels and seeds as metadata (what :func:`load_survey_runs` reads)."""
    from safetensors.torch import save_file

    keep = [x for x in s.seeds if x in set(seeds)]
    if sorted(keep) != sorted(seeds):
        raise ValueError(f"seeds {sorted(set(seeds) - set(s.seeds))} are not in the survey (seeds {s.seeds})")
    tensors: dict[str, Tensor] = {}
    meta: dict[str, object] = {"seeds": keep, "groups": {}}
    for name, g in survey_groups(s).items():
        pick = [r for r, x in enumerate(g.seeds) if x in keep]
        for key, value in g.runs.state_dict().items():
            tensors[f"{name}.{key}"] = value[pick].contiguous()
        tensors[f"{name}.losses"] = g.losses[:, pick].contiguous()
        meta["groups"][name] = {"labels": [g.labels[r] for r in pick], "seeds": [g.seeds[r] for r in pick]}  # type: ignore[index]
    save_file(tensors, str(path), metadata={_META: json.dumps(meta)})


def load_survey_runs(path: str | Path | None = None) -> RecallSurvey:
    """The trained runs stored by :func:`save_survey_runs`, as a :class:`RecallSurvey`; by
    default the heads of seeds :data:`RUN_SEEDS` that ``scripts/train_recall_survey.py``
    trained (the same training as the stored table), shipped with attnlib. Each group is
    rebuilt from :func:`train_survey`'s plan, and its labels and seeds must be the stored ones."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(__file__).with_name(SHIPPED_RUNS) if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no saved runs at {path}")
    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {}).get(_META, "null"))
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds no {_META} metadata: not written by save_survey_runs")
    state = load_file(str(path))
    seeds, plan, groups = list(meta["seeds"]), _survey_plan(), {}
    for name, stored in meta["groups"].items():
        if name not in plan:
            raise ValueError(f"{path}: unknown group {name!r}; train_survey's groups: {sorted(plan)}")
        task, configs, _, _ = plan[name]
        runs, labels, run_seeds, _ = _build_group(task, configs, seeds)
        if (labels, run_seeds) != (stored["labels"], stored["seeds"]):
            raise ValueError(f"{path}: group {name!r} holds other runs than train_survey's plan for seeds {seeds}")
        runs.load_state_dict({key: state[f"{name}.{key}"] for key in runs.state_dict()})
        groups[name] = SurveyGroup(task, runs, labels, run_seeds, state[f"{name}.losses"])
    if "main" not in groups:
        raise ValueError(f"{path} holds no 'main' group")
    return _assemble(seeds, groups)
