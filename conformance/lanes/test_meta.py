"""Meta lane: the suite fails when the implementation under test is broken.

The plan lane's comparison runs against deliberately wrong backends
(``conformance.mutants``) on a fixed set of workloads; each mutant must be
caught.  Also checks that the harness's helpers report what differed.
"""

from __future__ import annotations

import random

import pytest

from conformance import trace as T
from conformance.mutants import MUTANTS
from conformance.replay import Answer, first_divergence, replay
from conformance.workloads import PlanCase, driver_for

pytestmark = pytest.mark.meta

CASE = PlanCase("fa64+sw128@16", "blocks_per_chunk=2", "full_swa_kv_cache_config",
                (64, 16, 128), (("blocks_per_chunk", 2),), 0)


def _workloads() -> list[T.WorkloadSpec]:
    rng = random.Random(1)
    base = [rng.randrange(30) for _ in range(600)]
    return [
        T.WorkloadSpec(
            requests=(
                T.RequestSpec("a", tuple(base[:n]), max_tokens=2),
                T.RequestSpec("b", tuple(base[:n]), max_tokens=2, arrival_step=6),
            ),
            max_num_batched_tokens=budget,
            resets=(T.ResetSpec(step=5),),
        )
        for n, budget in ((300, 128), (513, 512), (450, 96))
    ]


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_plan_lane_catches_mutant(mutant: str, record_property) -> None:  # type: ignore[no-untyped-def]
    driver = driver_for(CASE)
    caught = 0
    for workload in _workloads():
        trace = driver.run(workload)
        assert first_divergence(replay(trace), replay(trace)) is None  # the oracle is deterministic
        if first_divergence(replay(trace), replay(trace, MUTANTS[mutant])) is not None:
            caught += 1
    record_property("fixture", CASE.fixture)
    record_property("knob", CASE.knob)
    assert caught > 0, f"mutant {mutant} passed every workload: the plan lane cannot fail"


def test_divergence_report_names_both_sides() -> None:
    a = [Answer(3, "lookup", "r0", 256)]
    b = [Answer(3, "lookup", "r0", 192)]
    div = first_divergence(a, b)
    assert div is not None and div.index == 0
    text = div.explain()
    assert "256" in text and "192" in text and "step 3" in text
    assert first_divergence(a, a) is None
    assert first_divergence(a, []) is not None
