r"""AdamW written out (chapters 7 and 11 train with it): ``torch.optim.AdamW``'s update on the
CPU, op for op, without importing the compiler that every ``torch.optim`` optimizer loads."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["AdamW"]


class AdamW:
    r"""Adam with decoupled weight decay (Kingma and Ba, 2015; Loshchilov and Hutter, 2019), the
    update of ``torch.optim.AdamW`` with its defaults (``betas=(0.9, 0.999)``, ``eps=1e-8``, no
    AMSGrad), written out op for op as PyTorch computes it on the CPU. At step :math:`t`, for
    each weight :math:`\theta` with gradient :math:`g`:

    .. math::
        \theta \leftarrow \theta (1 - \eta \lambda), \quad
        m \leftarrow m + (1 - \beta_1)(g - m), \quad
        v \leftarrow \beta_2 v + (1 - \beta_2) g^2, \quad
        \theta \leftarrow \theta - \frac{\eta}{1 - \beta_1^t}\,
        \frac{m}{\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon} .

    It gives ``torch.optim.AdamW``'s weights bit for bit, single-tensor or ``foreach``
    (``tests/test_induction.py`` checks both with ``torch.equal``).
    :func:`attnlib.recall.train_recall`, :func:`attnlib.recall.train_recall_runs` and
    :func:`attnlib.induction.train_induction` use it because building any ``torch.optim``
    optimizer imports ``torch._dynamo`` (and sympy) on its first use in a process, about
    1.5 s that a chapter's kernel would spend on a compiler it never calls.
    """

    def __init__(self, params: Sequence[Tensor], lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        for name, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not all(isinstance(b, float) and 0 <= b < 1 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
        self.params, self.lr, self.weight_decay, self.betas, self.eps = list(params), float(lr), float(weight_decay), betas, eps
        self.exp_avg = [torch.zeros_like(p) for p in params]  # m
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]  # v
        self.t = 0

    @torch.no_grad()
    def step(self, grads: Sequence[Tensor]) -> None:
        """One update of every weight, from its gradient ``grads[i]`` (of ``params[i]``'s shape)."""
        if len(grads) != len(self.params):
            raise ValueError(f"grads must hold one gradient per weight ({len(self.params)}), got {len(grads)}")
        (beta1, beta2), lr = self.betas, self.lr
        self.t += 1
        step = float(self.t)  # what torch reads from its float32 step counter
        bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
        step_size, bias_correction2_sqrt = lr / bias_correction1, bias_correction2**0.5
        for p, g, m, v in zip(self.params, grads, self.exp_avg, self.exp_avg_sq):
            if self.weight_decay != 0:
                p.mul_(1 - lr * self.weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            p.addcdiv_(m, (v.sqrt() / bias_correction2_sqrt).add_(self.eps), value=-step_size)
