"""The checks the meta lane runs on every mutant: the lanes' own check functions
(:mod:`conformance.checks`) on a fixed set of their cases, cheapest lane first.

Which cases: the ones that caught a mutant on some run (each earns its place), and
the plan lane's fixed workloads (:func:`fixed_workloads`).  Besides the lanes: the unit tests
of ``tests/test_rules.py`` and the fast == spec comparison of
``tests/test_transfer_catches.py`` (faults in the byte-layout spec).  ``Check.reaches`` lists
the module-name suffixes a check executes, so a mutant elsewhere skips it.  The
runner is :mod:`conformance.meta.mutation`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from conformance.harness.strategies import SLOW_EXAMPLE_CHECKS
from conformance.meta.mutants.source import Mutant
from conformance.protocol import deviations
from conformance.protocol import trace as T

__all__ = ["Check", "checks", "fixed_workloads"]


@dataclass(frozen=True)
class Check:
    """One of the suite's checks, runnable on demand; raises when the check fails."""

    lane: str
    name: str
    reaches: tuple[str, ...]
    """Module-name suffixes this check executes (a mutant elsewhere cannot change it)."""
    run: Callable[[Mutant | None], None]
    deviation: bool = False
    """A deviation is recorded for its case (the lane's test is a strict xfail): its
    baseline may fail, by assertion only."""

    @property
    def test_id(self) -> str:
        return f"{self.lane}::{self.name}"

    def executes(self, mutant: Mutant) -> bool:
        module = mutant.edit.module().__name__
        return any(module.endswith(suffix) for suffix in self.reaches)


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


def _config_case(case_id: str) -> Any:
    from conformance.lanes import test_config as lane

    return next(c for c in lane.CASES if str(c) == case_id)


def _config_check(test: str, check: str, case_id: str) -> Check:
    def run(_: Mutant | None) -> None:
        from conformance.checks import config

        getattr(config, check)(_config_case(case_id))

    deviation = (test == "test_resolution_agrees"
                 and deviations.find("vllm", "config", case_id) is not None)
    return Check("config", f"{test}[{case_id}]", _CONFIG, run, deviation)


_CLEAN_REJECTIONS = ("synthetic-full-swa blocks_per_chunk=0",
                     "synthetic-full-mamba-align block_size=100")


# -- plan lane ---------------------------------------------------------------------

