"""attnlib.audit: every bug of the catalogue, planted by hand, is named; right modules pass.

The learner's module below is written from scratch with ``nn.Linear`` layers, ``masked_fill`` and
``softmax``, as a tutorial would, and uses nothing from attnlib. Each bug is a small mixin that
overrides one step with the wrong line, so that two bugs combine by inheritance. The bugs of the
other call forms (causal, padded, cross, grouped, rotary) are planted in modules written in the
idioms of well-known code, in ``tests/foreign_attention.py``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from attnlib import MultiHeadAttention, SeparateHeadsAttention
from attnlib.audit import matcher
from attnlib.audit import (
    BUGS, BUGS_BY_NAME, PAIRS, AuditReport, assert_attention_matches, diagnose, planted, probe_inputs,
)
from attnlib.audit.report import fmt_error
from attnlib.interop import read_separate_linear, read_torch_mha, write_separate_linear

SETTINGS = settings(max_examples=20, deadline=None)
CONFLICTS = [{"missing_scale", "scale_by_d_model", "double_scale"},
             {"mask_ignored", "mask_fill_zero", "mask_after_softmax", "mask_fill_finite"}]
# the bugs of the default call form (self-attention, (n, n) mask, plain reference)
BASE = [name for name in BUGS if not BUGS_BY_NAME[name].needs]
# A pair whose outputs equal one of its bugs alone: an ignored mask has no polarity.
DEGENERATE = {frozenset({"mask_inverted", "mask_ignored"}): ("mask_ignored",)}


# ---- a learner's module, written from scratch ------------------------------------------


class Scratch(nn.Module):
    """Multi-head self-attention as a from-scratch tutorial writes it (mask: True = may attend)."""

    def __init__(self, d_model: int, h: int) -> None:
        super().__init__()
        self.h, self.d_k = h, d_model // h
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(d_model, d_model) for _ in range(4))

    def split(self, t: Tensor) -> Tensor:
        B, n, _ = t.shape
        return t.view(B, n, self.h, self.d_k).transpose(1, 2)  # (B, h, n, d_k)

    def merge(self, t: Tensor) -> Tensor:
        B, _, n, _ = t.shape
        return t.transpose(1, 2).reshape(B, n, self.h * self.d_k)  # (B, n, d)

    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        return q @ k.transpose(-2, -1) / math.sqrt(self.d_k)  # (B, h, n, n)

    def blocked(self, mask: Tensor) -> Tensor:
        return ~mask

    def fill(self, scores: Tensor, blocked: Tensor) -> Tensor:
        return scores.masked_fill(blocked, float("-inf"))

    def softmax(self, scores: Tensor) -> Tensor:
        return scores.softmax(dim=-1)

    def after(self, weights: Tensor, blocked: Tensor) -> Tensor:
        return weights

    def values(self, x: Tensor) -> Tensor:
        return self.W_v(x)

    def output(self, concat: Tensor) -> Tensor:
        return self.W_o(concat)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        q, k, v = self.split(self.W_q(x)), self.split(self.W_k(x)), self.split(self.values(x))
        scores = self.scores(q, k)
        if mask is not None:
            blocked = self.blocked(mask)
            weights = self.after(self.softmax(self.fill(scores, blocked)), blocked)
        else:
            weights = self.softmax(scores)
        return self.output(self.merge(weights @ v))


class MissingScale(Scratch):
    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        return q @ k.transpose(-2, -1)


class ScaleByDModel(Scratch):
    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        return q @ k.transpose(-2, -1) / math.sqrt(self.h * self.d_k)


class DoubleScale(Scratch):
    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        q = q / math.sqrt(self.d_k)  # scaled here ...
        return q @ k.transpose(-2, -1) / math.sqrt(self.d_k)  # ... and again


class SoftmaxWrongAxis(Scratch):
    def softmax(self, scores: Tensor) -> Tensor:
        return scores.softmax(dim=-2)


class SplitWithoutTranspose(Scratch):
    def split(self, t: Tensor) -> Tensor:
        B, n, _ = t.shape
        return t.view(B, self.h, n, self.d_k)


class MergeWithoutTranspose(Scratch):
    def merge(self, t: Tensor) -> Tensor:
        B, _, n, _ = t.shape
        return t.reshape(B, n, self.h * self.d_k)


class MaskInverted(Scratch):
    def blocked(self, mask: Tensor) -> Tensor:
        return mask


class MaskIgnored(Scratch):
    def fill(self, scores: Tensor, blocked: Tensor) -> Tensor:
        scores.masked_fill(blocked, float("-inf"))  # result thrown away
        return scores


class MissingOutputProjection(Scratch):
    def output(self, concat: Tensor) -> Tensor:
        return concat


class WeightsTransposed(Scratch):
    """Built correctly; :func:`learner` then copies each paper-orientation W into nn.Linear as is."""


class MaskFillZero(Scratch):
    def fill(self, scores: Tensor, blocked: Tensor) -> Tensor:
        return scores.masked_fill(blocked, 0.0)


class MaskAfterSoftmax(Scratch):
    def fill(self, scores: Tensor, blocked: Tensor) -> Tensor:
        return scores

    def after(self, weights: Tensor, blocked: Tensor) -> Tensor:
        return weights.masked_fill(blocked, 0.0)


class ValueUsesKeyWeights(Scratch):
    def values(self, x: Tensor) -> Tensor:
        return self.W_k(x)


class MaskFillFinite(Scratch):
    def fill(self, scores: Tensor, blocked: Tensor) -> Tensor:
        return scores.masked_fill(blocked, -10000)  # hyunwoongko/transformer's value


PLANTED: dict[str, type[Scratch]] = {
    "missing_scale": MissingScale,
    "scale_by_d_model": ScaleByDModel,
    "softmax_wrong_axis": SoftmaxWrongAxis,
    "split_without_transpose": SplitWithoutTranspose,
    "merge_without_transpose": MergeWithoutTranspose,
    "mask_inverted": MaskInverted,
    "mask_ignored": MaskIgnored,
    "missing_output_projection": MissingOutputProjection,
    "weights_transposed": WeightsTransposed,
    "mask_fill_zero": MaskFillZero,
    "mask_after_softmax": MaskAfterSoftmax,
    "value_uses_key_weights": ValueUsesKeyWeights,
    "double_scale": DoubleScale,
    "mask_fill_finite": MaskFillFinite,
}


def reference(d_model: int = 12, h: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32) -> MultiHeadAttention:
    """A seeded reference with non-zero biases (so that the checks cover them)."""
    torch.manual_seed(seed)
    ref = MultiHeadAttention(d_model, h, dtype=dtype)
    with torch.no_grad():
        for b in (ref.b_q, ref.b_k, ref.b_v, ref.b_o):
            b.normal_(0, 0.2)
    return ref


def learner(ref: MultiHeadAttention, *bugs: str) -> Scratch:
    """A Scratch module with ``bugs`` planted, holding ``ref``'s weights (chapter 5's layouts)."""
    bases = tuple(PLANTED[b] for b in bugs) or (Scratch,)
    cls = type("Planted", bases, {}) if len(bases) > 1 else bases[0]
    d_model = ref.w_q.shape[0]
    module = cls(d_model, ref.num_heads).to(ref.w_q.dtype)
    layers = write_separate_linear(ref.projections())  # nn.Linear layout: weight = W.T
    with torch.no_grad():
        for role in "qkvo":
            lin = getattr(module, f"W_{role}")
            w = layers[role].weight
            lin.weight.copy_(w.T if "weights_transposed" in bugs else w)  # the bug: W copied as is
            lin.bias.copy_(layers[role].bias)
    return module


def compatible(a: str, b: str) -> bool:
    return not any({a, b} <= group for group in CONFLICTS)


# ---- every bug, every pair ---------------------------------------------------------------


def test_every_bug_has_a_planted_module() -> None:
    assert set(PLANTED) == set(BASE)
    assert all(isinstance(d, str) and d for d in BUGS.values())
    for bug in BUGS_BY_NAME.values():
        assert bug.look_for and bug.fix and bug.look_for != bug.fix


@pytest.mark.parametrize("bug", BASE)
def test_each_bug_is_diagnosed(bug: str) -> None:
    ref = reference()
    report = diagnose(learner(ref, bug), ref)
    assert not report.ok and report.max_error > 0.01
    assert report.bugs == (bug,) and report.explanations == ((bug,),)
    # one explanation: nothing tied, no hint (the bug says what to look for), and no blocked-row
    # convention reported for a WRONG module
    assert report.tie == "" and report.hint == "" and report.blocked_rows is None
    text = str(report)
    assert text.startswith("WRONG") and bug in text and "look for" in text


def test_the_engine_plants_the_same_bugs_as_the_hand_written_modules() -> None:
    ref = reference()
    x = torch.randn(2, 5, 12)
    mask = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 1], [0, 0, 1, 1, 0], [1, 0, 0, 1, 1]]).bool()
    for bug in BASE:
        with torch.no_grad():
            torch.testing.assert_close(planted(ref, bug)(x, mask), learner(ref, bug)(x, mask))


def test_every_compatible_pair_is_diagnosed() -> None:
    ref = reference(d_model=8, h=2)
    seen = 0
    for a, b in itertools.combinations(BASE, 2):
        if not compatible(a, b):
            with pytest.raises(ValueError, match="change the same step"):
                planted(ref, a, b)
            continue
        report = diagnose(learner(ref, a, b), ref)
        expected = DEGENERATE.get(frozenset({a, b}), (a, b))
        assert not report.ok
        assert report.explanations == (expected,) and report.bugs == expected, (a, b, report.explanations)
        assert ((a, b) in PAIRS) == (frozenset({a, b}) not in DEGENERATE)
        seen += 1
    assert seen == len(PAIRS) + len(DEGENERATE) == 82


def test_pairs_leave_out_the_pair_that_computes_one_bug() -> None:
    assert len(PAIRS) == 81 and ("mask_inverted", "mask_ignored") not in PAIRS
    ref = reference()
    x = torch.randn(2, 5, 12)
    mask = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 1], [0, 0, 1, 1, 0], [1, 0, 0, 1, 1]]).bool()
    with torch.no_grad():  # the pair computes what mask_ignored computes alone
        both = planted(ref, "mask_inverted", "mask_ignored")(x, mask)
        assert torch.equal(both, planted(ref, "mask_ignored")(x, mask))


def test_diagnose_restores_the_number_of_threads() -> None:
    ref = reference()
    before = torch.get_num_threads()
    seen: list[int] = []

    def forward(x: Tensor, mask: Tensor | None) -> Tensor:
        seen.append(torch.get_num_threads())
        return planted(ref)(x, mask)

    assert diagnose(forward, ref).ok
    assert set(seen) == {1} and torch.get_num_threads() == before
    with pytest.raises(ValueError):
        diagnose(lambda x, m: x[..., :1], ref)
    assert torch.get_num_threads() == before


def test_diagnose_shares_the_candidates_outputs_only_while_the_weights_are_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Modules audited against one reference reuse the candidates' outputs: the reports are
    those of calls that share nothing, a repeated call computes no candidate, and a reference
    changed in place (a training step) gets its candidates computed afresh."""
    ref = reference()
    modules = [learner(ref, "missing_scale"), learner(ref, "mask_inverted")]
    computed: list[int] = []
    run_recipe = matcher.run_recipe
    monkeypatch.setattr(matcher, "run_recipe", lambda *a, **k: computed.append(1) or run_recipe(*a, **k))
    monkeypatch.setattr(matcher, "_SHARED", matcher.OrderedDict())

    def reports(shared: int) -> list[str]:
        monkeypatch.setattr(matcher, "SHARED_CALLS", shared)
        return [str(diagnose(module, ref, pairs=False)) for module in modules]

    alone = reports(0)
    assert alone[0] != alone[1] and reports(8) == alone
    before = len(computed)
    assert reports(8) == alone and len(computed) == before  # all shared: nothing computed
    with torch.no_grad():  # the same modules, a changed reference: their reports change
        ref.w_v.mul_(1.5)  # (W^Q and W^K would change the probes too)
    changed = reports(8)
    assert len(computed) > before and changed != alone and changed == reports(0)
    monkeypatch.setattr(matcher, "SHARED_BYTES", 0)  # over the budget: only the table in use is kept
    reports(8)
    with torch.no_grad():
        ref.w_v.mul_(2.0)
    reports(8)
    assert len(matcher._SHARED) == 1


