r"""A two-layer, attention-only transformer, several seeds trained as one batched model (chapter 11).

One run (one seed) reads token ids :math:`t_0 \dots t_{T-1}` and computes, with row vectors,

.. math::
    x^{(0)}_i = W_E[t_i] + W_{pos}[i], \qquad
    x^{(l+1)} = x^{(l)} + \sum_{h} A^{l,h}\, x^{(l)} W_h^{V,l} W_h^{O,l}, \qquad
    \text{logits} = x^{(2)} W_U ,

with :math:`A^{l,h} = \mathrm{softmax}_{causal}\big(x^{(l)} W_h^{Q,l} (x^{(l)} W_h^{K,l})^\top / \sqrt{d_k}\big)`:
embeddings, a residual stream, two layers of causal multi-head attention and an
unembedding. No MLP, no layer norm, no biases: every head's effect is its two circuits
:math:`W^{QK} = W^Q {W^K}^\top` and :math:`W^{OV} = W^V W^O` (Elhage et al., 2021).

:class:`InductionRuns` holds ``R`` such runs side by side, every weight with a leading
``R`` axis, so that many seeds train in one computation (the idea of
:class:`attnlib.recall.RecallRuns`). Each layer of each run is an
:class:`attnlib.MultiHeadAttention` without biases (:meth:`InductionRuns.layer` returns
it), so chapter 4's :func:`attnlib.qk_circuit` and :func:`attnlib.ov_circuit` read it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlib.checks import check_index, check_positive_int, check_tensor, format_shape
from attnlib.records import AttentionWeights
from attnlib.attention import causal_mask, masked_softmax
from attnlib.induction.data import RepeatTask
from attnlib.multihead import MultiHeadAttention
from attnlib.optim import AdamW  # its home since chapter 7 trains with it too

__all__ = ["InductionRuns", "train_induction", "AdamW", "save_runs", "load_runs"]

N_LAYERS = 2


class InductionRuns(nn.Module):
    r"""``R`` two-layer attention-only transformers (one per seed), stored side by side.

    Weights (paper orientation, ``x @ W``): ``embed`` ``(R, n_vocab, d_model)``, ``pos``
    ``(R, seq_len, d_model)``, ``w_q, w_k, w_v, w_o`` ``(R, 2, d_model, d_model)`` (layer
    ``l`` of run ``r`` is ``w_q[r, l]``..., head ``i`` owns columns ``i d_k .. (i+1) d_k - 1``
    of ``w_q, w_k, w_v`` and those rows of ``w_o``, the layout of
    :class:`~attnlib.MultiHeadAttention`), ``unembed`` ``(R, d_model, n_vocab)``.

    Run ``r`` starts from ``torch.manual_seed(seeds[r])`` (the global random state is left
    alone): each layer as a fresh ``MultiHeadAttention(d_model, num_heads, bias=False)``
    (Xavier-uniform), ``embed`` and ``pos`` normal with standard deviation 1, ``unembed``
    Xavier-uniform.
    """

    def __init__(
        self,
        task: RepeatTask,
        d_model: int,
        num_heads: int,
        seeds: Sequence[int],
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(task, RepeatTask):
            raise TypeError(f"task must be an attnlib.induction.RepeatTask, got {type(task).__name__}")
        check_positive_int("d_model", d_model)
        check_positive_int("num_heads", num_heads)
        if d_model % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
        seeds = list(seeds)
        if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
            raise ValueError(f"seeds must be a non-empty list of ints, got {seeds!r}")
        self.task, self.seeds = task, seeds
        self.d_model, self.num_heads, self.d_k = d_model, num_heads, d_model // num_heads
        dtype = dtype or torch.get_default_dtype()
        V, T = task.n_vocab, task.seq_len
        parts: dict[str, list[Tensor]] = {n: [] for n in ("embed", "pos", "w_q", "w_k", "w_v", "w_o", "unembed")}
        for s in seeds:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(s)
                layers = [MultiHeadAttention(d_model, num_heads, bias=False, dtype=dtype) for _ in range(N_LAYERS)]
                parts["embed"].append(torch.randn(V, d_model, dtype=dtype))  # (V, d_model)
                parts["pos"].append(torch.randn(T, d_model, dtype=dtype))  # (T, d_model)
                unembed = torch.empty(d_model, V, dtype=dtype)
                nn.init.xavier_uniform_(unembed)
                parts["unembed"].append(unembed)  # (d_model, V)
            for n in ("w_q", "w_k", "w_v", "w_o"):
                parts[n].append(torch.stack([getattr(m, n).detach() for m in layers]))  # (2, d_model, d_model)
        self.embed, self.pos, self.w_q, self.w_k, self.w_v, self.w_o, self.unembed = (
            nn.Parameter(torch.stack(parts[n]))
            for n in ("embed", "pos", "w_q", "w_k", "w_v", "w_o", "unembed")
        )

    @property
    def n_runs(self) -> int:
        return len(self.seeds)

    def _split(self, x: Tensor) -> Tensor:
        R, B, T, _ = x.shape
        return x.view(R, B, T, self.num_heads, self.d_k).transpose(2, 3)  # (R, B, h, T, d_k)

    def forward(self, tokens: Tensor, keep: Tensor | None = None, parts: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
        r"""Every run on its own sequences: ``tokens`` ``(R, B, seq_len)`` ids ->
        ``logits`` ``(R, B, seq_len, n_vocab)`` and, per layer, the attention maps
        ``(R, B, h, seq_len, seq_len)``.

        ``keep``: ``(R, 2, h)``, a factor on each head's output (default all 1); a 0
        *ablates* the head: :math:`x^{(l+1)} = x^{(l)} + \sum_h \text{keep}_{l,h}\, A^{l,h} x^{(l)} W_h^{OV,l}`.
        ``parts``: ``(R, h, 2)``, factors on the two parts of what a layer-0 head reads as its
        values (default: none given, the model itself): head ``h`` reads
        :math:`\text{parts}_{h,0} W_E[t_j] + \text{parts}_{h,1} W_{pos}[j]` instead of
        :math:`x^{(0)}_j`, so ``(1, 0)`` lets it copy only the token, ``(0, 1)`` only the position.
        """
        self._check_inputs(tokens, keep, parts)
        return self._forward(tokens, keep, parts)

    def _check_inputs(self, tokens: Tensor, keep: Tensor | None = None, parts: Tensor | None = None) -> None:
        """Raise unless :meth:`forward` can read ``tokens``, ``keep`` and ``parts`` (shapes,
        dtype, ids in the vocabulary)."""
        R, T = self.n_runs, self.task.seq_len
        check_tensor("tokens", tokens)
        if tokens.dtype != torch.long or tokens.dim() != 3 or tokens.shape[0] != R or tokens.shape[2] != T:
            raise ValueError(f"tokens must be torch.long ids of shape (R={R}, B, seq_len={T}), "
                             f"got {tokens.dtype} {format_shape(tokens)}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.task.n_vocab):
            raise ValueError(f"tokens must be ids in 0 .. {self.task.n_vocab - 1}")
        if keep is not None and check_tensor("keep", keep).shape != (R, N_LAYERS, self.num_heads):
            raise ValueError(f"keep must have shape (R, 2, h) = ({R}, {N_LAYERS}, {self.num_heads}), "
                             f"got {format_shape(keep)}")
        if parts is not None and check_tensor("parts", parts).shape != (R, self.num_heads, 2):
            raise ValueError(f"parts must have shape (R, h, 2) = ({R}, {self.num_heads}, 2), got {format_shape(parts)}")

    def _forward(self, tokens: Tensor, keep: Tensor | None, parts: Tensor | None) -> tuple[Tensor, list[Tensor]]:
        """:meth:`forward` without its checks (:meth:`_check_inputs`): what :func:`train_induction`
        calls at each step, on batches it checked once. Each layer's attention is
        :func:`attnlib.attention`'s computation (its softmax :func:`attnlib.attention.masked_softmax`);
        ``keep=None`` multiplies no head (the same numbers as a ``keep`` of ones)."""
        R, T = self.n_runs, self.task.seq_len
        B = tokens.shape[1]
        run = torch.arange(R).view(R, 1, 1)  # (R, 1, 1)
        x = self.embed[run, tokens] + self.pos[:, None]  # (R, B, T, d_model)
        mask = causal_mask(T)  # (T, T), True = may attend; no row is empty
        scale = 1.0 / math.sqrt(self.d_k)
        maps = []
        for l in range(N_LAYERS):
            q = self._split(x @ self.w_q[:, None, l])  # (R, B, h, T, d_k)
            k = self._split(x @ self.w_k[:, None, l])  # (R, B, h, T, d_k)
            v = self._split(x @ self.w_v[:, None, l])  # (R, B, h, T, d_k)
            if l == 0 and parts is not None:  # each head's values from the token part and the position part
                token, place = self.embed[run, tokens], self.pos[:, None].expand(R, B, T, -1)  # (R, B, T, d_model)
                v = (parts[:, None, :, 0, None, None] * self._split(token @ self.w_v[:, None, 0])
                     + parts[:, None, :, 1, None, None] * self._split(place @ self.w_v[:, None, 0]))  # (R, B, h, T, d_k)
            a = masked_softmax((q @ k.transpose(-2, -1)) * scale, mask)  # (R, B, h, T, T)
            heads = a @ v  # (R, B, h, T, d_k)
            if keep is not None:
                heads = heads * keep[:, l].view(R, 1, self.num_heads, 1, 1).to(heads.dtype)
            concat = heads.transpose(2, 3).reshape(R, B, T, self.d_model)  # (R, B, T, h d_k)
            x = x + concat @ self.w_o[:, None, l]  # (R, B, T, d_model)
            maps.append(a)
        return x @ self.unembed[:, None], maps  # (R, B, T, V)

    def select(self, rows: Sequence[int]) -> InductionRuns:
        """The runs ``rows`` (indices into ``seeds``) as a new :class:`InductionRuns`, with copies
        of their weights."""
        rows = [check_index("rows", r, self.n_runs, f"{self.n_runs} runs") for r in rows]
        if not rows:
            raise ValueError("rows must name at least one run")
        out = InductionRuns(self.task, self.d_model, self.num_heads, [self.seeds[r] for r in rows],
                            dtype=self.embed.dtype)
        out.load_state_dict({k: v[rows].clone() for k, v in self.state_dict().items()})
        return out

    def layer(self, r: int, l: int) -> MultiHeadAttention:
        """Layer ``l`` of run ``r`` as an :class:`~attnlib.MultiHeadAttention` (a copy,
        no biases): what :func:`attnlib.qk_circuit` and :func:`attnlib.ov_circuit` read."""
        r = check_index("r", r, self.n_runs, f"{self.n_runs} runs")
        l = check_index("l", l, N_LAYERS, f"{N_LAYERS} layers")
        w = AttentionWeights(*(getattr(self, n)[r, l].detach().clone() for n in ("w_q", "w_k", "w_v", "w_o")))
        return MultiHeadAttention.from_projections(w, self.num_heads)

    @torch.no_grad()
    def forward_one(self, r: int, tokens: Tensor) -> Tensor:
        """Run ``r`` alone, built from :meth:`layer`'s ``MultiHeadAttention`` modules with
        ``attnlib.causal_mask``: ``tokens`` ``(B, seq_len)`` -> logits ``(B, seq_len, n_vocab)``.
        The batched :meth:`forward` computes the same numbers for every run at once."""
        r = check_index("r", r, self.n_runs, f"{self.n_runs} runs")
        x = self.embed[r, tokens] + self.pos[r]  # (B, T, d_model)
        mask = causal_mask(self.task.seq_len)
        for l in range(N_LAYERS):
            out, _ = self.layer(r, l)(x, x, x, mask)  # (B, T, d_model)
            x = x + out
        return x @ self.unembed[r]  # (B, T, V)

    @torch.no_grad()
    def score(self, tokens: Tensor, period: Tensor, keep: Tensor | None = None,
              parts: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """On the positions the repeat decides (:meth:`RepeatTask.predictable`): per run,
        the share of next tokens predicted right and the mean cross-entropy (nats), two
        ``(R,)`` tensors. ``tokens``: ``(R, B, seq_len)``, ``period``: ``(R, B)``; ``keep``,
        ``parts``: as :meth:`forward`."""
        logits, _ = self(tokens, keep, parts)  # (R, B, T, V)
        return self.score_logits(logits, tokens, period)

    @torch.no_grad()
    def score_logits(self, logits: Tensor, tokens: Tensor, period: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`score` from ``logits`` ``(R, B, seq_len, n_vocab)`` that :meth:`forward` gave
        for ``tokens`` (so that one forward pass serves several measurements)."""
        if check_tensor("logits", logits).shape != (*tokens.shape, self.task.n_vocab):
            raise ValueError(f"logits must have shape (R, B, seq_len, n_vocab) = {(*tokens.shape, self.task.n_vocab)}, "
                             f"got {format_shape(logits)}")
        if check_tensor("period", period).shape != tokens.shape[:2]:
            raise ValueError(f"period must have shape (R, B) = {tuple(tokens.shape[:2])}, got {format_shape(period)}")
        where = self.task.predictable(period.flatten()).view(tokens.shape)[:, :, :-1].to(logits.dtype)  # (R, B, T-1)
        pred, target = logits[:, :, :-1], tokens[:, :, 1:]  # (R, B, T-1, V), (R, B, T-1)
        right = (pred.argmax(-1) == target).to(logits.dtype)  # (R, B, T-1)
        ce = nn.functional.cross_entropy(pred.flatten(1, 2).mT, target.flatten(1), reduction="none")  # (R, B (T-1))
        count = where.sum((1, 2))  # (R,)
        return (right * where).sum((1, 2)) / count, (ce.view_as(where) * where).sum((1, 2)) / count


