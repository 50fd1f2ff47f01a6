r"""Finding the heads by what they do: attention-pattern scores and ablations (chapter 11).

For one head's map :math:`A` ``(T, T)`` on a sequence :math:`t` with period ``p``, shares
of its attention, averaged over a set of query positions ``i`` (by default those the repeat
decides, :meth:`~attnlib.induction.RepeatTask.predictable`):

.. math::
    \text{previous} = A_{i,\,i-1}, \qquad
    \text{duplicate} = \sum_{j < i,\; t_j = t_i} A_{ij}, \qquad
    \text{induction} = \sum_{1 \le j \le i,\; t_{j-1} = t_i} A_{ij} ,

and the share on the *first* (earliest) of the duplicate and induction positions alone, and
on the latest induction position alone. A *previous-token* head puts its weight on the
position just before; a *duplicate-token* head on earlier occurrences of the current token;
an *induction* head on the tokens that *followed* earlier occurrences, the positions holding
the answer (Olsson et al., 2022).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlib.checks import check_tensor, format_shape
from attnlib.induction.data import RepeatBatch
from attnlib.induction.model import N_LAYERS, InductionRuns

__all__ = ["PATTERNS", "pattern_masks", "pattern_scores", "ablation_accuracy", "part_accuracy", "previous_by_position"]

PATTERNS = ("previous", "duplicate", "first duplicate", "induction", "first induction", "latest induction")


def pattern_masks(tokens: Tensor) -> dict[str, Tensor]:
    """The key positions each pattern counts, per query position: ``tokens`` ``(B, T)`` ->
    a dict keyed by :data:`PATTERNS`, each bool ``(B, T, T)`` (query, key). "first ..." keeps
    the earliest key of a row's set, "latest ..." the last one (no key where the set is empty)."""
    check_tensor("tokens", tokens)
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be (B, T) torch.long ids, got {tokens.dtype} {format_shape(tokens)}")
    B, T = tokens.shape
    before = torch.ones(T, T, dtype=torch.bool).tril(-1)  # (T, T): j < i
    previous = torch.zeros(T, T, dtype=torch.bool)
    previous[torch.arange(1, T), torch.arange(T - 1)] = True  # j = i - 1
    same = tokens[:, :, None] == tokens[:, None, :]  # (B, T, T): t_i = t_j
    after = torch.zeros(B, T, T, dtype=torch.bool)
    after[:, :, 1:] = tokens[:, :, None] == tokens[:, None, :-1]  # t_{j-1} = t_i
    duplicate = same & before  # (B, T, T)
    induction = after & torch.ones(T, T, dtype=torch.bool).tril()  # (B, T, T): j <= i
    return {
        "previous": previous.expand(B, T, T),
        "duplicate": duplicate,
        "first duplicate": duplicate & (duplicate.cumsum(-1) == 1),
        "induction": induction,
        "first induction": induction & (induction.cumsum(-1) == 1),
        "latest induction": induction & (induction.flip(-1).cumsum(-1).flip(-1) == 1),
    }


def _maps(runs: InductionRuns, tokens: Tensor, maps: list[Tensor] | None) -> list[Tensor]:
    """The runs' attention maps on ``tokens`` ``(B, T)``: ``maps`` if given (checked for shape),
    else one forward pass."""
    if not isinstance(runs, InductionRuns):
        raise TypeError(f"runs must be an InductionRuns, got {type(runs).__name__}")
    R, (B, T) = runs.n_runs, tokens.shape
    if maps is None:
        with torch.no_grad():
            _, maps = runs(tokens.expand(R, -1, -1))  # per layer (R, B, h, T, T)
    elif len(maps) != N_LAYERS or any(check_tensor("maps", m).shape != (R, B, runs.num_heads, T, T) for m in maps):
        raise ValueError(f"maps must be {N_LAYERS} tensors (R, B, h, T, T) = {(R, B, runs.num_heads, T, T)}, "
                         f"got {[format_shape(m) for m in maps]}")
    return maps


