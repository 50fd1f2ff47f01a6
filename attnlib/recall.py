r"""The phone book, learned: an associative-recall task and one trained head (chapter 7).

A sequence holds ``n_pairs`` (name, number) tokens and then one query token that
names one of them; the target is that name's number. Every token is the
concatenation of two one-hot blocks, so the key part and the value part of a
token can be read off its coordinates:

.. math::
    x(\text{name } a, \text{number } m) = e_a \oplus e_m \in \mathbb{R}^{N + M},
    \qquad x_{query}(a) = e_a \oplus 0 ,

with ``N = n_names`` and ``M = n_numbers``; ``d_model = N + M``. The first
``N`` coordinates are the **key block**, the last ``M`` the **value block**.

:class:`RecallHead` is one :class:`~attnlib.multihead.MultiHeadAttention` layer
(the query token attends to the pair tokens) followed by a linear read-out to
``M`` number logits; :func:`train_recall` trains it deterministically with AdamW.
Tasks of this kind go back to Ba et al. (2016); Olsson et al. (2022) and
Arora et al. (2023) use them to study attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from attnlib._core import check_positive_int, check_tensor, format_shape
from attnlib.multihead import MultiHeadAttention

__all__ = ["PhoneBookTask", "RecallBatch", "RecallHead", "train_recall", "block_fractions"]

Pairing = Literal["all", "even", "odd"]
Loss = Literal["squared", "cross_entropy"]


class RecallBatch(NamedTuple):
    """A batch of phone books and queries.

    ``context``: ``(B, n_pairs, d_model)`` pair tokens; ``query``: ``(B, 1, d_model)``;
    ``target``: ``(B,)`` the queried name's number; ``names``, ``numbers``:
    ``(B, n_pairs)`` integer ids of each pair; ``slot``: ``(B,)`` the position of
    the pair that holds the queried name.
    """

    context: Tensor
    query: Tensor
    target: Tensor
    names: Tensor
    numbers: Tensor
    slot: Tensor


@dataclass(frozen=True)
class PhoneBookTask:
    """Associative recall with one-hot names (the key block) and numbers (the value block).

    ``n_names`` names and ``n_numbers`` numbers exist; each sequence holds
    ``n_pairs <= n_names`` pairs with distinct names, so the queried name occurs once.
    """

    n_names: int
    n_numbers: int
    n_pairs: int

    def __post_init__(self) -> None:
        check_positive_int("n_names", self.n_names)
        check_positive_int("n_numbers", self.n_numbers)
        check_positive_int("n_pairs", self.n_pairs)
        if self.n_pairs > self.n_names:
            raise ValueError(
                f"n_pairs ({self.n_pairs}) must be at most n_names ({self.n_names}): "
                f"the names of one sequence are distinct"
            )

    @property
    def d_model(self) -> int:
        """Width of a token: ``n_names + n_numbers``."""
        return self.n_names + self.n_numbers

    @property
    def key_block(self) -> slice:
        """The coordinates of a token that hold its name: ``0 .. n_names - 1``."""
        return slice(0, self.n_names)

    @property
    def value_block(self) -> slice:
        """The coordinates of a token that hold its number: ``n_names .. d_model - 1``."""
        return slice(self.n_names, self.d_model)

    def embed(self, names: Tensor, numbers: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
        r"""Tokens :math:`e_{name} \oplus e_{number}`: ``names``, ``numbers``: ``(...)``
        integer ids -> ``(..., d_model)``. With ``numbers=None`` the value block is zero
        (a query token)."""
        _check_ids("names", names, self.n_names)
        out = torch.zeros(*names.shape, self.d_model, dtype=dtype or torch.get_default_dtype())  # (..., d_model)
        out.scatter_(-1, names.unsqueeze(-1), 1.0)
        if numbers is not None:
            _check_ids("numbers", numbers, self.n_numbers)
            if numbers.shape != names.shape:
                raise ValueError(
                    f"numbers must have the shape of names {format_shape(names)}, got {format_shape(numbers)}"
                )
            out.scatter_(-1, self.n_names + numbers.unsqueeze(-1), 1.0)
        return out

    def batch(self, names: Tensor, numbers: Tensor, slot: Tensor, dtype: torch.dtype | None = None) -> RecallBatch:
        """The batch asking, in each row, for the name at position ``slot``.

        ``names``, ``numbers``: ``(B, n_pairs)`` ids; ``slot``: ``(B,)`` positions.
        """
        _check_ids("names", names, self.n_names)
        _check_ids("numbers", numbers, self.n_numbers)
        _check_ids("slot", slot, self.n_pairs)
        expected = (names.shape[0] if names.dim() else 0, self.n_pairs)
        if names.dim() != 2 or names.shape[1] != self.n_pairs:
            raise ValueError(f"names must have shape (B, n_pairs={self.n_pairs}), got {format_shape(names)}")
        if numbers.shape != names.shape:
            raise ValueError(f"numbers must have shape (B, n_pairs) = {expected}, got {format_shape(numbers)}")
        if slot.shape != names.shape[:1]:
            raise ValueError(f"slot must have shape (B,) = ({expected[0]},), got {format_shape(slot)}")
        rows = torch.arange(names.shape[0])
        asked = names[rows, slot]  # (B,)
        return RecallBatch(
            context=self.embed(names, numbers, dtype),  # (B, n_pairs, d_model)
            query=self.embed(asked, dtype=dtype).unsqueeze(1),  # (B, 1, d_model)
            target=numbers[rows, slot],  # (B,)
            names=names,
            numbers=numbers,
            slot=slot,
        )

    def sample(
        self,
        batch_size: int,
        generator: torch.Generator,
        pairing: Pairing = "all",
        dtype: torch.dtype | None = None,
    ) -> RecallBatch:
        """``batch_size`` random phone books, each with a random queried pair.

        Names are distinct within a sequence. ``pairing`` restricts which numbers a
        name may get: ``"all"`` any, ``"even"`` only those with ``name + number``
        even, ``"odd"`` only those with it odd (the two halves share no pair, so a
        head trained on one half can be tested on pairs it never saw).
        """
        names, numbers, slot = self.draw(batch_size, generator, pairing)
        return self.batch(names, numbers, slot, dtype)

    def draw(self, batch_size: int, generator: torch.Generator, pairing: Pairing = "all") -> tuple[Tensor, Tensor, Tensor]:
        """The ids that :meth:`sample` embeds: ``names``, ``numbers``: ``(B, n_pairs)``,
        ``slot``: ``(B,)``; the same draws from ``generator``."""
        check_positive_int("batch_size", batch_size)
        if pairing not in ("all", "even", "odd"):
            raise ValueError(f"pairing must be 'all', 'even' or 'odd', got {pairing!r}")
        if pairing != "all" and self.n_numbers % 2:
            raise ValueError(f"pairing={pairing!r} needs an even n_numbers, got {self.n_numbers}")
        shape = (batch_size, self.n_pairs)
        names = torch.rand(batch_size, self.n_names, generator=generator).argsort(-1)[:, : self.n_pairs]
        if pairing == "all":
            numbers = torch.randint(self.n_numbers, shape, generator=generator)  # (B, n_pairs)
        else:
            parity = (names + (pairing == "odd")) % 2  # (B, n_pairs): the parity each number must have
            numbers = 2 * torch.randint(self.n_numbers // 2, shape, generator=generator) + parity
        slot = torch.randint(self.n_pairs, (batch_size,), generator=generator)  # (B,)
        return names, numbers, slot


def _check_ids(name: str, ids: Tensor, n: int) -> None:
    if not isinstance(ids, Tensor) or ids.dtype != torch.long:
        got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
        raise TypeError(f"{name} must be a torch.long tensor of ids, got {got}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise ValueError(f"{name} must hold ids in 0 .. {n - 1}, got values in {int(ids.min())} .. {int(ids.max())}")


class RecallHead(nn.Module):
    r"""One attention head of width ``d_k`` and a linear read-out.

    .. math::
        \alpha = \mathrm{softmax}\!\left(\frac{x_q W^Q (C W^K)^\top}{\sqrt{d_k}}\right),
        \qquad \text{logits} = \alpha\, C\, W^V W^O\, W^R ,

    with ``C``: ``(B, n_pairs, d_model)`` the pair tokens, ``x_q``: ``(B, 1, d_model)``
    the query token and ``W^R``: ``(d_model, n_numbers)`` the read-out.

    ``attn`` is a :class:`MultiHeadAttention` without biases. attnlib ties
    ``d_k = d_model / num_heads``, so a head narrower than ``d_model`` is head 0 of
    ``d_model / d_k`` heads whose other heads are switched off: their weights start
    at zero, get zero gradients, and so stay zero (weight decay keeps 0 at 0).
    The weights are drawn from ``torch.manual_seed(seed)`` without touching the
    global random state.
    """

    def __init__(self, d_model: int, n_numbers: int, d_k: int, seed: int = 0, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("n_numbers", n_numbers)
        check_positive_int("d_k", d_k)
        if d_model % d_k:
            raise ValueError(f"d_k ({d_k}) must divide d_model ({d_model})")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.attn = MultiHeadAttention(d_model, d_model // d_k, bias=False, dtype=dtype)
            self.readout = nn.Parameter(torch.empty(d_model, n_numbers, dtype=dtype))  # (d_model, M)
            nn.init.xavier_uniform_(self.readout)
        with torch.no_grad():
            for w in (self.attn.w_q_heads, self.attn.w_k_heads, self.attn.w_v_heads):
                w[1:].zero_()  # heads 1.. off: (h - 1, d_model, d_k)
            self.attn.w_o_heads[1:].zero_()  # (h - 1, d_k, d_model)

    @property
    def d_k(self) -> int:
        return self.attn.d_k

    def forward(self, context: Tensor, query: Tensor) -> tuple[Tensor, Tensor]:
        """``context``: ``(B, n_pairs, d_model)``, ``query``: ``(B, 1, d_model)`` ->
        ``logits``: ``(B, n_numbers)``, head 0's weights ``(B, n_pairs)``."""
        out, weights = self.attn(query, context, context)  # (B, 1, d_model), (B, h, 1, n_pairs)
        assert weights is not None
        logits = out[:, 0] @ self.readout  # (B, n_numbers)
        return logits, weights[:, 0, 0]  # (B, n_numbers), (B, n_pairs)

    @torch.no_grad()
    def accuracy(self, batch: RecallBatch) -> float:
        """Share of the batch whose largest logit is the target number."""
        logits, _ = self(batch.context, batch.query)
        return (logits.argmax(-1) == batch.target).double().mean().item()


