r"""The task of chapter 11: a block of random tokens, repeated.

A sequence of length ``seq_len`` is a block of ``p`` distinct tokens drawn at random
from a vocabulary of ``n_vocab``, repeated until the sequence is full:

.. math::
    t_i = a_{i \bmod p}, \qquad (a_0, \dots, a_{p-1}) \text{ distinct}, \qquad
    p \in \{\text{min\_period}, \dots, \text{max\_period}\} \text{ drawn per sequence.}

In the first block the next token cannot be known (it is any token not seen yet); from
position ``p`` on it can: the model has just read :math:`t_i = a_{i \bmod p}`, which
occurred before at :math:`i - p`, and the next token is the one that *followed that
earlier occurrence*, :math:`t_{i - p + 1}`. Because the period changes from sequence
to sequence, no fixed offset finds it: the model must look for the earlier occurrence
of its current token, which takes two attention layers (Olsson et al., 2022).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from attnlib.checks import check_positive_int, check_tensor, format_shape

__all__ = ["RepeatTask", "RepeatBatch"]


class RepeatBatch(NamedTuple):
    """``tokens``: ``(B, seq_len)`` ids (``torch.long``); ``period``: ``(B,)`` each
    sequence's block length ``p``."""

    tokens: Tensor
    period: Tensor


@dataclass(frozen=True)
class RepeatTask:
    """Blocks of ``p`` distinct random tokens (ids ``0 .. n_vocab - 1``), repeated to
    ``seq_len`` tokens, with ``p`` uniform in ``min_period .. max_period`` per sequence.

    Needs ``2 <= min_period <= max_period <= n_vocab`` and ``seq_len >= 2 max_period``
    (every sequence holds its block at least twice).
    """

    n_vocab: int
    seq_len: int
    min_period: int
    max_period: int

    def __post_init__(self) -> None:
        for name in ("n_vocab", "seq_len", "min_period", "max_period"):
            check_positive_int(name, getattr(self, name))
        if not 2 <= self.min_period <= self.max_period <= self.n_vocab:
            raise ValueError(
                f"need 2 <= min_period <= max_period <= n_vocab (a block's tokens are distinct), got "
                f"min_period={self.min_period}, max_period={self.max_period}, n_vocab={self.n_vocab}"
            )
        if self.seq_len < 2 * self.max_period:
            raise ValueError(
                f"seq_len ({self.seq_len}) must be at least 2 * max_period ({2 * self.max_period}): "
                f"every sequence holds its block twice"
            )

    @property
    def chance(self) -> float:
        """Accuracy of a guess among all tokens: ``1 / n_vocab``."""
        return 1.0 / self.n_vocab

    def sample(self, batch_size: int, generator: torch.Generator) -> RepeatBatch:
        """``batch_size`` sequences and their periods (a :class:`RepeatBatch`)."""
        check_positive_int("batch_size", batch_size)
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        span = self.max_period - self.min_period + 1
        block = torch.rand(batch_size, self.n_vocab, generator=generator).argsort(-1)  # (B, V): a_0, a_1, ...
        period = self.min_period + torch.randint(span, (batch_size,), generator=generator)  # (B,)
        where = torch.arange(self.seq_len)[None, :] % period[:, None]  # (B, T): i mod p
        return RepeatBatch(block.gather(1, where), period)

    def predictable(self, period: Tensor) -> Tensor:
        """``(B, seq_len)`` bool: True at the positions ``i`` whose next token the repeat
        decides, ``p <= i <= seq_len - 2`` (the last position has no next token)."""
        check_tensor("period", period)
        if period.dim() != 1 or period.dtype != torch.long:
            raise ValueError(f"period must be a (B,) torch.long tensor, got {period.dtype} {format_shape(period)}")
        i = torch.arange(self.seq_len)[None, :]  # (1, T)
        return (i >= period[:, None]) & (i <= self.seq_len - 2)  # (B, T)

    def block(self, period: Tensor) -> Tensor:
        """``(B, seq_len)`` long: the block each position lies in, ``i // p`` (0 for the
        first block, 1 for its first repeat, ...)."""
        check_tensor("period", period)
        if period.dim() != 1 or period.dtype != torch.long:
            raise ValueError(f"period must be a (B,) torch.long tensor, got {period.dtype} {format_shape(period)}")
        return torch.arange(self.seq_len)[None, :] // period[:, None]  # (B, T)
