"""The metadata-bound bench rows whose target lies above the mount's bound (issue #30: "a
target above that bound is a wrong target, not a miss: say so and propose one"): each is
held to the proposed target, :data:`conformance.bench.SHARE_OF_BOUND` x its bound, and
``reports/bench.md`` says the verdict.  Rows written here; no timing."""

from __future__ import annotations

from typing import Any

import pytest

from conformance.bench import SHARE_OF_BOUND, TARGETS, proposed_target
from conformance.bench import report as R


def _row(ratio: float, low: float, high: float, bound: float, target: float = 8.0) -> dict[str, Any]:
    return {"kind": "packed_time_metadata", "direction": "store", "ops_per_s": 2000,
            "ratio": ratio, "ratio_ci": [low, high], "bound": bound, "target": target,
            "target_above_bound": bound < target, "blocks_per_chunk": 1}


@pytest.mark.parametrize(("low", "high", "verdict"), [
    (6.7, 7.2, "met"), (6.4, 6.8, "inconclusive"), (5.0, 6.0, "missed")])
def test_a_wrong_target_is_replaced_by_its_share_of_the_bound(
        low: float, high: float, verdict: str) -> None:
    row = _row((low + high) / 2, low, high, bound=7.32)
    goal, got = proposed_target(row)
    assert goal == pytest.approx(SHARE_OF_BOUND * 7.32) == pytest.approx(6.588)
    assert got == verdict
    said = R._verdict(row)
    assert said.startswith("target 8 above the bound 7.32: a wrong target, not a miss; ")
    assert said.endswith(f"proposed >= 0.9 x the bound = 6.59: "
                         f"{verdict if verdict == 'met' else f'**{verdict}**'}")


def test_a_row_below_its_bound_keeps_the_set_target() -> None:
    """The proposal replaces only a wrong target: a row whose bound clears the target is
    judged by the target itself, and a miss there stays a miss."""
    row = _row(7.0, 6.8, 7.2, bound=9.7)
    (target,) = [t for t in TARGETS if t.applies(row)]
    assert target.min_ratio == 8.0 and target.verdict(row) == "missed"
    assert R._verdict(row) == "**missed**"
