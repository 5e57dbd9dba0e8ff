"""The benchmarks' paired interval and verdicts (:mod:`conformance.bench.stats`), by hand."""

from __future__ import annotations

import math

import pytest

from conformance.bench.stats import RatioInterval, classify, paired_interval, t_975


def test_identical_rounds_give_a_point_interval() -> None:
    # Every round: baseline 2 s, candidate 1 s -> speed ratio 2, no spread.
    iv = paired_interval([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], speed=True)
    assert iv.ratio == pytest.approx(2.0)
    assert (iv.low, iv.high) == (pytest.approx(2.0), pytest.approx(2.0))
    assert iv.rounds == 3
    cost = paired_interval([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], speed=False)
    assert cost.ratio == pytest.approx(0.5)


def test_three_rounds_by_hand() -> None:
    # log-ratios 0, 1, 2: mean 1, sd 1, t(0.975, 2) = 4.303, half = 4.303 / sqrt(3) = 2.4844.
    e = math.e
    iv = paired_interval([1.0, 1.0, 1.0], [1.0, e, e * e], speed=True)
    assert iv.ratio == pytest.approx(e)
    assert math.log(iv.low) == pytest.approx(1 - 2.4844, abs=1e-4)
    assert math.log(iv.high) == pytest.approx(1 + 2.4844, abs=1e-4)


def test_t_table_and_its_normal_tail() -> None:
    assert t_975(1) == 12.706
    assert t_975(8) == 2.306
    assert t_975(30) == 2.042
    assert t_975(200) == 1.96
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_975(0)


@pytest.mark.parametrize(
    "candidate,baseline,match",
    [([1.0], [1.0], ">= 2 rounds"), ([1.0, 1.0], [1.0], "baseline"), ([1.0, 0.0], [1.0, 1.0], "> 0")],
)
def test_bad_inputs(candidate: list[float], baseline: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        paired_interval(candidate, baseline, speed=True)


@pytest.mark.parametrize(
    "low,high,verdict",
    [(0.85, 0.95, "met"), (0.80, 0.90, "met"), (0.70, 0.79, "missed"), (0.75, 0.85, "inconclusive")],
)
def test_classify_lower_bound(low: float, high: float, verdict: str) -> None:
    assert classify(RatioInterval((low + high) / 2, low, high, 9), min_ratio=0.8) == verdict


@pytest.mark.parametrize(
    "low,high,verdict",
    [(0.5, 1.0, "met"), (1.01, 1.2, "missed"), (0.9, 1.1, "inconclusive")],
)
def test_classify_upper_bound(low: float, high: float, verdict: str) -> None:
    assert classify(RatioInterval((low + high) / 2, low, high, 9), max_ratio=1.0) == verdict


def test_classify_needs_exactly_one_bound() -> None:
    iv = RatioInterval(1.0, 1.0, 1.0, 2)
    with pytest.raises(ValueError, match="exactly one"):
        classify(iv)
    with pytest.raises(ValueError, match="exactly one"):
        classify(iv, min_ratio=0.5, max_ratio=2.0)
