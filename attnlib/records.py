"""The weight records of one attention layer: :class:`AttentionWeights`, with its
:class:`Biases`, and the packing ``[W^Q | W^K | W^V]`` (:func:`pack_qkv`,
:func:`split_qkv`).

A record holds the four projections of a layer in paper orientation (each used as
``x @ W``), as copies: what ``MultiHeadAttention.projections()`` returns, what
``MultiHeadAttention.from_projections`` builds a layer from, and what every reader and
writer of :mod:`attnlib.interop` converts. Chapter 8's records
(:class:`~attnlib.decoding.GroupedAttentionWeights`, and the ALiBi record
:class:`~attnlib.decoding.AlibiWeights`) build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from attnlib.checks import check_tensor, format_shape

__all__ = ["Biases", "AttentionWeights", "plain_record", "pack_qkv", "split_qkv", "record_tensors"]


class Biases(NamedTuple):
    """The four biases of a layer, all present: ``q, k, v``: ``(h*d_k,)``, ``o``: ``(d_model,)``."""

    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor


@dataclass(frozen=True)
class AttentionWeights:
    """The four projections of one multi-head attention layer, paper orientation.

    ``w_q, w_k, w_v``: ``(d_model, h*d_k)``, ``w_o``: ``(h*d_v, d_model)``, each used as
    ``x @ w``; biases ``b_q, b_k, b_v``: ``(h*d_k,)`` and ``b_o``: ``(d_model,)``, or all
    ``None``. ``h*d_k`` (:attr:`heads_width`) is ``d_model`` in the paper, and may be any width
    (Llama's ``head_dim``, T5's ``d_kv``); ``d_v = d_k``. Head ``i`` owns columns
    ``i*d_k:(i+1)*d_k`` of ``w_q, w_k, w_v`` and rows ``i*d_v:(i+1)*d_v`` of ``w_o``: the
    record does not know ``h``, the layer built from it does (``from_projections(w, num_heads)``).
    :attr:`biases` gives the four biases together (or ``None``).

    The record holds weights only: everything the plain layer of chapters 2-5 needs.
    A layer that adds something that is not a weight (ALiBi's position bias) gives a
    subclass, which :meth:`as_plain` refuses.
    """

    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    w_o: Tensor
    b_q: Tensor | None = None
    b_k: Tensor | None = None
    b_v: Tensor | None = None
    b_o: Tensor | None = None

    def __post_init__(self) -> None:
        weights = {"w_q": self.w_q, "w_k": self.w_k, "w_v": self.w_v, "w_o": self.w_o}
        biases = {"b_q": self.b_q, "b_k": self.b_k, "b_v": self.b_v, "b_o": self.b_o}
        for name, t in weights.items():
            check_tensor(name, t)
        for name, b in biases.items():
            if b is not None:
                check_tensor(name, b)
        if self.w_q.dim() != 2:
            raise ValueError(f"w_q must have shape (d_model, h*d_k), got {format_shape(self.w_q)}")
        d, hd = self.w_q.shape
        expected = {"w_k": ((d, hd), "(d_model, h*d_k)"), "w_v": ((d, hd), "(d_model, h*d_v)"),
                    "w_o": ((hd, d), "(h*d_v, d_model)"), "b_q": ((hd,), "(h*d_k,)"), "b_k": ((hd,), "(h*d_k,)"),
                    "b_v": ((hd,), "(h*d_v,)"), "b_o": ((d,), "(d_model,)")}
        for name, (shape, names) in expected.items():
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(
                    f"{name} must have shape {names} = {format_shape(shape)} for w_q of shape "
                    f"{format_shape(self.w_q)}, got {format_shape(t)}"
                )
        present = [b is not None for b in biases.values()]
        if any(present) and not all(present):
            raise ValueError("biases must be given for all four projections or for none")

    @property
    def d_model(self) -> int:
        return int(self.w_q.shape[0])

    @property
    def heads_width(self) -> int:
        """``h*d_k``: the width of the heads side by side (``d_model`` in the paper)."""
        return int(self.w_q.shape[1])

    @property
    def bias(self) -> bool:
        return self.b_q is not None

    @property
    def biases(self) -> Biases | None:
        """The four biases together, or ``None`` when the layer has none."""
        if self.b_q is None or self.b_k is None or self.b_v is None or self.b_o is None:
            return None  # __post_init__ made it all or none
        return Biases(self.b_q, self.b_k, self.b_v, self.b_o)

    def as_plain(self) -> AttentionWeights:
        """The record as the plain layer's weights: itself. A subclass whose layer adds
        something that is not a weight raises instead, naming it (``TypeError``), so that
        a tool for the plain layer (``MultiHeadAttention.from_projections``, the writers of
        :mod:`attnlib.interop`) never drops it silently."""
        return self


def plain_record(weights: object, name: str = "weights") -> AttentionWeights:
    """``weights.as_plain()``, what a tool for the plain layer's records calls first.

    Raises:
        TypeError: ``weights`` is not an :class:`AttentionWeights`, or is the record of a
            layer that adds more than weights (ALiBi), which its ``as_plain`` names.
    """
    if not isinstance(weights, AttentionWeights):
        raise TypeError(f"{name} must be an attnlib.AttentionWeights, got {type(weights).__name__}")
    return weights.as_plain()


def pack_qkv(weights: AttentionWeights) -> tuple[Tensor, Tensor | None]:
    """``[W^Q | W^K | W^V]``: ``(d, 3D)`` and ``[b^Q, b^K, b^V]``: ``(3D,)`` (or ``None``),
    ``D = h*d_k``."""
    w_qkv = torch.cat([weights.w_q, weights.w_k, weights.w_v], dim=1)  # (d, 3D)
    b = weights.biases
    return w_qkv, None if b is None else torch.cat([b.q, b.k, b.v])  # (3D,)


def split_qkv(w_qkv: Tensor, b_qkv: Tensor | None, w_o: Tensor, b_o: Tensor | None) -> AttentionWeights:
    """``w_qkv``: ``(d, 3D)`` = ``[W^Q | W^K | W^V]`` in paper orientation (``D = h*d_k``),
    ``b_qkv``: ``(3D,)``, ``w_o``: ``(D, d)`` -> copies."""
    if w_qkv.dim() != 2 or w_qkv.shape[1] % 3:
        raise ValueError(f"w_qkv must have shape (d_model, 3*h*d_k), got {format_shape(w_qkv)}")
    D = w_qkv.shape[1] // 3
    return AttentionWeights(
        w_q=w_qkv[:, :D].clone(),
        w_k=w_qkv[:, D : 2 * D].clone(),
        w_v=w_qkv[:, 2 * D :].clone(),
        w_o=w_o.clone(),
        b_q=None if b_qkv is None else b_qkv[:D].clone(),
        b_k=None if b_qkv is None else b_qkv[D : 2 * D].clone(),
        b_v=None if b_qkv is None else b_qkv[2 * D :].clone(),
        b_o=None if b_o is None else b_o.clone(),
    )


def record_tensors(record: object) -> dict[str, Tensor]:
    """The tensors of a weight record (:class:`AttentionWeights`, or chapter 8's
    :class:`~attnlib.decoding.GroupedAttentionWeights`) by field name, ``w_q`` to ``b_o``,
    absent biases left out: the state dict of the layer it describes, so that
    ``layer.load_state_dict(record_tensors(w))`` copies it in, shapes checked."""
    if not is_dataclass(record) or isinstance(record, type):
        raise TypeError(f"record must be a weight record (a dataclass of tensors), got {type(record).__name__}")
    values = {f.name: getattr(record, f.name) for f in fields(record)}
    return {name: t for name, t in values.items() if isinstance(t, Tensor)}