def test_pairs_false_finds_no_pair() -> None:
    ref = reference()
    report = diagnose(learner(ref, "missing_scale", "mask_inverted"), ref, pairs=False)
    assert not report.ok and report.bugs == ()


def test_catalogue_helpers_by_hand() -> None:
    """The catalogue's small functions on hand-made records: no diagnosis runs."""
    from attnlib.audit.catalogue import (
        Bug, Recipe, _need, active_bugs, active_pairs, can_plant_together, mask_bugs, tie_reason,
    )

    assert _need("causal", "rope") == frozenset({"causal", "rope"})
    # an ignored mask has no polarity: its recipe reads "may attend"; other recipes are kept
    assert Recipe(mask_use="ignored", mask_true="blocked").effective() == Recipe(mask_use="ignored")
    assert Recipe(mask_true="blocked").effective() == Recipe(mask_true="blocked")
    base = Recipe(projection="x @ W.T")
    bug = Bug("b", "d", "look", "fix", {"scale": "1"}, alternatives=({"scale": "d_k"},))
    assert bug.recipe() == Recipe(scale="1") and bug.recipe(base) == Recipe(projection="x @ W.T", scale="1")
    assert bug.recipes(base) == (Recipe(projection="x @ W.T", scale="1"), Recipe(projection="x @ W.T", scale="d_k"))
    masked = Bug("m", "d", "look", "fix", {"mask_true": "blocked"}, needs=frozenset({"padding"}))
    assert bug.all_needs == frozenset() and masked.all_needs == frozenset({"padding", "mask"})
    assert can_plant_together(bug, masked) and not can_plant_together(bug, Bug("c", "d", "l", "f", {"scale": "d_k"}))
    # call forms: the mask bugs need a mask, the padding bugs padding as well
    assert set(mask_bugs(frozenset())) == {"mask_inverted", "mask_ignored", "mask_fill_zero", "mask_after_softmax",
                                           "mask_fill_finite"}
    assert set(mask_bugs(frozenset({"padding"}))) - set(mask_bugs(frozenset())) == {"padding_head_order",
                                                                                    "padding_on_queries"}
    assert mask_bugs(frozenset({"mask", "padding", "causal"})) == mask_bugs(frozenset({"padding"}))
    assert {b.name for b in active_bugs(frozenset({"causal"}))} == set(BASE) - set(mask_bugs(frozenset())) | {
        "causal_blocks_diagonal", "causal_sees_next", "causal_reversed"}
    pairs = {(a.name, b.name) for a, b in active_pairs(frozenset({"mask"}))}
    assert pairs == set(PAIRS)
    assert {(a.name, b.name) for a, b in active_pairs(frozenset())} == {
        (a, b) for a, b in PAIRS if a not in mask_bugs(frozenset()) and b not in mask_bugs(frozenset())}
    # ties: named with the sizes that make them, and the generic sentence otherwise
    tied = frozenset({"scale_by_d_model", "double_scale", "mask_ignored"})
    reason = ("double_scale and scale_by_d_model: √d_model equals d_k when d_model = d_k², which for d_model = h·d_k "
              "means h = d_k; any reference with h ≠ d_k (and d_model ≠ d_k²) separates them")
    assert tie_reason(tied, 2, 2) == reason + " (here h = 2, d_k = 2)"
    assert tie_reason(tied, 2, 4, 16) == reason + " (here h = 2, d_k = 4, d_model = 16)"
    generic = ("for these weights and probes they compute the same outputs; a reference with other random weights "
               "(another seed) or other sizes (h, d_k) may separate them")
    assert tie_reason(tied, 3, 2) == generic  # d_model = 6, not 4
    assert tie_reason(tied, 2, 4, 8) == generic and tie_reason(frozenset({"double_scale"}), 2, 2) == generic
    assert tie_reason(frozenset({"scale_by_d_model", "double_scale"}), 2, 2) == reason + " (here h = 2, d_k = 2)"


