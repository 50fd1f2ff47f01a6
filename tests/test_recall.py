"""Tests for attnlib.recall: the phone-book task, the one-head model and its training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

from attnlib import attention
from attnlib.lowrank import ov_circuit, qk_circuit
from attnlib.recall import (
    CONFIGS,
    RUN_SEEDS,
    SURVEY_SEEDS,
    TEST_SEED,
    PhoneBookTask,
    RecallHead,
    RecallRuns,
    SurveyTable,
    binomial_counts,
    binomial_interval,
    block_fractions,
    compare_with_runs,
    compare_with_survey,
    load_survey,
    load_survey_runs,
    rate_text,
    save_survey,
    save_survey_runs,
    survey_groups,
    survey_numbers,
    train_group,
    train_recall,
    train_recall_runs,
    train_survey,
)
from strategies import examples

F64 = torch.float64
FAST = examples(20)
TASK = PhoneBookTask(n_names=6, n_numbers=4, n_pairs=3)
TASK12 = PhoneBookTask(n_names=12, n_numbers=4, n_pairs=4)  # chapter 7's task


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the task -------------------------------------------------------------------
def test_task_blocks_and_embedding() -> None:
    assert TASK.d_model == 10
    assert (TASK.key_block, TASK.value_block) == (slice(0, 6), slice(6, 10))
    names = torch.tensor([[0, 5, 2]])
    numbers = torch.tensor([[3, 0, 1]])
    x = TASK.embed(names, numbers, dtype=F64)  # (1, 3, 10)
    assert x.shape == (1, 3, 10) and x.dtype == F64
    assert torch.equal(x[..., TASK.key_block].argmax(-1), names)
    assert torch.equal(x[..., TASK.value_block].argmax(-1), numbers)
    assert torch.equal(x.sum(-1), torch.full((1, 3), 2.0, dtype=F64))  # one name, one number
    q = TASK.embed(torch.tensor([4]))  # a query: value block zero
    assert q[0, 4] == 1 and q.sum() == 1


def test_batch_asks_for_the_slot() -> None:
    names = torch.tensor([[0, 5, 2], [1, 2, 3]])
    numbers = torch.tensor([[3, 0, 1], [2, 2, 0]])
    b = TASK.batch(names, numbers, torch.tensor([1, 2]))
    assert b.context.shape == (2, 3, 10) and b.query.shape == (2, 1, 10)
    assert b.target.tolist() == [0, 0]
    assert b.query[:, 0, TASK.key_block].argmax(-1).tolist() == [5, 3]
    assert b.query[:, 0, TASK.value_block].abs().sum() == 0


@pytest.mark.parametrize("pairing", ["all", "even", "odd"])
def test_sample(pairing: str) -> None:
    b = TASK.sample(64, _gen(), pairing)  # type: ignore[arg-type]
    assert all(len(set(row.tolist())) == TASK.n_pairs for row in b.names)  # distinct names
    assert torch.equal(b.target, b.numbers[torch.arange(64), b.slot])
    asked = b.context[torch.arange(64), b.slot].clone()  # (64, d_model): the queried pair
    asked[:, TASK.value_block] = 0  # its name alone
    assert torch.equal(b.query[:, 0], asked)
    parity = (b.names + b.numbers) % 2
    if pairing == "even":
        assert (parity == 0).all()
    elif pairing == "odd":
        assert (parity == 1).all()
    else:
        assert 0 < parity.float().mean() < 1
    again = TASK.sample(64, _gen(), pairing)  # type: ignore[arg-type]
    assert torch.equal(again.context, b.context)  # the generator decides everything


def test_task_errors() -> None:
    with pytest.raises(ValueError, match=r"n_pairs \(7\) must be at most n_names \(6\)"):
        PhoneBookTask(6, 4, 7)
    with pytest.raises(ValueError, match="n_names must be a positive int, got 0"):
        PhoneBookTask(0, 4, 1)
    for bad in (True, 2.0):  # one rule across attnlib: a non-int is a TypeError
        with pytest.raises(TypeError, match="n_names must be a positive int, got"):
            PhoneBookTask(bad, 4, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_numbers must be a positive int"):
        PhoneBookTask(6, -1, 1)
    with pytest.raises(TypeError, match="names must be a torch.long tensor of ids, got torch.float32"):
        TASK.embed(torch.zeros(2))
    with pytest.raises(TypeError, match="names must be a torch.long tensor of ids, got list"):
        TASK.embed([0, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"numbers must hold ids in 0 \.\. 3, got values in 0 \.\. 4"):
        TASK.embed(torch.tensor([0, 1]), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"numbers must have the shape of names \(2,\), got \(3,\)"):
        TASK.embed(torch.tensor([0, 1]), torch.tensor([0, 1, 2]))
    names = torch.tensor([[0, 1, 2]])
    with pytest.raises(ValueError, match=r"names must have shape \(B, n_pairs=3\), got \(1, 2\)"):
        TASK.batch(names[:, :2], names[:, :2], torch.tensor([0]))
    with pytest.raises(ValueError, match=r"numbers must have shape \(B, n_pairs\) = \(1, 3\), got \(1, 2\)"):
        TASK.batch(names, names[:, :2], torch.tensor([0]))
    with pytest.raises(ValueError, match=r"slot must have shape \(B,\) = \(1,\), got \(2,\)"):
        TASK.batch(names, names, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="slot must be a torch.long tensor of ids, got list"):
        TASK.batch(names, names, [0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"slot must hold ids in 0 \.\. 2, got values in 3 \.\. 3"):
        TASK.batch(names, names, torch.tensor([3]))
    with pytest.raises(ValueError, match="pairing must be 'all', 'even' or 'odd', got 'none'"):
        TASK.sample(2, _gen(), "none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pairing='even' needs an even n_numbers, got 3"):
        PhoneBookTask(6, 3, 3).sample(2, _gen(), "even")
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        TASK.sample(0, _gen())


# ---- the model --------------------------------------------------------------------
@FAST
@given(st.sampled_from([1, 2, 5, 10]), st.integers(0, 2**31 - 1))
def test_head_is_one_attention_head(d_k: int, seed: int) -> None:
    """The model equals head 0 written out with attnlib.attention and its weights."""
    model = RecallHead(TASK.d_model, TASK.n_numbers, d_k, seed=seed, dtype=F64)
    b = TASK.sample(5, _gen(seed), dtype=F64)
    logits, weights = model(b.context, b.query)  # (5, 4), (5, 3)
    h = model.attn.head(0)
    out, w = attention(b.query @ h.w_q, b.context @ h.w_k, b.context @ h.w_v)  # (5, 1, d_k), (5, 1, 3)
    assert_close(weights, w[:, 0])
    assert_close(logits, (out[:, 0] @ h.w_o) @ model.readout.detach())
    # the same through the circuits: scores x_q W^QK C^T / sqrt(d_k), output alpha C W^OV W^R
    scores = qk_circuit(model.attn, 0).bilinear(b.query, b.context)[:, 0] / math.sqrt(d_k)  # (5, 3)
    assert_close(weights, torch.softmax(scores, -1))
    ov = ov_circuit(model.attn, 0).full()  # (d_model, d_model)
    assert_close(logits, (weights.unsqueeze(1) @ b.context)[:, 0] @ ov @ model.readout.detach())


def test_switched_off_heads_stay_zero_and_training_is_deterministic() -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = RecallHead(TASK.d_model, TASK.n_numbers, d_k=2, seed=3, dtype=F64)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is untouched
    assert a.d_k == 2 and a.attn.num_heads == 5
    losses_a = train_recall(a, TASK, steps=5, batch_size=8)
    for w in (a.attn.w_q_heads, a.attn.w_k_heads, a.attn.w_v_heads, a.attn.w_o_heads):
        assert w[0].abs().sum() > 0 and (w[1:] == 0).all()
    b = RecallHead(TASK.d_model, TASK.n_numbers, d_k=2, seed=3, dtype=F64)
    assert losses_a == train_recall(b, TASK, steps=5, batch_size=8)
    assert torch.equal(a.attn.w_q, b.attn.w_q)
    ce = train_recall(RecallHead(TASK.d_model, TASK.n_numbers, 2, dtype=F64), TASK, steps=2, loss="cross_entropy")
    assert len(ce) == 2 and all(math.isfinite(v) for v in ce)


def test_model_and_training_errors() -> None:
    with pytest.raises(ValueError, match=r"d_k \(3\) must divide d_model \(10\)"):
        RecallHead(10, 4, 3)
    with pytest.raises(ValueError, match="d_k must be a positive int, got 0"):
        RecallHead(10, 4, 0)
    model = RecallHead(10, 5, 2)
    with pytest.raises(ValueError, match=r"model.readout must have shape \(d_model, n_numbers\) = \(10, 4\)"):
        train_recall(model, TASK, steps=1)
    with pytest.raises(ValueError, match="loss must be 'squared' or 'cross_entropy', got 'l1'"):
        train_recall(RecallHead(10, 4, 2), TASK, steps=1, loss="l1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        train_recall(RecallHead(10, 4, 2), TASK, steps=0)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got -1"):
        train_recall(RecallHead(10, 4, 2), TASK, batch_size=-1)
    with pytest.raises(ValueError, match="n_numbers must be a positive int, got 0"):
        RecallHead(10, 0, 2)
    with pytest.raises(ValueError, match=r"query must have shape \(B, n_q, d_model=10\)"):
        RecallHead(10, 4, 2)(torch.zeros(2, 3, 10), torch.zeros(2, 1, 9))


# ---- block fractions --------------------------------------------------------------------
@FAST
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_block_fractions_tile_to_one(m: int, n: int, seed: int) -> None:
    mat = torch.randn(m + 1, n + 1, generator=_gen(seed), dtype=F64)
    rows, cols = [slice(0, m), slice(m, m + 1)], [slice(0, 1), slice(1, n + 1)]
    f = block_fractions(mat, rows, cols)  # (2, 2)
    assert f.shape == (2, 2) and (f >= 0).all()
    assert_close(f.sum(), torch.tensor(1.0, dtype=F64))
    assert_close(f[0, 1], mat[:m, 1:].square().sum() / mat.square().sum())


def test_block_fractions_errors() -> None:
    with pytest.raises(ValueError, match=r"matrix must have shape \(m, n\), got \(3,\)"):
        block_fractions(torch.ones(3), [slice(0, 1)], [slice(0, 1)])
    with pytest.raises(TypeError, match="matrix must be a torch.Tensor, got list"):
        block_fractions([[1.0]], [slice(0, 1)], [slice(0, 1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="matrix is zero"):
        block_fractions(torch.zeros(2, 2), [slice(0, 1)], [slice(0, 1)])


# ---- many runs at once ---------------------------------------------------------------------
def test_draw_is_what_sample_embeds() -> None:
    b = TASK.sample(16, _gen(4), "even")
    names, numbers, slot = TASK.draw(16, _gen(4), "even")
    assert torch.equal(b.names, names) and torch.equal(b.numbers, numbers) and torch.equal(b.slot, slot)


@FAST
@given(st.lists(st.sampled_from([1, 2, 5, 10]), min_size=1, max_size=3), st.integers(0, 2**31 - 1))
def test_runs_compute_each_head(d_ks: list[int], seed: int) -> None:
    """Every run is the RecallHead of its width and seed; the padding does nothing."""
    seeds = [seed + i for i in range(len(d_ks))]
    runs = RecallRuns(TASK.d_model, TASK.n_numbers, d_ks, seeds, dtype=F64)
    b = TASK.sample(7, _gen(seed), dtype=F64)
    logits, weights = runs.run_batch(b)  # (R, 7, M), (R, 7, P)
    for r, (d_k, s) in enumerate(zip(d_ks, seeds)):
        head = RecallHead(TASK.d_model, TASK.n_numbers, d_k, seed=s, dtype=F64)
        y, a = head(b.context, b.query)
        assert_close(logits[r], y)
        assert_close(weights[r], a)
        assert_close(runs.head(r).attn.w_q, head.attn.w_q)
    qk, ov = runs.circuits()  # (R, d_model, d_model) each
    assert_close(qk[0], qk_circuit(runs.head(0).attn, 0).full())
    assert_close(ov[0], ov_circuit(runs.head(0).attn, 0).full())


def test_runs_without_search_and_with_tied_values() -> None:
    runs = RecallRuns(TASK.d_model, TASK.n_numbers, [5, 5], [1, 1], search=[False, True], tie_vk=[False, True], dtype=F64)
    b = TASK.sample(6, _gen(2), dtype=F64)
    logits, weights = runs.run_batch(b)
    assert_close(weights[0], torch.full((6, 3), 1 / 3, dtype=F64))  # never searches: uniform
    w_q, w_k, w_o, w_r = (t.detach()[1] for t in (runs.w_q, runs.w_k, runs.w_o, runs.readout))
    out, a = attention(b.query @ w_q, b.context @ w_k, b.context @ w_k)  # W^V = W^K
    assert_close(weights[1], a[:, 0])
    assert_close(logits[1], out[:, 0] @ w_o @ w_r)
    assert_close(runs.circuits()[1][1], w_k @ w_o)
    train_recall_runs(runs, TASK, steps=3, batch_size=8)
    assert_close(runs.w_v[1], RecallRuns(TASK.d_model, TASK.n_numbers, [5], [1], dtype=F64).w_v[0] * (1 - 0.1 * 0.05) ** 3)  # unused: only decays
    with pytest.raises(ValueError, match="run 0 has a tied or switched-off search"):
        runs.head(0)


def test_runs_train_as_train_recall() -> None:
    """Training R runs together gives each run the training of train_recall, whatever the
    others do: other widths, weight decay, loss or target."""
    d_ks, seeds = [2, 5, 10, 5], [3, 4, 3, 0]
    decays, losses = [0.05, 0.0, 0.05, 0.05], ["squared", "squared", "cross_entropy", "squared"]
    runs = RecallRuns(TASK.d_model, TASK.n_numbers, d_ks, seeds, dtype=F64)
    out = train_recall_runs(runs, TASK, steps=6, batch_size=8, weight_decay=decays, loss=losses,  # type: ignore[arg-type]
                            target=["centred", "centred", "centred", "one_hot"])
    assert out.shape == (6, 4)
    for r in range(3):
        head = RecallHead(TASK.d_model, TASK.n_numbers, d_ks[r], seed=seeds[r], dtype=F64)
        ref = train_recall(head, TASK, steps=6, batch_size=8, weight_decay=decays[r], seed=seeds[r], loss=losses[r])  # type: ignore[arg-type]
        assert_close(out[:, r], torch.tensor(ref, dtype=F64))
        assert_close(runs.head(r).attn.w_q, head.attn.w_q)
        assert_close(runs.head(r).readout, head.readout)
        assert (runs.w_q[r, :, d_ks[r]:] == 0).all() and (runs.w_o[r, d_ks[r]:] == 0).all()  # padding stays zero
    # one-hot targets: the first step's loss is that of e_m, not e_m - 1/M
    fresh = RecallRuns(TASK.d_model, TASK.n_numbers, [5], [0], dtype=F64)
    names, numbers, slot = TASK.draw(8, _gen(0))
    b = TASK.batch(names, numbers, slot, dtype=F64)
    with torch.no_grad():
        y, _ = fresh.run_batch(b)
    goal = torch.nn.functional.one_hot(b.target, 4).to(F64)
    assert_close(out[0, 3], (y[0] - goal).square().sum(-1).mean())


def test_runs_errors() -> None:
    with pytest.raises(ValueError, match="d_ks and seeds must be non-empty and of one length, got 2 and 1"):
        RecallRuns(10, 4, [1, 2], [0])
    with pytest.raises(ValueError, match=r"search and tie_vk must have len\(d_ks\) = 1 entries, got 2 and 1"):
        RecallRuns(10, 4, [1], [0], search=[True, False])
    runs = RecallRuns(10, 4, [2, 5], [0, 1])
    with pytest.raises(ValueError, match=r"loss must be one of \('squared', 'cross_entropy'\) or 2 of them"):
        train_recall_runs(runs, TASK, steps=1, loss=["squared"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="target must be one of"):
        train_recall_runs(runs, TASK, steps=1, target="plain")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight_decay must be a float or 2 floats"):
        train_recall_runs(runs, TASK, steps=1, weight_decay=[0.1])
    with pytest.raises(ValueError, match=r"runs.readout must have shape \(R, d_model, n_numbers\) = \(R, 12, 4\)"):
        train_recall_runs(runs, PhoneBookTask(8, 4, 2), steps=1)


# ---- chapter 7's survey: the stored per-seed numbers ----------------------------------------------
def test_a_seed_outside_the_chapters_sample_reproduces_the_stored_numbers() -> None:
    """Chapter 7 retrains seeds 0-4 and compares them with the stored table of seeds 0-39; here
    seed 23, outside that sample, is retrained (the main task's 14 heads) and every one of its
    numbers checked against the table. It also learns: the width-16 head answers every test book
    (``train_recall_runs`` trains as ``train_recall`` does, test_runs_train_as_train_recall), and
    RecallHead.accuracy agrees with the stored accuracy."""
    torch.set_num_threads(1)
    table = load_survey()
    assert table.seeds == SURVEY_SEEDS and 23 in table.seeds
    survey = train_survey([23], main_only=True)
    numbers = survey_numbers(survey)
    assert len(numbers) > 100 and all(f"accuracy | {label}" in numbers for label in CONFIGS)
    assert compare_with_survey(numbers, [23], table) == len(numbers)
    assert numbers["accuracy | 16"] == [1.0] and numbers["accuracy | untrained 16"][0] < 0.4
    head = survey.main.runs.head(survey.main.members("16")[0])  # the trained width-16 head alone
    test = TASK12.sample(1000, _gen(TEST_SEED), dtype=F64)
    assert head.accuracy(test) == numbers["accuracy | 16"][0]


def test_the_comparison_refuses_what_differs(tmp_path: Path) -> None:
    table = load_survey()
    row = {key: table.of(key, [5, 6]).tolist() for key in table.numbers}
    assert compare_with_survey(row, [5, 6], table) == 2 * len(row)
    moved = {**row, "accuracy | 2": [row["accuracy | 2"][0], row["accuracy | 2"][1] + 1e-3]}
    with pytest.raises(AssertionError, match=r"'accuracy \| 2', seed 6"):
        compare_with_survey(moved, [5, 6], table)
    with pytest.raises(AssertionError, match="not in the table"):
        compare_with_survey({**row, "speed | 16": [1.0, 1.0]}, [5, 6], table)
    with pytest.raises(KeyError, match="not in the table"):
        table.of("accuracy | 16", [40])
    with pytest.raises(KeyError, match="no measurement"):
        table["speed | 16"]
    save_survey(row, [5, 6], tmp_path / "t.json")
    back = load_survey(tmp_path / "t.json")
    assert back.seeds == (5, 6) and compare_with_survey(row, [5, 6], back) == 2 * len(row)
    assert isinstance(back, SurveyTable)


def test_the_stored_table_holds_what_chapter_7_reports() -> None:
    """The rates the chapter states, read from the stored table (seeds 0-39)."""
    t = load_survey()
    assert len(t.seeds) == 40 and all(len(v) == 40 for v in t.numbers.values())
    assert (t["accuracy | 16"] == 1.0).all() and (t["accuracy | 4"] == 1.0).all()
    assert ((t["accuracy | 2"] < 0.8).double().mean() >= 0.6)  # a rate, with the chapter's margin
    ceiling = 960 / 1980  # the rank-one search by name
    assert ((t["match read most, every book | 1"] - ceiling).abs() < 0.01).all()


def test_a_stored_head_outside_the_chapters_sample_retrains_to_the_stored_weights() -> None:
    """Chapter 7 reads the stored heads of seeds 0-4 (their numbers checked there against the
    table) and retrains the main task's heads of seed 0; here a head of another group and seed,
    the 12-name d_k = 2 head of 150 steps of seed 3, is retrained and equals the stored one."""
    torch.set_num_threads(1)
    stored = survey_groups(load_survey_runs())
    assert list(stored) == ["main", "wide", "more 26 4", "more 13 8", "more 12 4", "parity"]
    assert sum(len(g.labels) for g in stored.values()) == 24 * len(RUN_SEEDS) == 120
    group = train_group(TASK12, {"12 4 2": {"d_k": 2}}, [3], steps=150)
    assert compare_with_runs(group, stored["more 12 4"]) == 150 + sum(p[0].numel() for p in group.runs.state_dict().values())


def test_the_stored_heads_save_load_and_refuse(tmp_path: Path) -> None:
    survey = load_survey_runs()
    assert survey.seeds == list(RUN_SEEDS) and set(RUN_SEEDS) < set(SURVEY_SEEDS)
    save_survey_runs(survey, tmp_path / "r.safetensors", seeds=[1, 3])
    back = load_survey_runs(tmp_path / "r.safetensors")
    assert back.seeds == [1, 3] and back.untrained.seeds == [1, 3]
    for name, g in survey_groups(back).items():  # the same runs, bit for bit
        full = survey_groups(survey)[name]
        assert g.labels == [lab for lab, s in zip(full.labels, full.seeds) if s in (1, 3)]
        picked = [r for r, s in enumerate(full.seeds) if s in (1, 3)]
        assert torch.equal(g.losses, full.losses[:, picked])
        assert all(torch.equal(v, full.runs.state_dict()[k][picked]) for k, v in g.runs.state_dict().items())
        assert compare_with_runs(g, full) > 0
    with pytest.raises(ValueError, match=r"seeds \[7\] are not in the survey"):
        save_survey_runs(survey, tmp_path / "x.safetensors", seeds=[0, 7])
    with pytest.raises(FileNotFoundError, match="no saved runs"):
        load_survey_runs(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"main.w_q": torch.zeros(1)}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(ValueError, match="not written by save_survey_runs"):
        load_survey_runs(tmp_path / "bare.safetensors")
    # a group whose runs are not train_survey's plan, and a group train_survey has not
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(tmp_path / "r.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["attnlib.recall"])
    tensors = load_file(str(tmp_path / "r.safetensors"))
    meta["groups"]["wide"]["labels"].reverse()
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"attnlib.recall": json.dumps(meta)})
    with pytest.raises(ValueError, match="group 'wide' holds other runs"):
        load_survey_runs(tmp_path / "t.safetensors")
    meta["groups"]["wide 2"] = meta["groups"].pop("wide")
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"attnlib.recall": json.dumps(meta)})
    with pytest.raises(ValueError, match="unknown group 'wide 2'"):
        load_survey_runs(tmp_path / "t.safetensors")
    # the comparison refuses a moved weight, a moved loss, a run it lacks, another length
    main = survey_groups(back)["main"]
    with torch.no_grad():
        main.runs.w_o[5, 0, 2] *= 1 + 1e-5
    with pytest.raises(AssertionError, match=r"w_o of run '4', seed 3, entry 2: 1.0e-05 of the stored value apart \(allowed: 1e-06\)"):
        compare_with_runs(main, survey.main)
    main.losses[299, 0] *= 1 + 1e-5
    with pytest.raises(AssertionError, match=r"losses of run '1', seed 1, entry 299"):
        compare_with_runs(main, survey.main)
    with pytest.raises(AssertionError, match="run '1', seed 0 is not among the stored runs"):
        compare_with_runs(survey.main, main)
    short = train_group(TASK12, {"2": {"d_k": 2}}, [0], steps=2, extra=[("2", 44)])
    assert short.labels == ["2", "2"] and short.seeds == [0, 44]
    with pytest.raises(AssertionError, match="not the same training: 2 and 300 steps"):
        compare_with_runs(short, survey.main)
    # only the listed seeds' runs are compared; none listed is no comparison
    par = survey_groups(back)["parity"]
    assert compare_with_runs(par, survey.parity, seeds=[3]) == compare_with_runs(par, survey.parity, seeds=[3, 9])
    assert 2 * compare_with_runs(par, survey.parity, seeds=[3]) == compare_with_runs(par, survey.parity)
    with pytest.raises(AssertionError, match=r"no run of seeds \[9\] to compare"):
        compare_with_runs(par, survey.parity, seeds=[9])
    with pytest.raises(KeyError, match=r"extra runs with labels \['3'\] not in configs"):
        train_group(TASK12, {"2": {"d_k": 2}}, [0], steps=1, extra=[("3", 44)])


def test_survey_errors() -> None:
    with pytest.raises(ValueError, match="distinct"):
        train_survey([1, 1])
    with pytest.raises(ValueError, match="test seed"):
        train_survey([TEST_SEED])
    group = train_group(TASK, {"2": {"d_k": 2}}, [0], steps=2, batch_size=4)
    assert group.members("2") == [0] and group.losses.shape == (2, 1)
    with pytest.raises(KeyError, match="no run is labelled"):
        group.members("16")


# ---- rates over seeds: the binomial interval ------------------------------------------------------
def tail_le(c: int, n: int, p: float) -> float:
    """P(X <= c), X ~ Binomial(n, p), summed directly (another way than the library's)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(max(c + 1, 0)))


@examples(10)
@given(n=st.integers(1, 60), data=st.data(), level=st.sampled_from([0.8, 0.95, 0.99]))
def test_binomial_interval_ends_solve_their_tails(n: int, data: st.DataObject, level: float) -> None:
    """The ends are where the count's tail probability is (1 - level) / 2; counts at the edges
    (0, 1, n - 1, n) are where such intervals go wrong, so they are drawn more often."""
    k = data.draw(st.one_of(st.sampled_from(sorted({0, 1, max(n - 1, 0), n})), st.integers(0, n)))
    lo, hi = binomial_interval(k, n, level)
    alpha = (1 - level) / 2
    assert 0.0 <= lo <= k / n <= hi <= 1.0 and lo < hi
    if k > 0:
        assert abs((1 - tail_le(k - 1, n, lo)) - alpha) < 1e-9
    else:
        assert lo == 0.0 and abs(hi - (1 - alpha ** (1 / n))) < 1e-12  # closed form at k = 0
    if k < n:
        assert abs(tail_le(k, n, hi) - alpha) < 1e-9
    else:
        assert hi == 1.0 and abs(lo - alpha ** (1 / n)) < 1e-12  # and at k = n
    if k < n:  # one more success moves both ends up
        lo2, hi2 = binomial_interval(k + 1, n, level)
        assert lo2 > lo and hi2 > hi


@examples(10)
@given(n=st.integers(1, 25), p=st.one_of(st.floats(0.001, 0.999), st.sampled_from([0.001, 0.5, 0.999])))
def test_binomial_interval_covers_every_rate(n: int, p: float) -> None:
    """Exact coverage, summed over every count: at least 95 % for any true rate, including
    rates near 0 and 1, where approximate intervals fail."""
    covered = sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)
                  if binomial_interval(k, n)[0] <= p <= binomial_interval(k, n)[1])
    assert covered >= 0.95 - 1e-12


