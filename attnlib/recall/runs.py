r"""Many one-head models, over seeds and widths, trained at once (chapter 7).

A trained claim holds over several seeds, next to a control: :class:`RecallRuns` stores
``R`` :class:`~attnlib.recall.head.RecallHead` models side by side and
:func:`train_recall_runs` trains them as one batched computation, each run exactly as
:func:`~attnlib.recall.head.train_recall` would train it alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from attnlib.checks import check_positive_int, format_shape
from attnlib.optim import AdamW
from attnlib.recall.head import Loss, RecallHead
from attnlib.recall.task import Pairing, PhoneBookTask, RecallBatch

__all__ = ["RecallRuns", "train_recall_runs"]

Target = Literal["centred", "one_hot"]


class RecallRuns(nn.Module):
    r"""``R`` independent one-head models (:class:`RecallHead`), stored side by side so
    that they train in one batched computation: run ``r`` has width ``d_ks[r]`` and starts
    from the weights of ``RecallHead(d_model, n_numbers, d_ks[r], seed=seeds[r])``.

    Weights: ``w_q, w_k, w_v``: ``(R, d_model, d)``, ``w_o``: ``(R, d, d_model)``,
    ``readout``: ``(R, d_model, M)``, with ``d = max(d_ks)``; a narrower run's extra
    columns of ``w_q, w_k, w_v`` and rows of ``w_o`` are zero, get zero gradients and stay
    zero, as the switched-off heads of :class:`RecallHead` do. Per run,

    .. math::
        \alpha = \mathrm{softmax}\!\left(s_r\,\frac{x_q W^Q (C W^K)^\top}{\sqrt{d_k}}\right),
        \qquad \text{logits} = \alpha\, C\, W^V W^O\, W^R ,

    with ``s_r = 0`` where ``search[r]`` is False (a head that never searches: uniform
    weights over the entries; its ``W^Q, W^K`` get no gradient) and ``W^V = W^K`` where
    ``tie_vk[r]`` is True (the key projection is also the value projection; ``w_v`` is
    then unused).
    """

    scale: Tensor
    tied: Tensor

    def __init__(
        self,
        d_model: int,
        n_numbers: int,
        d_ks: Sequence[int],
        seeds: Sequence[int],
        search: Sequence[bool] | None = None,
        tie_vk: Sequence[bool] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        n_runs = len(d_ks)
        if n_runs == 0 or len(seeds) != n_runs:
            raise ValueError(f"d_ks and seeds must be non-empty and of one length, got {n_runs} and {len(seeds)}")
        search = [True] * n_runs if search is None else list(search)
        tie_vk = [False] * n_runs if tie_vk is None else list(tie_vk)
        if len(search) != n_runs or len(tie_vk) != n_runs:
            raise ValueError(f"search and tie_vk must have len(d_ks) = {n_runs} entries, got {len(search)} and {len(tie_vk)}")
        self.d_ks, self.seeds = list(d_ks), list(seeds)
        self.search, self.tie_vk = search, tie_vk
        d = max(d_ks)
        heads = [RecallHead(d_model, n_numbers, d_k, seed=s, dtype=dtype) for d_k, s in zip(d_ks, seeds)]
        dtype = heads[0].readout.dtype
        w = {n: torch.zeros(n_runs, *shape, dtype=dtype) for n, shape in
             [("q", (d_model, d)), ("k", (d_model, d)), ("v", (d_model, d)), ("o", (d, d_model))]}
        for r, head in enumerate(heads):
            h0 = head.attn.head(0)
            k = head.d_k
            w["q"][r, :, :k], w["k"][r, :, :k] = h0.w_q.detach(), h0.w_k.detach()  # (d_model, d_k)
            w["v"][r, :, :k], w["o"][r, :k] = h0.w_v.detach(), h0.w_o.detach()  # (d_model, d_k), (d_k, d_model)
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Parameter(w[n]) for n in "qkvo")
        self.readout = nn.Parameter(torch.stack([h.readout.detach() for h in heads]))  # (R, d_model, M)
        scale = torch.tensor([float(s) / math.sqrt(k) for s, k in zip(search, d_ks)], dtype=dtype)
        self.register_buffer("scale", scale.view(n_runs, 1, 1))  # (R, 1, 1): s_r / sqrt(d_k)
        self.register_buffer("tied", torch.tensor(tie_vk).view(n_runs, 1, 1))  # (R, 1, 1)

    def forward(self, names: Tensor, numbers: Tensor, asked: Tensor) -> tuple[Tensor, Tensor]:
        """``names``, ``numbers``: ``(R, B, n_pairs)`` ids of the entries, ``asked``:
        ``(R, B)`` the question's name -> ``logits``: ``(R, B, n_numbers)``, weights
        ``(R, B, n_pairs)``. A token is two one-hot blocks, so ``x W`` is the sum of the
        two rows of ``W`` that its name and its number pick (the same numbers as the dense
        product, without its zeros)."""
        n_runs, d_model, _ = self.w_q.shape
        n_names = d_model - self.readout.shape[2]
        w_v = torch.where(self.tied, self.w_k, self.w_v)  # (R, d_model, d)
        qk = self.w_q[:, :n_names] @ self.w_k.mT  # (R, N, d_model): W^QK's name rows
        ovr = w_v @ self.w_o @ self.readout  # (R, d_model, M): W^OV W^R
        run = torch.arange(n_runs).view(-1, 1, 1)  # (R, 1, 1)
        row = (run * n_names + asked.unsqueeze(-1)) * d_model  # (R, B, 1): the question's row of W^QK
        flat_qk = qk.flatten()  # (R N d_model,)
        scores = _rows(flat_qk, row + names) + _rows(flat_qk, row + n_names + numbers)  # (R, B, P): x_q W^QK x_j^T
        alpha = torch.softmax(scores * self.scale, -1)  # (R, B, P)
        flat_ovr = ovr.reshape(n_runs * d_model, -1)  # (R d_model, M)
        base = run * d_model  # (R, 1, 1)
        added = _rows(flat_ovr, base + names) + _rows(flat_ovr, base + n_names + numbers)  # (R, B, P, M): x_j W^OV W^R
        logits = (alpha.unsqueeze(-1) * added).sum(-2)  # (R, B, M)
        return logits, alpha

    def run_batch(self, batch: RecallBatch) -> tuple[Tensor, Tensor]:
        """Every run on one shared ``batch``: logits ``(R, B, M)``, weights ``(R, B, P)``."""
        n = len(self.d_ks)
        asked = batch.names[torch.arange(len(batch.slot)), batch.slot]  # (B,)
        return self(batch.names.expand(n, -1, -1), batch.numbers.expand(n, -1, -1), asked.expand(n, -1))

    @torch.no_grad()
    def accuracy(self, batch: RecallBatch) -> Tensor:
        """``(R,)``: each run's share of ``batch`` (one batch, shared) answered right."""
        logits, _ = self.run_batch(batch)
        return (logits.argmax(-1) == batch.target).double().mean(-1)

    @torch.no_grad()
    def circuits(self) -> tuple[Tensor, Tensor]:
        r"""Every run's :math:`W^{QK} = W^Q {W^K}^\top` and :math:`W^{OV} = W^V W^O`:
        ``(R, d_model, d_model)`` each, detached (with ``W^V = W^K`` for a tied run)."""
        w_v = torch.where(self.tied, self.w_k, self.w_v)  # (R, d_model, d)
        return self.w_q @ self.w_k.mT, w_v @ self.w_o

    def head(self, r: int) -> RecallHead:
        """Run ``r`` as a :class:`RecallHead` (a copy; needs ``d_ks[r]`` to divide
        ``d_model`` and ``tie_vk[r]`` False)."""
        d_model, n_numbers = self.readout.shape[1:]
        if self.tie_vk[r] or not self.search[r]:
            raise ValueError(f"run {r} has a tied or switched-off search; a RecallHead has neither")
        k = self.d_ks[r]
        out = RecallHead(d_model, n_numbers, k, seed=self.seeds[r], dtype=self.readout.dtype)
        with torch.no_grad():
            h0 = out.attn.head(0)
            h0.w_q.copy_(self.w_q[r, :, :k])
            h0.w_k.copy_(self.w_k[r, :, :k])
            h0.w_v.copy_(self.w_v[r, :, :k])
            h0.w_o.copy_(self.w_o[r, :k])
            out.readout.copy_(self.readout[r])
        return out