def test_tolerance_is_its_formula() -> None:
    """search.tolerance by hand: the coarser dtype's rounding along the layer (d_model, d_k, n_k,
    d_model; n_k the longest keys, a context's included), RoPE's float32 angles (n_k, n_k), both
    times max(1, top), top = the largest |x W^Q| |k W^K| / sqrt(d_k) over the probes but "large
    scores"; never below sqrt(eps) of the reference's dtype; rtol given wins."""
    from attnlib import rounding_tolerance
    from attnlib.audit.engine import ReferenceParams
    from attnlib.audit.probes import Probe
    from attnlib.audit.search import tolerance

    f32, f64 = torch.float32, torch.float64
    ref = MultiHeadAttention(4, 2)  # d_model = 4, d_k = 2
    x = torch.tensor([[[1.0, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1]]], dtype=f64)  # (1, 3, 4)
    context = torch.tensor([[[0.0, 0, 1, 0]] * 5], dtype=f64)  # (1, 5, 4): n_k = 5 keys
    probes = [Probe("no mask", x, None, None), Probe("cross", x, context, None),
              Probe("large scores", 1e6 * x, None, None)]

    def params(scale: float, rope: float | None) -> ReferenceParams:
        w = {"q": scale * torch.eye(4, dtype=f64), "k": scale * torch.eye(4, dtype=f64)}
        return ReferenceParams(w=w, b={}, num_heads=2, num_kv_heads=2, rope_base=rope)

    layer = rounding_tolerance(f32, 4, 2, 5, 4)
    angles = rounding_tolerance(f32, 5, 5)
    # top = 2 * 1 / sqrt 2 < 1 with the weights scaled by 1/2: the factor is 1
    small = params(0.5, None)
    assert tolerance(None, f64, f32, ref, small, probes) == max(math.sqrt(torch.finfo(f64).eps), layer)
    assert tolerance(None, f64, f64, ref, small, probes) == math.sqrt(torch.finfo(f64).eps)
    assert tolerance(None, f64, f64, ref, small, probes, f32) == layer
    assert tolerance(0.125, f64, f32, ref, small, probes) == 0.125
    # weights x 1000: top = (2000 * 2000) / sqrt 2 (x as its own keys); with RoPE the angles' rounding adds
    big = params(1000.0, 10000.0)
    top = 2000.0 * 2000.0 / math.sqrt(2)
    assert tolerance(None, f64, f32, ref, big, probes) == pytest.approx((layer + angles) * top, rel=1e-12, abs=0)
    # a float32 reference and float64 outputs: float32's rounding along the layer all the same
    assert tolerance(None, f32, f64, ref, params(1000.0, None), probes) == pytest.approx(layer * top, rel=1e-12, abs=0)


def test_large_scale_spreads_head_0s_scores_over_large_scores() -> None:
    """_large_scale: the input scale s at which head 0's scores (no bias) of 8 seeded float64 inputs
    have a standard deviation of LARGE_SCORES (s^2 scales them); 1e-12 stands for a zero spread."""
    from attnlib.audit.engine import ReferenceParams
    from attnlib.audit.probes import LARGE_SCORES
    from attnlib.audit.search import _large_scale

    ref = reference()  # d_model = 12, 3 heads of d_k = 4
    w = ReferenceParams.of(ref, torch.float64)
    s = _large_scale(w, 12)
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * s
    q, k = x @ w.w["q"][:, :4], x @ w.w["k"][:, :4]
    assert float((q @ k.T).std()) / 2 == pytest.approx(LARGE_SCORES, rel=1e-12, abs=0)
    with torch.no_grad():
        ref.w_q.zero_()
    assert _large_scale(ReferenceParams.of(ref, torch.float64), 12) == pytest.approx(1e9, rel=1e-15, abs=0)


