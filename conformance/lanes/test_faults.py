"""Reliability lane: bad configs get clear errors, faults never corrupt a load, nothing leaks.

* Config fuzzing (:func:`conformance.harness.fuzz.check_extra_config`): hypothesis
  over ``kv_connector_extra_config`` for the kvchunk connector on every stored
  fixture geometry, plus the reference alone on the sub-hash geometry vLLM
  refuses, plus the ``python -m vllm_adapter config`` CLI when it exists.
  Counters: ``config_fuzz_tried``, ``config_fuzz_rejected_cleanly``,
  ``config_fuzz_accepted``, ``config_fuzz_unclean`` (must stay 0).
* Fault injection through vLLM's real scheduler and the reference worker
  (:func:`conformance.harness.faults.run_fault_scenario`; what a failed store means
  in vLLM 0.33.0 is documented there).  Counters ``fault:<type>`` (injected,
  by type), ``faults_corrupted_loads`` / ``faults_corrupted_reads`` /
  ``faults_failed_store_loaded`` / ``faults_leaks`` (must stay 0).
* Load: >= 1,000 requests with heavy prefix sharing at capacity pressure
  (``load_trace_*`` counters: requests, steps, milliseconds, RSS growth).

``KVCHUNK_PROFILE=deep`` runs more examples, seeds, geometries and requests.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import example, given, settings

from conformance.harness.strategies import SLOW_EXAMPLE_CHECKS
from conformance.testing.requires import require_vllm

require_vllm()

from conformance.harness import faults as FA  # noqa: E402
from conformance.harness import fuzz as FZ  # noqa: E402
from conformance.meta.mutants.worker import install_mutation  # noqa: E402
from conformance.protocol import deviations  # noqa: E402

PROFILE = os.environ.get("KVCHUNK_PROFILE", "ci")
DEEP = PROFILE == "deep"
_EXAMPLES = {"ci": 150, "deep": 3000, "dev": 20}.get(PROFILE, 150)
_DERANDOMIZE = PROFILE == "ci"
"""The CI profile draws the same examples every run (what it catches cannot depend on a
seed); other profiles keep exploring.  What a random run finds becomes an ``@example``."""
_SEEDS = {"ci": 3, "deep": 60, "dev": 1}.get(PROFILE, 3)


def _record(record_property: Any, counters: dict[str, int]) -> None:
    for name, value in counters.items():
        record_property(f"counter:{name}", int(value))


# ---------------------------------------------------------------------------
# Config fuzzing
# ---------------------------------------------------------------------------


class _Tally:
    def __init__(self) -> None:
        self.counts = {"tried": 0, "rejected": 0, "accepted": 0, "unclean": 0}
        self.unclean: list[str] = []

    def add(self, extra: Any, verdict: FZ.ConfigVerdict) -> None:
        self.counts["tried"] += 1
        self.counts[verdict.outcome] += 1
        if not verdict.clean and len(self.unclean) < 5:
            self.unclean.append(f"{extra!r}: {verdict.detail}")

    def record(self, record_property: Any) -> None:
        _record(record_property, {
            "config_fuzz_tried": self.counts["tried"],
            "config_fuzz_rejected_cleanly": self.counts["rejected"],
            "config_fuzz_accepted": self.counts["accepted"],
            "config_fuzz_unclean": self.counts["unclean"],
        })


@pytest.mark.faults
@pytest.mark.parametrize("fixture", FZ.CONFIG_FIXTURES)
def test_config_fuzz_connector(fixture: str, record_property: Any) -> None:
    record_property("fixture", fixture)
    record_property("knob", "fuzzed kv_connector_extra_config")
    target = FZ.config_target(fixture)
    tally = _Tally()

    @settings(max_examples=_EXAMPLES, database=None, suppress_health_check=SLOW_EXAMPLE_CHECKS,
              derandomize=_DERANDOMIZE)
    @given(FZ.extra_configs())
    def run(extra: dict[str, Any]) -> None:
        tally.add(extra, FZ.check_extra_config(target, extra))

    run()
    tally.record(record_property)
    assert tally.counts["unclean"] == 0, "\n".join(tally.unclean)
    assert tally.counts["rejected"] > 0
    if target.geometry is not None:
        assert tally.counts["accepted"] > 0


@pytest.mark.faults
def test_config_fuzz_reference_on_a_group_smaller_than_the_hash_unit(record_property: Any) -> None:
    record_property("fixture", "synthetic-sub-hash")
    record_property("knob", "fuzzed knob (reference only)")
    geometry = FZ.sub_hash_geometry()
    tally = _Tally()

    @settings(max_examples=_EXAMPLES, database=None, suppress_health_check=SLOW_EXAMPLE_CHECKS,
              derandomize=_DERANDOMIZE)
    @given(FZ.extra_configs())
    def run(extra: dict[str, Any]) -> None:
        tally.add(extra, FZ.check_reference_only(geometry, extra))

    run()
    tally.record(record_property)
    assert tally.counts["unclean"] == 0, "\n".join(tally.unclean)
    assert tally.counts["accepted"] > 0 and tally.counts["rejected"] > 0


@pytest.mark.faults
def test_config_fuzz_cli(record_property: Any) -> None:
    record_property("fixture", "every fixture")
    record_property("knob", "python -m vllm_adapter config")
    tally = _Tally()

    @settings(max_examples=max(10, _EXAMPLES // 2), database=None,
              suppress_health_check=SLOW_EXAMPLE_CHECKS, derandomize=_DERANDOMIZE)
    @given(FZ.cli_cases())
    # Found by a random CI run (2026-12-03): an OverflowError past a float.
    @example(("gemma-4-31B-it-tp2", ["--blocks-per-chunk", str(10**400)],
              {"blocks_per_chunk": str(10**400)}))
    def run(case: tuple[str, list[str], dict[str, str]]) -> None:
        tally.add(case, FZ.check_cli(case))

    run()
    tally.record(record_property)
    assert tally.counts["unclean"] == 0, "\n".join(tally.unclean)


# ---------------------------------------------------------------------------
# Fault injection
# ---------------------------------------------------------------------------

P = FA.FaultPlan
SCENARIOS = [
    FA.FaultScenario("delays+aborts+resets", "synthetic-full-swa", P(max_delay=3),
                     p_abort=0.25, reset_every=6, p_connector_reset=0.3),
    FA.FaultScenario("store_lost", "synthetic-full-swa", P(max_delay=2, p_store_lost=0.3),
                     reset_every=6, p_connector_reset=0.2),
    FA.FaultScenario("load_failed", "synthetic-full-swa", P(max_delay=2, p_load_fail=0.4),
                     reset_every=5, p_abort=0.1, spacing=3),
    FA.FaultScenario("cpu_full+evictions", "synthetic-full", P(max_delay=4, p_load_fail=0.1),
                     blocks_per_chunk=4, num_gpu_blocks=96, num_cpu_chunks=6, num_docs=4,
                     reset_every=4, spacing=3),
    FA.FaultScenario("mixed", "synthetic-full-mamba-align",
                     P(max_delay=3, p_store_lost=0.15, p_load_fail=0.25),
                     num_gpu_blocks=96, num_cpu_chunks=24, reset_every=5, p_abort=0.15,
                     p_connector_reset=0.3),
    FA.FaultScenario("mixed", "synthetic-eagle", P(max_delay=3, p_store_lost=0.15, p_load_fail=0.25),
                     num_gpu_blocks=160, num_cpu_chunks=32, reset_every=5, p_abort=0.15,
                     p_connector_reset=0.3),
    FA.FaultScenario("mixed planned", "synthetic-full-swa",
                     P(max_delay=3, p_store_lost=0.15, p_load_fail=0.25),
                     planned=True, num_gpu_blocks=80, num_cpu_chunks=16, reset_every=5,
                     p_abort=0.15, p_connector_reset=0.3),
    FA.FaultScenario("rank-partial ws2", "synthetic-full-swa",
                     P(max_delay=2, p_store_lost=0.25, p_load_fail=0.35, p_rank_partial=0.8),
                     world_size=2, reset_every=5, p_connector_reset=0.25),
    FA.FaultScenario("rank-partial", "gemma-4-31B-it-tp2",
                     P(seed=1, max_delay=2, p_store_lost=0.2, p_load_fail=0.35, p_rank_partial=0.8),
                     blocks_per_chunk=1, num_gpu_blocks=224, num_cpu_chunks=96, num_requests=12,
                     num_docs=2, doc_len=200, spacing=5, budget=256, reset_every=4,
                     p_connector_reset=0.2, block_tokens_base=32),
    FA.FaultScenario("rank-partial", "deepseek-v4-flash-tp4",
                     P(seed=1, max_delay=2, p_store_lost=0.2, p_load_fail=0.35,
                       p_rank_partial=0.8),
                     blocks_per_chunk=1, num_gpu_blocks=256, num_cpu_chunks=96,
                     num_requests=12, num_docs=2, doc_len=600, spacing=5, budget=256,
                     reset_every=4, p_connector_reset=0.2),
]
if DEEP:
    SCENARIOS += [
        FA.FaultScenario("everything small pools", "synthetic-full-swa",
                         P(max_delay=5, p_store_lost=0.2, p_load_fail=0.3),
                         num_gpu_blocks=56, num_cpu_chunks=8, num_requests=40, reset_every=4,
                         p_abort=0.3, p_connector_reset=0.4),
        FA.FaultScenario("small pools", "synthetic-full-mamba-align",
                         P(max_delay=5, p_load_fail=0.3, p_store_lost=0.1),
                         num_gpu_blocks=64, num_cpu_chunks=8, num_requests=40, reset_every=4,
                         p_abort=0.3, p_connector_reset=0.3),
        FA.FaultScenario("bpc1 small pools", "synthetic-full-swa",
                         P(max_delay=4, p_load_fail=0.3, p_store_lost=0.1),
                         blocks_per_chunk=1, num_gpu_blocks=64, num_cpu_chunks=16,
                         num_requests=40, reset_every=3, p_abort=0.3, p_connector_reset=0.3),
    ]


def _exercised(scenario: FA.FaultScenario, total: FA.FaultStats) -> bool:
    """The scenario injected every fault it is named after (the assertions below)."""
    plan, injected = scenario.plan, total.injected
    return (
        (not plan.p_store_lost or injected["store_lost"] + injected["store_rank_partial"] > 0)
        and (
            not plan.p_load_fail
            or (
                injected["load_failed"] + injected["load_rank_partial"] > 0
                and total.recomputed_blocks_checked > 0
            )
        )
        and (
            not plan.p_rank_partial
            or injected["store_rank_partial"] + injected["load_rank_partial"] > 0
        )
    )


@pytest.mark.faults
@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
def test_faults_never_corrupt_a_load_and_nothing_leaks(
    scenario: FA.FaultScenario, record_property: Any
) -> None:
    record_property("fixture", scenario.fixture)
    record_property("knob", scenario.knob)
    driver = FA.scenario_driver(scenario)
    seeds = _SEEDS if scenario.fixture.startswith("synthetic-") else max(1, _SEEDS // 3)
    total = FA.FaultStats()
    # At least `seeds` runs, and more (up to 4x) until the scenario has injected what it
    # is named after: how many draws that takes depends on the release's block sizes
    # (vLLM 0.34.0 plans gemma-4 with 4x larger blocks), not on what is being checked.
    seed = 0
    while seed < seeds or (seed < 4 * seeds and not _exercised(scenario, total)):
        sc = FA.replace_seed(scenario, 1000 * seed + scenario.plan.seed)
        total.merge(FA.run_fault_scenario(sc, driver))
        seed += 1
    record_property("counter:fault_scenario_seeds", seed)
    _record(record_property, total.counters())
    assert total.corrupted_loads == 0, total.describe()
    assert total.corrupted_reads == 0, total.describe()
    assert total.foreign_bytes_changed == 0, total.describe()
    assert total.failed_store_loaded == 0, total.describe()
    assert total.leaks == 0, total.describe()
    assert total.blocks_read_checked > 0, total.describe()
    # The scenario injected what it is named after.
    plan = scenario.plan
    if plan.p_store_lost:
        lost = total.injected["store_lost"] + total.injected["store_rank_partial"]
        assert lost > 0, total.describe()
    if plan.p_load_fail:
        failed = total.injected["load_failed"] + total.injected["load_rank_partial"]
        assert failed > 0 and total.recomputed_blocks_checked > 0, total.describe()
    if plan.p_rank_partial:
        assert total.injected["store_rank_partial"] + total.injected["load_rank_partial"] > 0
    if plan.max_delay:
        assert total.injected["delayed_jobs"] > 0, total.describe()
    if scenario.num_cpu_chunks <= 8:
        assert total.injected["cpu_full"] > 0, total.describe()


# ---------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------

LOAD_REQUESTS = {"ci": 1000, "deep": 10000, "dev": 1000}.get(PROFILE, 1000)
LOAD_GEOMETRIES = ["synthetic-full-swa"] + (
    ["synthetic-full", "synthetic-full-mamba-align", "synthetic-eagle"] if DEEP else []
)


@pytest.mark.faults
@pytest.mark.parametrize("fixture", LOAD_GEOMETRIES)
def test_load_trace_at_capacity_pressure(fixture: str, record_property: Any) -> None:
    record_property("fixture", fixture)
    record_property("knob", f"blocks_per_chunk=2, {LOAD_REQUESTS} requests, shared prefixes")
    sc = FA.FaultScenario("load", fixture, P(seed=11, max_delay=2, p_load_fail=0.02),
                          num_gpu_blocks=96 if fixture != "synthetic-eagle" else 160,
                          num_cpu_chunks=32)
    report = FA.run_load_trace(FA.scenario_driver(sc), num_requests=LOAD_REQUESTS,
                               prompt_len=320, plan=sc.plan)
    stats = report.stats
    _record(record_property, stats.counters())
    _record(record_property, {
        "load_trace_requests": report.requests,
        "load_trace_steps": report.steps,
        "load_trace_ms": round(1000 * report.seconds),
        "load_trace_rss_growth_kib": max(0, report.rss_growth_kib),
    })
    record_property("load_requests_per_s", round(report.requests / report.seconds, 1))
    record_property("load_steps_per_s", round(report.steps / report.seconds, 1))
    record_property("load_peak_bookkeeping", str(report.peak_bookkeeping))
    assert report.requests >= 1000
    assert stats.corrupted_loads == 0 and stats.corrupted_reads == 0, stats.describe()
    assert stats.leaks == 0, stats.describe()
    assert stats.loads_executed > 0, stats.describe()
    # Bounded memory: per-request state is gone at the end, the CPU tier never holds
    # more than its chunks, vLLM's LRU heap stays within its compaction bound, and
    # RSS stops growing once warm.
    final = report.final_bookkeeping
    for key in ("scheduler_requests", "connector_req_status", "connector_jobs",
                "connector_block_fences", "worker_pending", "runner_hash_cache"):
        assert final[key] == 0, (key, final)
    peak = report.peak_bookkeeping
    assert peak["cpu_chunks_held"] <= sc.num_cpu_chunks and peak["lru_ranks"] <= sc.num_cpu_chunks
    assert peak["lru_heap"] <= max(64, 2 * sc.num_cpu_chunks) + 64, peak
    assert peak["scheduler_requests"] <= 64, peak
    assert report.rss_growth_kib < 64 * 1024, report.rss_growth_kib


# ---------------------------------------------------------------------------
# vLLM 0.33.0 bugs the lane found (strict xfails from conformance/protocol/deviations/vllm.toml)
# ---------------------------------------------------------------------------


def _expect_deviation(request: pytest.FixtureRequest, case: str) -> None:
    dev = deviations.find("vllm", "faults", case)
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))


@pytest.mark.faults
def test_vllm_connector_reset_keeps_stale_swa_block_ids(
    request: pytest.FixtureRequest, record_property: Any
) -> None:
    """After a connector reset, a running request's store job names only blocks it holds."""
    from conformance.harness import driver as D
    from conformance.protocol.trace import BuildMeta, RequestSpec

    record_property("fixture", "synthetic-full-swa")
    record_property("knob", "blocks_per_chunk=2, connector reset while running")
    _expect_deviation(request, "connector-reset-stale-swa-blocks")
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_swa_kv_cache_config(num_blocks=31), extra_config={"blocks_per_chunk": 2},
        prefix_cache_retention_interval=0, num_gpu_blocks=31,
    )
    s = driver.session(max_num_batched_tokens=512)
    s.add_request(RequestSpec("A", tuple(range(1000, 1200)), max_tokens=20))
    s.step()
    s.step()  # A decodes: its SWA positions 0-3 are freed
    s.add_request(RequestSpec("B", tuple(range(5000, 5200)), max_tokens=20))
    s.step()  # B allocates the freed blocks
    assert s.reset_prefix_cache(reset_connector=True) is False  # GPU part refused, connector reset
    s.step()
    meta = s.trace().of_type(BuildMeta)[-1]
    (job,) = [r.job for r in meta.store_jobs if r.job.req_id == "A"]
    table = s.block_ids("A")
    cursor = 0
    for g, (n, first) in enumerate(zip(job.group_sizes, job.block_indices, strict=True)):
        ids = job.block_ids[cursor : cursor + n]
        cursor += n
        held = [table[g][first + k] for k in range(n)]
        assert list(ids) == held, (
            f"group {g}: the store job copies blocks {list(ids)} from positions "
            f"{first}..{first + n - 1}, where A holds {held}"
        )


