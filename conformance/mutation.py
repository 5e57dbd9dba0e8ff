"""The mutation score: does the suite catch realistic single-line bugs, on either side?

For every mutant (:mod:`conformance.mutants.vllm_side`, :mod:`conformance.mutants.rules`)
:func:`run_mutant` installs it and runs the lanes' own checks, in a fixed order,
stopping at the first that changes outcome:

- config: ``test_config.test_resolution_agrees``'s comparison (vLLM's
  ``build_offloading_config`` / ``SchedulerOffloadConfig`` against the reference);
- plan: ``first_divergence(replay(trace), recorded_answers(trace))`` on fixed
  workloads, traces recorded *with the mutant applied* for vLLM-side mutants
  (rule mutants replay the unmutated traces), and the tier-capacity check;
- data: ``test_data.run_workload`` + ``record_and_check`` (real bytes);
- tests: ``tests/test_rules.py``'s planner-against-rules properties, derandomized
  (the declarative rules the planner does not call are checked there).

A mutant's ``EXPECTED_CATCHERS`` hint (:mod:`conformance.mutants.records`) is tried
first, so a caught mutant usually costs one check; ``python -m conformance.mutation``
prints fresh hints.

A check *catches* a mutant when its outcome differs from its outcome without
the mutant (a strict xfail that passes counts, as it does in pytest).  A check
runs only on mutants whose target module it executes (``Check.reaches``): the
plan lane's emulated engine never runs vLLM's worker, for instance.  Workloads
are fixed (no seed), so the outcome never varies.  The driver (``conformance.driver``) is
imported lazily.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

from conformance import trace as T
from conformance.mutants.records import EXPECTED_CATCHERS, KNOWN_GAPS, MEASURED_SCORE
from conformance.mutants.source import Mutant
from conformance.strategies import SLOW_EXAMPLE_CHECKS
from vllm_adapter.names import STOCK_CONNECTOR

__all__ = ["EXPECTED_CATCHERS", "KNOWN_GAPS", "MEASURED_SCORE", "Check", "Outcome",
           "all_mutants", "checks", "run_mutant", "score"]


@dataclass(frozen=True)
class Check:
    """One of the suite's checks, runnable on demand; raises when the check fails."""

    lane: str
    name: str
    reaches: tuple[str, ...]
    """Module-name suffixes this check executes (a mutant elsewhere cannot change it)."""
    run: Callable[[Mutant | None], None]

    @property
    def test_id(self) -> str:
        return f"{self.lane}::{self.name}"

    def executes(self, mutant: Mutant) -> bool:
        module = mutant.edit.module().__name__
        return any(module.endswith(suffix) for suffix in self.reaches)


@dataclass(frozen=True)
class Outcome:
    mutant: str
    bug_class: str
    side: str
    caught_by: str | None
    detail: str
    seconds: float
    equivalent: str | None

    @property
    def status(self) -> str:
        if self.caught_by:
            return "caught"
        return "equivalent" if self.equivalent else "survived"


_CONFIG = ("offloading.config", "offloading.scheduler", "cpu.spec",
           "reference.knobs", "reference.rules")
_PLAN = ("offloading.config", "offloading.scheduler", "cpu.spec", "cpu.manager",
         "reference.knobs", "reference.rules", "reference.keys", "reference.plan",
         "reference.store")
_CAPACITY = ("offloading.config", "cpu.spec")
_DATA = (*_PLAN, "offloading.worker", "reference.transfer", "reference.transfer_fast",
         "reference.transfer_checks", "reference.geometry")


# -- config lane -------------------------------------------------------------------

_CONFIG_CASES = (
    "synthetic-full-swa blocks_per_chunk=2", "synthetic-eagle blocks_per_chunk=2",
    "synthetic-full-mamba-align blocks_per_chunk=2", "synthetic-full-swa block_size=512",
    "synthetic-full-mamba-align block_size=100", "synthetic-full-swa blocks_per_chunk=0",
)