def test_describe_names_the_call_form() -> None:
    """The words that name a probe in diagnose's errors: shapes, the context, and the mask's kind."""
    from attnlib.audit.probes import Probe
    from attnlib.audit.search import _describe

    x = torch.zeros(1, 3, 4, dtype=torch.float64)
    cross = Probe("cross", x, torch.zeros(1, 5, 4, dtype=torch.float64), None)
    assert _describe(cross, True, False) == "x of shape (1, 3, 4), context of shape (1, 5, 4) and mask=None"
    assert _describe(cross, True, False, takes_mask=False) == "x of shape (1, 3, 4), context of shape (1, 5, 4)"
    padded = Probe("padding", x, None, torch.ones(1, 3, dtype=torch.bool))
    assert _describe(padded, False, True) == "x of shape (1, 3, 4) and a bool key-padding mask of shape (1, 3)"
    masked = Probe("causal", x, None, torch.ones(3, 3, dtype=torch.bool))
    assert _describe(masked, False, False) == "x of shape (1, 3, 4) and a bool mask of shape (3, 3)"


def test_call_names_the_call_form_in_its_errors() -> None:
    """_call's errors start with the call as your forward got it: the arguments, then the probe
    (context and the mask's kind included), then the reference's width."""
    from attnlib.audit.probes import Probe
    from attnlib.audit.search import _call

    x = torch.zeros(1, 3, 4, dtype=torch.float64)
    cross = Probe("cross", x, torch.zeros(1, 5, 4, dtype=torch.float64), None)
    padded = Probe("padding", x, None, torch.ones(1, 3, dtype=torch.bool))
    cpu, f64 = torch.device("cpu"), torch.float64
    cases = [
        (cross, True, False, True, "forward(x, context, mask) with x of shape (1, 3, 4), context of shape (1, 5, 4) "
                                   "and mask=None"),
        (cross, False, False, False, "forward(x) with x of shape (1, 3, 4)"),
        (padded, False, True, True, "forward(x, mask) with x of shape (1, 3, 4) and a bool key-padding mask of shape (1, 3)"),
    ]
    for probe, is_cross, padding, takes_mask, where in cases:
        n_args = 1 + is_cross + takes_mask  # a forward that takes exactly the arguments of its form
        with pytest.raises(TypeError) as info:
            _call(lambda *a: (a[0],) if len(a) == n_args else None, probe, f64, cpu, is_cross, padding, 4, takes_mask)
        assert str(info.value).startswith(f"{where} (reference.d_model = 4) returned a tuple;")


def test_call_gives_your_forward_its_inputs_on_the_references_device() -> None:
    """x, the context and the mask go to the device _call is given (the reference's): "meta" here,
    standing in for a GPU."""
    from attnlib.audit.probes import Probe
    from attnlib.audit.search import _call

    probe = Probe("cross", torch.zeros(1, 3, 4, dtype=torch.float64), torch.zeros(1, 5, 4, dtype=torch.float64),
                  torch.ones(3, 5, dtype=torch.bool))
    seen: list[tuple[str, ...]] = []
    with pytest.raises(TypeError, match="returned a tuple"):  # before anything reads the meta output
        _call(lambda *a: seen.append(tuple(t.device.type for t in a)) or (a[0],), probe, torch.float32,
              torch.device("meta"), True, False, 4, True)
    assert seen == [("meta", "meta", "meta")]


