"""Pearson's chi-square goodness-of-fit test, for checking sampled frequencies against
a distribution (no SciPy in the test environment; the incomplete gamma function as in
Numerical Recipes, 6.2)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_EXPECTED = 5.0
"""Bins expected to hold fewer draws than this are pooled: the chi-square law is an
approximation that needs about five per bin."""


def _lower_series(a: float, x: float) -> float:
    """P(a, x) by its series (converges fast for x < a + 1)."""
    term = total = 1.0 / a
    n = a
    for _ in range(10_000):
        n += 1.0
        term *= x / n
        total += term
        if abs(term) < abs(total) * 1e-15:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _upper_fraction(a: float, x: float) -> float:
    """Q(a, x) by its continued fraction (Lentz; converges fast for x >= a + 1)."""
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h * math.exp(-x + a * math.log(x) - math.lgamma(a))


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X chi-square distributed with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if statistic <= 0:
        return 1.0
    if math.isinf(statistic):
        return 0.0
    a, x = df / 2.0, statistic / 2.0
    if x < a + 1.0:
        return max(0.0, 1.0 - _lower_series(a, x))
    return _upper_fraction(a, x)


@dataclass(frozen=True)
class Fit:
    statistic: float
    df: int
    p_value: float
    impossible: tuple[int, ...]
    """Bins drawn at least once that the distribution gives no probability."""


def goodness_of_fit(counts: Sequence[int], probs: Sequence[float]) -> Fit:
    """Pearson's test of ``counts`` (draws per outcome) against ``probs``. Outcomes of
    probability 0 that were drawn make the fit impossible (p = 0); those expected fewer
    than :data:`MIN_EXPECTED` times are pooled into one bin."""
    if len(counts) != len(probs):
        raise ValueError("one probability per outcome")
    n = sum(counts)
    total = math.fsum(probs)
    impossible = tuple(i for i, (c, p) in enumerate(zip(counts, probs, strict=True))
                       if p <= 0 and c > 0)  # fmt: skip
    if impossible:
        return Fit(math.inf, 0, 0.0, impossible)
    bins: list[tuple[float, float]] = []
    pooled_obs = pooled_exp = 0.0
    for c, p in zip(counts, probs, strict=True):
        expected = n * p / total
        if expected <= 0:
            continue
        if expected < MIN_EXPECTED:
            pooled_obs += c
            pooled_exp += expected
        else:
            bins.append((c, expected))
    if pooled_exp > 0:
        bins.append((pooled_obs, pooled_exp))
    df = len(bins) - 1
    if df < 1:
        return Fit(0.0, 0, 1.0, ())
    statistic = math.fsum((o - e) ** 2 / e for o, e in bins)
    return Fit(statistic, df, chi2_sf(statistic, df), ())