def train_recall(
    model: RecallHead,
    task: PhoneBookTask,
    steps: int = 300,
    batch_size: int = 256,
    lr: float = 0.1,
    weight_decay: float = 0.05,
    seed: int = 0,
    pairing: Pairing = "all",
    loss: Loss = "squared",
) -> list[float]:
    r"""Train ``model`` on ``steps`` fresh batches of ``task`` with AdamW; return every
    step's loss. Deterministic for a given ``seed`` and ``model`` on one thread.

    ``loss="squared"``: the read-out must reproduce the number itself,
    :math:`\lVert \text{logits} - (e_m - \tfrac1M \mathbf 1) \rVert^2` averaged over the
    batch (the one-hot vector of the target number ``m``, centred: the ``M`` targets
    sum to zero and span ``M - 1`` dimensions, so fitting them needs a head of width
    ``d_k >= M - 1``; plain one-hot targets would need ``M``). ``loss="cross_entropy"``: the usual
    classification loss, which only asks the target to have the largest logit.
    """
    check_positive_int("steps", steps)
    check_positive_int("batch_size", batch_size)
    if loss not in ("squared", "cross_entropy"):
        raise ValueError(f"loss must be 'squared' or 'cross_entropy', got {loss!r}")
    if model.readout.shape != (task.d_model, task.n_numbers):
        raise ValueError(
            f"model.readout must have shape (d_model, n_numbers) = ({task.d_model}, {task.n_numbers}) "
            f"to fit the task, got {format_shape(model.readout)}"
        )
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    dtype = model.readout.dtype
    losses = []
    for _ in range(steps):
        b = task.sample(batch_size, gen, pairing, dtype)
        logits, _ = model(b.context, b.query)  # (B, n_numbers)
        if loss == "squared":
            target = nn.functional.one_hot(b.target, task.n_numbers).to(dtype) - 1 / task.n_numbers  # (B, M)
            value = (logits - target).square().sum(-1).mean()
        else:
            value = nn.functional.cross_entropy(logits, b.target)
        opt.zero_grad()
        value.backward()
        opt.step()
        losses.append(value.item())
    return losses