def test_call_runs_your_forward_or_says_why_not() -> None:
    """_call runs your forward without gradients and returns its output detached; a forward that
    raises is named with its call, where it raised and what to check, except on a cross probe whose
    query and key lengths differ (a Raised, part of the diagnosis); a wrong output type or shape is
    named too."""
    from attnlib.audit.matcher import Raised
    from attnlib.audit.probes import Probe
    from attnlib.audit.search import _call

    x = torch.arange(12, dtype=torch.float64).reshape(1, 3, 4)
    cpu, f64 = torch.device("cpu"), torch.float64
    plain = Probe("no mask", x, None, None)
    grad: list[bool] = []
    out = _call(lambda t: grad.append(torch.is_grad_enabled()) or (t * 2).requires_grad_(), plain, f64, cpu,
                False, False, 4, False)
    assert grad == [False] and isinstance(out, Tensor) and torch.equal(out, x * 2) and not out.requires_grad

    def boom(*args: Tensor) -> Tensor:
        raise RuntimeError("boom")

    tail = r"raised RuntimeError in your adapter, boom \(line \d+\), outside your module: boom\. Does reference have your module's width, "
    padded = Probe("padding", x, None, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^forward\(x, mask\) with x of shape \(1, 3, 4\) and a bool key-padding mask of shape "
                       r"\(1, 3\) \(reference.d_model = 4\) " + tail + r"does your forward accept mask=None and a bool "
                       r"\(B, n_k\) key-padding mask, True = real token, and does it take torch.float64 inputs \(else pass dtype=\)\?$"):
        _call(boom, padded, f64, cpu, False, True, 4, True)
    with pytest.raises(ValueError, match=r"^forward\(x\) with x of shape \(1, 3, 4\) \(reference.d_model = 4\) " + tail
                       + r"does your forward take x alone \(takes_mask=False\), and does it take torch.float32 inputs"):
        _call(boom, plain, torch.float32, cpu, False, False, 4, False)
    with pytest.raises(ValueError, match=r"^forward\(x, mask\) with x of shape \(1, 3, 4\) and mask=None \(reference.d_model = 4\) "
                       r"raised TypeError in your forward: "):  # a torch module: refused in torch's code, not an adapter's
        _call(nn.Identity(), plain, f64, cpu, False, False, 4, True)
    square = Probe("cross", x, torch.zeros(1, 3, 4, dtype=f64), torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^forward\(x, context, mask\) .* a bool \(n, n\) mask, True = may attend, "):
        _call(boom, square, f64, cpu, True, False, 4, True)  # n_q = n_k: your forward's error, not a diagnosis
    longer = Probe("cross", x, torch.zeros(1, 5, 4, dtype=f64), None)
    raised = _call(boom, longer, f64, cpu, True, False, 4, True)
    assert isinstance(raised, Raised) and raised.text == "RuntimeError: boom"
    with pytest.raises(TypeError, match=r"^forward\(x\) with x of shape \(1, 3, 4\) \(reference.d_model = 4\) must return a "
                       r"torch.Tensor of shape \(1, 3, 4\), got list$"):
        _call(lambda t: [t], plain, f64, cpu, False, False, 4, False)
    with pytest.raises(ValueError, match=r"^forward\(x\) with x of shape \(1, 3, 4\) \(reference.d_model = 4\) must return "
                       r"shape \(B, n, d_model\) = \(1, 3, 4\), got \(1, 3, 5\)$"):
        _call(lambda t: torch.zeros(1, 3, 5), plain, f64, cpu, False, False, 4, False)


# ---- right modules pass ---------------------------------------------------------------------


def test_from_scratch_module_passes() -> None:
    ref = reference()
    report = diagnose(learner(ref), ref)
    assert report.ok and report.bugs == () and report.max_error < 1e-5
    # a float32 module against a float32 reference, every mask bug tested: no note, no hint, no
    # dtype named, nothing untested; padded rows only with padding=True; its three heads
    assert report.notes == () and report.hint == "" and report.compute_dtype == "" == report.suspected_dtype
    assert report.untested == () and report.padded_rows is None and report.tie == "" and report.num_heads == 3
    assert str(report) == ("OK: matches the reference to within 0.00035 (relative) on every probe\n"
                           "a query with every key blocked gets, in your module: NaN (a convention, not a\n  bug)")


def test_large_negative_fill_passes() -> None:
    class FillMinusBillion(Scratch):
        def fill(self, scores: Tensor, blocked: Tensor) -> Tensor:
            return scores.masked_fill(blocked, -1e9)

    ref = reference()
    module = learner(ref)
    other = FillMinusBillion(12, 3)
    other.load_state_dict(module.state_dict())
    assert diagnose(other, ref).ok


def test_torch_multihead_attention_passes() -> None:
    torch.manual_seed(1)
    m = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    ref = MultiHeadAttention.from_weights(read_torch_mha(m), m.num_heads)

    def forward(x: Tensor, mask: Tensor | None) -> Tensor:
        return m(x, x, x, attn_mask=None if mask is None else ~mask, need_weights=False)[0]

    assert diagnose(forward, ref).ok


def test_separate_heads_attention_passes() -> None:
    ref = reference()
    sep = SeparateHeadsAttention.from_fused(ref)
    assert diagnose(lambda x, m: sep(x, x, x, mask=m)[0], ref).ok


def test_hugging_face_bert_self_attention_passes() -> None:
    bert = pytest.importorskip("transformers.models.bert.modeling_bert")
    from transformers import BertConfig

    config = BertConfig(hidden_size=16, num_attention_heads=4, intermediate_size=32, num_hidden_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    layer = bert.BertAttention(config).eval()
    self_attn, dense = layer.self, layer.output.dense  # attention, then W^O (before dropout, LayerNorm)
    pair = lambda lin: (lin.weight, lin.bias)  # noqa: E731
    ref = MultiHeadAttention.from_weights(
        read_separate_linear(pair(self_attn.query), pair(self_attn.key), pair(self_attn.value), pair(dense)),
        config.num_attention_heads,
    )

    def forward(x: Tensor, mask: Tensor | None) -> Tensor:
        additive = None
        if mask is not None:  # BERT adds the mask to the scores: 0 = may attend
            additive = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, torch.finfo(x.dtype).min)
            additive = additive[None, None]  # (1, 1, n, n)
        return dense(self_attn(x, attention_mask=additive)[0])

    report = diagnose(forward, ref)
    assert report.ok, str(report)


# ---- what the report says when nothing fits, and honest limits ---------------------------


def test_unexplained_module_is_wrong_with_no_bug() -> None:
    class SigmoidWeights(Scratch):
        def softmax(self, scores: Tensor) -> Tensor:
            return torch.sigmoid(scores)

    ref = reference()
    module = learner(ref)
    other = SigmoidWeights(12, 3)
    other.load_state_dict(module.state_dict())
    report = diagnose(other, ref)
    assert not report.ok and report.bugs == () and report.explanations == ()
    assert "no bug of the catalogue" in str(report)
    assert "wrong even without a mask" in str(report) and "reference(x, x, x, mask=mask)[1]" in str(report)


def test_wrong_only_with_a_mask_says_so() -> None:
    class MaskTransposed(Scratch):
        def blocked(self, mask: Tensor) -> Tensor:
            return ~mask.T

    ref = reference()
    other = MaskTransposed(12, 3)
    other.load_state_dict(learner(ref).state_dict())
    report = diagnose(other, ref)
    assert not report.ok and report.bugs == ()
    assert report.errors["no mask"] < 1e-5 and report.errors["random mask"] > 0.01
    assert "look at how the mask is applied" in str(report)


def test_nan_and_inf_are_tolerated() -> None:
    ref = reference()
    report = diagnose(lambda x, m: torch.full_like(x, math.nan), ref)
    assert not report.ok and report.max_error == math.inf and report.bugs == ()
    assert "NaN or inf" in str(report)
    one_inf = diagnose(lambda x, m: learner(ref)(x, m).index_fill(-1, torch.tensor([0]), math.inf), ref)
    assert not one_inf.ok and one_inf.max_error == math.inf


def test_one_head_makes_some_bugs_undetectable() -> None:
    ref = reference(d_model=8, h=1)
    report = diagnose(learner(ref, "scale_by_d_model"), ref)
    assert report.ok  # with h = 1, d_k = d_model: the code is right for this layer
    assert {"scale_by_d_model", "split_without_transpose", "merge_without_transpose"} <= set(report.undetectable)
    assert "cannot be seen" in str(report) and "scale_by_d_model" in str(report)
    assert report.num_heads == 1 and "with h = 1 and these weights" in " ".join(str(report).split())
    assert diagnose(learner(reference(), "scale_by_d_model"), reference()).bugs == ("scale_by_d_model",)


def test_indistinguishable_bugs_are_all_reported() -> None:
    ref = reference()
    with torch.no_grad():
        ref.w_q.zero_()
        ref.b_q.zero_()  # every score 0: an ignored mask == blocked scores set to 0
    report = diagnose(learner(ref, "mask_ignored"), ref)
    assert report.explanations == (("mask_ignored",), ("mask_fill_zero",))
    assert report.bugs == ("mask_ignored", "mask_fill_zero")  # ties listed, not dropped
    text = str(report)
    assert text.startswith("WRONG") and "cannot tell" in text and "why:" in text
    for name in ("mask_ignored", "mask_fill_zero"):  # every explanation's line to look for
        assert f"bug {name}:" in text
    assert text.count("look for:") == 2 and text.count("write:") == 2
    assert set(report.undetectable) == {"missing_scale", "scale_by_d_model", "double_scale"}
    assert "cannot be seen: missing_scale, scale_by_d_model, double_scale" in " ".join(text.split())  # WRONG too


@pytest.mark.parametrize(
    ("bug", "words"),
    [
        ("mask_inverted", "pass ~mask"),
        ("missing_output_projection", "BertSelfOutput's dense layer"),
        ("weights_transposed", "the weights you loaded from"),
        ("missing_scale", None),
    ],
)
def test_report_notes_where_else_the_fix_may_belong(bug: str, words: str | None) -> None:
    ref = reference()
    text = str(diagnose(learner(ref, bug), ref))
    assert ("note:" in text) == (words is not None)
    assert words is None or words in " ".join(text.split())


def test_a_wrong_load_is_seen_only_against_the_source_weights() -> None:
    ref = reference()
    module = learner(ref, "weights_transposed")
    assert diagnose(module, ref).bugs == ("weights_transposed",)
    lin = lambda layer: (layer.weight, layer.bias)  # noqa: E731
    read_back = MultiHeadAttention.from_weights(
        read_separate_linear(lin(module.W_q), lin(module.W_k), lin(module.W_v), lin(module.W_o)), 3
    )
    assert diagnose(module, read_back).ok  # the module's own weights hold the same transposition


def test_float64_reference_and_rtol() -> None:
    ref = reference(dtype=torch.float64)
    report = diagnose(learner(ref), ref)
    assert report.ok and report.rtol == pytest.approx(math.sqrt(torch.finfo(torch.float64).eps))
    assert diagnose(learner(ref, "missing_scale"), ref, rtol=1e-6).bugs == ("missing_scale",)


class ScaleOff(Scratch):
    """Scores divided by ``factor * sqrt(d_k)``: a real error, as small as ``factor - 1``."""

    factor = 1.0001

    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        return q @ k.transpose(-2, -1) / (math.sqrt(self.d_k) * self.factor)


def scale_off(ref: MultiHeadAttention, factor: float) -> Scratch:
    module = type("Off", (ScaleOff,), {"factor": factor})(ref.d_model, ref.num_heads).to(ref.w_q.dtype)
    module.load_state_dict(learner(ref).state_dict())
    return module


def test_a_small_real_error_in_float64_passes_undeclared_and_the_report_says_so() -> None:
    """A float64 module whose scale is off by 1e-4 is within float32's rounding of the reference.
    Undeclared, it passes at float32's tolerance, like a float32 softmax would, and the report
    says so: a real error this small passes the same way, compute_dtype=torch.float64 checks at
    float64's rounding. Declared float64 it is WRONG, with no word of float32."""
    ref = reference(dtype=torch.float64)
    module = scale_off(ref, 1.0001)
    report = diagnose(module, ref, pairs=False)  # pairs: the search is not the point here
    assert report.ok and report.bugs == () and report.suspected_dtype == report.compute_dtype == "float32"
    rtol64 = math.sqrt(torch.finfo(torch.float64).eps)
    assert 1e-6 < report.max_error < 1e-4 and rtol64 < report.max_error <= report.rtol < 1e-4
    text = " ".join(str(report).split())
    assert text.startswith("OK") and "passed at float32's tolerance" in text and "not float64's" in text
    assert "a step of your module seems to run in float32" in text
    assert "A real error this small (a scale off by 1e-4, say) would pass the same way" in text
    assert "compute_dtype=torch.float64" in text and "compute_dtype=torch.float32" in text
    assert assert_attention_matches(module, ref, pairs=False).notes == report.notes
    strict = diagnose(module, ref, compute_dtype=torch.float64, pairs=False)
    assert not strict.ok and strict.suspected_dtype == "" and strict.compute_dtype == "float64"
    assert "float32" not in str(strict)
    assert strict.rtol == pytest.approx(rtol64) and str(strict).startswith("WRONG")
    given = diagnose(module, ref, rtol=rtol64, pairs=False)  # an rtol given is kept: no retry at float32's
    assert not given.ok and given.suspected_dtype == "" and given.rtol == rtol64
    with pytest.raises(AssertionError, match="WRONG"):
        assert_attention_matches(module, ref, compute_dtype=torch.float64, pairs=False)
    declared = diagnose(module, ref, compute_dtype=torch.float32)
    assert declared.ok and declared.compute_dtype == "float32" and declared.suspected_dtype == ""
    assert declared.notes == (f"compute_dtype=float32: compared at float32's rounding, {fmt_error(declared.rtol)}",)
    assert "would pass the same way" not in " ".join(str(declared).split())
    assert strict.notes == ()  # compute_dtype=float64 for float64 outputs: nothing to say
    assert diagnose(learner(ref), ref, compute_dtype=torch.float64).ok  # a right module still passes


class Float32Softmax(Scratch):
    """A float64 module that takes its softmax in float32 (as Hugging Face's OPT and Llama do)."""

    def softmax(self, scores: Tensor) -> Tensor:
        return scores.float().softmax(dim=-1).to(scores.dtype)


def test_a_pair_explaining_a_float64_module_only_at_float32s_rounding_is_named_there() -> None:
    """No bug explains a float64 module with a float32 softmax at float64's rounding; a pair
    does at float32's, and is named there, WRONG, with the note that says so."""
    ref = reference(dtype=torch.float64)
    cls = type("Planted", (Float32Softmax, MissingScale, MaskInverted), {})
    module = cls(12, 3).double()
    module.load_state_dict(learner(ref).state_dict())
    report = diagnose(module, ref)
    assert not report.ok and report.explanations == (("missing_scale", "mask_inverted"),)
    assert report.suspected_dtype == report.compute_dtype == "float32" and report.hint == ""
    assert report.rtol > 1e-6  # float32's rounding along the layer, not float64's sqrt(eps)
    assert report.notes == (
        "a step of your module seems to run in float32: no bug explains its outputs at float64's rounding, so the "
        f"bugs were sought at float32's ({fmt_error(report.rtol)}). Pass compute_dtype=torch.float32 if a step does "
        "run in float32, or compute_dtype=torch.float64 if none does.",)


def test_each_kind_of_probe_reports_its_worst_error() -> None:
    """A module wrong on the first "random mask" probe only: that kind's error is the worst one,
    though the second "random mask" probe is right."""
    ref = reference()
    right = learner(ref)
    first = next(x for kind, x, _ in probe_inputs(12) if kind == "random mask")

    def forward(x: Tensor, mask: Tensor | None) -> Tensor:
        out = right(x, mask)
        return out * 1.5 if x.shape == first.shape and torch.equal(x, first) else out

    report = diagnose(forward, ref, pairs=False)
    assert not report.ok and report.errors["random mask"] == report.max_error == pytest.approx(0.5, rel=1e-5)
    assert "random mask 0.5," in str(report)


def test_a_tie_is_explained_with_the_references_own_d_model() -> None:
    """d_model = 16 with h = 2 heads of d_k = 4 (h d_k = 8): double_scale divides by d_k = 4,
    scale_by_d_model by sqrt(16) = 4, the same; the reason names d_model = 16."""
    ref = MultiHeadAttention(16, 2, d_k=4)
    report = diagnose(planted(ref, "double_scale"), ref)
    assert report.explanations == (("scale_by_d_model",), ("double_scale",))
    assert report.tie.endswith("(here h = 2, d_k = 4, d_model = 16)")


def test_the_hint_of_a_causal_module_says_every_probe_is_masked_by_it() -> None:
    ref = reference()
    right = planted(ref, causal=True)
    report = diagnose(lambda x, mask: right(x, mask) * 1.1, ref, causal=True, pairs=False)
    assert not report.ok and report.bugs == ()
    assert "every probe of this call form is masked (causal=True: your module masks the future itself)" in report.hint


def test_padded_rows_are_named_for_a_right_padded_module_only() -> None:
    """padding=True: what a right module returns for the padded queries is named (a convention);
    for a wrong one nothing is."""
    ref = reference()
    report = diagnose(planted(ref, padding=True), ref, padding=True)
    assert report.ok and report.padded_rows == "the real keys"
    assert "a padded query (not compared) gets, in your module: attention over the real keys" in " ".join(
        str(report).split())
    wrong = diagnose(planted(ref, "missing_scale", padding=True), ref, padding=True, pairs=False)
    assert wrong.bugs == ("missing_scale",) and wrong.padded_rows is None


def test_the_reference_gets_its_inputs_on_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """x, the context and the mask go to the reference's device before it runs: "meta" here,
    standing in for a GPU (attnlib's float64 model of the layer reads a CPU twin's weights; the
    reference stops at its first call, where nothing reads its meta output)."""
    from attnlib.audit.engine import ReferenceParams

    class Recorder(MultiHeadAttention):
        seen: list[tuple[str, ...]] = []

        def forward(self, query, key, value, mask=None, need_weights=True):
            self.seen.append(tuple(t.device.type for t in (query, key, value, mask)))
            raise RuntimeError("stop")

    twin = reference()
    on_meta = Recorder(12, 3, device="meta")
    of = ReferenceParams.of
    monkeypatch.setattr(ReferenceParams, "of",
                        classmethod(lambda cls, r, dtype: of(twin if r is on_meta else r, dtype)))
    with pytest.raises(RuntimeError, match="the reference raised RuntimeError on a random mask probe: stop"):
        diagnose(lambda x, mask: torch.zeros(x.shape), on_meta)
    assert Recorder.seen == [("meta", "meta", "meta", "meta")]


def test_a_reference_off_the_model_by_exactly_the_tolerance_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """diagnose checks the reference's own forward against attnlib's model of it: an error above
    max(rtol, sqrt(eps)) on a probe is refused, one equal to it accepted (as a module's error
    equal to rtol passes)."""
    from attnlib.audit import checks, search

    class Shifted(MultiHeadAttention):
        def forward(self, query, key, value, mask=None, need_weights=True):
            out, w = super().forward(query, key, value, mask, need_weights)
            return out + 1e-3, w

    torch.manual_seed(0)
    ref = Shifted(12, 3)
    seen: list[float] = []

    def recorded(e: Tensor, a: Tensor) -> float:
        seen.append(checks.relative_error(e, a))
        return seen[-1]

    monkeypatch.setattr(search, "relative_error", recorded)
    diagnose(lambda x, mask: x, ref, rtol=1.0, pairs=False)  # the reference's errors, one per probe
    worst = max(seen)
    assert len(seen) == 7 and worst > math.sqrt(torch.finfo(torch.float32).eps)
    assert not diagnose(lambda x, mask: x, ref, rtol=worst, pairs=False).ok  # accepted: the module is judged
    with pytest.raises(RuntimeError, match="disagrees with reference.forward"):
        diagnose(lambda x, mask: x, ref, rtol=math.nextafter(worst, 0.0), pairs=False)


def test_a_wrong_modules_errors_are_read_under_the_convention_that_fits_the_most_probes() -> None:
    """A module wrong without a mask, whose query with every key blocked gets the mean of the
    values: its errors are read under that convention, the blocked row "ok", when rtol equals
    that probe's error exactly (an error equal to rtol fits); "zeros", first of the
    conventions, fits one probe fewer."""
    ref = reference()
    right = planted(ref, blocked="mean of values")

    def forward(x: Tensor, mask: Tensor | None) -> Tensor:
        return right(x, mask) * (3.0 if mask is None else 1.0)

    first = diagnose(forward, ref, pairs=False)
    rtol = first.errors["blocked row"]
    assert 0 < rtol < first.rtol < first.errors["no mask"]
    report = diagnose(forward, ref, rtol=rtol, pairs=False)
    assert not report.ok and report.errors["blocked row"] == rtol and "blocked row ok" in str(report)


def test_large_scores_hints_name_renormalisation_finite_fills_and_capping() -> None:
    class Renormalised(Scratch):  # masked after the softmax, then renormalised: 0/0 with large scores
        def fill(self, scores: Tensor, blocked: Tensor) -> Tensor:
            return scores

        def after(self, weights: Tensor, blocked: Tensor) -> Tensor:
            kept = weights.masked_fill(blocked, 0.0)
            return kept / kept.sum(-1, keepdim=True)

    class SoftCapped(Scratch):  # Gemma 2's logit soft-capping, 50 tanh(s / 50)
        def scores(self, q: Tensor, k: Tensor) -> Tensor:
            return 50 * torch.tanh(super().scores(q, k) / 50)

    ref = reference(d_model=32, h=4)
    for cls in (Renormalised, SoftCapped):
        module = cls(32, 4)
        module.load_state_dict(learner(ref).state_dict())
        report = diagnose(module, ref, pairs=False)
        assert not report.ok and report.bugs == ()
        text = " ".join(str(report).split())
        assert "soft-capping" in text and "cannot be referenced" in text
        if cls is Renormalised:  # right on every probe but the large scores, where it is NaN
            assert [k for k, e in report.errors.items() if e > report.rtol] == ["large scores"]
            assert report.max_error == math.inf and "NaN or inf" in text
            assert "masking after the softmax and renormalising" in text and "finite mask value" in text


def test_probe_masks_have_an_allowed_and_a_blocked_key_in_every_row_and_column() -> None:
    for seed in range(20):
        for kind, _, mask in probe_inputs(8, seed=seed):
            if mask is None:
                continue
            rows = mask if kind != "blocked row" else torch.cat((mask[:1], mask[2:]))  # row 1: all blocked
            for m in (rows, mask.T):
                assert m.any(dim=-1).all() and (~m).any(dim=-1).all(), (seed, kind, m)
            if kind == "causal":
                assert not torch.triu(mask, diagonal=1).any()


def test_probe_inputs_are_the_probes_diagnose_uses() -> None:
    probes = probe_inputs(6, seed=3, dtype=torch.float64)
    assert [kind for kind, _, _ in probes] == [
        "random mask", "causal", "no mask", "random mask", "no mask", "blocked row", "large scores"]
    for kind, x, mask in probes:
        assert (kind == "blocked row") == (mask is not None and not mask.any(dim=-1).all())
        assert x.dtype == torch.float64 and x.shape[-1] == 6
        assert mask is None or mask.shape == (x.shape[1], x.shape[1])
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="d_model must be a positive int"):
            probe_inputs(bad)  # type: ignore[arg-type]


