"""The probe inputs of :func:`~attnlib.audit.diagnose`, per call form.

Every row and every column of a random probe mask holds at least one allowed and one blocked
entry, so that code which fills blocked scores with ``-inf`` and code which fills them with a
large negative number agree. The rows that are blocked entirely are probed on their own
(``"blocked row"``), where modules differ by convention; so is a finite mask value that a
large score overcomes (``"large scores"``: scores spread over about ``1e6``). Padding masks
pad on the right, so key 0 is always real; with ``causal=True`` one more probe pads on the
left (``"left padding"``), where a causal query sees padded keys: right padding hides a
padding mask put on the queries, left padding does not. In self-attention with padding only
the real queries' rows are compared (``Probe.rows``): what a module returns for a padded
query is a convention. A module that takes no mask (``takes_mask=False``) gets the unmasked
probes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LARGE_SCORES", "Probe", "make_probes", "probe_inputs"]


@dataclass(frozen=True)
class Probe:
    """One probe input of a call form, float64 on the CPU."""

    kind: str  # "no mask" | "causal" | "random mask" | "blocked row" | "large scores" | ...
    x: Tensor  # (B, n_q, d_model), float64
    context: Tensor | None  # (B, n_k, d_model) for cross-attention, None for self-attention
    mask: Tensor | None  # bool (n_q, n_k), or (B, n_k) key padding; True = may attend / real
    rows: Tensor | None = None  # bool (B, n_q): the query rows compared (None: all); padded ones are not

    @property
    def keys(self) -> Tensor:
        return self.x if self.context is None else self.context


# (kind, B, n): the masked probes come first, because they tell most bugs apart.
_PROBE_SIZES = (("random mask", 2, 5), ("causal", 3, 4), ("no mask", 2, 3), ("random mask", 1, 6), ("no mask", 1, 7))
_EXTRA = (("blocked row", 2, 5, 5), ("large scores", 2, 5, 5))
_CAUSAL = (("causal", 2, 5, 5), ("causal", 1, 7, 7), ("causal", 3, 3, 3), ("large scores", 2, 5, 5))
_PADDING = (("padding", 3, 5, 5), ("padding", 2, 4, 4), ("no padding", 2, 3, 3), ("large scores", 3, 5, 5))
_CROSS = (("same length", 2, 5, 5), ("random mask", 2, 4, 6), ("no mask", 1, 3, 5), ("blocked row", 2, 4, 6),
          ("large scores", 2, 5, 3))
_CROSS_PADDING = (("same length", 3, 5, 5), ("padding", 3, 4, 6), ("no padding", 2, 3, 5), ("large scores", 3, 4, 6))
_LEFT = (("left padding", 3, 5, 5),)  # causal with padding: a padded key before a real query
_NO_MASK = (("no mask", 2, 5, 5), ("no mask", 3, 4, 4), ("no mask", 2, 3, 3), ("no mask", 1, 6, 6),
            ("no mask", 1, 7, 7))
_CROSS_NO_MASK = (("no mask", 2, 5, 5), ("no mask", 2, 4, 6), ("no mask", 1, 3, 5))

LARGE_SCORES = 1e6
"""The spread of the scores on the ``"large scores"`` probe: a blocked key whose score is that
much above an allowed one beats an additive mask of ``-1e5``, but not ``-1e9`` or ``-inf``."""


def _probe_mask(kind: str, n: int, g: torch.Generator) -> Tensor | None:
    """Each row and each column holds at least one True and one False (``n >= 3``)."""
    if kind == "no mask":
        return None
    i = torch.arange(n)
    if kind == "causal":  # a causal window of n - 1 keys: key j visible to queries j .. j + n - 2
        return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < n - 1)  # (n, n)
    mask = torch.rand(n, n, generator=g) < 0.5  # (n, n)
    perm = torch.randperm(n, generator=g)
    mask[i, perm] = True  # row i may attend perm[i]: every row and column has a True
    mask[i, perm.roll(-1)] = False  # and is blocked from perm[i + 1]: every row and column has a False
    return mask


def _mixed(mask: Tensor) -> bool:
    """Every row and every column of ``mask`` holds a True and a False."""
    return all(bool(m.any(dim=-1).all() and (~m).any(dim=-1).all()) for m in (mask, mask.T))


def _rect_mask(n_q: int, n_k: int, g: torch.Generator) -> Tensor:
    """A random bool ``(n_q, n_k)`` whose rows and columns each hold a True and a False."""
    while True:
        mask = torch.rand(n_q, n_k, generator=g) < 0.5  # (n_q, n_k)
        if _mixed(mask):
            return mask


def _blocked_row_mask(n_q: int, n_k: int, g: torch.Generator) -> Tensor:
    """A random mask with row 1 entirely blocked; every other row, and every column, mixed."""
    while True:
        mask = _rect_mask(n_q, n_k, g)
        mask[1] = False  # query 1 may attend to nothing
        others = torch.cat((mask[:1], mask[2:]))  # (n_q - 1, n_k)
        if _mixed(others):
            return mask


def _padding_mask(B: int, n_k: int, left: bool = False) -> Tensor:
    """``(B, n_k)``, True = real: sequence ``b`` has ``n_k, n_k - 2, 1, ...`` real keys, padded on the
    right (``left=True``: on the left)."""
    lengths = [max(1, n_k - 2 * (b % 3)) if b % 3 < 2 else 1 for b in range(B)]
    mask = torch.arange(n_k)[None, :] < torch.tensor(lengths)[:, None]  # (B, n_k)
    return mask.flip(-1) if left else mask


def _plan(
    causal: bool, padding: bool, cross: bool, takes_mask: bool = True,
) -> tuple[tuple[str, int, int, int], ...]:
    if not takes_mask and not causal:
        return _CROSS_NO_MASK if cross else _NO_MASK
    if cross:
        return _CROSS_PADDING if padding else _CROSS
    if padding:
        return _PADDING + _LEFT if causal else _PADDING
    if causal:
        return _CAUSAL
    return tuple((kind, B, n, n) for kind, B, n in _PROBE_SIZES) + _EXTRA


def make_probes(
    d_model: int, seed: int, *, causal: bool = False, padding: bool = False, cross: bool = False,
    large: float = 1.0, takes_mask: bool = True,
) -> list[Probe]:
    """The probes of a call form, float64 on the CPU; ``large`` multiplies the inputs of the
    ``"large scores"`` probe."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for kind, B, n_q, n_k in _plan(causal, padding, cross, takes_mask):
        x = torch.randn(B, n_q, d_model, generator=g, dtype=torch.float64)  # (B, n_q, d_model)
        context = torch.randn(B, n_k, d_model, generator=g, dtype=torch.float64) if cross else None
        mask: Tensor | None
        rows = None
        if not takes_mask and not causal:
            mask = None
        elif padding:
            mask = _padding_mask(B, n_k, left=kind == "left padding") if kind != "no padding" \
                else torch.ones(B, n_k, dtype=torch.bool)
            rows = None if cross or bool(mask.all()) else mask  # self-attention: the real queries
        elif causal:
            mask = None  # the module masks the future itself
        elif kind == "blocked row":
            mask = _blocked_row_mask(n_q, n_k, g)
        elif n_q == n_k and kind in ("random mask", "causal", "no mask"):
            mask = _probe_mask(kind, n_q, g)
        elif kind == "no mask":
            mask = None
        else:  # "random mask", "same length", "large scores"
            mask = _rect_mask(n_q, n_k, g)
        if kind == "large scores":
            x = x * large
            context = None if context is None else context * large
        out.append(Probe(kind, x, context, mask, rows))
    return out


def probe_inputs(
    d_model: int, *, seed: int = 0, dtype: torch.dtype = torch.float32,
    causal: bool = False, padding: bool = False, cross: bool = False, takes_mask: bool = True,
) -> list[tuple[str, Tensor, Tensor | None]]:
    """The probes :func:`diagnose` uses: ``(kind, x, mask)`` with ``x: (B, n, d_model)`` and
    ``mask``: bool ``(n, n)`` (True = may attend), ``(B, n)`` key padding, or ``None``; masked
    probes first. Cross-attention probes (``cross=True``) are ``(kind, (x, context), mask)``.
    The ``"large scores"`` probe is shown at scale 1 (:func:`diagnose` scales it to the
    reference's weights)."""
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
        raise ValueError(f"d_model must be a positive int, got {d_model!r}")
    out: list[tuple[str, Tensor, Tensor | None]] = []
    for p in make_probes(d_model, seed, causal=causal, padding=padding, cross=cross, takes_mask=takes_mask):
        x = p.x.to(dtype)
        both = (x, p.keys.to(dtype)) if cross else x
        out.append((p.kind, both, p.mask))  # type: ignore[arg-type]
    return out
