r"""Rates over seeds (chapters 7 and 11): a claim about training is a count of seeds, and a count
is a rate with an uncertainty.

:func:`binomial_interval` gives the exact (Clopper–Pearson) interval for a rate seen ``k`` times
in ``n`` seeds, :func:`binomial_counts` the counts that another sample of seeds can show for any
rate in such an interval, and :func:`rate_text` says both in words, as the chapters print them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["binomial_interval", "binomial_counts", "rate_text"]


def _binomial_cdf(c: int, n: int, p: float) -> float:
    """P(X <= c) for X ~ Binomial(n, p), summed from log-probabilities (no overflow for large n)."""
    if c < 0:
        return 0.0
    if c >= n or p == 0.0:
        return 1.0
    if p == 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    return min(1.0, sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                        for i in range(c + 1)))


def _check_level(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie strictly between 0 and 1, got {level}")
    return (1.0 - level) / 2


def binomial_interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    r"""The exact (Clopper–Pearson) interval for a rate seen ``k`` times in ``n`` seeds: the rates
    :math:`p` that such a count does not rule out at two-sided ``level``. With
    :math:`\alpha = (1 - \text{level})/2` and :math:`X \sim \mathrm{Binomial}(n, p)`, the lower end
    solves :math:`P(X \ge k) = \alpha` (0 when ``k = 0``), the upper end :math:`P(X \le k) = \alpha`
    (1 when ``k = n``); both by bisection, to below 1e-15. Covers the true rate in at least
    ``level`` of samples, whatever it is. Returns ``(lower, upper)``, floats in [0, 1]."""
    if isinstance(k, bool) or isinstance(n, bool) or not isinstance(k, int) or not isinstance(n, int):
        raise TypeError(f"k and n must be int counts, got {type(k).__name__} and {type(n).__name__}")
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    alpha = _check_level(level)

    def solve(f: Callable[[float], float], increasing: bool) -> float:  # the root of f(p) = alpha on [0, 1]
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if (f(mid) < alpha) == increasing:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda p: 1.0 - _binomial_cdf(k - 1, n, p), increasing=True)
    upper = 1.0 if k == n else solve(lambda p: _binomial_cdf(k, n, p), increasing=False)
    return lower, upper


def binomial_counts(rate: tuple[float, float], n: int, level: float = 0.95) -> tuple[int, int]:
    r"""The counts another sample of ``n`` seeds can show when the rate lies in ``rate = (lower,
    upper)`` (for instance a :func:`binomial_interval`): from the lower ``(1 - level)/2``-quantile of
    :math:`\mathrm{Binomial}(n, \text{lower})` to the upper one of :math:`\mathrm{Binomial}(n,
    \text{upper})`. A count outside it is unlikely (below ``(1 - level)/2`` on each side) for every
    rate in the interval. Returns ``(low count, high count)``, ints in ``0 .. n``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    lower, upper = rate
    if not 0.0 <= lower <= upper <= 1.0:
        raise ValueError(f"rate must be (lower, upper) with 0 <= lower <= upper <= 1, got {rate}")
    alpha = _check_level(level)
    low = next(c for c in range(n + 1) if _binomial_cdf(c, n, lower) > alpha)
    high = next(c for c in range(n + 1) if _binomial_cdf(c, n, upper) >= 1.0 - alpha)
    return low, high


def rate_text(k: int, n: int, others: int = 20, level: float = 0.95) -> str:
    """``k`` of ``n`` seeds as a rate, in words: the count, its :func:`binomial_interval` and the
    :func:`binomial_counts` that ``others`` other seeds can show, e.g. ``"36 of 40: a rate of 0.76
    to 0.97 (95 %), 11 to 20 of 20 other seeds"``."""
    lo, hi = binomial_interval(k, n, level)
    low, high = binomial_counts((lo, hi), others, level)
    return f"{k} of {n}: a rate of {lo:.2f} to {hi:.2f} ({level:.0%}), {low} to {high} of {others} other seeds".replace("%)", " %)")