def _rows(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for a 1-d ``index`` into the first dimension, of any shape: ``index.shape +
    table.shape[1:]`` (``index_select``: the same rows, gathered and, backwards, summed in the
    same order as indexing does, at a fraction of its cost on the CPU)."""
    return table.index_select(0, index.flatten()).view(*index.shape, *table.shape[1:])


def train_recall_runs(
    runs: RecallRuns,
    task: PhoneBookTask,
    steps: int = 300,
    batch_size: int = 256,
    lr: float = 0.1,
    weight_decay: float | Sequence[float] = 0.05,
    pairing: Pairing = "all",
    loss: Loss | Sequence[Loss] = "squared",
    target: Target | Sequence[Target] = "centred",
) -> Tensor:
    r"""Train every run of ``runs`` as :func:`train_recall` trains one :class:`RecallHead`,
    run ``r`` on the data stream of ``seed = runs.seeds[r]``; return the losses
    ``(steps, R)``.

    The loss is the sum of the runs' losses, so each run's gradient is its own loss's
    gradient; AdamW acts elementwise, so every run follows its own training (its
    decoupled weight decay, :math:`W \leftarrow (1 - \mathrm{lr}\,\lambda_r) W`, is
    applied per run). ``weight_decay``, ``loss`` and ``target`` take one value for all
    runs or one per run; ``target`` (for the squared error): ``"centred"`` fits
    :math:`e_m - \tfrac1M \mathbf 1`, ``"one_hot"`` fits :math:`e_m`.
    """
    check_positive_int("steps", steps)
    check_positive_int("batch_size", batch_size)
    n_runs = len(runs.d_ks)

    def per_run(name: str, value: object, allowed: tuple[object, ...] | None) -> list[object]:
        values = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value] * n_runs
        if len(values) != n_runs or (allowed is not None and any(v not in allowed for v in values)):
            raise ValueError(f"{name} must be one of {allowed} or {n_runs} of them, got {value!r}"
                             if allowed else f"{name} must be a float or {n_runs} floats, got {value!r}")
        return values

    losses_r = per_run("loss", loss, ("squared", "cross_entropy"))
    targets = per_run("target", target, ("centred", "one_hot"))
    decays = per_run("weight_decay", weight_decay, None)
    if runs.readout.shape[1:] != (task.d_model, task.n_numbers):
        raise ValueError(
            f"runs.readout must have shape (R, d_model, n_numbers) = (R, {task.d_model}, {task.n_numbers}), "
            f"got {format_shape(runs.readout)}"
        )
    dtype = runs.readout.dtype
    shift = torch.tensor([1.0 if t == "centred" else 0.0 for t in targets], dtype=dtype).view(n_runs, 1, 1) / task.n_numbers
    is_ce = torch.tensor([v == "cross_entropy" for v in losses_r])  # (R,)
    keep = torch.tensor([1 - lr * float(w) for w in decays], dtype=dtype)  # type: ignore[arg-type]  # (R,): AdamW's decay factor
    seeds = sorted(set(runs.seeds))
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    pick = torch.tensor([seeds.index(s) for s in runs.seeds])  # (R,): run -> data stream
    params = list(runs.parameters())
    keeps = [keep.view(-1, *[1] * (p.dim() - 1)) for p in params]  # (R, 1, ...) per parameter
    any_ce = bool(is_ce.any())
    opt = AdamW(params, lr=lr, weight_decay=0.0)  # torch.optim.AdamW's update, bit for bit
    losses = torch.empty(steps, n_runs, dtype=dtype)
    rows = torch.arange(batch_size)
    for step in range(steps):
        draws = [task.draw(batch_size, g, pairing) for g in gens]
        names = torch.stack([d[0] for d in draws])[pick]  # (R, B, P)
        numbers = torch.stack([d[1] for d in draws])[pick]  # (R, B, P)
        asked = torch.stack([d[0][rows, d[2]] for d in draws])[pick]  # (R, B)
        answer = torch.stack([d[1][rows, d[2]] for d in draws])[pick]  # (R, B)
        logits, _ = runs(names, numbers, asked)  # (R, B, M)
        goal = nn.functional.one_hot(answer, task.n_numbers).to(dtype) - shift  # (R, B, M)
        value = (logits - goal).square().sum(-1).mean(-1)  # (R,)
        if any_ce:
            ce = nn.functional.cross_entropy(logits.mT, answer, reduction="none").mean(-1)  # (R,)
            value = torch.where(is_ce, ce, value)
        grads = torch.autograd.grad(value.sum(), params)
        with torch.no_grad():
            for p, k in zip(params, keeps):
                p.mul_(k)  # decoupled weight decay, per run
        opt.step(grads)
        losses[step] = value.detach()
    return losses
