r"""What attention costs in memory: bytes held on the CPU (measured), bytes moved between a
GPU's HBM and its on-chip SRAM (simulated) (chapter 10).

- :func:`peak_live_bytes`: the most bytes that the tensors a call allocates hold at once,
  tracked op by op with a ``TorchDispatchMode`` (its returned tensors left out);
- :class:`SRAM`: an on-chip memory between an algorithm and HBM that counts every byte read
  from HBM, written to it, and held on chip at once; it holds real tensors (to check that
  the algorithm is right) or only sizes (to count fast);
- the algorithms of Dao et al. (2022), written against it: ``"standard"`` (their Algorithm 0:
  ``S``, then ``P``, then ``O``, each through HBM), ``"flash"`` (their Algorithm 1: key/value
  tiles outside, ``O``, :math:`\ell`, :math:`m` read and written back at every tile),
  ``"flash2"`` (FlashAttention-2's forward: query tiles outside, as
  :mod:`attnlib.blockwise`), and the backward in both loop orders, ``"backward_q_outer"`` and
  ``"backward_kv_outer"``;
- :func:`count_io`, :func:`simulate`: run one through an SRAM of ``sram_bytes``;
  :func:`io_formula`: the same count in closed form; :func:`block_sizes`: the tiles used.

Sizes: ``n`` queries and keys, head width ``d``, ``M = sram_bytes // itemsize`` numbers on
chip. Algorithm 1's tiles are the paper's, :math:`B_c = \lceil M / 4d \rceil`,
:math:`B_r = \min(B_c, d)` (``"flash2"`` and the backward put the large tile outside);
Algorithm 0's products use square tiles :math:`B = \lfloor \sqrt{d^2 + M} \rfloor - d`, the
largest with :math:`B^2 + 2 B d \le M`, and its softmax whole rows, :math:`\lfloor M / (n+2)
\rfloor` at a time (it needs :math:`n + 2 \le M`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnlib.checks import check_positive_int, check_tensor

__all__ = ["peak_live_bytes", "SRAM", "Block", "IOCount", "ALGORITHMS", "block_sizes", "count_io", "simulate",
           "io_formula"]

ALGORITHMS = ("standard", "flash", "flash2", "backward_q_outer", "backward_kv_outer")


# ---- bytes held: every allocation, op by op ---------------------------------------------------
class _Allocations(TorchDispatchMode):
    """Records ``(storage, +bytes)`` when an op returns a tensor on new storage and
    ``(storage, -bytes)`` when the last tensor on it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (allocation number, +bytes or -bytes)
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors on it, allocation number]

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # torch's hook: nothing is compiled in here, and
        return False  # wrapping for dynamo would import it (seconds) on the first op

    def _watch(self, t: Tensor, key: int) -> None:
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.events.append((entry[2], -entry[0]))
            del self.live[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type == "meta":  # a meta tensor holds no memory
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self.live and key not in given and storage.nbytes():  # a new allocation
                self.live[key] = [storage.nbytes(), 0, len(self.events)]
                self.events.append((len(self.events), storage.nbytes()))
            if key in self.live:  # a new tensor, or a view, on a tracked storage
                self._watch(t, key)
        return out


def peak_live_bytes(fn: Callable[[], Any]) -> int:
    """The most bytes held at once by the tensors ``fn()`` allocates, leaving out those it
    returns (its output) and those that existed before (its inputs).

    Tracked op by op (``torch.utils._python_dispatch.TorchDispatchMode``): a tensor counts
    from the op that allocates its storage to the death of the last tensor on it. What one
    kernel allocates and frees inside itself (a BLAS packing buffer) is not a tensor and is
    not seen; nor is memory that PyTorch's caching or the C library keeps after a free. Tensors
    on the ``meta`` device (shapes only, as argument checks build them) hold no memory and are
    not counted.
    """
    mode = _Allocations()
    with mode:
        result = fn()
    kept = {mode.live[key][2] for key in (t.untyped_storage().data_ptr() for t in tree_leaves(result)
                                           if isinstance(t, Tensor)) if key in mode.live}
    now = peak = 0
    for number, nbytes in mode.events:
        if number not in kept:
            now += nbytes
            peak = max(peak, now)
    return peak


# ---- bytes moved: an SRAM between the algorithm and HBM ------------------------------------------
class Block:
    """What the SRAM holds: a ``(rows, cols)`` block of numbers and, with values, the tensor."""

    __slots__ = ("rows", "cols", "value")

    def __init__(self, rows: int, cols: int, value: Tensor | None) -> None:
        self.rows, self.cols, self.value = rows, cols, value


class IOCount(NamedTuple):
    """Bytes read from HBM, bytes written to it, and the most bytes held on chip at once."""

    read: int
    written: int
    peak: int

    @property
    def moved(self) -> int:
        """Bytes moved between HBM and SRAM, both ways: what Theorem 2 of Dao et al. counts."""
        return self.read + self.written


class SRAM:
    """An on-chip memory between an algorithm and HBM; counts the bytes moved and held.

    ``hbm`` maps names to 2-D float64 tensors (values: the algorithm computes, and its
    results can be checked) or to ``(rows, cols)`` sizes (no arithmetic, a fast count).
    :meth:`load` brings a block of rows and columns of an HBM array onto the chip (bytes
    read), :meth:`new` and :meth:`update` compute on chip (no traffic), :meth:`store` writes
    a block back (bytes written), :meth:`free` releases it; ``peak`` is the most held at once.
    """

    def __init__(self, hbm: dict[str, Any], itemsize: int = 2) -> None:
        self.hbm, self.itemsize = dict(hbm), check_positive_int("itemsize", itemsize)
        self.values = all(isinstance(a, Tensor) for a in self.hbm.values())
        self.read = self.written = self.held = self.peak = 0

    def allocate(self, name: str, rows: int, cols: int) -> None:
        """A new ``(rows, cols)`` array in HBM; no traffic (the algorithm writes it)."""
        self.hbm[name] = torch.zeros(rows, cols, dtype=torch.float64) if self.values else (rows, cols)

    def _cols(self, name: str, cols: range | None) -> range:
        width = self.hbm[name].shape[1] if self.values else self.hbm[name][1]
        return range(width) if cols is None else cols

    # load, store and new run hundreds of thousands of times in a count: the bookkeeping inline
    def load(self, name: str, rows: range, cols: range | None = None) -> Block:
        """Rows ``rows`` (and columns ``cols``, default all) of HBM array ``name`` onto the chip."""
        cols = self._cols(name, cols)
        r, c = len(rows), len(cols)
        value = self.hbm[name][rows.start:rows.stop, cols.start:cols.stop].clone() if self.values else None
        nbytes = r * c * self.itemsize
        self.read += nbytes
        self.held += nbytes
        if self.held > self.peak:
            self.peak = self.held
        return Block(r, c, value)

    def store(self, block: Block, name: str, rows: range, cols: range | None = None) -> None:
        """``block`` into those rows and columns of HBM array ``name``; it stays on chip."""
        cols = self._cols(name, cols)
        if block.rows != len(rows) or block.cols != len(cols):
            raise ValueError(f"a ({block.rows}, {block.cols}) block cannot fill ({len(rows)}, {len(cols)}) of {name}")
        self.written += block.rows * block.cols * self.itemsize
        if self.values:
            self.hbm[name][rows.start:rows.stop, cols.start:cols.stop] = block.value

    def new(self, rows: int, cols: int, fn: Callable[..., Tensor], *inputs: Block) -> Block:
        """A ``(rows, cols)`` block computed on chip: ``fn`` of the inputs' values."""
        self.held += rows * cols * self.itemsize
        if self.held > self.peak:
            self.peak = self.held
        return Block(rows, cols, fn(*(b.value for b in inputs)) if self.values else None)

    def update(self, block: Block, fn: Callable[..., Tensor], *inputs: Block) -> None:
        """``block = fn(block, *inputs)`` in place: no more room."""
        if self.values:
            block.value = fn(block.value, *(b.value for b in inputs))

    def free(self, *blocks: Block) -> None:
        for b in blocks:
            self.held -= b.rows * b.cols * self.itemsize

    def count(self) -> IOCount:
        return IOCount(self.read, self.written, self.peak)


def _tiles(n: int, b: int) -> list[range]:
    return [range(i, min(i + b, n)) for i in range(0, n, b)]


def _full(rows: int, cols: int, fill: float) -> Callable[[], Tensor]:
    return lambda: torch.full((rows, cols), fill, dtype=torch.float64)


# ---- the algorithms ----------------------------------------------------------------------------------
def _standard(c: SRAM, n: int, d: int, tile: int, rows: int, scale: float) -> None:
    """Algorithm 0: S = Q K^T written to HBM, P = softmax(S) read and written, O = P V."""
    for name, cols in (("S", n), ("P", n), ("O", d)):
        c.allocate(name, n, cols)
    for r_i in _tiles(n, tile):  # 1. S, one (tile, tile) block at a time
        q_i = c.load("Q", r_i)
        for r_j in _tiles(n, tile):
            k_j = c.load("K", r_j)
            s = c.new(len(r_i), len(r_j), lambda q, k: q @ k.T * scale, q_i, k_j)
            c.store(s, "S", r_i, r_j)
            c.free(k_j, s)
        c.free(q_i)
    for r_i in _tiles(n, rows):  # 2. P, whole rows at a time (their max and sum beside them)
        s = c.load("S", r_i)
        stats = c.new(len(r_i), 2, lambda s: s.new_zeros(s.shape[0], 2), s)
        c.update(s, lambda s, _: torch.softmax(s, -1), stats)
        c.store(s, "P", r_i)
        c.free(s, stats)
    for r_i in _tiles(n, tile):  # 3. O = P V, one (tile, d) block of O kept while P's row goes by
        o_i = c.new(len(r_i), d, _full(len(r_i), d, 0.0))
        for r_j in _tiles(n, tile):
            p, v_j = c.load("P", r_i, r_j), c.load("V", r_j)
            c.update(o_i, lambda o, p, v: o + p @ v, p, v_j)
            c.free(p, v_j)
        c.store(o_i, "O", r_i)
        c.free(o_i)


def _flash(c: SRAM, n: int, d: int, b_r: int, b_c: int, scale: float) -> None:
    """Algorithm 1: key/value tiles outside; O, l, m live in HBM, read and written at every tile."""
    for name, cols, fill in (("O", d, 0.0), ("l", 1, 0.0), ("m", 1, -math.inf)):
        c.allocate(name, n, cols)
        for r_i in _tiles(n, b_r):  # line 2: initialise O, l, m in HBM
            z = c.new(len(r_i), cols, _full(len(r_i), cols, fill))
            c.store(z, name, r_i)
            c.free(z)
    for r_j in _tiles(n, b_c):
        k_j, v_j = c.load("K", r_j), c.load("V", r_j)
        for r_i in _tiles(n, b_r):
            b = len(r_i)
            q_i, o_i, l_i, m_i = (c.load(name, r_i) for name in ("Q", "O", "l", "m"))
            s = c.new(b, len(r_j), lambda q, k: q @ k.T * scale, q_i, k_j)
            m_t = c.new(b, 1, lambda s: s.amax(-1, keepdim=True), s)
            c.update(s, lambda s, m: torch.exp(s - m), m_t)  # P~, in place of S
            l_t = c.new(b, 1, lambda p: p.sum(-1, keepdim=True), s)
            m_new = c.new(b, 1, torch.maximum, m_i, m_t)
            l_new = c.new(b, 1, lambda l, m, lt, mt, mn: torch.exp(m - mn) * l + torch.exp(mt - mn) * lt,
                          l_i, m_i, l_t, m_t, m_new)
            pv = c.new(b, d, lambda p, v: p @ v, s, v_j)
            c.update(o_i, lambda o, l, m, mt, mn, ln, pv: (l * torch.exp(m - mn) * o + torch.exp(mt - mn) * pv) / ln,
                     l_i, m_i, m_t, m_new, l_new, pv)
            for block, name in ((o_i, "O"), (l_new, "l"), (m_new, "m")):
                c.store(block, name, r_i)
            c.free(q_i, o_i, l_i, m_i, s, m_t, l_t, m_new, l_new, pv)
        c.free(k_j, v_j)


def _flash2(c: SRAM, n: int, d: int, b_r: int, b_c: int, scale: float) -> None:
    """FlashAttention-2's forward: query tiles outside; O and the statistics stay on chip."""
    c.allocate("O", n, d)
    c.allocate("lse", n, 1)
    for r_i in _tiles(n, b_r):
        b = len(r_i)
        q_i = c.load("Q", r_i)
        o_i, l_i, m_i = c.new(b, d, _full(b, d, 0.0)), c.new(b, 1, _full(b, 1, 0.0)), c.new(b, 1, _full(b, 1, -math.inf))
        for r_j in _tiles(n, b_c):
            k_j, v_j = c.load("K", r_j), c.load("V", r_j)
            s = c.new(b, len(r_j), lambda q, k: q @ k.T * scale, q_i, k_j)
            m_new = c.new(b, 1, lambda m, s: torch.maximum(m, s.amax(-1, keepdim=True)), m_i, s)
            c.update(s, lambda s, m: torch.exp(s - m), m_new)
            r = c.new(b, 1, lambda m, mn: torch.exp(m - mn), m_i, m_new)
            c.update(l_i, lambda l, r, p: r * l + p.sum(-1, keepdim=True), r, s)
            pv = c.new(b, d, lambda p, v: p @ v, s, v_j)
            c.update(o_i, lambda o, r, pv: r * o + pv, r, pv)
            c.free(m_i, k_j, v_j, s, r, pv)
            m_i = m_new
        c.update(o_i, lambda o, l: o / l, l_i)
        lse = c.new(b, 1, lambda m, l: m + torch.log(l), m_i, l_i)
        c.store(o_i, "O", r_i)
        c.store(lse, "lse", r_i)
        c.free(q_i, o_i, l_i, m_i, lse)


def _d_pass(c: SRAM, n: int, b: int) -> None:
    """The backward's first pass: D = rowsum(dO * O), read O and dO, write D."""
    c.allocate("D", n, 1)
    for r_i in _tiles(n, b):
        o_i, do_i = c.load("O", r_i), c.load("dO", r_i)
        d_i = c.new(len(r_i), 1, lambda o, do: (o * do).sum(-1, keepdim=True), o_i, do_i)
        c.store(d_i, "D", r_i)
        c.free(o_i, do_i, d_i)


def _grad_tile(c: SRAM, q: Block, k: Block, v: Block, do: Block, lse: Block, dd: Block,
               scale: float) -> tuple[Block, Block]:
    """P and dS = P * (dO V^T - D) * scale of one tile, on chip, from the saved lse."""
    p = c.new(q.rows, k.rows, lambda q, k, lse: torch.exp(q @ k.T * scale - lse), q, k, lse)
    ds = c.new(q.rows, k.rows, lambda do, v, p, dd: p * (do @ v.T - dd) * scale, do, v, p, dd)
    return p, ds


def _bwd_q_outer(c: SRAM, n: int, d: int, b_out: int, b_in: int, scale: float) -> None:
    """Query tiles outside: dQ_i stays on chip; dK_j and dV_j are read and written at every tile."""
    _d_pass(c, n, b_out)
    for name in ("dQ", "dK", "dV"):
        c.allocate(name, n, d)
    for name in ("dK", "dV"):  # start from zeros in HBM
        for r_j in _tiles(n, b_in):
            z = c.new(len(r_j), d, _full(len(r_j), d, 0.0))
            c.store(z, name, r_j)
            c.free(z)
    for r_i in _tiles(n, b_out):
        q_i, do_i, lse_i, d_i = (c.load(name, r_i) for name in ("Q", "dO", "lse", "D"))
        dq_i = c.new(len(r_i), d, _full(len(r_i), d, 0.0))
        for r_j in _tiles(n, b_in):
            k_j, v_j = c.load("K", r_j), c.load("V", r_j)
            p, ds = _grad_tile(c, q_i, k_j, v_j, do_i, lse_i, d_i, scale)
            c.update(dq_i, lambda g, ds, k: g + ds @ k, ds, k_j)
            dk_j, dv_j = c.load("dK", r_j), c.load("dV", r_j)
            c.update(dk_j, lambda g, ds, q: g + ds.T @ q, ds, q_i)
            c.update(dv_j, lambda g, p, do: g + p.T @ do, p, do_i)
            c.store(dk_j, "dK", r_j)
            c.store(dv_j, "dV", r_j)
            c.free(k_j, v_j, p, ds, dk_j, dv_j)
        c.store(dq_i, "dQ", r_i)
        c.free(q_i, do_i, lse_i, d_i, dq_i)


def _bwd_kv_outer(c: SRAM, n: int, d: int, b_out: int, b_in: int, scale: float) -> None:
    """Key/value tiles outside (FlashAttention's): dK_j, dV_j stay on chip; dQ_i is read and
    written at every tile (on a GPU, an atomic add)."""
    _d_pass(c, n, b_in)
    for name in ("dQ", "dK", "dV"):
        c.allocate(name, n, d)
    for r_i in _tiles(n, b_in):  # dQ starts from zeros in HBM
        z = c.new(len(r_i), d, _full(len(r_i), d, 0.0))
        c.store(z, "dQ", r_i)
        c.free(z)
    for r_j in _tiles(n, b_out):
        k_j, v_j = c.load("K", r_j), c.load("V", r_j)
        dk_j, dv_j = c.new(len(r_j), d, _full(len(r_j), d, 0.0)), c.new(len(r_j), d, _full(len(r_j), d, 0.0))
        for r_i in _tiles(n, b_in):
            q_i, do_i, lse_i, d_i = (c.load(name, r_i) for name in ("Q", "dO", "lse", "D"))
            p, ds = _grad_tile(c, q_i, k_j, v_j, do_i, lse_i, d_i, scale)
            c.update(dv_j, lambda g, p, do: g + p.T @ do, p, do_i)
            c.update(dk_j, lambda g, ds, q: g + ds.T @ q, ds, q_i)
            dq_i = c.load("dQ", r_i)
            c.update(dq_i, lambda g, ds, k: g + ds @ k, ds, k_j)
            c.store(dq_i, "dQ", r_i)
            c.free(q_i, do_i, lse_i, d_i, p, ds, dq_i)
        c.store(dk_j, "dK", r_j)
        c.store(dv_j, "dV", r_j)
        c.free(k_j, v_j, dk_j, dv_j)


# ---- running them -------------------------------------------------------------------------------------
def block_sizes(algorithm: str, n: int, d: int, sram_bytes: int, itemsize: int = 2) -> tuple[int, int]:
    r"""The two tile sizes an algorithm uses in an SRAM of ``sram_bytes``, :math:`M` numbers:

    - ``"standard"``: the products' square tile :math:`B = \lfloor\sqrt{d^2 + M}\rfloor - d` and the
      softmax's rows :math:`\lfloor M / (n + 2) \rfloor`;
    - ``"flash"``: :math:`(B_r, B_c) = (\min(B_c, d), \lceil M / 4d \rceil)`, the paper's;
    - the others: (outer tile, inner tile) = :math:`(\lceil M / 4d \rceil, \min(\lceil M / 4d \rceil, d))`.

    Raises ValueError where a tile would be empty (:math:`M < 2d + 1`, or a row of ``n``
    scores does not fit for ``"standard"``).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    for name, x in (("n", n), ("d", d), ("sram_bytes", sram_bytes), ("itemsize", itemsize)):
        check_positive_int(name, x)
    m = sram_bytes // itemsize
    if m < 2 * d + 1:
        raise ValueError(f"an SRAM of {m} numbers cannot hold a row of Q and of K (d = {d}): give more")
    big = -(-m // (4 * d))
    if algorithm == "standard":
        if m < n + 2:
            raise ValueError(f"Algorithm 0's softmax needs a row of n = {n} scores on chip, but it holds {m} numbers")
        return math.isqrt(d * d + m) - d, m // (n + 2)
    return (min(big, d), big) if algorithm == "flash" else (big, min(big, d))


_RUN = {"standard": _standard, "flash": _flash, "flash2": _flash2,
        "backward_q_outer": _bwd_q_outer, "backward_kv_outer": _bwd_kv_outer}


def count_io(algorithm: str, n: int, d: int, sram_bytes: int, itemsize: int = 2) -> IOCount:
    """Run ``algorithm`` (one of :data:`ALGORITHMS`) on sizes only: bytes read, written, held."""
    a, b = block_sizes(algorithm, n, d, sram_bytes, itemsize)
    names = ("Q", "K", "V") + (("O", "dO", "lse") if algorithm.startswith("backward") else ())
    c = SRAM({name: (n, 1 if name == "lse" else d) for name in names}, itemsize)
    _RUN[algorithm](c, n, d, a, b, 1.0)
    return c.count()


def simulate(algorithm: str, q: Tensor, k: Tensor, v: Tensor, sram_bytes: int, itemsize: int = 2,
             d_out: Tensor | None = None) -> tuple[dict[str, Tensor], IOCount]:
    """Run ``algorithm`` on values: ``q``, ``k``, ``v`` ``(n, d)`` (computed in float64). The
    forward algorithms return ``{"O": ...}`` (and ``"lse"``, ``"l"``, ``"m"`` where kept); the
    backward ones need ``d_out`` ``(n, d)`` and return ``{"dQ", "dK", "dV"}``. With the count."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if check_tensor(name, t).dim() != 2 or t.shape != q.shape:
            raise ValueError(f"q, k and v must all have one shape (n, d), got {name} of shape {tuple(t.shape)}")
    n, d = q.shape
    a, b = block_sizes(algorithm, n, d, sram_bytes, itemsize)
    scale = 1.0 / math.sqrt(d)
    hbm = {"Q": q.double(), "K": k.double(), "V": v.double()}
    if algorithm.startswith("backward"):
        if d_out is None or check_tensor("d_out", d_out).shape != q.shape:
            raise ValueError(f"the backward needs d_out of shape {tuple(q.shape)}")
        s = hbm["Q"] @ hbm["K"].T * scale  # the forward's outputs, from which the backward starts
        hbm.update(O=torch.softmax(s, -1) @ hbm["V"], dO=d_out.double(), lse=torch.logsumexp(s, -1, keepdim=True))
    c = SRAM(hbm, itemsize)
    _RUN[algorithm](c, n, d, a, b, scale)
    keep = ("dQ", "dK", "dV") if algorithm.startswith("backward") else ("O", "lse", "l", "m")
    return {name: c.hbm[name] for name in keep if name in c.hbm}, c.count()


def io_formula(algorithm: str, n: int, d: int, sram_bytes: int, itemsize: int = 2) -> int:
    r"""Bytes moved (read + written) by ``algorithm``, in closed form; :func:`count_io` counts the same.

    With :math:`T(b) = \lceil n / b \rceil` and the tiles of :func:`block_sizes`, in numbers:

    - ``"standard"``: :math:`4 n^2 + 2 n d + 2\, T(B)\, n d` (S written, read; P written, read;
      Q and O once; K and V once per row of tiles);
    - ``"flash"``: :math:`3 n d + 2 n + T(B_c)\,(3 n d + 4 n)` (K, V once; O, :math:`\ell`, m
      written to start; then per key tile Q and O read, O written, :math:`\ell` and m read and written);
    - ``"flash2"``: :math:`2 n d + n + 2\, T(B)\, n d`, :math:`B = \lceil M / 4d \rceil` its query
      tile (not Algorithm 1's :math:`B_r`): K and V read once per query tile;
    - ``"backward_q_outer"``: :math:`7 n d + 3 n + 6\, T(B)\, n d`;
    - ``"backward_kv_outer"``: :math:`7 n d + n + T(B)\,(4 n d + 2 n)`.
    """
    tiles = block_sizes(algorithm, n, d, sram_bytes, itemsize)
    t = -(-n // tiles[1 if algorithm == "flash" else 0])  # passes of the outer loop (rows of S's tiles)
    numbers = {"standard": 4 * n * n + 2 * n * d + 2 * t * n * d,
               "flash": 3 * n * d + 2 * n + t * (3 * n * d + 4 * n),
               "flash2": 2 * n * d + n + 2 * t * n * d,
               "backward_q_outer": 7 * n * d + 3 * n + 6 * t * n * d,
               "backward_kv_outer": 7 * n * d + n + t * (4 * n * d + 2 * n)}[algorithm]
    return numbers * itemsize
