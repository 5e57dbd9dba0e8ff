"""Paired ratio intervals and target verdicts (pure functions; no timing here).

Every benchmark runs its candidate and its baseline interleaved in one process
(``B A B A ... B``, :func:`conformance.bench.measure`).  Round ``i`` pairs the
candidate's time ``c_i`` with ``b_i``, the mean of the baseline runs just
before and just after it, and contributes one log-ratio
``x_i = log(c_i / b_i)`` (or ``log(b_i / c_i)`` for a speed ratio).  A load
spike that hits both neighbours cancels; one that hits only one side widens
the spread of the ``x_i``, and so the interval, instead of biasing the point.

The interval is Student's t on the mean log-ratio, mapped back by ``exp``:
``exp(mean(x) +- t(0.975, n - 1) * sd(x) / sqrt(n))``, a 95 % interval of the
geometric-mean ratio.  scipy is not a dependency, so the two-sided 97.5 %
quantiles for 1..30 degrees of freedom come from :data:`T_975` (standard
tables, e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2), and the normal 1.96 beyond.

A target is **met** when the whole interval is on its side, **missed** when
the whole interval is on the wrong side, and **inconclusive** when the
interval straddles it (rerun, with more rounds); only "missed" fails
``nox -s bench``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["T_975", "RatioInterval", "Verdict", "classify", "paired_interval", "t_975"]

Verdict = Literal["met", "missed", "inconclusive"]

T_975: tuple[float, ...] = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
"""``t(0.975, df)`` for ``df`` = 1..30 (two-sided 95 %)."""


def t_975(df: int) -> float:
    """Student's two-sided 95 % quantile for ``df`` degrees of freedom (>= 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return T_975[df - 1] if df <= len(T_975) else 1.96


@dataclass(frozen=True)
class RatioInterval:
    """A geometric-mean ratio and its 95 % paired t-interval."""

    ratio: float
    low: float
    high: float
    rounds: int


def paired_interval(
    candidate: Sequence[float], baseline: Sequence[float], *, speed: bool
) -> RatioInterval:
    """The interval of ``baseline / candidate`` (``speed``) or ``candidate / baseline``.

    ``candidate[i]`` and ``baseline[i]`` are one round's paired times (seconds, > 0).
    """
    if len(candidate) != len(baseline):
        raise ValueError(f"{len(candidate)} candidate times vs {len(baseline)} baseline times")
    if len(candidate) < 2:
        raise ValueError(f"a paired interval needs >= 2 rounds, got {len(candidate)}")
    if min(*candidate, *baseline) <= 0:
        raise ValueError("times must be > 0")
    logs = [
        math.log(b / c) if speed else math.log(c / b)
        for c, b in zip(candidate, baseline, strict=True)
    ]
    n = len(logs)
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t_975(n - 1) * sd / math.sqrt(n)
    return RatioInterval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)


def classify(
    interval: RatioInterval, *, min_ratio: float | None = None, max_ratio: float | None = None
) -> Verdict:
    """``met`` / ``missed`` / ``inconclusive`` of ``interval`` against a bound (exactly one)."""
    if (min_ratio is None) == (max_ratio is None):
        raise ValueError("give exactly one of min_ratio and max_ratio")
    if min_ratio is not None:
        if interval.low >= min_ratio:
            return "met"
        return "missed" if interval.high < min_ratio else "inconclusive"
    assert max_ratio is not None
    if interval.high <= max_ratio:
        return "met"
    return "missed" if interval.low > max_ratio else "inconclusive"