def train_induction(
    runs: InductionRuns,
    steps: int = 400,
    batch_size: int = 32,
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    data_seeds: Sequence[int] | None = None,
) -> Tensor:
    r"""Train every run on next-token prediction over whole sequences (cross-entropy at
    positions ``0 .. seq_len - 2``), run ``r`` on the data stream of
    ``torch.Generator().manual_seed(data_seeds[r])`` (by default ``runs.seeds[r]``, the seed
    that also drew its initial weights); return the losses ``(steps, R)``.

    The loss minimised is the sum of the runs' losses, so each run's gradient is its own;
    AdamW acts elementwise, so every run follows its own training, as if trained alone.
    With the default ``weight_decay=0`` (the shipped runs) AdamW is plain Adam. The update is
    :class:`attnlib.optim.AdamW`, ``torch.optim.AdamW``'s own arithmetic (the same weights, bit for bit).
    Deterministic on one thread.
    """
    check_positive_int("steps", steps)
    check_positive_int("batch_size", batch_size)
    task, R = runs.task, runs.n_runs
    data_seeds = runs.seeds if data_seeds is None else list(data_seeds)
    if len(data_seeds) != R or any(isinstance(s, bool) or not isinstance(s, int) for s in data_seeds):
        raise ValueError(f"data_seeds must be {R} ints, one per run, got {data_seeds!r}")
    gens = [torch.Generator().manual_seed(s) for s in data_seeds]
    opt = AdamW(list(runs.parameters()), lr=lr, weight_decay=weight_decay)
    losses = torch.empty(steps, R)
    for step in range(steps):
        tokens = torch.stack([task.sample(batch_size, g).tokens for g in gens])  # (R, B, T)
        if step == 0:  # every batch is drawn alike (task.sample): checked once, then read unchecked
            runs._check_inputs(tokens)
        logits, _ = runs._forward(tokens, None, None)  # (R, B, T, V)
        ce = nn.functional.cross_entropy(logits[:, :, :-1].flatten(1, 2).mT, tokens[:, :, 1:].flatten(1),
                                         reduction="none").mean(-1)  # (R,)
        opt.step(torch.autograd.grad(ce.sum(), opt.params))
        losses[step] = ce.detach()
    return losses


