"""The benchmarks' paired interval and verdicts (:mod:`conformance.bench.stats`), by hand."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from conformance.bench import TARGETS, Measured, Target
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


# A miss must repeat (conformance.bench.Target.verdict / Measured.ratio_fields).

_TRANSFER = {"kind": "transfer", "blocks_per_chunk": 16}
"""A figure the transfer target (>= 0.8 for blocks_per_chunk >= 4) applies to."""


def _target() -> Target:
    (target,) = [t for t in TARGETS if t.applies(_TRANSFER)]
    return target


@pytest.mark.parametrize(
    "first,again,verdict",
    [
        ((0.66, 0.56, 0.78), None, "missed"),  # no second batch recorded: the miss stands
        ((0.66, 0.56, 0.78), (0.70, 0.60, 0.79), "missed"),  # repeated
        ((0.66, 0.56, 0.78), (0.95, 0.85, 1.05), "inconclusive"),  # not repeated: noise
        ((0.66, 0.56, 0.78), (0.85, 0.75, 0.95), "inconclusive"),
        ((0.90, 0.85, 0.95), (0.10, 0.05, 0.20), "met"),  # a second batch never turns a met
    ],
)
def test_a_miss_stands_only_when_it_repeats(
    first: tuple[float, float, float], again: tuple[float, float, float] | None, verdict: str
) -> None:
    row: dict[str, object] = {**_TRANSFER, "ratio": first[0], "ratio_ci": list(first[1:])}
    if again is not None:
        row |= {"confirm_ratio": again[0], "confirm_ratio_ci": list(again[1:])}
    assert _target().verdict(row) == verdict
    if again is not None:
        assert "measured again" in _target().explain(row)


def _measured(
    candidate: float, baseline: float, again: Callable[[], Measured] | None = None, rounds: int = 3
) -> Measured:
    return Measured([candidate] * rounds, {"memcpy": [baseline] * (rounds + 1)}, again)


def test_ratio_fields_measures_again_only_after_a_miss() -> None:
    calls: list[float] = []

    def again() -> Measured:
        calls.append(1.0)
        return _measured(1.0, 0.9)  # speed 0.9: met this time

    met = _measured(1.0, 0.9, again).ratio_fields("memcpy", speed=True, about=_TRANSFER)
    assert not calls and "confirm_ratio" not in met
    missed = _measured(1.0, 0.5, again).ratio_fields("memcpy", speed=True, about=_TRANSFER)
    assert len(calls) == 1
    assert missed["ratio"] == pytest.approx(0.5)
    assert missed["confirm_ratio"] == pytest.approx(0.9)
    assert _target().verdict(missed) == "inconclusive"
    small = _measured(1.0, 0.5, again).ratio_fields(  # B = 1: no target applies, no second batch
        "memcpy", speed=True, about={**_TRANSFER, "blocks_per_chunk": 1}
    )
    assert len(calls) == 1 and "confirm_ratio" not in small