_PLAN_CASES = (
    "fa64+sw40@16/blocks_per_chunk=2/retention=0",
    "fa64+sw33@16/blocks_per_chunk=2/retention=0",
    "fa64+sw32+mtp2@16/blocks_per_chunk=2/retention=0",
    "fa64+sw32+mtp1@16/blocks_per_chunk=2/retention=0",
    "fa64+sw40@16/blocks_per_chunk=2/retention=None",
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

    from conformance.harness.workloads import workloads

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
    from conformance.harness.workloads import driver_for

    return driver_for(_plan_case(case_id)).run(fixed_workloads()[index])


def _trace(case_id: str, index: int, mutant: Mutant | None) -> T.Trace:
    """The case's trace of fixed workload ``index``: recorded with a vLLM-side mutant
    applied, else the cached unmutated one."""
    from conformance.harness.workloads import driver_for

    if mutant is not None and mutant.side == "vllm":
        return driver_for(_plan_case(case_id)).run(fixed_workloads()[index])
    return _baseline_trace(case_id, index)


def _plan_check(case_id: str, index: int) -> Check:
    def run(mutant: Mutant | None) -> None:
        from conformance.checks.plan import answers_agree

        answers_agree(_trace(case_id, index, mutant))

    from conformance.lanes import test_plan as lane

    test = "test_plans_agree"
    if any(str(c) == case_id for c in lane.EDGE_CASES):
        test = "test_plans_agree_at_the_edges"
    elif any(str(c) == case_id for c in lane.EDGE_WORKLOAD_CASES):
        test = "test_edge_workloads_agree"
    return Check("plan", f"{test}[{case_id}]/workload{index}", _PLAN, run,
                 deviations.find("vllm", "plan", case_id) is not None)


def _capacity_check(case_id: str) -> Check:
    def run(_: Mutant | None) -> None:
        from conformance.checks.plan import tier_holds_what_it_was_sized_for

        tier_holds_what_it_was_sized_for(_plan_case(case_id))

    return Check("plan", f"test_tier_holds_what_it_was_sized_for[{case_id}]", _CAPACITY, run)


_EVICTION_CASES = ("full@16 full tier/blocks_per_chunk=4/retention=0/cpu=4",
                   "fa64+sw128@16 full tier/blocks_per_chunk=2/retention=0/cpu=12")


def _eviction_check(case_id: str, index: int) -> Check:
    def run(mutant: Mutant | None) -> None:
        from conformance.checks.plan import full_tier_evicts_what_capacity_requires

        full_tier_evicts_what_capacity_requires(_trace(case_id, index, mutant))

    return Check("plan", f"test_full_tier_evicts_what_capacity_requires[{case_id}]/workload{index}",
                 ("cpu.manager", "cpu.spec"), run)


# -- the byte-layout spec ----------------------------------------------------------

_TESTS = Path(__file__).resolve().parents[3] / "tests"
_TRANSFER = ("reference.transfer", "reference.transfer_fast", "reference.transfer_host",
             "reference.transfer_checks")


def _fast_equals_spec_check() -> Check:
    """``tests/test_transfer_catches.py::check_fast_equals_spec``: the fast path against the
    spec (``reference.transfer``) on fixed layouts, CPU only, deterministic (< 1 s)."""
    def run(_: Mutant | None) -> None:
        if str(_TESTS) not in sys.path:
            sys.path.append(str(_TESTS))  # it imports its sibling test modules by name
        importlib.import_module("test_transfer_catches").check_fast_equals_spec()

    return Check("tests", "tests/test_transfer_catches.py::check_fast_equals_spec", _TRANSFER,
                 run)


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
        from conformance.checks import data

        case, driver = _data_driver(case_id)
        data.loads_carry_the_stored_bytes(
            data.run_workload(driver, prompt_len=case.prompt_len, budget=case.budget))

    return Check("data", f"test_synthetic_loads_carry_the_stored_bytes[{case_id}]", _DATA, run)


# -- faults lane: failed stores of vLLM's fs tier -------------------------------------

_STORE_FAILURE_CASES = ("enospc",)


def _store_failure_check(fault: str) -> Check:
    """``conformance/lanes/test_tiered_store_failures.py`` on vLLM's fs tier: a store that
    fails is reported failed, never advertised, and leaves nothing behind (< 1 s)."""
    def run(_: Mutant | None) -> None:
        from conformance.harness.store_failures import run_checked

        run_checked("vllm", fault)

    deviation = deviations.find("vllm", "faults", f"fs-store-{fault}") is not None
    return Check("faults", f"test_failed_store_is_never_advertised[vllm-{fault}]",
                 ("tiering.fs.manager",), run, deviation)


# -- the unit-test module ------------------------------------------------------------

_UNITS = ("reference.rules", "reference.plan", "reference.keys", "reference.knobs")


def _unit_check(name: str) -> Check:
    """A ``tests/test_rules.py`` test (rule tables, planner against the declarative rules)."""
    def run(_: Mutant | None) -> None:
        from conformance.checks.units import unit_tests

        dict(unit_tests())[name]()

    return Check("tests", f"tests/test_rules.py::{name}", _UNITS, run)


# -- the disk eviction rule ---------------------------------------------------------

_EVICTION = ("reference.eviction",)


def _eviction_checks() -> tuple[Check, ...]:
    """The eviction rule's tests (``reference/eviction.py`` is reached by no lane): its
    direct test in ``tests/test_rules.py`` and ``tests/test_eviction.py``'s tests."""
    from conformance.checks.units import unit_tests

    def check(module: str, name: str, test: Callable[[], None]) -> Check:
        def run(_: Mutant | None) -> None:
            test()

        return Check("tests", f"tests/{module}.py::{name}", _EVICTION, run)

    return (
        *(check("test_rules", name, test) for name, test in unit_tests() if "eviction" in name),
        *(check("test_eviction", name, test) for name, test in unit_tests("test_eviction")),
    )


@cache
def checks() -> tuple[Check, ...]:
    """The suite's checks, cheapest lane first, in a fixed order."""
    from conformance.checks.units import unit_tests

    n = len(fixed_workloads())
    return (
        *(_config_check("test_resolution_agrees", "resolution_agrees", c) for c in _CONFIG_CASES),
        _config_check("test_config_deviation_is_a_vllm_rejection", "deviation_holds",
                      "synthetic-full-swa block_size=512"),
        *(_config_check("test_vllm_rejects_the_knob_cleanly", "vllm_rejects_cleanly", c)
          for c in _CLEAN_REJECTIONS),
        *(_plan_check(c, i) for c in _PLAN_CASES for i in range(n)),
        *(_capacity_check(c) for c in _PLAN_CASES),
        *(_eviction_check(c, i) for c in _EVICTION_CASES for i in range(n)),
        _fast_equals_spec_check(),
        *(_data_check(c) for c in _DATA_CASES),
        *(_store_failure_check(f) for f in _STORE_FAILURE_CASES),
        *(_unit_check(name) for name, _ in unit_tests()),
        *_eviction_checks(),
    )


