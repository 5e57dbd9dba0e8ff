"""Meta lane, the corpus's power: how many rule mutants does the golden corpus kill alone?

Every reference-rule mutant (:data:`conformance.meta.mutants.rules.MUTANTS`) is installed
in turn and every committed corpus case replayed into the reference, as ``python -m
conformance.corpus replay --backend reference`` does (:mod:`conformance.meta.corpus_power`).
A mutant is killed when a case fails (a divergence or the backend raising).  The score,
beside the suite's mutation score (``test_meta.py::test_mutation_score``), says what a
backend author who only replays the corpus would catch.  Target: 90 %.

Each survivor is recorded with the case class the corpus lacks
(:data:`~conformance.meta.corpus_power.CORPUS_GAPS`): a strict xfail, so a new case that
kills it fails until its record goes.  Needs no vLLM.
"""

from __future__ import annotations

import pytest

from conformance.meta import corpus_power as C
from conformance.meta.mutants.source import NotApplicable

pytestmark = [pytest.mark.meta, pytest.mark.xdist_group("corpus_power")]
"""One worker runs the lane under ``-n``: the score reads the outcomes the mutants cached."""

_KILLS: dict[str, C.MutantKill | None] = {}
"""Each rule mutant's outcome against the corpus (None: its edit does not apply)."""


class ScoreBelowTarget(AssertionError):
    """The corpus alone kills fewer than :data:`~conformance.meta.corpus_power.TARGET`."""


def _kill(name: str) -> C.MutantKill | None:
    if name not in _KILLS:
        mutant = next(m for m in C.rule_mutants() if m.name == name)
        try:
            _KILLS[name] = C.replay_mutant(mutant)
        except NotApplicable:
            _KILLS[name] = None
    return _KILLS[name]


def test_every_case_passes_unmutated(record_property) -> None:  # type: ignore[no-untyped-def]
    """The replay that scores the mutants passes on the unmutated reference (else HarnessError)."""
    record_property("counter:corpus_power_cases", len(C.committed_cases()))


@pytest.mark.parametrize("name", [m.name for m in C.rule_mutants()])
def test_corpus_kills_mutant(name: str, record_property, request) -> None:  # type: ignore[no-untyped-def]
    """Killed means some committed case fails under the mutant; a recorded gap is a strict xfail."""
    gap = C.CORPUS_GAPS.get(name)
    if gap is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"corpus gap: {gap}"))
    kill = _kill(name)
    if kill is None:
        pytest.skip(f"{name}: the mutant's edit applies to no current source (not applicable)")
    record_property("corpus_mutant", name)
    record_property("corpus_killed", "yes" if kill.killed else "no")
    record_property("corpus_killed_by", kill.first_failing_case or "-")
    record_property("corpus_kill_kind", ("raised" if kill.raised else "diverged")
                    if kill.killed else "-")
    record_property("corpus_target_reached", "yes" if kill.reached else "no")
    record_property("corpus_survivor_reason", gap or "-")
    assert kill.killed, (f"rule mutant {name} survived every corpus case"
                         + ("" if kill.reached else " (the replay never runs its target)")
                         + ": record the case class the corpus lacks in CORPUS_GAPS")


def test_corpus_mutation_score(record_property, request) -> None:  # type: ignore[no-untyped-def]
    """The corpus alone kills at least 90 % of the applicable rule mutants; while the
    recorded gaps put it below, a strict xfail listing them (and why)."""
    names = [m.name for m in C.rule_mutants()]
    kills = [k for k in (_kill(n) for n in names) if k is not None]
    power = C.CorpusPower(tuple(kills), tuple(n for n in names if _KILLS[n] is None),
                          len(C.committed_cases()))
    record_property("corpus_mutation_score", f"{power.killed}/{power.total}")
    record_property("corpus_mutation_score_reached", f"{power.killed_reached}/{power.reached}")
    recorded = [n for n in names if n in C.CORPUS_GAPS and _KILLS[n] is not None]
    if len(recorded) > (1 - C.TARGET) * power.total:
        request.applymarker(pytest.mark.xfail(
            strict=True, raises=ScoreBelowTarget,
            reason=f"the corpus alone kills {power.total - len(recorded)}/{power.total} "
                   f"< {C.TARGET:.0%} (recorded); survivors and the case each lacks: "
                   + "; ".join(f"{n}: {C.CORPUS_GAPS[n]}" for n in recorded)))
    if power.fraction < C.TARGET:
        raise ScoreBelowTarget(
            f"the corpus alone kills {power.killed}/{power.total} = {power.fraction:.0%} of the "
            f"rule mutants < {C.TARGET:.0%} ({power.killed_reached}/{power.reached} of those whose "
            f"target the replay runs); survivors {list(power.survivors)}")