# ---- the trained runs the chapter reads, shipped with the package --------------------------
SHIPPED = "runs.safetensors"


def save_runs(runs: InductionRuns, path: str | Path) -> None:
    """Write ``runs``' weights, with the task, widths and seeds as metadata, to a
    safetensors file (what :func:`load_runs` reads)."""
    from safetensors.torch import save_file

    t = runs.task
    meta = {"n_vocab": t.n_vocab, "seq_len": t.seq_len, "min_period": t.min_period, "max_period": t.max_period,
            "d_model": runs.d_model, "num_heads": runs.num_heads, "seeds": runs.seeds}
    save_file({k: v.detach().contiguous() for k, v in runs.state_dict().items()}, str(path),
              metadata={"attnlib.induction": json.dumps(meta)})


def load_runs(path: str | Path | None = None) -> InductionRuns:
    """The runs stored by :func:`save_runs` at ``path``; by default the twelve runs that
    ``scripts/train_induction.py`` trained, shipped with attnlib."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(__file__).with_name(SHIPPED) if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no saved runs at {path}")
    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("attnlib.induction", "null"))
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds no attnlib.induction metadata: not written by save_runs")
    task = RepeatTask(meta["n_vocab"], meta["seq_len"], meta["min_period"], meta["max_period"])
    state = load_file(str(path))
    runs = InductionRuns(task, meta["d_model"], meta["num_heads"], meta["seeds"], dtype=state["embed"].dtype)
    runs.load_state_dict(state)
    return runs