# ---- bad arguments ------------------------------------------------------------------------------


def test_bad_arguments_raise_clear_errors() -> None:
    ref = reference()
    good = learner(ref)
    with pytest.raises(TypeError, match="forward must be a callable"):
        diagnose(3, ref)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="reference must be an attnlib.MultiHeadAttention"):
        diagnose(good, nn.Linear(12, 12))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="returned a tuple"):
        diagnose(lambda x, m: (good(x, m), None), ref)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="must return a torch.Tensor"):
        diagnose(lambda x, m: x.tolist(), ref)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match=r"must return shape \(B, n, d_model\) = \(2, 5, 12\), got \(2, 5, 6\)"):
        diagnose(lambda x, m: good(x, m)[..., :6], ref)
    with pytest.raises(ValueError, match=r"reference.d_model = 8.*raised RuntimeError.*width"):
        diagnose(good, reference(d_model=8, h=2))
    with pytest.raises(ValueError, match="different outputs for the same input"):
        diagnose(lambda x, m: good(x, m) + torch.rand(()), ref)
    with pytest.raises(ValueError, match="rtol must be a positive number"):
        diagnose(good, ref, rtol=0.0)
    with pytest.raises(TypeError, match="seed must be an int"):
        diagnose(good, ref, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pairs must be a bool"):
        diagnose(good, ref, pairs=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown bug 'softmax_twice'"):
        planted(ref, "softmax_twice")
    with pytest.raises(TypeError, match="reference must be"):
        planted(good, "missing_scale")  # type: ignore[arg-type]


def test_a_reference_with_another_forward_is_refused() -> None:
    class Shifted(MultiHeadAttention):
        def forward(self, query, key, value, mask=None, need_weights=True):  # type: ignore[no-untyped-def]
            out, w = super().forward(query, key, value, mask, need_weights)
            return out + 1.0, w

    torch.manual_seed(0)
    ref = Shifted(12, 3)
    with pytest.raises(RuntimeError, match="disagrees with reference.forward"):
        diagnose(lambda x, m: x, ref)


# ---- properties over sizes and seeds ---------------------------------------------------------------


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**16), st.sampled_from(BASE))
def test_property_planted_bug_is_found_or_honestly_undetectable(h: int, d_k: int, seed: int, bug: str) -> None:
    ref = reference(d_model=h * d_k, h=h, seed=seed)
    right = diagnose(learner(ref), ref, seed=seed, pairs=False)
    assert right.ok
    report = diagnose(learner(ref, bug), ref, seed=seed, pairs=False)
    assert isinstance(report, AuditReport)
    if bug in right.undetectable:
        assert report.ok
    else:
        assert not report.ok and (bug,) in report.explanations, (h, d_k, seed, bug, report.explanations)


