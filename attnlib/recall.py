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
        return self.batch(names, numbers, slot, dtype)


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
