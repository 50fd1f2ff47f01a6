r"""One attention head that learns the phone book, and how it is trained (chapter 7).

:class:`RecallHead`: a :class:`~attnlib.multihead.MultiHeadAttention` layer (the query
token attends to the pair tokens), then a linear read-out to the number logits;
:func:`train_recall` trains it deterministically with AdamW; :func:`block_fractions`
reads where a trained matrix puts its weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from attnlib.checks import check_positive_int, check_tensor, format_shape
from attnlib.multihead import MultiHeadAttention
from attnlib.optim import AdamW
from attnlib.recall.task import Pairing, PhoneBookTask, RecallBatch

__all__ = ["RecallHead", "train_recall", "block_fractions"]

Loss = Literal["squared", "cross_entropy"]


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
    opt = AdamW(list(model.parameters()), lr=lr, weight_decay=weight_decay)  # torch.optim.AdamW's update
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
        opt.step(torch.autograd.grad(value, opt.params))
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