def block_fractions(matrix: Tensor, row_blocks: Sequence[slice], col_blocks: Sequence[slice]) -> Tensor:
    r"""Share of ``matrix``'s squared Frobenius norm in each block.

    ``matrix``: ``(m, n)``; returns ``(len(row_blocks), len(col_blocks))`` with entry
    :math:`\lVert M_{r_i, c_j} \rVert_F^2 / \lVert M \rVert_F^2`. The blocks should tile
    the matrix; then the entries sum to 1.
    """
    check_tensor("matrix", matrix)
    if matrix.dim() != 2:
        raise ValueError(f"matrix must have shape (m, n), got {format_shape(matrix)}")
    total = matrix.square().sum()
    if total == 0:
        raise ValueError("matrix is zero: it has no norm to share out")
    out = torch.empty(len(row_blocks), len(col_blocks), dtype=matrix.dtype)
    for i, r in enumerate(row_blocks):
        for j, c in enumerate(col_blocks):
            out[i, j] = matrix[r, c].square().sum() / total
    return out


# ---- many heads trained at once ----------------------------------------------------------
__all__ += ["RecallRuns", "train_recall_runs"]

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
        scores = flat_qk[row + names] + flat_qk[row + n_names + numbers]  # (R, B, P): x_q W^QK x_j^T
        alpha = torch.softmax(scores * self.scale, -1)  # (R, B, P)
        flat_ovr = ovr.reshape(n_runs * d_model, -1)  # (R d_model, M)
        base = run * d_model  # (R, 1, 1)
        added = flat_ovr[base + names] + flat_ovr[base + n_names + numbers]  # (R, B, P, M): x_j W^OV W^R
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
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
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
        if is_ce.any():
            ce = nn.functional.cross_entropy(logits.mT, answer, reduction="none").mean(-1)  # (R,)
            value = torch.where(is_ce, ce, value)
        opt.zero_grad()
        value.sum().backward()
        with torch.no_grad():
            for p in params:
                p.mul_(keep.view(-1, *[1] * (p.dim() - 1)))  # decoupled weight decay, per run
        opt.step()
        losses[step] = value.detach()
    return losses