def _config_check(case_id: str) -> Check:
    def run(_: Mutant | None) -> None:
        from conformance.lanes import test_config as lane
        from vllm_adapter import fixtures as F

        case = next(c for c in lane.CASES if str(c) == case_id)
        fx = lane._fixture(case.fixture)
        kvc = F.rebuild_kv_cache_config(fx, "scheduler")
        chunking, error = lane._reference(case)
        try:
            vllm = lane.vllm_blocks_per_chunk(kvc, F.make_vllm_config(fx, case.knob.extra))
        except lane.VllmRejected as rejected:
            assert chunking is None, f"vLLM rejects ({rejected}), the reference accepts"
            assert f"'{case.knob.items[0][0]}'" in error, error
            return
        assert chunking is not None, f"vLLM accepts, the reference rejects: {error}"
        assert vllm.blocks_per_chunk == chunking.uniform_blocks_per_chunk
        assert vllm.tokens_per_hash == chunking.tokens_per_hash
        assert vllm.sliding_window_size_in_chunks == {
            gc.group.index: gc.window_in_chunks for gc in chunking.groups}
        lane._assert_same(chunking, lane._scheduler_config(case, STOCK_CONNECTOR, None))

    return Check("config", f"test_resolution_agrees[{case_id}]", _CONFIG, run)


def _deviation_check(case_id: str) -> Check:
    def run(_: Mutant | None) -> None:
        from conformance.lanes import test_config as lane

        lane.deviation_holds(next(c for c in lane.CASES if str(c) == case_id))

    return Check("config", f"test_config_deviation_is_a_vllm_rejection[{case_id}]", _CONFIG, run)


_CLEAN_REJECTIONS = ("synthetic-full-swa blocks_per_chunk=0",
                     "synthetic-full-mamba-align block_size=100")


def _clean_rejection_check(case_id: str) -> Check:
    def run(_: Mutant | None) -> None:
        from conformance.lanes import test_config as lane

        lane.vllm_rejects_cleanly(next(c for c in lane.CASES if str(c) == case_id))

    return Check("config", f"test_vllm_rejects_the_knob_cleanly[{case_id}]", _CONFIG, run)


# -- plan lane ---------------------------------------------------------------------

_PLAN_CASES = (
    "fa64+sw40@16/blocks_per_chunk=2/retention=0",
    "fa64+sw33@16/blocks_per_chunk=2/retention=0",
    "fa64+sw32+mtp2@16/blocks_per_chunk=2/retention=0",
    "fa64+sw32+mtp1@16/blocks_per_chunk=2/retention=0",
    "fa64+sw16@16/blocks_per_chunk=4/retention=0",
    "fa64+eagle-sw128@16 decode stores/blocks_per_chunk=1 offload_prompt_only=False/retention=0",
    "fa64+eagle-sw128@16/blocks_per_chunk=2/retention=0",
    "fa64+mamba-align@64/blocks_per_chunk=2/retention=0",
    "fa64+sw128@16/blocks_per_chunk=2/retention=None",
    "full@16 full tier/blocks_per_chunk=4/retention=0/cpu=4",
)


_EXAMPLES_DRAWN, _EXAMPLES_KEPT = 40, 2


@cache
def fixed_workloads(max_len: int = 520) -> tuple[T.WorkloadSpec, ...]:
    """The plan lane's own workload strategy, drawn derandomized (no seed): of the ci
    profile's 40 examples, the 2 that end with a repeat (loads from the tier) and
    carry the most prompt tokens."""
    from hypothesis import Phase, given, settings

    from conformance.workloads import workloads

    drawn: list[T.WorkloadSpec] = []

    @settings(max_examples=_EXAMPLES_DRAWN, derandomize=True, database=None,
              phases=[Phase.generate], suppress_health_check=SLOW_EXAMPLE_CHECKS)
    @given(workloads(max_len=max_len))
    def collect(workload: T.WorkloadSpec) -> None:
        drawn.append(workload)

    collect()
    repeats = [w for w in drawn if any(r.req_id == "repeat" for r in w.requests)]
    repeats.sort(key=lambda w: -sum(len(r.prompt) for r in w.requests))
    from conformance.lanes.test_plan import edge_workloads

    return (*edge_workloads(), *repeats[:_EXAMPLES_KEPT])


@cache
def _plan_case(case_id: str) -> Any:
    from conformance.lanes import test_plan as lane

    return next(c for c in (*lane.CASES, *lane.EDGE_CASES, *lane.EDGE_WORKLOAD_CASES)
                if str(c) == case_id)


