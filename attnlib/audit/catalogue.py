"""The catalogue of bugs: each one a name, its typical wrong line, the fix, and the steps of
the computation it changes (fields of :class:`Recipe`, whose defaults are right)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = [
    "BUGS", "BUGS_BY_NAME", "MASK_FIELDS", "PAIRS", "Bug", "Mode", "Recipe", "active_bugs", "active_pairs",
    "can_plant_together", "mask_bugs", "tie_reason",
]

Mode = Literal["causal", "padding", "cross", "grouped", "rope", "mask"]

MASK_FIELDS = frozenset({"mask_true", "mask_use", "padding"})
"""The steps of :class:`Recipe` that only act on a mask: a module that takes no mask and masks
nothing itself (``takes_mask=False`` without ``causal``) runs none of them."""


@dataclass(frozen=True)
class Recipe:
    """How a forward pass computes each step; the defaults are right."""

    # every projection, W^O included: x @ W (right) or x @ W.T
    projection: Literal["x @ W", "x @ W.T"] = "x @ W"
    # the layer that makes the values
    value_weights: Literal["W_v", "W_k"] = "W_v"
    # what the keys and the values are projected from (cross-attention: the context)
    key_input: Literal["context", "x"] = "context"
    value_input: Literal["context", "x"] = "context"
    # (B, n, d) -> (B, h, n, d_k)
    split: Literal["view, transpose", "view"] = "view, transpose"
    # RoPE's pairs: (j, j + d_k/2) with rotate_half (right); (2j, 2j+1); or rotate_half
    # with GPT-J's interleaved frequencies; and whether the values are rotated too
    rope: Literal["rotate-half", "adjacent", "half, interleaved angles"] = "rotate-half"
    rope_values: bool = False
    # grouped keys/values: query head i reads group i // (h/g) (repeat_interleave) or i % g (repeat)
    kv_expand: Literal["repeat_interleave", "repeat"] = "repeat_interleave"
    # the scores are divided by it
    scale: Literal["sqrt(d_k)", "1", "sqrt(d_model)", "d_k"] = "sqrt(d_k)"
    # the module's own causal mask: key j visible to query i when j <= i (right), j < i,
    # j <= i + 1, or j >= i
    causal: Literal["j <= i", "j < i", "j <= i + 1", "j >= i"] = "j <= i"
    # a (B, n_k) padding mask as (B, 1, 1, n_k) (right), (B, 1, n, 1), or folded into
    # (B*h) rows by repeat (b*h + i) / repeat_interleave (i*B + b) the wrong way round;
    # "keys and queries" (a padded query blocked from every key, as vit-pytorch did in 2021)
    # is no bug: it changes only the padded queries' rows, which are a convention
    padding: Literal["keys", "queries", "fold b*h+i by repeat", "fold i*B+b by repeat_interleave",
                     "keys and queries"] = "keys"
    # -1: each query's weights over the keys sum to 1; -2: over the queries
    softmax_dim: Literal[-1, -2] = -1
    # what True in the mask means
    mask_true: Literal["may attend", "blocked"] = "may attend"
    # how the mask is used: blocked scores set to -inf (right), the mask ignored, blocked
    # scores set to 0, weights zeroed after the softmax, or blocked scores set to (or
    # shifted by, "+") a finite value that scores further apart than it overcome
    mask_use: Literal["-inf", "ignored", "0", "after softmax", "-1e4", "+ -1e4", "-1e5", "+ -1e5"] = "-inf"
    # (B, h, n, d_k) -> (B, n, d)
    merge: Literal["transpose, reshape", "reshape"] = "transpose, reshape"
    # multiply the concatenation by W^O (and add b^O)
    output_projection: bool = True

    def effective(self) -> Recipe:
        """The same computation, with the fields it never reads set to their defaults."""
        if self.mask_use == "ignored":  # an ignored mask has no polarity
            return dataclasses.replace(self, mask_true="may attend")
        return self


@dataclass(frozen=True)
class Bug:
    """One mistake of the catalogue: what it is, where it lives, what it changes.

    ``needs``: the call forms or reference features without which it cannot occur
    (``causal``, ``padding``, ``cross``, ``grouped``, ``rope``); ``alternatives``: other
    changes that are the same mistake made the other way round (tried as well).
    """

    name: str
    description: str
    look_for: str  # the wrong line in its typical hand-written form
    fix: str  # the right line
    change: Mapping[str, object]  # the fields of Recipe the mistake changes
    note: str = ""  # where else the fix may belong (an adapter, the loading code)
    needs: frozenset[str] = frozenset()
    alternatives: tuple[Mapping[str, object], ...] = ()

    @property
    def all_needs(self) -> frozenset[str]:
        """``needs``, plus ``"mask"`` for a bug that changes how a mask is used (it cannot occur
        in a module that takes no mask and masks nothing itself)."""
        fields = set(self.change).union(*(set(c) for c in self.alternatives))
        return self.needs | (frozenset({"mask"}) if fields & MASK_FIELDS else frozenset())

    def recipe(self, base: Recipe | None = None) -> Recipe:
        return dataclasses.replace(base or Recipe(), **self.change)  # type: ignore[arg-type]

    def recipes(self, base: Recipe | None = None) -> tuple[Recipe, ...]:
        """The recipe, and one per alternative way of making the same mistake."""
        return tuple(
            dataclasses.replace(base or Recipe(), **c)  # type: ignore[arg-type]
            for c in (self.change, *self.alternatives)
        )


def _need(*modes: Mode) -> frozenset[str]:
    return frozenset(modes)


_CATALOGUE: tuple[Bug, ...] = (
    Bug(
        "missing_scale",
        "scores not divided by √d_k",
        "scores = q @ k.transpose(-2, -1)",
        "scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)",
        {"scale": "1"},
    ),
    Bug(
        "scale_by_d_model",
        "scores divided by √d_model instead of √d_k",
        "scores = q @ k.transpose(-2, -1) / math.sqrt(d_model)",
        "scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)",
        {"scale": "sqrt(d_model)"},
    ),
    Bug(
        "softmax_wrong_axis",
        "softmax normalised over the queries (dim=-2) instead of the keys",
        "weights = scores.softmax(dim=-2)",
        "weights = scores.softmax(dim=-1)   # over the keys",
        {"softmax_dim": -2},
    ),
    Bug(
        "split_without_transpose",
        "(B, n, d) viewed as (B, h, n, d_k) directly",
        "q = q.view(B, h, n, d_k)",
        "q = q.view(B, n, h, d_k).transpose(1, 2)",
        {"split": "view"},
    ),
    Bug(
        "merge_without_transpose",
        "heads (B, h, n, d_k) reshaped to (B, n, d) without transposing back",
        "out = heads.reshape(B, n, d_model)",
        "out = heads.transpose(1, 2).reshape(B, n, d_model)",
        {"merge": "reshape"},
    ),
    Bug(
        "mask_inverted",
        "True in the mask treated as blocked",
        "scores = scores.masked_fill(mask, float('-inf'))",
        "scores = scores.masked_fill(~mask, float('-inf'))",
        {"mask_true": "blocked"},
        "auditing another library's layer through an adapter, the slip is usually the adapter's: "
        "convert the mask there (torch's attn_mask takes True = blocked: pass ~mask).",
    ),
    Bug(
        "mask_ignored",
        "the mask not applied (e.g. masked_fill's result thrown away)",
        "scores.masked_fill(~mask, float('-inf'))   # result not assigned",
        "scores = scores.masked_fill(~mask, float('-inf'))",
        {"mask_use": "ignored"},
        "auditing another library's layer with causal=True: Hugging Face's attention layers "
        "(GPT2Attention in eager mode, LlamaAttention, ...) apply no causal mask of their own; "
        "the model builds it and passes it in attention_mask, so an adapter that calls the layer "
        "alone must pass it too.",
    ),
    Bug(
        "missing_output_projection",
        "the concatenated heads returned without W^O",
        "return heads.transpose(1, 2).reshape(B, n, d_model)",
        "return self.W_o(heads.transpose(1, 2).reshape(B, n, d_model))",
        {"output_projection": False},
        "auditing another library's layer through an adapter, the adapter may have left out the "
        "library's output layer (BERT keeps W^O in BertSelfOutput's dense layer): apply it there.",
    ),
    Bug(
        "weights_transposed",
        "every projection applied as x @ Wᵀ instead of x @ W",
        "layer.weight.copy_(W)   # or: x @ W.T",
        "layer.weight.copy_(W.T)   # nn.Linear computes x @ weight.T",
        {"projection": "x @ W.T"},
        "a wrong load is seen only against a reference built from the weights you loaded from; "
        "a reference read back from the module holds the same transposed weights and passes it.",
    ),
    Bug(
        "mask_fill_zero",
        "blocked scores set to 0 instead of -inf, so blocked keys keep weight",
        "scores = scores.masked_fill(~mask, 0)",
        "scores = scores.masked_fill(~mask, float('-inf'))",
        {"mask_use": "0"},
    ),
    Bug(
        "mask_after_softmax",
        "blocked weights zeroed after the softmax, so the rows no longer sum to 1",
        "weights = scores.softmax(dim=-1).masked_fill(~mask, 0)",
        "weights = scores.masked_fill(~mask, float('-inf')).softmax(dim=-1)",
        {"mask_use": "after softmax"},
    ),
    Bug(
        "value_uses_key_weights",
        "values projected with the key layer (a copy-paste slip)",
        "v = self.W_k(x)",
        "v = self.W_v(x)",
        {"value_weights": "W_k"},
    ),
    Bug(
        "double_scale",
        "scores divided by √d_k twice (by d_k): q pre-scaled and the scores scaled again",
        "q = q / math.sqrt(d_k)   # and the scores scaled again",
        "scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)   # once",
        {"scale": "d_k"},
    ),
    Bug(
        "mask_fill_finite",
        "blocked scores filled with (or shifted by) a finite value such as -1e4, which a blocked "
        "key whose score is that much larger overcomes",
        "scores = scores.masked_fill(mask == 0, -10000)   # or + (1 - mask) * -1e4",
        "scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)   # or float('-inf')",
        {"mask_use": "-1e4"},
        "harmless while the scores of a row stay within about 1e4 of each other; the large-scores "
        "probe spreads them over about 1e6. -1e4 was common where float16 cannot hold -1e9.",
        alternatives=({"mask_use": "+ -1e4"}, {"mask_use": "-1e5"}, {"mask_use": "+ -1e5"}),
    ),
    Bug(
        "causal_blocks_diagonal",
        "the causal mask also blocks the diagonal: a token cannot see itself (row 0 sees nothing)",
        "torch.tril(torch.ones(n, n), diagonal=-1)   # or blocked: triu(...)",
        "torch.tril(torch.ones(n, n))   # or blocked: triu(..., diagonal=1)",
        {"causal": "j < i"},
        needs=_need("causal"),
    ),
    Bug(
        "causal_sees_next",
        "the causal mask lets each token see the next one",
        "torch.tril(torch.ones(n, n), diagonal=1)   # or blocked: triu(..., 2)",
        "torch.tril(torch.ones(n, n))   # or blocked: triu(..., diagonal=1)",
        {"causal": "j <= i + 1"},
        needs=_need("causal"),
    ),
    Bug(
        "causal_reversed",
        "the causal mask keeps the future and blocks the past (a token still sees itself)",
        "torch.triu(torch.ones(n, n))   # or blocked: tril(..., diagonal=-1)",
        "torch.tril(torch.ones(n, n))   # or blocked: triu(..., diagonal=1)",
        {"causal": "j >= i"},
        needs=_need("causal"),
    ),
    Bug(
        "padding_head_order",
        "the (B, n) padding mask folded into the (B*h) rows in the wrong order",
        "mask.repeat(h, 1)   # rows b*h + i (for i*B + b: repeat_interleave)",
        "mask.repeat_interleave(h, dim=0)   # row b*h + i: sequence b",
        {"padding": "fold b*h+i by repeat"},
        needs=_need("padding"),
        alternatives=({"padding": "fold i*B+b by repeat_interleave"},),
    ),
    Bug(
        "padding_on_queries",
        "the padding mask applied to the queries, (B, 1, n, 1), instead of the keys",
        "mask = mask[:, None, :, None]",
        "mask = mask[:, None, None, :]   # (B, 1, 1, n): padded keys",
        {"padding": "queries"},
        needs=_need("padding"),
    ),
    Bug(
        "keys_from_query",
        "keys projected from the query input instead of the context",
        "k = self.W_k(x)",
        "k = self.W_k(context)",
        {"key_input": "x"},
        needs=_need("cross"),
    ),
    Bug(
        "values_from_query",
        "values projected from the query input instead of the context",
        "v = self.W_v(x)",
        "v = self.W_v(context)",
        {"value_input": "x"},
        needs=_need("cross"),
    ),
    Bug(
        "kv_head_order",
        "grouped key/value heads expanded in tile order: head i reads group i % g",
        "k = k.repeat(1, h // g, 1, 1)",
        "k = k.repeat_interleave(h // g, dim=1)   # head i: group i // (h/g)",
        {"kv_expand": "repeat"},
        needs=_need("grouped"),
    ),
    Bug(
        "rope_pairing",
        "RoPE rotates adjacent pairs (2j, 2j+1) where the weights expect rotate-half pairs "
        "(j, j + d_k/2), or the two layouts are mixed",
        "x[..., ::2], x[..., 1::2]   # or rotate_half with interleaved freqs",
        "x * cos + rotate_half(x) * sin   # cos = cat(freqs, freqs).cos()",
        {"rope": "adjacent"},
        "a checkpoint stored for the other layout (Meta's Llama vs Hugging Face's) needs its "
        "q/k rows permuted when loaded; the fix may belong in the loading code.",
        needs=_need("rope"),
        alternatives=({"rope": "half, interleaved angles"},),
    ),
    Bug(
        "rope_on_values",
        "RoPE applied to the values as well as to the queries and keys",
        "q, k, v = (apply_rope(t, pos) for t in (q, k, v))",
        "q, k = apply_rope(q, pos), apply_rope(k, pos)   # not v",
        {"rope_values": True},
        needs=_need("rope"),
    ),
)

BUGS_BY_NAME: Mapping[str, Bug] = MappingProxyType({b.name: b for b in _CATALOGUE})
"""The catalogue: bug name -> its :class:`Bug` record (read-only)."""

BUGS: Mapping[str, str] = MappingProxyType({b.name: b.description for b in _CATALOGUE})
"""The catalogue: bug name -> one-line description (read-only)."""


def can_plant_together(a: Bug, b: Bug) -> bool:
    """Two bugs can be planted together when they change different steps."""
    return not set(a.change) & set(b.change)


_SINGLES = {b.recipe().effective() for b in _CATALOGUE}

_ALL_PAIRS: tuple[tuple[Bug, Bug], ...] = tuple(
    (a, b)
    for a, b in itertools.combinations(_CATALOGUE, 2)
    if can_plant_together(a, b) and b.recipe(a.recipe()).effective() not in _SINGLES
)


def active_bugs(modes: frozenset[str]) -> tuple[Bug, ...]:
    """The bugs that can occur in a call form with these features."""
    return tuple(b for b in _CATALOGUE if b.all_needs <= modes)


def active_pairs(modes: frozenset[str]) -> tuple[tuple[Bug, Bug], ...]:
    return tuple((a, b) for a, b in _ALL_PAIRS if a.all_needs <= modes and b.all_needs <= modes)


def mask_bugs(modes: frozenset[str]) -> tuple[str, ...]:
    """The bugs of a call form that need a mask: those :func:`diagnose` cannot test when the
    module takes none (``modes`` without ``"mask"``)."""
    return tuple(b.name for b in _CATALOGUE if b.all_needs - {"mask"} <= modes and "mask" in b.all_needs)


PAIRS: tuple[tuple[str, str], ...] = tuple((a.name, b.name) for a, b in active_pairs(frozenset({"mask"})))
"""The pairs of bugs :func:`diagnose` tries in its default call form (self-attention, a plain
reference): every two that change different steps, except a pair that computes what one bug
computes alone (``mask_inverted`` with ``mask_ignored``: an ignored mask has no polarity). The
other call forms add the pairs of their own bugs."""


# ---- ties: why two bugs give the same numbers, and which sizes separate them ------------

_TIES: tuple[tuple[frozenset[str], Callable[[int, int, int], bool], str], ...] = (
    (frozenset({"scale_by_d_model", "double_scale"}), lambda h, d_k, d_model: d_model == d_k * d_k,
     "√d_model equals d_k when d_model = d_k², which for d_model = h·d_k means h = d_k; any reference "
     "with h ≠ d_k (and d_model ≠ d_k²) separates them"),
)
"""Known ties: two bugs that compute the same numbers for some sizes ``(h, d_k)``, and why.
(A bug that computes the right numbers for some sizes, ``scale_by_d_model`` with one head, is
no tie: the report lists it as undetectable.)"""


def tie_reason(names: frozenset[str], h: int, d_k: int, d_model: int | None = None) -> str:
    """Why the explanations ``names`` give the same outputs here, and what would separate them
    (``d_model``: default ``h * d_k``)."""
    d = h * d_k if d_model is None else d_model
    for pair, condition, reason in _TIES:
        if pair <= names and condition(h, d_k, d):
            sizes = f"h = {h}, d_k = {d_k}" + ("" if d == h * d_k else f", d_model = {d}")
            return f"{' and '.join(sorted(pair))}: {reason} (here {sizes})"
    return (
        "for these weights and probes they compute the same outputs; a reference with other "
        "random weights (another seed) or other sizes (h, d_k) may separate them"
    )
