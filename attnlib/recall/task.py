r"""The phone-book task: pair tokens, a query, its target (chapter 7).

Each token is two one-hot blocks, name then number: :math:`x = e_a \oplus e_m`, a query
:math:`e_a \oplus 0` (see :mod:`attnlib.recall`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from attnlib.checks import check_positive_int, format_shape

__all__ = ["PhoneBookTask", "RecallBatch"]

Pairing = Literal["all", "even", "odd"]


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