@cache
def _baseline_trace(case_id: str, index: int) -> T.Trace:
    from conformance.workloads import driver_for

    return driver_for(_plan_case(case_id)).run(fixed_workloads()[index])


def _plan_check(case_id: str, index: int) -> Check:
    def run(mutant: Mutant | None) -> None:
        from conformance.replay import first_divergence, recorded_answers, replay
        from conformance.workloads import driver_for

        if mutant is not None and mutant.side == "vllm":
            trace = driver_for(_plan_case(case_id)).run(fixed_workloads()[index])
        else:
            trace = _baseline_trace(case_id, index)
        div = first_divergence(replay(trace), recorded_answers(trace))
        assert div is None, div.explain()

    from conformance.lanes import test_plan as lane

    test = "test_plans_agree"
    if any(str(c) == case_id for c in lane.EDGE_CASES):
        test = "test_plans_agree_at_the_edges"
    elif any(str(c) == case_id for c in lane.EDGE_WORKLOAD_CASES):
        test = "test_edge_workloads_agree"
    return Check("plan", f"{test}[{case_id}]/workload{index}", _PLAN, run)


def _capacity_check(case_id: str) -> Check:
    def run(_: Mutant | None) -> None:
        from conformance.lanes import test_plan as lane

        problem = lane.tier_capacity_problem(_plan_case(case_id))
        assert problem is None, problem

    return Check("plan", f"test_tier_holds_what_it_was_sized_for[{case_id}]", _CAPACITY, run)


_EVICTION_CASES = ("full@16 full tier/blocks_per_chunk=4/retention=0/cpu=4",
                   "fa64+sw128@16 full tier/blocks_per_chunk=2/retention=0/cpu=12")


def _eviction_check(case_id: str, index: int) -> Check:
    def run(mutant: Mutant | None) -> None:
        from conformance.lanes import test_plan as lane
        from conformance.workloads import driver_for

        if mutant is not None and mutant.side == "vllm":
            trace = driver_for(_plan_case(case_id)).run(fixed_workloads()[index])
        else:
            trace = _baseline_trace(case_id, index)
        problem = lane.eviction_problem(trace)
        assert problem is None, problem

    return Check("plan", f"test_full_tier_evicts_what_capacity_requires[{case_id}]/workload{index}",
                 ("cpu.manager", "cpu.spec"), run)


# -- data lane ---------------------------------------------------------------------

_DATA_CASES = ("synthetic-full-swa-bpc2-planned", "synthetic-full-swa-bpc4",
               "synthetic-full-swa-2layer-bpc2", "synthetic-full-swa-2layer-bpc2-planned",
               "synthetic-full-padded-swa-bpc2", "synthetic-unequal-pages-bpc2",
               "synthetic-full-swa-2layer-bpc2-planned-BLHNC")


@cache
def _data_driver(case_id: str) -> Any:
    from conformance.lanes import test_data as lane

    case = next(c for c in lane.SYNTHETIC if str(c) == case_id)
    return case, lane.synthetic_driver(case)


def _data_check(case_id: str) -> Check:
    def run(_: Mutant | None) -> None:
        from conformance.lanes import test_data as lane

        case, driver = _data_driver(case_id)
        stats = lane.run_workload(driver, prompt_len=case.prompt_len, budget=case.budget)
        lane.record_and_check(stats, lambda name, value: None)

    return Check("data", f"test_synthetic_loads_carry_the_stored_bytes[{case_id}]", _DATA, run)


# -- unit properties of the declarative core -----------------------------------------

_PROPERTIES = ("test_planner_lookup_equals_rules", "test_planner_store_job_equals_rules")
_PROPERTY_EXAMPLES = 150


@cache
def _unit_module(name: str) -> Any:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_kvchunk_unit_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _derandomized(module: str, name: str) -> Callable[[], None]:
    """The unit property ``name``, settings applied once (hypothesis refuses twice)."""
    from hypothesis import settings

    test = getattr(_unit_module(module), name)
    return settings(max_examples=_PROPERTY_EXAMPLES, derandomize=True, database=None,  # type: ignore[no-any-return]
                    suppress_health_check=SLOW_EXAMPLE_CHECKS, deadline=None)(test)