def test_diagnose_seeds_0_by_default_and_names_what_it_refuses() -> None:
    """The default seed is 0 (seed 1's probes give other rounding errors); an rtol given is used;
    a compute_dtype that is not a floating dtype is refused by that name, and an rtol that is not a
    positive number (a bool included); a half dtype is named without "torch.", and a half
    compute_dtype refused."""
    from attnlib.audit.search import _refuse_half

    ref = reference()
    module = learner(ref)
    default, zero, one = (dict(diagnose(module, ref, **kw).errors) for kw in ({}, {"seed": 0}, {"seed": 1}))
    assert default == zero and default != one
    given = diagnose(module, ref, rtol=1).rtol  # an rtol given is the one used, as a float
    assert given == 1.0 and type(given) is float
    with pytest.raises(TypeError, match=r"^compute_dtype must be a floating torch.dtype or None, got torch.int32$"):
        diagnose(module, ref, compute_dtype=torch.int32)
    for bad in (True, "1e-3", 0.0):  # a bool is not a tolerance; a string is refused, not compared
        with pytest.raises(ValueError, match=f"^rtol must be a positive number, got {bad!r}$".replace(".", r"\.")):
            diagnose(module, ref, rtol=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^your module computes in bfloat16: diagnose compares float32 or float64"):
        _refuse_half("your module", torch.bfloat16)
    with pytest.raises(ValueError, match=r"^compute_dtype computes in float16: diagnose compares"):
        diagnose(module, ref, compute_dtype=torch.float16)


def test_a_module_without_a_mask_runs_on_the_references_device_and_unmasked_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """takes_mask=False: your forward gets x alone, on unmasked probes only (it passes, the mask bugs
    untested), each call on the reference's device; with padding=True a failing forward's error
    names the key-padding mask."""
    from attnlib.audit import search

    ref = reference()
    module = learner(ref)
    devices: list[object] = []
    inner = search._call
    monkeypatch.setattr(search, "_call", lambda *a: devices.append(a[3]) or inner(*a))
    report = diagnose(lambda x: module(x, None), ref, takes_mask=False)
    assert report.ok and report.untested and set(devices) == {ref.w_q.device} and len(devices) > 2

    def boom(x: Tensor, mask: Tensor | None) -> Tensor:
        raise RuntimeError("boom")

    with pytest.raises(ValueError, match=r"^forward\(x, mask\) with x of shape \(\d+, \d+, 12\) and a bool key-padding mask of shape "
                       r"\(\d+, \d+\) \(reference.d_model = 12\) raised RuntimeError .* a bool \(B, n_k\) key-padding mask, "):
        diagnose(boom, ref, padding=True)


def test_a_half_output_and_a_failing_repeat_call_are_named() -> None:
    """A float32 forward whose output is float16 is refused as "your module's output"; a forward
    that fails only when diagnose repeats its first probe (the dropout check) is named with that
    call, key-padding mask and reference width included."""
    ref = reference()
    with pytest.raises(ValueError, match=r"^your module's output computes in float16: "):
        diagnose(lambda x, mask: x.half(), ref)
    seen: list[Tensor] = []

    def fails_again(x: Tensor, mask: Tensor | None) -> Tensor:
        if any(x.shape == s.shape and torch.equal(x, s) for s in seen):
            raise RuntimeError("again")
        seen.append(x)
        return torch.zeros_like(x)

    with pytest.raises(ValueError, match=r"^forward\(x, mask\) with x of shape \(\d+, \d+, 12\) and a bool key-padding mask of shape "
                       r"\(\d+, \d+\) \(reference.d_model = 12\) raised RuntimeError .*: again\. "):
        diagnose(fails_again, ref, padding=True)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_precision_is_refused_with_what_to_do(half: torch.dtype) -> None:
    """bfloat16 rounding is as large as some bugs, and float16 overflows the large-scores
    probe: diagnose refuses both and says to cast the module to float32."""
    torch.manual_seed(0)
    ref = MultiHeadAttention(16, 4)
    module = MultiHeadAttention.from_weights(ref.projections(), 4).to(half)

    def forward(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return module(x, x, x, mask)[0]

    with pytest.raises(ValueError, match=r"half precision rounds as much as some bugs change; call module\.float\(\)"):
        diagnose(module, ref)
    with pytest.raises(ValueError, match=r"(your module's output|your module) computes in"):
        diagnose(forward, ref, dtype=half)
    with pytest.raises(ValueError, match="the reference computes in"):
        diagnose(module.float(), ref.to(half))