def pattern_scores(runs: InductionRuns, batch: RepeatBatch, where: Tensor | None = None,
                   maps: list[Tensor] | None = None) -> dict[str, Tensor]:
    """Every head's scores (see the module, one per :data:`PATTERNS`) on one shared ``batch``,
    averaged over the query positions ``where`` (bool ``(B, seq_len)``; default: the
    predictable ones): each ``(R, 2, h)`` (run, layer, head), float64. ``maps``: the runs'
    attention maps on ``batch.tokens``, per layer ``(R, B, h, T, T)``, where already computed
    (by default one forward pass computes them)."""
    tokens, period = batch
    maps = _maps(runs, tokens, maps)
    if where is None:
        where = runs.task.predictable(period)
    elif check_tensor("where", where).dtype != torch.bool or where.shape != tokens.shape or not where.any():
        raise ValueError(f"where must be a bool tensor of the tokens' shape {format_shape(tokens)} with a "
                         f"True somewhere, got {where.dtype} {format_shape(where)}")
    rows = where.double()  # (B, T)
    out = {}
    for name, mask in pattern_masks(tokens).items():
        per_layer = []
        for l in range(N_LAYERS):
            share = (maps[l].double() * mask[None, :, None]).sum(-1)  # (R, B, h, T)
            per_layer.append((share * rows[None, :, None]).sum((1, 3)) / rows.sum())  # (R, h)
        out[name] = torch.stack(per_layer, 1)  # (R, 2, h)
    return out


def ablation_accuracy(runs: InductionRuns, batch: RepeatBatch, heads: list[tuple[int, int]]) -> Tensor:
    """Accuracy on the positions the repeat decides with the listed ``(layer, head)`` pairs
    ablated (their output multiplied by 0) in every run: ``(R,)``. An empty list: the intact
    model."""
    if not isinstance(runs, InductionRuns):
        raise TypeError(f"runs must be an InductionRuns, got {type(runs).__name__}")
    keep = torch.ones(runs.n_runs, N_LAYERS, runs.num_heads)
    for pair in heads:
        l, h = pair
        if not (0 <= l < N_LAYERS and 0 <= h < runs.num_heads):
            raise IndexError(f"heads must be (layer < {N_LAYERS}, head < {runs.num_heads}) pairs, got {pair!r}")
        keep[:, l, h] = 0.0
    R = runs.n_runs
    acc, _ = runs.score(batch.tokens.expand(R, -1, -1), batch.period.expand(R, -1), keep.to(runs.embed.dtype))
    return acc


def part_accuracy(runs: InductionRuns, batch: RepeatBatch, heads: list[int], part: str) -> Tensor:
    r"""Accuracy (on the positions the repeat decides) when layer-0 head ``heads[r]`` of run ``r``
    reads only one part of the stream as its values: ``part="token"``, :math:`W_E[t_j]`;
    ``part="position"``, :math:`W_{pos}[j]` (the ``parts`` of :meth:`InductionRuns.forward`).
    Its attention and every other head are left as they are. ``(R,)``.

    A head that copies a token keeps its model working on the token part alone; one that copies
    a position, on the position part alone."""
    if not isinstance(runs, InductionRuns):
        raise TypeError(f"runs must be an InductionRuns, got {type(runs).__name__}")
    if part not in ("token", "position"):
        raise ValueError(f"part must be 'token' or 'position', got {part!r}")
    if len(heads) != runs.n_runs or any(not 0 <= h < runs.num_heads for h in heads):
        raise ValueError(f"heads must give one layer-0 head (0 .. {runs.num_heads - 1}) per run, got {heads!r}")
    parts = torch.ones(runs.n_runs, runs.num_heads, 2, dtype=runs.embed.dtype)
    parts[torch.arange(runs.n_runs), torch.tensor(heads), 1 if part == "token" else 0] = 0.0
    R = runs.n_runs
    acc, _ = runs.score(batch.tokens.expand(R, -1, -1), batch.period.expand(R, -1), parts=parts)
    return acc


def previous_by_position(runs: InductionRuns, batch: RepeatBatch, layer: int = 0,
                         maps: list[Tensor] | None = None) -> Tensor:
    r"""Each head's weight on the position just before, :math:`A_{i,i-1}`, averaged per query
    position ``i`` over the sequences whose first block contains ``i`` (``1 <= i < p``):
    ``(R, h, max_period - 1)`` for ``i = 1 .. max_period - 1``, float64. The mean over the
    first block weights early positions more (every sequence has them); this shows each one.
    ``maps``: as :func:`pattern_scores`."""
    tokens, period = batch
    maps = _maps(runs, tokens, maps)
    max_period = runs.task.max_period
    i = torch.arange(1, max_period)  # (I,)
    before = maps[layer][:, :, :, i, i - 1].double()  # (R, B, h, I)
    inside = (i[None, :] < period[:, None]).double()  # (B, I): i lies in the first block
    if (inside.sum(0) == 0).any():
        raise ValueError(f"batch needs, for each position 1 .. {max_period - 1}, a sequence whose "
                         f"first block holds it (a period above it); periods here: {sorted(set(period.tolist()))}")
    return (before * inside[None, :, None]).sum(1) / inside.sum(0)  # (R, h, I)