def _property_check(name: str) -> Check:
    """A ``tests/test_rules.py`` property (planner against the declarative rules), drawn
    derandomized: the rules the planner does not call (``needed_chunks``, ``hit``) are
    checked there, and nowhere else."""
    def run(_: Mutant | None) -> None:
        _derandomized("test_rules", name)()

    return Check("tests", f"tests/test_rules.py::{name}",
                 ("reference.rules", "reference.plan", "reference.keys", "reference.knobs"), run)


@cache
def checks() -> tuple[Check, ...]:
    """The suite's checks, cheapest lane first, in a fixed order."""
    n = len(fixed_workloads())
    return (
        *(_config_check(c) for c in _CONFIG_CASES),
        _deviation_check("synthetic-full-swa block_size=512"),
        *(_clean_rejection_check(c) for c in _CLEAN_REJECTIONS),
        *(_plan_check(c, i) for c in _PLAN_CASES for i in range(n)),
        *(_capacity_check(c) for c in _PLAN_CASES),
        *(_eviction_check(c, i) for c in _EVICTION_CASES for i in range(n)),
        *(_data_check(c) for c in _DATA_CASES),
        *(_property_check(p) for p in _PROPERTIES),
    )


# -- the runner --------------------------------------------------------------------


def _outcome(check: Check, mutant: Mutant | None) -> str | None:
    """None when the check passes, else what failed (one line)."""
    try:
        check.run(mutant)
    except (Exception, pytest.fail.Exception) as err:  # any failure: assertion, crash, fail()
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
    return None


@cache
def baseline(check: Check) -> str | None:
    """The check's outcome without any mutant (run once; drivers and traces cached)."""
    return _outcome(check, None)


def walk_order(mutant: Mutant, all_checks: tuple[Check, ...]) -> tuple[Check, ...]:
    """``all_checks`` with the mutant's ``EXPECTED_CATCHERS`` hint first (a speed-up
    only: a stale hint costs time, never an outcome, since the rest follow in order)."""
    hint = EXPECTED_CATCHERS.get(mutant.name)
    first = tuple(c for c in all_checks if c.test_id == hint)
    return (*first, *(c for c in all_checks if c.test_id != hint))


def run_mutant(mutant: Mutant, all_checks: tuple[Check, ...] | None = None) -> Outcome:
    """Install ``mutant`` around each check in turn; stop at the first that catches it."""
    spent = 0.0
    for check in walk_order(mutant, all_checks if all_checks is not None else checks()):
        if not check.executes(mutant):
            continue
        expected = baseline(check)
        start = time.perf_counter()
        with pytest.MonkeyPatch.context() as mp:
            mutant.apply(mp)
            got = _outcome(check, mutant)
        spent += time.perf_counter() - start
        if (got is None) != (expected is None):
            detail = got if got is not None else f"now passes (baseline: {expected})"
            return Outcome(mutant.name, mutant.bug_class, mutant.side, check.test_id,
                           detail, spent, mutant.equivalent)
    return Outcome(mutant.name, mutant.bug_class, mutant.side, None, "no check failed",
                   spent, mutant.equivalent)


def all_mutants() -> tuple[Mutant, ...]:
    from conformance.mutants import rules, vllm_side

    return (*vllm_side.MUTANTS, *rules.MUTANTS)


def score(outcomes: list[Outcome]) -> tuple[int, int, float]:
    """``(caught, non-equivalent, caught / non-equivalent)``."""
    scored = [o for o in outcomes if o.status != "equivalent"]
    caught = sum(o.status == "caught" for o in scored)
    return caught, len(scored), caught / len(scored) if scored else 1.0


def main() -> None:
    """Run every mutant; print each outcome, the score and a fresh ``EXPECTED_CATCHERS``."""
    outcomes = [run_mutant(m) for m in all_mutants()]
    for o in outcomes:
        print(f"{o.seconds:6.1f}s {o.status:10} {o.mutant}: {o.caught_by or o.detail}")
    caught, scored, ratio = score(outcomes)
    print(f"score {caught}/{scored} = {ratio:.0%}\nEXPECTED_CATCHERS = {{")
    for o in outcomes:
        if o.caught_by:
            print(f"    {o.mutant!r}:\n        {o.caught_by!r},")
    print("}")


if __name__ == "__main__":
    main()