def test_binomial_counts() -> None:
    """The counts a new sample can show: each side leaves out at most (1 - level) / 2, and one
    count fewer (more) would leave out more."""
    alpha = 0.025
    for rate, n in (((0.3, 0.3), 20), ((0.76, 0.97), 20), ((0.0, 0.2), 40), ((0.9, 1.0), 23)):
        low, high = binomial_counts(rate, n)
        assert tail_le(low - 1, n, rate[0]) <= alpha < tail_le(low, n, rate[0])
        assert 1 - tail_le(high, n, rate[1]) <= alpha < 1 - tail_le(high - 1, n, rate[1])
    assert binomial_counts(binomial_interval(36, 40), 20) == (11, 20)  # chapter 7: 36 of 40 seeds
    assert binomial_counts((0.0, 0.0), 5) == (0, 0) and binomial_counts((1.0, 1.0), 5) == (5, 5)
    assert rate_text(36, 40) == "36 of 40: a rate of 0.76 to 0.97 (95 %), 11 to 20 of 20 other seeds"
    assert rate_text(0, 40, others=10, level=0.9).startswith("0 of 40: a rate of 0.00 to 0.07 (90 %), 0 to ")


def test_binomial_errors() -> None:
    with pytest.raises(TypeError, match="int counts"):
        binomial_interval(3.0, 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int counts"):
        binomial_interval(True, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0 <= k <= n"):
        binomial_interval(11, 10)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        binomial_interval(0, 0)
    with pytest.raises(ValueError, match="level"):
        binomial_interval(3, 10, level=1.0)
    with pytest.raises(ValueError, match="rate"):
        binomial_counts((0.6, 0.4), 10)
    with pytest.raises(ValueError, match="positive int"):
        binomial_counts((0.4, 0.6), 0)
    with pytest.raises(ValueError, match="level"):
        binomial_counts((0.4, 0.6), 10, level=0.0)

