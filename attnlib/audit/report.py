"""What :func:`~attnlib.audit.diagnose` and :func:`~attnlib.audit.diagnose_cache` found, and
how it reads."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from attnlib.audit.catalogue import BUGS_BY_NAME, Bug

__all__ = ["PADDED_ROWS", "AuditReport", "fmt_error", "hint_for", "register_bugs"]

_EXTRA_BUGS: dict[str, Bug] = {}  # filled by register_bugs
PADDED_ROWS: Mapping[str, str] = MappingProxyType({
    "the real keys": "attention over the real keys, as in the reference",
    "zeros": "zeros (it is blocked from every key)",
    "NaN": "NaN (it is blocked from every key)",
    "mean of values": "the mean of all values (it is blocked from every key by a finite fill)",
    "as if unmasked": "the unmasked softmax (every key of its row got the same additive mask)",
    "zero vectors": "zero vectors",
})
"""What a module may return for a padded query (``padding=True``; not compared, a convention):
name -> description."""


def register_bugs(bugs: Iterable[Bug]) -> None:
    """Let a report name ``bugs`` as it names those of the catalogue: the cache check
    (:mod:`attnlib.audit.cache`) registers its own, so that one report reads both."""
    _EXTRA_BUGS.update({b.name: b for b in bugs if b.name not in BUGS_BY_NAME})


def _bug(name: str) -> Bug:
    return BUGS_BY_NAME[name] if name in BUGS_BY_NAME else _EXTRA_BUGS[name]


@dataclass(frozen=True)
class AuditReport:
    """What :func:`diagnose` found.

    - ``ok``: your outputs match the reference's to within ``rtol`` on every probe (a query
      whose keys are all blocked may return any of the conventions in ``blocked_rows``).
    - ``bugs``: every catalogue name of the explanations that fit (one bug, a pair, or all the
      names of explanations the probes cannot tell apart); empty when ``ok`` and when nothing
      in the catalogue explains your outputs.
    - ``explanations``: every explanation of the smallest size that fits; more than one when
      the probes cannot tell the bugs apart for this reference (``tie`` says why, and which
      sizes would separate them).
    - ``max_error``: the worst relative error over all probes (``inf`` for NaN or inf).
    - ``errors``: the worst relative error per kind of probe (``"no mask"``, ``"causal"``,
      ``"random mask"``, ``"blocked row"``, ``"large scores"``, ``"padding"``, ...).
    - ``undetectable``: bugs that compute the same numbers as the right layer for this
      reference (e.g. ``scale_by_d_model`` with one head), so no test with it can see them.
    - ``blocked_rows``: what your module returns for a query whose keys are all blocked
      (a convention, not a bug: ``"zeros"``, ``"NaN"``, ``"mean of values"``, ``"as if
      unmasked"``), or ``None`` when no probe had such a query or nothing fits.
    - ``dtype``, ``reference_dtype``: of your outputs and of the reference.
    - ``raised``: the kinds of probe on which your forward raised (an explanation must raise
      there too), with the error.
    - ``untested``: the bugs no probe could test, because your module takes no mask
      (``takes_mask=False``): they act on a mask only.
    - ``padded_rows``: with ``padding=True``, what your module returns for a padded query (a
      convention, not compared: a key of :data:`~attnlib.audit.report.PADDED_ROWS`, or
      ``"something else"``); None otherwise.
    - ``compute_dtype``: the dtype a step of your module computes in, declared
      (``compute_dtype=``) or inferred (a float64 module within float32's rounding of the
      reference, or a bug named only at float32's tolerance); empty when neither.
    - ``suspected_dtype``: ``"float32"`` when that dtype was inferred, not declared: your float64
      module's outputs are within float32's rounding of the reference but not float64's, and you
      declared no ``compute_dtype``. Such a report is ``ok`` at float32's tolerance (``rtol``),
      and its note says that a real error that small (a scale off by 1e-4) would pass the same
      way: declare ``compute_dtype=torch.float64`` for a module that computes in float64
      throughout, to check it at float64's rounding. Also ``"float32"`` when a bug was named at
      float32's tolerance. Empty otherwise.
    - ``notes``: further lines of the report (why a tolerance was raised, ...).
    """

    ok: bool
    bugs: tuple[str, ...]
    explanations: tuple[tuple[str, ...], ...]
    max_error: float
    errors: Mapping[str, float]
    undetectable: tuple[str, ...]
    rtol: float
    num_heads: int
    blocked_rows: str | None = None
    dtype: str = ""
    reference_dtype: str = ""
    tie: str = ""
    raised: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    hint: str = ""
    untested: tuple[str, ...] = ()
    padded_rows: str | None = None
    compute_dtype: str = ""
    notes: tuple[str, ...] = ()
    suspected_dtype: str = ""

    def __str__(self) -> str:
        if self.ok:
            lines = [f"OK: matches the reference to within {fmt_error(self.rtol)} (relative) on every probe"]
        else:
            per_kind = ", ".join(f"{k} {fmt_error(v) if v > self.rtol else 'ok'}" for k, v in self.errors.items())
            lines = [f"WRONG: worst relative error {fmt_error(self.max_error)} ({per_kind})"]
        if self.dtype and self.dtype != self.reference_dtype:
            lines.append(
                f"dtypes: your module returns {self.dtype}, the reference is {self.reference_dtype}; "
                f"compared at the coarser one's rounding tolerance, {fmt_error(self.rtol)}"
            )
        lines.extend(self.notes)
        if self.blocked_rows is not None:
            lines.append(f"a query with every key blocked gets, in your module: {self.blocked_rows} "
                         "(a convention, not a bug)")
        if self.padded_rows is not None:
            what = PADDED_ROWS.get(self.padded_rows, self.padded_rows)
            lines.append(f"a padded query (not compared) gets, in your module: {what} (a convention, not a bug)")
        if self.untested:
            lines.append(f"your module takes no mask, so these bugs could not be tested: {', '.join(self.untested)}")
        for kind, err in self.raised.items():
            lines.append(f"your forward raised on the {kind} probes: {err}")
        if self.undetectable:
            lines.append(
                f"note: with h = {self.num_heads} and these weights, these bugs compute the same "
                f"numbers as the right layer and cannot be seen: {', '.join(self.undetectable)}"
            )
        if self.ok:
            return _wrap(lines)
        if not self.explanations:
            lines.append("no bug of the catalogue, alone or in a pair, explains these numbers;")
            lines.append(self.hint)
            return _wrap(lines)
        several = len(self.explanations) > 1
        if several:
            alts = "; ".join(" + ".join(e) for e in self.explanations)
            lines.append(f"the probes cannot tell these explanations apart (look for each): {alts}")
            lines.append(f"why: {self.tie}")
        for i, explanation in enumerate(self.explanations, 1):
            for name in explanation:
                bug = _bug(name)
                lines.append(f"{f'({i}) ' if several else ''}bug {name}: {bug.description}")
                lines.append(f"  look for: {bug.look_for}")
                lines.append(f"  write:    {bug.fix}")
                if bug.note:
                    lines.extend(textwrap.wrap(bug.note, 78, initial_indent="  note: ", subsequent_indent="    "))
        return _wrap(lines)


def _wrap(lines: list[str], width: int = 78) -> str:
    """Lines of prose wrapped to ``width``; the code lines (indented) kept whole."""
    return "\n".join(
        line if line.startswith("  ") else textwrap.fill(line, width, subsequent_indent="  ")
        for line in lines
    )


def fmt_error(e: float) -> str:
    """A relative error or tolerance as the report prints it: two significant digits, or ``inf``."""
    return "inf" if math.isinf(e) else f"{e:.2g}"


def hint_for(errors: Mapping[str, float], rtol: float, *, causal: bool = False) -> str:
    """What to look at when no bug of the catalogue explains the numbers. ``causal``: the call
    form runs no unmasked probe (the module masks the future itself)."""
    wrong = {k for k, e in errors.items() if e > rtol}
    beyond = (" If your module adds positions inside attention (partial rotary, a relative position bias; "
              "ALiBi needs an AlibiAttention reference), normalises q and k (QK-norm) or caps its scores "
              "(logit soft-capping), no attnlib reference computes it; a sliding window applied inside "
              "your module must go into the mask instead: see chapter 9's table of what cannot be referenced.")
    if wrong == {"large scores"}:
        renormalised = ("masking after the softmax and renormalising (w = softmax(s) * mask; w = w / "
                        "w.sum(-1)), which divides 0 by 0 (NaN) where blocked keys take all the weight and "
                        "the allowed ones underflow: mask the scores before the softmax")
        finite = ("a finite mask value (-1e4 or -1e5 added, say), which loses to scores this far apart: "
                  "fill with float('-inf') or torch.finfo(dtype).min")
        capped = (" A module that caps its scores (logit soft-capping, c * tanh(s / c), as in Gemma 2) "
                  "differs there too, and no attnlib reference computes it: see chapter 9's table of what "
                  "cannot be referenced.")
        if math.isinf(errors["large scores"]):
            return (f"right except with large scores, where your output holds NaN or inf. Look for {renormalised}; "
                    f"or for {finite}." + capped)
        return ("right except with large scores: blocked keys leak or allowed ones underflow there. Look for "
                f"{finite}; or for {renormalised}." + capped)
    if wrong == {"blocked row"}:
        return ("right except for the query whose keys are all blocked: it returns neither zeros, NaN, "
                "the mean of the values nor the unmasked softmax there.")
    if wrong and wrong <= {"steps", "chunks"}:
        which = "one-token steps" if wrong == {"steps"} else "steps after the prefill"
        return f"the prefill is right, the {which} are not: look at how the cache is updated and read."
    if any(k in errors and errors[k] <= rtol for k in ("no mask", "no padding")):
        return "right without a mask, wrong with one: look at how the mask is applied."
    if any(math.isinf(e) for e in errors.values()):
        return "NaN or inf in your output: look for a softmax over a row of -inf, or an overflow." + beyond
    if any(k in errors for k in ("no mask", "no padding")):
        return (
            "wrong even without a mask, so not (only) the mask: compare your attention weights with "
            "reference(x, x, x, mask=mask)[1], of shape (B, h, n, n), then the other steps." + beyond
        )
    first = ("every probe of this call form is masked (causal=True: your module masks the future "
             "itself), so the mask and the other steps are both suspects" if causal
             else "every probe of this call form is masked, so the mask and the other steps are both suspects")
    return (
        f"{first}: compare your attention weights with reference(x, x, x, mask=mask)[1], of shape "
        "(B, h, n, n), then the other steps." + beyond
    )
