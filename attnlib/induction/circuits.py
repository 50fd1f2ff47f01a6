r"""The full virtual circuits of the two-layer model: which token or position each head pair
connects (chapter 11).

A composition score (:mod:`attnlib.induction.composition`) says how much of one head's output a
head of the next layer reads; it does not say *what* is read. Multiplying the circuits out
between the embeddings answers that (Elhage et al., 2021, read this way their two-layer models;
ARENA's exercises do it with TransformerLens). With :math:`E = W_E` ``(V, d)``, :math:`P = W_{pos}`
``(T, d)``, :math:`W_U` ``(d, V)``, a layer-0 head ``a`` and a layer-1 head ``b``:

- **K-composition, token circuit** ``(V, V)``: :math:`E\, W^{QK}_{1,b}\, (E\, W^{OV}_{0,a})^\top`.
  Row ``s``: a layer-1 query holding token ``s``; column ``s'``: a key position into which head
  ``a`` copied the token ``s'`` (a previous-token head copies the token before it). An
  induction head built on a previous-token head matches ``s`` with ``s``: a diagonal.
- **Q-composition, positional circuit** ``(T, T)``: :math:`(P\, W^{OV}_{0,a})\, W^{QK}_{1,b}\, P^\top`.
  Row ``k``: a layer-1 query into which head ``a`` copied the position ``k`` (a duplicate-token
  head copies where the current token occurred first); column ``j``: a key position. An induction
  head built on it looks one position later: a line just above the diagonal, ``j = k + 1``.
- **Copying circuit** ``(V, V)``: :math:`E\, W^{OV}_{1,b}\, W_U`. Row ``s``: the token at the
  position head ``b`` reads; column: the logit it raises. A head that copies raises ``s`` most.

Each is summarised by a *diagonal rate*: the share of rows whose largest entry is at the
expected column (:func:`diagonal_rate`). Everything is computed in float64 for all runs at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlib.induction.model import InductionRuns

__all__ = ["head_circuits", "virtual_circuits", "diagonal_rate", "circuit_rates"]


def head_circuits(runs: InductionRuns, layer: int) -> tuple[Tensor, Tensor]:
    r"""Every run's per-head :math:`W^{QK} = W^Q {W^K}^\top` and :math:`W^{OV} = W^V W^O` of one
    layer, float64: two ``(R, h, d_model, d_model)`` tensors (head ``i`` owns columns
    ``i d_k .. (i+1) d_k - 1`` of ``W^Q, W^K, W^V`` and those rows of ``W^O``)."""
    if not isinstance(runs, InductionRuns):
        raise TypeError(f"runs must be an InductionRuns, got {type(runs).__name__}")
    R, h, d, k = runs.n_runs, runs.num_heads, runs.d_model, runs.d_k

    def cols(w: Tensor) -> Tensor:  # (R, d, d) -> (R, h, d, d_k)
        return w.detach().double().view(R, d, h, k).transpose(1, 2)

    q, kk, v = cols(runs.w_q[:, layer]), cols(runs.w_k[:, layer]), cols(runs.w_v[:, layer])
    o = runs.w_o[:, layer].detach().double().view(R, h, k, d)  # (R, h, d_k, d)
    return q @ kk.mT, v @ o  # (R, h, d, d) each


def virtual_circuits(runs: InductionRuns) -> dict[str, Tensor]:
    r"""The three circuits of the module for every run and head pair, float64:
    ``"K"`` ``(R, h0, h1, V, V)``, ``"positional"`` ``(R, h0, h1, T, T)`` (indexed by layer-0
    head ``a``, then layer-1 head ``b``) and ``"copying"`` ``(R, h1, V, V)``."""
    qk1, ov1 = head_circuits(runs, 1)  # (R, h, d, d)
    _, ov0 = head_circuits(runs, 0)
    E = runs.embed.detach().double()[:, None]  # (R, 1, V, d)
    P = runs.pos.detach().double()[:, None]  # (R, 1, T, d)
    U = runs.unembed.detach().double()[:, None]  # (R, 1, d, V)
    written_tok = (E @ ov0)[:, :, None]  # (R, h0, 1, V, d): E W^OV_0a
    written_pos = (P @ ov0)[:, :, None]  # (R, h0, 1, T, d): P W^OV_0a
    k_circuit = (E @ qk1)[:, None] @ written_tok.mT  # (R, h0, h1, V, V)
    positional = written_pos @ qk1[:, None] @ P[:, None].mT  # (R, h0, h1, T, T)
    copying = E @ ov1 @ U  # (R, h1, V, V)
    return {"K": k_circuit, "positional": positional, "copying": copying}


def diagonal_rate(m: Tensor, offset: int = 0, rows: int | None = None) -> Tensor:
    r"""Share of the rows ``s`` of ``m`` ``(..., n, n')`` whose largest entry is in column
    ``s + offset``: ``(...)``. ``rows``: only the first ``rows`` rows count (default all those
    whose expected column exists). A tie counts as a miss unless the expected column is the
    first of the tied ones (``argmax``'s rule); trained circuits have no ties."""
    if not isinstance(m, Tensor) or m.dim() < 2:
        raise ValueError(f"m must be a tensor (..., n, n'), got {type(m).__name__}")
    n = min(m.shape[-2], m.shape[-1] - offset) if rows is None else rows
    if offset < 0 or not 0 < n <= m.shape[-2] or n + offset > m.shape[-1]:
        raise ValueError(f"rows {rows} with offset {offset} do not fit a matrix of shape {tuple(m.shape[-2:])}")
    hit = m[..., :n, :].argmax(-1) == torch.arange(n) + offset  # (..., n)
    return hit.double().mean(-1)


def circuit_rates(runs: InductionRuns) -> dict[str, Tensor]:
    r"""The diagonal rates of :func:`virtual_circuits`: ``"K"`` ``(R, h0, h1)`` (row ``s`` peaks
    at ``s``), ``"positional"`` ``(R, h0, h1)`` (row ``k`` peaks at ``k + 1``, for the positions
    ``k = 0 .. max_period - 1`` that a first occurrence can hold), ``"copying"`` ``(R, h1)``."""
    c = virtual_circuits(runs)
    return {"K": diagonal_rate(c["K"]), "positional": diagonal_rate(c["positional"], 1, runs.task.max_period),
            "copying": diagonal_rate(c["copying"])}