@pytest.mark.faults
def test_vllm_connector_reset_twice_between_steps(
    request: pytest.FixtureRequest, record_property: Any
) -> None:
    """Two connector resets with no step in between: both must be accepted."""
    from conformance.harness import driver as D
    from conformance.protocol.trace import RequestSpec

    record_property("fixture", "synthetic-full")
    record_property("knob", "blocks_per_chunk=2, two connector resets in one step")
    _expect_deviation(request, "connector-reset-twice")
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_attention_kv_cache_config(), extra_config={"blocks_per_chunk": 2}
    )
    s = driver.session(default_delay_steps=3)
    s.add_request(RequestSpec("A", tuple(range(1000, 1300)), max_tokens=5))
    s.step()
    s.step()
    assert s.connector_scheduler._jobs  # a store job in flight
    s.reset_prefix_cache(reset_connector=True)
    s.reset_prefix_cache(reset_connector=True)
    s.run_until_idle()


# ---------------------------------------------------------------------------
# The checks themselves (they must catch what they are for)
# ---------------------------------------------------------------------------

MUTATIONS = ["report_lost_store", "skip_flush_wait", "report_load_early"]


@pytest.mark.meta
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_fault_checks_catch_a_broken_worker(mutation: str, monkeypatch: pytest.MonkeyPatch,
                                            record_property: Any) -> None:
    """A worker that reports a lost store, ignores flushes or reports a load before copying is caught."""
    record_property("fixture", "synthetic-full-swa")
    record_property("knob", f"fault-check mutation={mutation}")
    install_mutation(monkeypatch, mutation)
    sc = FA.FaultScenario("mutant", "synthetic-full-swa",
                          P(seed=5, max_delay=4, p_store_lost=0.3 if mutation == "report_lost_store" else 0),
                          num_gpu_blocks=72, num_cpu_chunks=24, reset_every=5, num_requests=30)
    driver = FA.scenario_driver(sc)
    caught = 0
    for seed in range(6):
        try:
            stats = FA.run_fault_scenario(FA.replace_seed(sc, seed), driver)
        except (AssertionError, RuntimeError):
            caught += 1  # vLLM itself tripped over the broken worker
            continue
        bad = (stats.corrupted_loads + stats.corrupted_reads + stats.failed_store_loaded
               + stats.leaks + stats.foreign_bytes_changed)
        caught += bool(bad)
        if caught:
            break
    assert caught > 0, f"mutation {mutation} went unnoticed in 6 seeds"
    record_property("counter:fault_mutations_detected", 1)
