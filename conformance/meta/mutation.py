"""The mutation score: does the suite catch realistic single-line bugs, on either side?

For every mutant (:mod:`conformance.meta.mutants.vllm_side`, :mod:`conformance.meta.mutants.rules`)
:func:`run_mutant` installs it and runs the lanes' own checks (:mod:`conformance.checks`,
the functions the lanes call), in a fixed order, until one catches it:

- config: :mod:`conformance.checks.config` (vLLM's ``build_offloading_config`` /
  ``SchedulerOffloadConfig`` against the reference);
- plan: :func:`conformance.checks.plan.answers_agree` on fixed workloads, traces
  recorded *with the mutant applied* for vLLM-side mutants (rule mutants replay the
  unmutated traces), the tier's capacity and its evictions;
- data: :mod:`conformance.checks.data` (real bytes);
- tests: ``tests/test_rules.py``'s tests (:mod:`conformance.checks.units`), properties
  derandomized (the declarative rules the planner does not call are checked there).
- spec: ``tests/test_transfer_catches.py::check_fast_equals_spec`` (the fast path
  against the byte-layout spec, :mod:`reference.transfer`, on fixed layouts).

A check *catches* a mutant only by an assertion (:func:`classify`): it passed without
the mutant and fails an assertion with it, or (a recorded deviation's strict xfail) it
failed an assertion without the mutant and passes with it.  Any other exception is a
*crash*: recorded (``Outcome.crashed_by``), never counted.  Every check's baseline
(no mutant) must pass, or fail by assertion where a deviation is recorded for its
case; anything else raises :class:`HarnessError` naming the check (a renamed case or
test cannot silently retire a check).

A mutant's ``EXPECTED_CATCHERS`` hint (:mod:`conformance.meta.mutants.records`) is tried
first, so a caught mutant usually costs one check; ``python -m conformance.meta.mutation``
prints fresh hints.  A check runs only on mutants whose target module it executes
(``Check.reaches``).  Workloads are fixed (no seed), so the outcome never varies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from conformance.meta.mutants.catalogue import Check, checks
from conformance.meta.mutants.records import EXPECTED_CATCHERS, KNOWN_GAPS, MEASURED_SCORE
from conformance.meta.mutants.source import Mutant

__all__ = ["EXPECTED_CATCHERS", "KNOWN_GAPS", "MEASURED_SCORE", "Check", "Failure",
           "HarnessError", "Outcome", "all_mutants", "baseline", "checks", "classify",
           "run_mutant", "score"]


class HarnessError(RuntimeError):
    """A check does not hold on the unmutated code: it cannot score mutants."""


@dataclass(frozen=True)
class Failure:
    """How a check failed: ``assertion`` (a finding) or ``crash`` (any other exception)."""

    kind: str
    line: str


@dataclass(frozen=True)
class Outcome:
    mutant: str
    bug_class: str
    side: str
    caught_by: str | None
    """The check whose assertion caught the mutant (the only catch that counts)."""
    detail: str
    seconds: float
    equivalent: str | None
    crashed_by: str | None = None
    """The first check that crashed (an exception other than an assertion) under the mutant."""

    @property
    def kind(self) -> str | None:
        """``assertion`` when caught, ``crash`` when a check only crashed, else None."""
        if self.caught_by:
            return "assertion"
        return "crash" if self.crashed_by else None

    @property
    def status(self) -> str:
        if self.caught_by:
            return "caught"
        if self.equivalent:
            return "equivalent"
        return "crashed" if self.crashed_by else "survived"


# -- the runner --------------------------------------------------------------------


_ROOT = Path(__file__).resolve().parents[2]
_ASSERTING = (str(_ROOT / "conformance" / "checks") + "/", str(_ROOT / "tests") + "/")
"""Where a check's assertions live: an ``AssertionError`` raised anywhere else (vLLM's
own ``assert``, the reference's, the driver's) is a crash of the code under test."""


def classify(err: BaseException) -> str:
    """``assertion`` for a check's finding (``CheckFailed``, or an ``AssertionError`` raised
    by a check or a unit test itself; a hypothesis group of them, not a flaky one), else
    ``crash``."""
    from hypothesis.errors import Flaky

    from conformance.checks import CheckFailed

    if isinstance(err, CheckFailed):
        return "assertion"
    if isinstance(err, AssertionError):
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        raised_in = tb.tb_frame.f_code.co_filename if tb is not None else ""
        return "assertion" if raised_in.startswith(_ASSERTING) else "crash"
    if isinstance(err, BaseExceptionGroup) and not isinstance(err, Flaky):
        return "assertion" if all(classify(e) == "assertion" for e in err.exceptions) else "crash"
    return "crash"


def _outcome(check: Check, mutant: Mutant | None) -> Failure | None:
    """None when the check passes, else how it failed (kind and one line)."""
    try:
        check.run(mutant)
    except (Exception, pytest.fail.Exception, pytest.skip.Exception) as err:
        text = str(err).splitlines()[0] if str(err) else ""
        return Failure(classify(err), f"{type(err).__name__}: {text}"[:160])
    return None


@cache
def baseline(check: Check) -> Failure | None:
    """The check's outcome without any mutant (run once; drivers and traces cached):
    None, or an assertion failure where a deviation is recorded; else HarnessError."""
    got = _outcome(check, None)
    if got is None or (got.kind == "assertion" and check.deviation):
        return got
    raise HarnessError(f"{check.test_id} fails on the unmutated code ({got.kind}: {got.line}): "
                       "a check that does not hold cannot score mutants; fix the check")


def walk_order(mutant: Mutant, all_checks: tuple[Check, ...]) -> tuple[Check, ...]:
    """``all_checks`` with the mutant's ``EXPECTED_CATCHERS`` hint first (a speed-up
    only: a stale hint costs time, never an outcome, since the rest follow in order)."""
    hint = EXPECTED_CATCHERS.get(mutant.name)
    first = tuple(c for c in all_checks if c.test_id == hint)
    return (*first, *(c for c in all_checks if c.test_id != hint))


def run_mutant(mutant: Mutant, all_checks: tuple[Check, ...] | None = None) -> Outcome:
    """Install ``mutant`` around each check in turn; stop at the first assertion that
    catches it (crashes are noted and the walk goes on)."""
    spent, crash = 0.0, None
    for check in walk_order(mutant, all_checks if all_checks is not None else checks()):
        if not check.executes(mutant):
            continue
        expected = baseline(check)
        start = time.perf_counter()
        with pytest.MonkeyPatch.context() as mp:
            mutant.apply(mp)
            got = _outcome(check, mutant)
        spent += time.perf_counter() - start
        if got is not None and got.kind == "crash":
            crash = crash or (check.test_id, got.line)
            continue
        if (got is None) != (expected is None):
            detail = got.line if got is not None else f"now passes (baseline: {expected})"
            return Outcome(mutant.name, mutant.bug_class, mutant.side, check.test_id,
                           detail, spent, mutant.equivalent, crash[0] if crash else None)
    return Outcome(mutant.name, mutant.bug_class, mutant.side, None,
                   crash[1] if crash else "no check failed", spent, mutant.equivalent,
                   crash[0] if crash else None)


def all_mutants() -> tuple[Mutant, ...]:
    from conformance.meta.mutants import rules, vllm_side

    return (*vllm_side.MUTANTS, *rules.MUTANTS)


def score(outcomes: list[Outcome]) -> tuple[int, int, float]:
    """``(caught, non-equivalent, caught / non-equivalent)``: caught by assertion alone."""
    scored = [o for o in outcomes if o.status != "equivalent"]
    caught = sum(o.status == "caught" for o in scored)
    return caught, len(scored), caught / len(scored) if scored else 1.0


def main() -> None:
    """Check every baseline, run every mutant; print each outcome, the score and a fresh
    ``EXPECTED_CATCHERS``."""
    for check in checks():
        baseline(check)
    outcomes = []
    for mutant in all_mutants():
        o = run_mutant(mutant)
        outcomes.append(o)
        where = o.caught_by or (f"crashed in {o.crashed_by}" if o.crashed_by else "-")
        print(f"{o.seconds:6.1f}s {o.status:10} {o.mutant}: {where} ({o.detail})", flush=True)
    caught, scored, ratio = score(outcomes)
    crashed = [o.mutant for o in outcomes if o.status == "crashed"]
    print(f"score {caught}/{scored} = {ratio:.0%} by assertion; crashed only: {crashed}")
    print("EXPECTED_CATCHERS = {")
    for o in outcomes:
        if o.caught_by:
            print(f"    {o.mutant!r}:\n        {o.caught_by!r},")
    print("}")


if __name__ == "__main__":
    main()
