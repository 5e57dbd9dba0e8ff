"""Meta lane: the suite fails when the implementation under test is broken.

The plan lane's comparison runs against deliberately wrong backends
(``conformance.meta.mutants``) on a fixed set of workloads; each mutant must be
caught.  Also checks that the harness's helpers report what differed.

The mutation score (:mod:`conformance.meta.mutation`): every vLLM-side mutant
(one-line faults in vLLM's offloading config, scheduler and worker) and every
rule mutant (one-line faults in the reference's rules) must be caught by an
assertion of one of the lanes' own checks (:mod:`conformance.checks`; a crash does
not count), or carry an equivalence argument; the score over the non-equivalent
ones must be at least 90%.  Every check must hold on the unmutated code first.
"""

from __future__ import annotations

import random

import pytest

from conformance.harness.workloads import PlanCase, driver_for
from conformance.meta import mutation
from conformance.meta.mutants import MUTANTS
from conformance.protocol import trace as T
from conformance.protocol.replay import Answer, first_divergence, replay

pytestmark = [pytest.mark.meta, pytest.mark.xdist_group("meta")]
"""One worker runs the lane under ``-n``: the score reads the mutants' outcomes it cached."""

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


# -- the mutation score ------------------------------------------------------------

_OUTCOMES: dict[str, mutation.Outcome] = {}


def test_every_check_holds_unmutated(record_property) -> None:  # type: ignore[no-untyped-def]
    """Every check the score uses passes on the unmutated code (or, where a deviation is
    recorded for its case, fails by assertion): a renamed case or test is a harness
    error, not a check silently retired."""
    broken = []
    for check in mutation.checks():
        try:
            mutation.baseline(check)
        except mutation.HarnessError as err:
            broken.append(str(err))
    record_property("counter:mutation_checks", len(mutation.checks()))
    assert not broken, "checks that do not hold unmutated:\n" + "\n".join(broken)


def _outcome(name: str) -> mutation.Outcome:
    if name not in _OUTCOMES:
        mutant = next(m for m in mutation.all_mutants() if m.name == name)
        _OUTCOMES[name] = mutation.run_mutant(mutant)
    return _OUTCOMES[name]


@pytest.mark.parametrize("name", [m.name for m in mutation.all_mutants()])
def test_mutant_is_caught(name: str, record_property, request) -> None:  # type: ignore[no-untyped-def]
    """Caught means a check's assertion failed; a crash is recorded and does not count."""
    gap = mutation.KNOWN_GAPS.get(name)
    if gap is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"known gap: {gap}"))
    outcome = _outcome(name)
    record_property("mutant", outcome.mutant)
    record_property("bug_class", outcome.bug_class)
    record_property("caught_by", outcome.caught_by or outcome.status)
    record_property("catch_kind", outcome.kind or "-")
    record_property("crashed_by", outcome.crashed_by or "-")
    record_property("survivor_reason", gap or outcome.equivalent or "-")
    record_property("seconds", round(outcome.seconds, 2))
    record_property("mutation_detail", outcome.detail)
    if outcome.equivalent:
        assert outcome.caught_by is None, (
            f"{name} is marked equivalent but {outcome.caught_by} caught it: drop the argument")
    else:
        assert outcome.caught_by is not None, (
            f"mutant {name} ({outcome.bug_class}) survived every check's assertions"
            + (f" (it crashed {outcome.crashed_by}: {outcome.detail})" if outcome.crashed_by
               else "") + ": a gap in the suite")


def test_mutation_score(record_property) -> None:  # type: ignore[no-untyped-def]
    outcomes = [_outcome(m.name) for m in mutation.all_mutants()]
    caught, scored, score = mutation.score(outcomes)
    record_property("mutation_score", f"{caught}/{scored}")
    survivors = [o.mutant for o in outcomes if o.status in ("survived", "crashed")]
    assert score >= 0.9, (f"mutation score {caught}/{scored} = {score:.0%} by assertion < 90% "
                          f"(last measured {mutation.MEASURED_SCORE}); survivors {survivors}")
